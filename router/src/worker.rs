//! The unit the router places requests on: one data-parallel rank of one worker, and targets
//! (pins, session bindings, affinity hints) that name such a unit.

use std::fmt;

use kvroute_common::messages::Pin;
use kvroute_common::{DpRank, WorkerId};
use serde::{Deserialize, Serialize};

/// One schedulable row: a worker and one of the data-parallel ranks it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerRank {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
}

impl WorkerRank {
    pub fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// A worker, and optionally one of its ranks. `dp_rank: None` matches every rank of the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerTarget {
    pub worker_id: WorkerId,
    pub dp_rank: Option<DpRank>,
}

impl WorkerTarget {
    /// Exactly this rank.
    pub fn exact(worker: WorkerRank) -> Self {
        Self {
            worker_id: worker.worker_id,
            dp_rank: Some(worker.dp_rank),
        }
    }

    /// Whether `worker` is (one of) the rank(s) this target names.
    pub fn matches(&self, worker: WorkerRank) -> bool {
        self.worker_id == worker.worker_id && self.dp_rank.is_none_or(|r| r == worker.dp_rank)
    }
}

impl From<Pin> for WorkerTarget {
    fn from(pin: Pin) -> Self {
        Self {
            worker_id: pin.worker_id,
            dp_rank: pin.dp_rank,
        }
    }
}

impl fmt::Display for WorkerTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dp_rank {
            Some(rank) => write!(f, "{}/{}", self.worker_id, rank),
            None => write!(f, "{}/*", self.worker_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_without_rank_matches_every_rank_of_its_worker() {
        let any = WorkerTarget {
            worker_id: 7,
            dp_rank: None,
        };
        assert!(any.matches(WorkerRank::new(7, 0)));
        assert!(any.matches(WorkerRank::new(7, 3)));
        assert!(!any.matches(WorkerRank::new(8, 0)));
        let one = WorkerTarget::exact(WorkerRank::new(7, 1));
        assert!(one.matches(WorkerRank::new(7, 1)));
        assert!(!one.matches(WorkerRank::new(7, 0)));
    }
}
