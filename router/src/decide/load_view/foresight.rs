//! Predicted overlap: what the view expects ranks' caches to hold from decisions alone — the
//! prompts of recent decisions, as overlap their ranks are about to have ([`PredictedOverlap`]),
//! and the predicted caches of workers without KV events ([`ApproxCache`]). Neither touches
//! the load accounting; both are read by the decision core beside the index's overlap.

use kvroute_common::WorkerId;
use kvroute_common::messages::{Decision, WorkerCard};

use super::Applied;
use super::approx::ApproxCache;
use super::predicted::{PredictedOverlap, PromptPrefixes};
use crate::worker::WorkerRank;

#[derive(Debug)]
pub(super) struct Foresight {
    pub predicted: PredictedOverlap,
    pub approx: ApproxCache,
}

impl Foresight {
    pub fn new(predicted_overlap_ttl_ms: u64, approx_cache_ttl_ms: u64) -> Self {
        Self {
            predicted: PredictedOverlap::new(predicted_overlap_ttl_ms),
            approx: ApproxCache::new(approx_cache_ttl_ms),
        }
    }

    /// Records decision `d`, which the load accounting `applied` so: a charged decision's
    /// prompt is predicted overlap of its rank; every distinct decision, a superseded one too,
    /// is credited to its worker's approximate cache (replicas that see a request's decisions
    /// in different orders then credit the same ones).
    pub fn record(&mut self, d: &Decision, applied: Applied, now_ms: u64) {
        let rank = WorkerRank::new(d.worker_id, d.dp_rank);
        if matches!(
            applied,
            Applied::Added | Applied::Replaced | Applied::AlreadyCounted
        ) {
            self.predicted.record(rank, &d.prefix_hashes, d.ts, now_ms);
        }
        if applied != Applied::Duplicate
            && self.approx.tracks(rank)
            && let Some(prompt) = PromptPrefixes::of_decision(&d.prefix_hashes, d.request_blocks)
        {
            self.approx.record(rank, &prompt, d.ts, now_ms);
        }
    }

    pub fn set_workers<'a>(&mut self, cards: impl IntoIterator<Item = &'a WorkerCard>) {
        self.approx.set_workers(cards);
    }

    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.predicted.remove_worker(worker_id);
        self.approx.remove_worker(worker_id);
    }

    pub fn expire(&mut self, now_ms: u64) {
        self.predicted.expire(now_ms);
        self.approx.expire(now_ms);
    }
}
