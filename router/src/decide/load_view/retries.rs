//! Retry memory: the decision each recent request got (by any replica) and the rank its charge
//! sits on, so a retry is answered with the decision already made and a request is charged
//! once; and the requests a worker accounted for before their decision arrived, so that
//! decision is not charged. Both are bounded by count and by age.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvroute_common::RequestId;
use kvroute_common::messages::Decision;

use crate::worker::WorkerRank;

/// Decisions remembered per request id (de-duplication, retries).
const RECENT_DECISIONS: usize = 65_536;
/// Requests a worker already accounts for (finished, or named by a report) before any decision
/// of theirs arrived, remembered so that decision is not charged.
const SETTLED_EARLY: usize = 16_384;
/// How long such a request is remembered.
const SETTLED_EARLY_MS: u64 = 60_000;

/// The decision a request got, and where it is charged.
#[derive(Debug, Clone)]
pub(super) struct Decided {
    pub decision: Arc<Decision>,
    /// The rank holding its prediction (the decision's, unless a lifecycle event or a report
    /// moved it).
    pub rank: WorkerRank,
    pub added_ms: u64,
    /// Its `prefill_done` has been seen (the prefill rate learns from the first only).
    pub prefill_seen: bool,
}

/// How a decision compares with what is remembered of its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Known {
    /// Its request has no remembered decision.
    New,
    /// This very decision (this replica's own, or a redelivery).
    Same,
    /// The remembered decision wins.
    Loses,
    /// This decision wins over the remembered one, charged to `rank`.
    Wins { rank: WorkerRank },
}

/// `d` as remembered for answering retries: without its prefix hashes, which only the
/// predicted overlap reads.
fn remembered(d: &Decision) -> Arc<Decision> {
    let mut kept = d.clone();
    kept.prefix_hashes = Vec::new();
    Arc::new(kept)
}

/// Whether decision `new` wins over `old` (same request): the later attempt, then the lower
/// decision id. Every replica applies the same rule, so all keep the same decision.
fn supersedes(new: &Decision, old: &Decision) -> bool {
    (new.attempt, std::cmp::Reverse(new.decision_id))
        > (old.attempt, std::cmp::Reverse(old.decision_id))
}

/// Recent requests' decisions, and requests settled before their decision came.
#[derive(Debug, Default)]
pub(super) struct RetryMemory {
    decided: HashMap<RequestId, Decided>,
    /// Insertion order of `decided`, for the cap and the age limit.
    decided_order: VecDeque<RequestId>,
    /// Requests the worker accounted for before any decision of theirs arrived, and when.
    settled_early: HashMap<RequestId, u64>,
    settled_early_order: VecDeque<RequestId>,
}

impl RetryMemory {
    pub fn get(&self, request_id: &RequestId) -> Option<&Decided> {
        self.decided.get(request_id)
    }

    pub fn get_mut(&mut self, request_id: &RequestId) -> Option<&mut Decided> {
        self.decided.get_mut(request_id)
    }

    /// How `d` compares with its request's remembered decision.
    pub fn compare(&self, d: &Decision) -> Known {
        match self.decided.get(&d.request_id) {
            None => Known::New,
            Some(known) if known.decision.decision_id == d.decision_id => Known::Same,
            Some(known) if !supersedes(d, &known.decision) => Known::Loses,
            Some(known) => Known::Wins { rank: known.rank },
        }
    }

    /// Remembers `d` as its request's decision, charged to `rank`: a new request's first
    /// decision, or one that won ([`Known::Wins`]) over the remembered one.
    pub fn remember(&mut self, d: &Decision, rank: WorkerRank, now_ms: u64) {
        if let Some(known) = self.decided.get_mut(&d.request_id) {
            known.decision = remembered(d);
            known.rank = rank;
            return;
        }
        self.decided.insert(
            d.request_id,
            Decided {
                decision: remembered(d),
                rank,
                added_ms: now_ms,
                prefill_seen: false,
            },
        );
        self.decided_order.push_back(d.request_id);
        while self.decided_order.len() > RECENT_DECISIONS {
            if let Some(old) = self.decided_order.pop_front() {
                self.decided.remove(&old);
            }
        }
    }

    /// Forgets `d` if it is its request's decision, returning the rank it was charged to.
    pub fn forget(&mut self, d: &Decision) -> Option<WorkerRank> {
        let known = self.decided.get(&d.request_id)?;
        if known.decision.decision_id != d.decision_id {
            return None;
        }
        let rank = known.rank;
        self.decided.remove(&d.request_id);
        if let Some(i) = self
            .decided_order
            .iter()
            .rposition(|id| *id == d.request_id)
        {
            self.decided_order.remove(i);
        }
        Some(rank)
    }

    /// Remembers that a worker accounts for `request_id`, whose decision is not known yet.
    pub fn settle_early(&mut self, request_id: RequestId, now_ms: u64) {
        if self.settled_early.insert(request_id, now_ms).is_none() {
            self.settled_early_order.push_back(request_id);
        }
        while self.settled_early_order.len() > SETTLED_EARLY {
            if let Some(old) = self.settled_early_order.pop_front() {
                self.settled_early.remove(&old);
            }
        }
    }

    /// Whether a worker accounted for `request_id` before its decision came (forgotten now).
    pub fn take_settled_early(&mut self, request_id: &RequestId) -> bool {
        self.settled_early.remove(request_id).is_some()
    }

    /// Forgets decisions remembered at or before `cutoff_ms`, and requests settled early more
    /// than [`SETTLED_EARLY_MS`] before `now_ms`.
    pub fn expire(&mut self, cutoff_ms: u64, now_ms: u64) {
        while let Some(id) = self.decided_order.front() {
            match self.decided.get(id) {
                Some(d) if d.added_ms > cutoff_ms => break,
                _ => {
                    let id = *id;
                    self.decided_order.pop_front();
                    self.decided.remove(&id);
                }
            }
        }
        let early_cutoff = now_ms.saturating_sub(SETTLED_EARLY_MS);
        while let Some(id) = self.settled_early_order.front() {
            match self.settled_early.get(id) {
                Some(at) if *at > early_cutoff => break,
                _ => {
                    let id = *id;
                    self.settled_early_order.pop_front();
                    self.settled_early.remove(&id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;

    fn decision(request_id: Uuid, attempt: u32, decision_id: Uuid) -> Decision {
        let mut d = crate::testing::decision(1, request_id, 1, 16);
        d.attempt = attempt;
        d.decision_id = decision_id;
        d.prefix_hashes = vec![1, 2];
        d
    }

    fn rank(worker_id: u64) -> WorkerRank {
        WorkerRank::new(worker_id, 0)
    }

    #[test]
    fn the_later_attempt_wins_then_the_lower_decision_id() {
        let mut memory = RetryMemory::default();
        let request = Uuid::new_v4();
        let (low, high) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let first = decision(request, 0, high);
        assert_eq!(memory.compare(&first), Known::New);
        memory.remember(&first, rank(1), 0);
        assert_eq!(memory.compare(&first), Known::Same);
        // Same attempt: the lower decision id wins, the higher loses.
        assert_eq!(
            memory.compare(&decision(request, 0, low)),
            Known::Wins { rank: rank(1) }
        );
        memory.remember(&decision(request, 0, low), rank(2), 5);
        assert_eq!(memory.compare(&decision(request, 0, high)), Known::Loses);
        // A later attempt wins whatever its id; the charge's rank is the remembered one.
        assert_eq!(
            memory.compare(&decision(request, 1, Uuid::from_u128(9))),
            Known::Wins { rank: rank(2) }
        );
        // What is remembered answers retries without the prompt's hashes, from the first
        // decision's time.
        let known = memory.get(&request).unwrap();
        assert_eq!(known.decision.decision_id, low);
        assert!(known.decision.prefix_hashes.is_empty());
        assert_eq!(known.added_ms, 0);
    }

    #[test]
    fn only_the_remembered_decision_is_forgotten() {
        let mut memory = RetryMemory::default();
        let request = Uuid::new_v4();
        let kept = decision(request, 1, Uuid::new_v4());
        memory.remember(&kept, rank(3), 0);
        assert_eq!(memory.forget(&decision(request, 0, Uuid::new_v4())), None);
        assert_eq!(memory.forget(&kept), Some(rank(3)));
        assert_eq!(memory.compare(&kept), Known::New);
        assert_eq!(memory.forget(&kept), None);
    }

    #[test]
    fn memory_is_bounded_by_count_and_age() {
        let mut memory = RetryMemory::default();
        let first = decision(Uuid::new_v4(), 0, Uuid::new_v4());
        memory.remember(&first, rank(1), 0);
        for i in 0..RECENT_DECISIONS {
            memory.remember(
                &decision(Uuid::new_v4(), 0, Uuid::new_v4()),
                rank(1),
                i as u64,
            );
        }
        assert!(
            memory.get(&first.request_id).is_none(),
            "the oldest went past the cap"
        );
        assert_eq!(memory.decided.len(), RECENT_DECISIONS);
        memory.expire(100, 100);
        assert_eq!(memory.decided.len(), RECENT_DECISIONS - 101);

        let early = Uuid::new_v4();
        memory.settle_early(early, 1_000);
        memory.expire(0, 999 + SETTLED_EARLY_MS);
        assert!(
            memory.take_settled_early(&early),
            "kept for SETTLED_EARLY_MS"
        );
        memory.settle_early(early, 1_000);
        memory.expire(0, 1_000 + SETTLED_EARLY_MS);
        assert!(!memory.take_settled_early(&early), "forgotten after it");
    }
}
