//! What the host tells a classifier about the requests it admitted: admission, dispatch to a
//! worker, and the end.

use kvroute_common::RequestId;

use crate::worker::WorkerRank;

/// A lifecycle step of one request of the classifier's partition. For a request the
/// classifier admitted the host delivers `Admitted`, then `Sent` when a worker is chosen
/// (again, naming the new worker, if a retry moves it), then exactly one `Completed`. A
/// deferred request that is never admitted gets only `Completed` (`Expired` or `Rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassifyEvent {
    /// The request entered the admission queue.
    Admitted { request_id: RequestId },
    /// The request was sent to `worker`, the worker actually chosen (which may differ from the
    /// classifier's target).
    Sent {
        request_id: RequestId,
        worker: WorkerRank,
    },
    /// The request is over; `worker` is the last one it was sent to, if any.
    Completed {
        request_id: RequestId,
        worker: Option<WorkerRank>,
        outcome: Completion,
    },
}

impl ClassifyEvent {
    pub fn request_id(&self) -> RequestId {
        match self {
            Self::Admitted { request_id }
            | Self::Sent { request_id, .. }
            | Self::Completed { request_id, .. } => *request_id,
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Completion {
    /// It ran to the end.
    Finished,
    /// The worker or the request failed.
    Failed,
    /// Its queue timeout passed before it was dispatched.
    Expired,
    /// It was never dispatched: it got an error answer.
    Rejected,
}
