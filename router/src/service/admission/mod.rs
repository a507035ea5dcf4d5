//! Admission in the service: one actor per replica owns every partition's admission queue and
//! the request classifier's instances, and takes a closed set of inputs ([`Input`]): arrivals
//! (classify, queue behind those waiting, or let through to selection), requests that found
//! every eligible worker busy, the ends of selections (the classifier hears where a request
//! went), capacity that may have freed (load reports, decisions, worker changes: the feeds
//! poke it), lifecycle events, worker changes, the dispatch rounds' results, hand-overs,
//! ticks and shutdown. Nothing else touches the queues or the classifiers, so there is no
//! lock around them.
//!
//! A dispatch round runs when capacity may have freed, a request joins, or a deadline or an
//! ageing comes: the actor ages and expires the queues, classifies deferred requests again,
//! and hands the heads of the queues to a round task ([`round`]), which runs each through the
//! same selection machine as a new request, in order, and sends back what became of it; the
//! actor then takes a served request out and its client gets the answer. Requests that
//! expired get `queue_timeout`.
//!
//! One replica queues a partition's requests: its owner (`crate::decide::owner`), to which the
//! other replicas forward them, or any replica when ownership is off. A replica whose forward
//! found no owner answering (it died and its registration has not expired yet, or it stalls)
//! queues the request itself and hands it over once a live owner takes it; only while an
//! owner is alive but unresponsive can two replicas' queues dispatch onto one freed slot (the
//! second decision is still counted by every load view). A forwarded request carries its
//! client's inbox (`Kvroute-Reply-To`); when the owner queues it, it tells the forwarding
//! replica so (`Kvroute-Queued`) and answers the client itself later. Its decisions are
//! charged to the partition's load view under the partition's lock, so two queued requests
//! never take one freed slot. A replica that stops owning a partition hands its queued
//! requests to the new owner (with their first arrival, `Kvroute-Arrived-Ms`, so they keep
//! their place); at shutdown it answers them `unavailable`, which clients retry.
//!
//! A request arriving while nothing is queued and no classifier is configured does not
//! involve the actor at all.

mod actor;
mod queues;
mod round;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_common::messages::{
    Decision, ErrorCode, RequestLifecycle, SelectRequest, SelectResponse,
};
use kvroute_common::{RequestId, WorkerId};
use tokio::sync::{mpsc, oneshot};

pub(super) use self::actor::Actor;
pub(super) use self::queues::{Entry, Waiting};
use super::Router;
use super::classifying::Classifiers;
use crate::classify::ClassifyRequest;
use crate::decide::candidates::{Partition, PartitionKey};
use crate::decide::prompt::Prepared;
use crate::decide::wire;
use crate::queue::{Left, QueueConfig};
use crate::signals::SignalSnapshot;
use crate::worker::{WorkerRank, WorkerTarget};

/// How long shutdown waits for the actor to answer what it holds.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// Every input of the admission actor.
#[derive(Debug)]
pub(super) enum Input {
    /// A request this replica decides, before its selection: answered [`Admit`].
    Arrival(Box<Arrival>, oneshot::Sender<Admit>),
    /// A request whose selection found every eligible worker busy: answered
    /// [`Admit::Queued`] or [`Admit::Refused`].
    Join(Box<Join>, oneshot::Sender<Admit>),
    /// A selection that did not queue ended: its request went to `rank`, or was refused.
    Ended {
        id: RequestId,
        rank: Option<WorkerRank>,
        now_ms: u64,
    },
    /// A load report, a decision or a worker change may have freed capacity.
    Capacity,
    /// A lifecycle event (the classifier follows its request).
    Lifecycle(Box<RequestLifecycle>),
    /// The registered workers changed: `departed` left; every partition now.
    Workers {
        departed: Vec<WorkerId>,
        partitions: HashMap<PartitionKey, Arc<Partition>>,
    },
    /// What a dispatch round did with one queued request's turn.
    Turned(Box<Turned>),
    /// Requests a hand-over kept (their new owner did not take them); `failed`: the next
    /// hand-over waits.
    Kept {
        left: Vec<(PartitionKey, Left<Waiting>)>,
        failed: bool,
    },
    /// The dispatch round is over.
    RoundDone,
    /// Once a second, from the feeds: the classifier's expiry and the gauges.
    Tick,
    /// The process stops: every queued request is answered `unavailable`, then this is.
    Shutdown(oneshot::Sender<()>),
}

/// A request arriving at this replica's selection.
#[derive(Debug)]
pub(super) struct Arrival {
    pub key: PartitionKey,
    pub prepared: Arc<Prepared>,
    /// Where its client waits, when this replica may queue it.
    pub reply_to: Option<async_nats::Subject>,
    /// Its first arrival (a handed-over request keeps it).
    pub arrived_ms: u64,
    pub now_ms: u64,
}

/// A request joining its partition's queue after its selection found every worker busy.
#[derive(Debug)]
pub(super) struct Join {
    pub key: PartitionKey,
    pub waiting: Waiting,
    pub admitted: Admitted,
    pub arrived_ms: u64,
    pub now_ms: u64,
}

/// What admission says of a request.
#[derive(Debug)]
pub(super) enum Admit {
    /// Queued (a retry of a queued request took its place, it goes behind those waiting, its
    /// classifier deferred it, or every worker was busy): the answer comes later.
    Queued,
    /// Refused with this answer.
    Refused(Box<SelectResponse>),
    /// Select it now.
    Select(Admitted),
}

/// What a request's classifier said of it, kept for its selection (and its queue entry, if
/// it joins).
#[derive(Debug, Default)]
pub(super) struct Admitted {
    pub entry: Entry,
    pub classify: Option<ClassifyRequest>,
}

impl Admitted {
    /// The classifier's soft preference for the selection.
    pub fn target(&self) -> Option<WorkerTarget> {
        self.classify
            .as_ref()
            .and_then(ClassifyRequest::worker_selection_target)
    }
}

/// What a queued request's turn came to.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Queued {
    /// Every eligible worker is still busy: it keeps waiting.
    Overloaded,
    /// Served or refused: answer, and publish the decision if one was made.
    Answer(SelectResponse, Option<Decision>),
    /// Past its attempt's deadline.
    Expired,
}

/// One turn's result, for the actor.
#[derive(Debug)]
pub(super) struct Turned {
    pub key: PartitionKey,
    pub id: RequestId,
    pub queued: Queued,
    /// The overlap fetched for the turn (the request keeps it while it waits).
    pub fresh_overlap: Option<SignalSnapshot>,
    pub now_ms: u64,
}

/// The rest of the service's handle on the admission actor.
#[derive(Debug)]
pub(super) struct Admission {
    pub config: QueueConfig,
    /// Whether a classifier is configured.
    classifying: bool,
    /// Requests held (kept by the actor, read without it).
    held: Arc<AtomicUsize>,
    /// A [`Input::Capacity`] is on its way (pokes coalesce).
    poked: Arc<AtomicBool>,
    tx: mpsc::UnboundedSender<Input>,
}

impl Admission {
    /// The handle and the actor (to spawn once the router exists: [`Actor::run`]).
    pub fn new(config: QueueConfig, classifiers: Classifiers) -> (Self, Actor) {
        let (tx, rx) = mpsc::unbounded_channel();
        let held = Arc::new(AtomicUsize::new(0));
        let poked = Arc::new(AtomicBool::new(false));
        let handle = Self {
            config,
            classifying: classifiers.enabled(),
            held: held.clone(),
            poked: poked.clone(),
            tx: tx.clone(),
        };
        (handle, Actor::new(config, classifiers, held, poked, tx, rx))
    }

    /// Requests held on this replica.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Whether a request must go through admission before its selection: a classifier is
    /// configured, or it may queue here and requests are queued (it may be a retry of one of
    /// them, or go behind them).
    pub fn consulted(&self, may_queue: bool) -> bool {
        self.classifying || (may_queue && self.held() > 0)
    }

    async fn ask(
        &self,
        input: impl FnOnce(oneshot::Sender<Admit>) -> Input,
        id: RequestId,
    ) -> Admit {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(input(tx)).is_ok()
            && let Ok(admit) = rx.await
        {
            return admit;
        }
        Admit::Refused(Box::new(wire::error(
            ErrorCode::Unavailable,
            "the router is shutting down; retry".to_owned(),
            Some(id),
        )))
    }

    /// What admission says of an arriving request.
    pub async fn arrive(&self, arrival: Arrival) -> Admit {
        let id = arrival.prepared.request_id;
        self.ask(|tx| Input::Arrival(Box::new(arrival), tx), id)
            .await
    }

    /// Queues a request that found every eligible worker busy.
    pub async fn join(&self, join: Join) -> Admit {
        let id = join.waiting.prepared.request_id;
        self.ask(|tx| Input::Join(Box::new(join), tx), id).await
    }

    /// A selection that did not queue ended (the classifier's `Sent` or `Completed`).
    pub fn ended(&self, id: RequestId, rank: Option<WorkerRank>, now_ms: u64) {
        if self.classifying {
            let _ = self.tx.send(Input::Ended { id, rank, now_ms });
        }
    }

    /// Capacity may have freed: a round runs when something is queued.
    pub fn poke(&self) {
        if self.held() > 0 && !self.poked.swap(true, Ordering::AcqRel) {
            let _ = self.tx.send(Input::Capacity);
        }
    }

    /// A lifecycle event, for the classifier.
    pub fn lifecycle(&self, event: &RequestLifecycle) {
        if self.classifying {
            let _ = self.tx.send(Input::Lifecycle(Box::new(event.clone())));
        }
    }

    /// The registered workers changed (for the classifier; queued requests may now fit).
    pub fn workers(
        &self,
        departed: Vec<WorkerId>,
        partitions: impl FnOnce() -> HashMap<PartitionKey, Arc<Partition>>,
    ) {
        if self.classifying {
            let partitions = partitions();
            let _ = self.tx.send(Input::Workers {
                departed,
                partitions,
            });
        }
        self.poke();
    }

    /// The feeds' second.
    pub fn tick(&self) {
        let _ = self.tx.send(Input::Tick);
    }

    /// Answers every queued request `unavailable` (the process is stopping), waiting up to
    /// [`SHUTDOWN_WAIT`].
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Input::Shutdown(tx)).is_ok() {
            let _ = tokio::time::timeout(SHUTDOWN_WAIT, rx).await;
        }
    }
}

impl Router {
    /// Whether this replica queues requests of `request`'s partition: it owns the partition,
    /// ownership is off, or `anyway` (the request was forwarded here by a replica that thinks
    /// this one owns it, or the owner did not answer).
    pub(super) fn queues_here(&self, request: &SelectRequest, anyway: bool) -> bool {
        self.admission.config.enabled() && (anyway || self.owner_of(request).is_none())
    }

    /// The replica owning `key`'s partition, when it is another one.
    fn owner_of_partition(&self, key: &PartitionKey) -> Option<String> {
        let probe = SelectRequest {
            model: key.0.clone(),
            role: key.1,
            ..SelectRequest::default()
        };
        self.owner_of(&probe)
    }
}
