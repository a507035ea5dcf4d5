//! Per (worker, dp rank) event-id bookkeeping: which events are new, duplicated or missing,
//! and which workers the log has removed. Pure, and part of the replicated state: every
//! replica that applied the same log prefix holds the same tracker.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::KvEventData;
use serde::{Deserialize, Serialize};

/// What to do with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it.
    Apply,
    /// Apply it, but events `expected .. event_id` never arrived (a gap).
    ApplyAfterGap { expected: u64 },
    /// Already applied (`event_id` below the next expected one): skip.
    Duplicate,
    /// The worker was removed by the log and has not started a new incarnation: skip.
    WorkerRemoved,
}

/// The tracker's whole state (snapshotted with the index).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventTracker {
    /// Next expected event id per (worker, dp rank).
    next: BTreeMap<(WorkerId, DpRank), u64>,
    /// Workers removed by a `WorkerRemoved` record and not re-incarnated since.
    removed: BTreeSet<WorkerId>,
}

impl EventTracker {
    /// Classifies one event and advances the bookkeeping.
    ///
    /// Rules (PROTOCOL.md, "Event ids"): event 0 carrying `Cleared` starts a new incarnation
    /// of the worker (accepted even after removal); a removed worker's other events are
    /// ignored; the first event seen of a (worker, rank) sets the baseline; after that an id
    /// below the expected one is a duplicate and an id above it is a gap.
    pub fn check(
        &mut self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        event_id: u64,
        data: &KvEventData,
    ) -> Verdict {
        let key = (worker_id, dp_rank);
        if event_id == 0 && matches!(data, KvEventData::Cleared) {
            self.removed.remove(&worker_id);
            self.next.insert(key, 1);
            return Verdict::Apply;
        }
        if self.removed.contains(&worker_id) {
            return Verdict::WorkerRemoved;
        }
        match self.next.get_mut(&key) {
            None => {
                self.next.insert(key, event_id.saturating_add(1));
                Verdict::Apply
            }
            Some(next) if event_id < *next => Verdict::Duplicate,
            Some(next) if event_id == *next => {
                *next += 1;
                Verdict::Apply
            }
            Some(next) => {
                let expected = *next;
                *next = event_id.saturating_add(1);
                Verdict::ApplyAfterGap { expected }
            }
        }
    }

    /// The log removed `worker_id`: forget its ranks and ignore it until it re-incarnates.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.next.retain(|(w, _), _| *w != worker_id);
        self.removed.insert(worker_id);
    }

    pub fn is_removed(&self, worker_id: WorkerId) -> bool {
        self.removed.contains(&worker_id)
    }

    /// Workers the log has seen events from and not removed.
    pub fn live_workers(&self) -> BTreeSet<WorkerId> {
        self.next.keys().map(|(w, _)| *w).collect()
    }

    pub fn removed_count(&self) -> usize {
        self.removed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORE: KvEventData = KvEventData::Removed {
        block_hashes: Vec::new(),
        tier: kvroute_common::messages::StorageTier::Device,
    };

    #[test]
    fn classifies_duplicates_gaps_and_incarnations() {
        let mut t = EventTracker::default();
        assert_eq!(t.check(1, 0, 0, &KvEventData::Cleared), Verdict::Apply);
        assert_eq!(t.check(1, 0, 1, &STORE), Verdict::Apply);
        assert_eq!(t.check(1, 0, 1, &STORE), Verdict::Duplicate);
        assert_eq!(
            t.check(1, 0, 5, &STORE),
            Verdict::ApplyAfterGap { expected: 2 }
        );
        assert_eq!(t.check(1, 0, 6, &STORE), Verdict::Apply);
        // Ranks are independent; a first sighting sets the baseline.
        assert_eq!(t.check(1, 1, 40, &STORE), Verdict::Apply);
        assert_eq!(t.check(1, 1, 41, &STORE), Verdict::Apply);

        t.remove_worker(1);
        assert_eq!(t.check(1, 0, 7, &STORE), Verdict::WorkerRemoved);
        assert_eq!(t.check(1, 1, 42, &STORE), Verdict::WorkerRemoved);
        assert!(t.is_removed(1));
        // A restarted worker announces itself with event 0 = Cleared.
        assert_eq!(t.check(1, 0, 0, &KvEventData::Cleared), Verdict::Apply);
        assert!(!t.is_removed(1));
        assert_eq!(t.check(1, 0, 1, &STORE), Verdict::Apply);
    }
}
