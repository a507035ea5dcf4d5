//! The shared load view: each rank's last `WorkerLoad` report plus the load the routers
//! predicted for it — every replica's decisions add a request's prefill tokens and blocks,
//! lifecycle events remove them, and a newer report drops predictions older than one report
//! interval (the report already counts them), so a lost `finished` leaves phantom load for at
//! most one interval. Pure: time comes in as `now_ms`.

use std::collections::{HashMap, HashSet, VecDeque};

use kvroute_common::messages::{Decision, LifecycleKind, RequestLifecycle, WorkerLoad};
use kvroute_common::{DecisionId, RequestId, WorkerId};

use crate::signals::ObservedLoad;
use crate::worker::WorkerRank;

/// Decision ids remembered for de-duplication (own decisions come back from NATS).
const RECENT_DECISIONS: usize = 65_536;
/// Predictions kept per rank; the oldest go first beyond it.
const MAX_PREDICTIONS_PER_RANK: usize = 16_384;

/// Settings of a [`LoadView`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadViewConfig {
    /// Workers' report interval: a newer report drops predictions older than this.
    pub report_interval_ms: u64,
    /// A prediction with no lifecycle event and no newer report goes after this long.
    pub prediction_max_age_ms: u64,
}

/// What applying a decision did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Added,
    /// Seen before (this replica's own decision, or a redelivery).
    Duplicate,
}

#[derive(Debug, Clone, Copy)]
struct Prediction {
    prefill_tokens: u64,
    blocks: u64,
    added_ms: u64,
    prefilled: bool,
}

#[derive(Debug, Default)]
struct RankLoad {
    report: Option<(u64, ObservedLoad)>,
    predictions: HashMap<RequestId, Prediction>,
    /// Insertion order, for the per-rank cap (entries may already be gone).
    order: VecDeque<RequestId>,
}

impl RankLoad {
    fn observed(&self) -> Option<ObservedLoad> {
        if self.report.is_none() && self.predictions.is_empty() {
            return None;
        }
        let mut load = self.report.map(|(_, l)| l).unwrap_or_default();
        for p in self.predictions.values() {
            if !p.prefilled {
                load.active_prefill_tokens += p.prefill_tokens;
            }
            load.active_decode_blocks += p.blocks;
            load.active_requests += 1;
        }
        Some(load)
    }

    fn retain_newer_than(&mut self, cutoff_ms: u64) {
        self.predictions.retain(|_, p| p.added_ms > cutoff_ms);
        let predictions = &self.predictions;
        self.order.retain(|id| predictions.contains_key(id));
    }
}

/// Reports and predictions per rank.
#[derive(Debug)]
pub struct LoadView {
    config: LoadViewConfig,
    ranks: HashMap<WorkerRank, RankLoad>,
    seen: HashSet<DecisionId>,
    seen_order: VecDeque<DecisionId>,
}

impl LoadView {
    pub fn new(config: LoadViewConfig) -> Self {
        Self {
            config,
            ranks: HashMap::new(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
        }
    }

    /// The rank's load; `None` when nothing is known of it.
    pub fn load(&self, rank: WorkerRank) -> Option<ObservedLoad> {
        self.ranks.get(&rank).and_then(RankLoad::observed)
    }

    /// Requests predicted and not yet finished, over all ranks.
    pub fn predictions(&self) -> usize {
        self.ranks.values().map(|r| r.predictions.len()).sum()
    }

    /// Adds a decision's request to its rank, once per decision id.
    pub fn apply_decision(&mut self, d: &Decision, now_ms: u64) -> Applied {
        if !self.seen.insert(d.decision_id) {
            return Applied::Duplicate;
        }
        self.seen_order.push_back(d.decision_id);
        if self.seen_order.len() > RECENT_DECISIONS
            && let Some(old) = self.seen_order.pop_front()
        {
            self.seen.remove(&old);
        }
        let rank = self
            .ranks
            .entry(WorkerRank::new(d.worker_id, d.dp_rank))
            .or_default();
        let prediction = Prediction {
            prefill_tokens: d.prefill_tokens,
            blocks: u64::from(d.request_blocks),
            added_ms: now_ms,
            prefilled: false,
        };
        if rank.predictions.insert(d.request_id, prediction).is_none() {
            rank.order.push_back(d.request_id);
        }
        while rank.predictions.len() > MAX_PREDICTIONS_PER_RANK {
            match rank.order.pop_front() {
                Some(old) => {
                    rank.predictions.remove(&old);
                }
                None => break,
            }
        }
        Applied::Added
    }

    /// Prefill done: the prompt no longer counts as prefill. Finished: the request is gone.
    pub fn apply_lifecycle(&mut self, event: &RequestLifecycle) {
        let Some(rank) = self
            .ranks
            .get_mut(&WorkerRank::new(event.worker_id, event.dp_rank))
        else {
            return;
        };
        match event.kind {
            LifecycleKind::PrefillDone { .. } => {
                if let Some(p) = rank.predictions.get_mut(&event.request_id) {
                    p.prefilled = true;
                }
            }
            LifecycleKind::Finished { .. } => {
                rank.predictions.remove(&event.request_id);
            }
        }
    }

    /// Takes a report (older sequence numbers than the last are dropped) and reconciles:
    /// predictions older than one report interval are now counted by the worker itself.
    /// Returns whether the report was newer.
    pub fn apply_report(&mut self, report: &WorkerLoad, now_ms: u64) -> bool {
        let rank = self
            .ranks
            .entry(WorkerRank::new(report.worker_id, report.dp_rank))
            .or_default();
        if let Some((seq, _)) = rank.report
            && report.seq != 0
            && report.seq <= seq
        {
            return false;
        }
        rank.report = Some((report.seq, ObservedLoad::from(report)));
        rank.retain_newer_than(now_ms.saturating_sub(self.config.report_interval_ms));
        true
    }

    /// Forgets every rank of a departed worker.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|rank, _| rank.worker_id != worker_id);
    }

    /// Drops predictions past the maximum age, and ranks with nothing left.
    pub fn expire(&mut self, now_ms: u64) {
        let cutoff = now_ms.saturating_sub(self.config.prediction_max_age_ms);
        for rank in self.ranks.values_mut() {
            rank.retain_newer_than(cutoff);
        }
        self.ranks
            .retain(|_, r| r.report.is_some() || !r.predictions.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::SchemaVersion;
    use uuid::Uuid;

    use super::*;

    fn view() -> LoadView {
        LoadView::new(LoadViewConfig {
            report_interval_ms: 1000,
            prediction_max_age_ms: 60_000,
        })
    }

    fn decision(worker_id: u64, request_id: Uuid, blocks: u32, prefill: u64) -> Decision {
        Decision {
            v: SchemaVersion::CURRENT,
            decision_id: Uuid::new_v4(),
            request_id,
            router_id: "r".into(),
            model: "m".into(),
            role: Default::default(),
            worker_id,
            dp_rank: 0,
            session_id: None,
            request_blocks: blocks,
            overlap_blocks: 0,
            prefill_tokens: prefill,
            expected_output_tokens: None,
            cost: Default::default(),
            policy: "default".into(),
            binding: None,
            ts: 0,
        }
    }

    fn lifecycle(worker_id: u64, request_id: Uuid, kind: LifecycleKind) -> RequestLifecycle {
        RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id,
            worker_id,
            dp_rank: 0,
            kind,
            ts: 0,
        }
    }

    fn report(worker_id: u64, seq: u64, requests: u64) -> WorkerLoad {
        WorkerLoad {
            v: SchemaVersion::CURRENT,
            worker_id,
            dp_rank: 0,
            seq,
            active_prefill_tokens: 0,
            active_decode_blocks: 0,
            active_requests: requests,
            waiting_requests: 0,
            kv_used_blocks: 0,
            total_kv_blocks: 0,
            ts: 0,
        }
    }

    const W: WorkerRank = WorkerRank {
        worker_id: 1,
        dp_rank: 0,
    };

    #[test]
    fn decisions_add_and_lifecycle_events_remove_predicted_load() {
        let mut v = view();
        assert_eq!(v.load(W), None);
        let r = Uuid::new_v4();
        let d = decision(1, r, 10, 160);
        assert_eq!(v.apply_decision(&d, 0), Applied::Added);
        assert_eq!(v.apply_decision(&d, 0), Applied::Duplicate);
        let l = v.load(W).unwrap();
        assert_eq!(
            (
                l.active_prefill_tokens,
                l.active_decode_blocks,
                l.active_requests
            ),
            (160, 10, 1)
        );
        v.apply_lifecycle(&lifecycle(
            1,
            r,
            LifecycleKind::PrefillDone { cached_tokens: 0 },
        ));
        let l = v.load(W).unwrap();
        assert_eq!((l.active_prefill_tokens, l.active_decode_blocks), (0, 10));
        v.apply_lifecycle(&lifecycle(
            1,
            r,
            LifecycleKind::Finished { output_tokens: 5 },
        ));
        // Nothing predicted and no report: nothing known.
        assert_eq!(v.load(W), None);
    }

    #[test]
    fn a_newer_report_drops_predictions_older_than_one_interval() {
        let mut v = view();
        v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 1_000);
        v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 2_500);
        assert!(v.apply_report(&report(1, 5, 3), 3_000));
        // The first prediction (2 s old) is in the report now; the second (0.5 s) is not yet.
        let l = v.load(W).unwrap();
        assert_eq!((l.active_requests, l.active_decode_blocks), (4, 4));
        // A stale report changes nothing.
        assert!(!v.apply_report(&report(1, 4, 0), 9_000));
        assert_eq!(v.load(W).unwrap().active_requests, 4);
        // A lost `finished`: gone with the next report after one interval.
        assert!(v.apply_report(&report(1, 6, 0), 3_600));
        assert_eq!(v.load(W).unwrap().active_requests, 0);
    }

    #[test]
    fn departed_workers_and_old_predictions_are_forgotten() {
        let mut v = view();
        v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 0);
        v.apply_decision(&decision(2, Uuid::new_v4(), 4, 64), 50_000);
        v.remove_worker(1);
        assert_eq!(v.load(W), None);
        v.expire(70_000);
        assert_eq!(v.predictions(), 1);
        v.expire(120_000);
        assert_eq!(v.predictions(), 0);
        assert_eq!(v.load(WorkerRank::new(2, 0)), None);
    }
}
