//! Per (worker, dp rank) event-id bookkeeping: which events are new, duplicated or missing,
//! and which workers the log has removed. Pure, and part of the replicated state: every
//! replica that applied the same log prefix holds the same tracker.
//!
//! The removed set is bounded by rules that read only the log (see [`REMOVED_RETENTION_MS`]
//! and [`MAX_REMOVED`]), so replicas evict the same entries at the same position.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_common::ids::{DpRank, WorkerId};
use kvroute_common::messages::KvEventData;
use serde::{Deserialize, Serialize};

/// A removed worker is remembered at least this long after its removal, measured in the log's
/// own time (the `at_ms` of `WorkerRemoved` records): far beyond the events stream's duplicate
/// window (120 s by default) and a worker's lease TTL, the times in which a removed worker's
/// late or retried events can still reach the log. Changing it changes the replicated state:
/// a protocol change.
pub const REMOVED_RETENTION_MS: u64 = 60 * 60 * 1000;

/// At most this many removed workers are remembered; beyond it the oldest removal (by log
/// sequence) is forgotten first, whatever its age. A protocol constant like the retention.
pub const MAX_REMOVED: usize = 65_536;

/// What to do with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventDisposition {
    /// Apply it.
    Apply,
    /// Apply it, but events `expected .. event_id` never arrived (a gap).
    ApplyAfterGap { expected: u64 },
    /// Already applied (`event_id` below the next expected one): skip.
    Duplicate,
    /// The worker was removed by the log and has not started a new incarnation: skip.
    WorkerRemoved,
}

/// When the log removed a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Removal {
    /// Stream sequence of the `WorkerRemoved` record (0: restored from a snapshot written
    /// before removals were stamped).
    seq: u64,
    /// The record's `at_ms` (0: unknown; stamped by the next record that carries a time).
    at_ms: u64,
}

/// The tracker's whole state (snapshotted with the index).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "TrackerFile", into = "TrackerFile")]
pub struct EventTracker {
    /// Next expected event id per (worker, dp rank). Holds no removed worker.
    next: BTreeMap<(WorkerId, DpRank), u64>,
    /// Workers removed by a `WorkerRemoved` record and not re-incarnated since.
    removed: BTreeMap<WorkerId, Removal>,
    /// `removed` ordered by removal (log sequence), oldest first.
    removed_order: BTreeSet<(u64, WorkerId)>,
    /// The newest leader term seen in a control record (0: none).
    term: u64,
}

/// The serialized tracker. `removed` (the ids alone) is what snapshots held before removals
/// were stamped and what older readers still read; `removals` carries the stamps.
#[derive(Serialize, Deserialize)]
struct TrackerFile {
    next: BTreeMap<(WorkerId, DpRank), u64>,
    #[serde(default)]
    removed: BTreeSet<WorkerId>,
    #[serde(default)]
    removals: Vec<(WorkerId, u64, u64)>,
    #[serde(default)]
    term: u64,
}

impl From<TrackerFile> for EventTracker {
    fn from(f: TrackerFile) -> Self {
        let mut t = EventTracker {
            next: f.next,
            term: f.term,
            ..Default::default()
        };
        for w in f.removed {
            t.insert_removed(w, Removal { seq: 0, at_ms: 0 });
        }
        for (w, seq, at_ms) in f.removals {
            t.insert_removed(w, Removal { seq, at_ms });
        }
        t
    }
}

impl From<EventTracker> for TrackerFile {
    fn from(t: EventTracker) -> Self {
        TrackerFile {
            removed: t.removed.keys().copied().collect(),
            removals: t
                .removed_order
                .iter()
                .map(|&(seq, w)| (w, seq, t.removed[&w].at_ms))
                .collect(),
            next: t.next,
            term: t.term,
        }
    }
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
    ) -> EventDisposition {
        let key = (worker_id, dp_rank);
        if event_id == 0 && matches!(data, KvEventData::Cleared) {
            self.forget_removed(worker_id);
            self.next.insert(key, 1);
            return EventDisposition::Apply;
        }
        if self.removed.contains_key(&worker_id) {
            return EventDisposition::WorkerRemoved;
        }
        match self.next.get_mut(&key) {
            None => {
                self.next.insert(key, event_id.saturating_add(1));
                EventDisposition::Apply
            }
            Some(next) if event_id < *next => EventDisposition::Duplicate,
            Some(next) if event_id == *next => {
                *next += 1;
                EventDisposition::Apply
            }
            Some(next) => {
                let expected = *next;
                *next = event_id.saturating_add(1);
                EventDisposition::ApplyAfterGap { expected }
            }
        }
    }

    /// The log removed `worker_id` with the record at stream sequence `seq`, stamped `at_ms`
    /// (0: unknown): forget its ranks and ignore it until it re-incarnates. Then forgets the
    /// removals older than [`REMOVED_RETENTION_MS`] before this one, and the oldest beyond
    /// [`MAX_REMOVED`].
    pub fn remove_worker(&mut self, worker_id: WorkerId, seq: u64, at_ms: u64) {
        self.next.retain(|(w, _), _| *w != worker_id);
        if at_ms > 0 {
            self.stamp_unknown(at_ms);
        }
        self.forget_removed(worker_id);
        self.insert_removed(worker_id, Removal { seq, at_ms });
        self.evict(at_ms);
    }

    /// Records the term of a control record; returns false if it is older than the newest
    /// term seen (a deposed leader's write, to be ignored). Term 0 (unfenced) is never stale.
    pub fn observe_term(&mut self, term: u64) -> bool {
        if term == 0 {
            return true;
        }
        if term < self.term {
            return false;
        }
        self.term = term;
        true
    }

    /// The newest leader term seen in the log (0: none).
    pub fn term(&self) -> u64 {
        self.term
    }

    pub fn is_removed(&self, worker_id: WorkerId) -> bool {
        self.removed.contains_key(&worker_id)
    }

    /// Workers the log has seen events from and not removed.
    pub fn live_workers(&self) -> BTreeSet<WorkerId> {
        self.next.keys().map(|(w, _)| *w).collect()
    }

    pub fn removed_count(&self) -> usize {
        self.removed.len()
    }

    /// (worker, rank) pairs with a next expected event id.
    pub fn tracked_ranks(&self) -> usize {
        self.next.len()
    }

    fn insert_removed(&mut self, worker_id: WorkerId, removal: Removal) {
        if let Some(old) = self.removed.insert(worker_id, removal) {
            self.removed_order.remove(&(old.seq, worker_id));
        }
        self.removed_order.insert((removal.seq, worker_id));
    }

    fn forget_removed(&mut self, worker_id: WorkerId) {
        if let Some(old) = self.removed.remove(&worker_id) {
            self.removed_order.remove(&(old.seq, worker_id));
        }
    }

    /// Removals of unknown time (older records, older snapshots) take the first known time
    /// after them, so the retention counts from there.
    fn stamp_unknown(&mut self, at_ms: u64) {
        let newest_unknown = self
            .removed_order
            .last()
            .is_some_and(|(_, w)| self.removed[w].at_ms == 0);
        if newest_unknown {
            for r in self.removed.values_mut().filter(|r| r.at_ms == 0) {
                r.at_ms = at_ms;
            }
        }
    }

    /// Forgets, oldest removal first, while over [`MAX_REMOVED`] or while the oldest is past
    /// the retention as of `now_ms` (the newest record's time; 0: time rule off).
    fn evict(&mut self, now_ms: u64) {
        while let Some(&(seq, w)) = self.removed_order.first() {
            let at_ms = self.removed[&w].at_ms;
            let over_cap = self.removed.len() > MAX_REMOVED;
            let expired =
                now_ms > 0 && at_ms > 0 && at_ms.saturating_add(REMOVED_RETENTION_MS) < now_ms;
            if !(over_cap || expired) {
                return;
            }
            self.removed_order.remove(&(seq, w));
            self.removed.remove(&w);
        }
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
        assert_eq!(
            t.check(1, 0, 0, &KvEventData::Cleared),
            EventDisposition::Apply
        );
        assert_eq!(t.check(1, 0, 1, &STORE), EventDisposition::Apply);
        assert_eq!(t.check(1, 0, 1, &STORE), EventDisposition::Duplicate);
        assert_eq!(
            t.check(1, 0, 5, &STORE),
            EventDisposition::ApplyAfterGap { expected: 2 }
        );
        assert_eq!(t.check(1, 0, 6, &STORE), EventDisposition::Apply);
        // Ranks are independent; a first sighting sets the baseline.
        assert_eq!(t.check(1, 1, 40, &STORE), EventDisposition::Apply);
        assert_eq!(t.check(1, 1, 41, &STORE), EventDisposition::Apply);

        t.remove_worker(1, 10, 1_000);
        assert_eq!(t.check(1, 0, 7, &STORE), EventDisposition::WorkerRemoved);
        assert_eq!(t.check(1, 1, 42, &STORE), EventDisposition::WorkerRemoved);
        assert!(t.is_removed(1));
        // A restarted worker announces itself with event 0 = Cleared.
        assert_eq!(
            t.check(1, 0, 0, &KvEventData::Cleared),
            EventDisposition::Apply
        );
        assert!(!t.is_removed(1));
        assert_eq!(t.check(1, 0, 1, &STORE), EventDisposition::Apply);
    }

    /// 100k distinct workers, each with two ranks, added and removed one after another, one
    /// removal record per second of log time: the tracker stays bounded, and a removed
    /// worker's late events stay ignored for as long as the rules promise.
    #[test]
    fn churn_keeps_the_tracker_bounded_and_late_events_ignored_within_the_bound() {
        let mut t = EventTracker::default();
        let mut seq = 0;
        const T0: u64 = 1_700_000_000_000;
        for w in 0..100_000u64 {
            for rank in 0..2 {
                assert_eq!(
                    t.check(w, rank, 0, &KvEventData::Cleared),
                    EventDisposition::Apply
                );
                assert_eq!(t.check(w, rank, 1, &STORE), EventDisposition::Apply);
            }
            seq += 1;
            t.remove_worker(w, seq, T0 + w * 1_000);
            assert!(t.removed_count() <= MAX_REMOVED);
            assert_eq!(
                t.tracked_ranks(),
                0,
                "a removed worker's ranks are forgotten"
            );
        }
        // One record per second: the time rule binds first (an hour of removals).
        let window = (REMOVED_RETENTION_MS / 1_000) as usize + 1;
        assert_eq!(t.removed_count(), window);
        assert_eq!(t.removed_order.len(), window);
        // Late events of every worker removed within the retention are ignored ...
        let newest = 99_999u64;
        for w in newest + 1 - window as u64..=newest {
            assert_eq!(
                t.check(w, 1, 2, &STORE),
                EventDisposition::WorkerRemoved,
                "{w}"
            );
        }
        // ... one removed before it is forgotten: its late event sets a new baseline (the
        // leader removes such a worker again once it has no registration for the grace).
        let forgotten = newest - window as u64;
        assert_eq!(t.check(forgotten, 1, 2, &STORE), EventDisposition::Apply);
        assert_eq!(t.tracked_ranks(), 1);

        // Removals faster than the retention: the count cap binds, oldest removal first.
        let mut t = EventTracker::default();
        for w in 0..100_000u64 {
            t.remove_worker(w, w + 1, T0 + w);
        }
        assert_eq!(t.removed_count(), MAX_REMOVED);
        assert!(t.is_removed(99_999) && t.is_removed(100_000 - MAX_REMOVED as u64));
        assert!(!t.is_removed(100_000 - MAX_REMOVED as u64 - 1));
    }

    #[test]
    fn same_records_same_tracker_and_snapshots_round_trip() {
        const T0: u64 = 3_000_000;
        let run = || {
            let mut t = EventTracker::default();
            for w in 0..200u64 {
                t.check(w, 0, 0, &KvEventData::Cleared);
                t.remove_worker(w, w + 1, if w < 50 { 0 } else { T0 + w });
            }
            t
        };
        let (a, b) = (run(), run());
        assert_eq!(a, b);
        assert_eq!(a.removed_count(), 200);
        let bytes = rmp_serde::to_vec_named(&a).unwrap();
        let back: EventTracker = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, a);
        // The first timed record (worker 50) stamped the 50 removals of unknown time, so they
        // expire with it once the log is past its retention.
        let mut c = back.clone();
        c.remove_worker(1_000, 1_000, T0 + 50 + REMOVED_RETENTION_MS + 1);
        assert!((0..=50).all(|w| !c.is_removed(w)));
        assert!((51..200).all(|w| c.is_removed(w)));
    }

    #[test]
    fn a_snapshot_without_stamps_restores_its_removed_workers() {
        #[derive(Serialize)]
        struct Old {
            next: BTreeMap<(WorkerId, DpRank), u64>,
            removed: BTreeSet<WorkerId>,
        }
        let old = Old {
            next: [((5, 0), 3)].into_iter().collect(),
            removed: [1, 2].into_iter().collect(),
        };
        let bytes = rmp_serde::to_vec_named(&old).unwrap();
        let mut t: EventTracker = rmp_serde::from_slice(&bytes).unwrap();
        assert!(t.is_removed(1) && t.is_removed(2));
        assert_eq!(t.check(5, 0, 3, &STORE), EventDisposition::Apply);
        assert_eq!(t.check(1, 0, 9, &STORE), EventDisposition::WorkerRemoved);
        // The first timed removal stamps them; they expire an hour of log time later.
        t.remove_worker(3, 10, 5_000);
        t.remove_worker(4, 11, 5_000 + REMOVED_RETENTION_MS + 1);
        assert!(!t.is_removed(1) && !t.is_removed(2) && !t.is_removed(3));
        assert!(t.is_removed(4));
    }

    #[test]
    fn stale_terms_are_refused() {
        let mut t = EventTracker::default();
        assert!(t.observe_term(0));
        assert!(t.observe_term(5));
        assert!(t.observe_term(5));
        assert!(!t.observe_term(4));
        assert!(t.observe_term(0), "unfenced records are never stale");
        assert!(t.observe_term(9));
        assert_eq!(t.term(), 9);
    }
}
