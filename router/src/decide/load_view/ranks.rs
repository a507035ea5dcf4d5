//! Load accounting: each rank's last `WorkerLoad` report and the predictions charged to it,
//! which reports take over (those that name their new requests, exactly those; the others,
//! every prediction older than the rank's report interval) and lifecycle events release. It
//! knows nothing of decisions or requests' histories: the load view says which rank a request
//! is charged to ([`super::retries`]).

use std::collections::VecDeque;

use kvroute_common::messages::{Decision, LifecycleKind, WorkerLoad};
use kvroute_common::{RequestId, WorkerId};

use super::models::{
    self, DEFAULT_PREFILL_TOKENS_PER_SEC, MILLIBLOCKS, PrefillLoadModel, PrefillRate,
};
use super::predictions::{Prediction, Predictions};
use super::{LoadViewConfig, RankView};
use crate::signals::ObservedLoad;
use crate::worker::WorkerRank;

/// Predictions kept per rank; the oldest go first beyond it.
const MAX_PREDICTIONS_PER_RANK: usize = 16_384;
/// The shortest report interval assumed: a request decided this recently may not have reached
/// its worker yet, however often the worker reports.
const MIN_REPORT_INTERVAL_MS: u64 = 20;

#[derive(Debug)]
struct RankLoad {
    report: Option<(u64, ObservedLoad)>,
    /// `ts` of the last report (the worker's clock; 0 when it sends none).
    report_ts: u64,
    /// The report interval learned from consecutive reports' `ts` (a moving average).
    interval_ms: Option<f64>,
    predictions: Predictions,
    /// Insertion order, for the per-rank cap (entries may already be gone).
    order: VecDeque<RequestId>,
    /// The rank's prefill rate as observed (prefill decay without a configured rate).
    prefill_rate: PrefillRate,
}

impl RankLoad {
    fn new(models: models::LoadModels) -> Self {
        Self {
            report: None,
            report_ts: 0,
            interval_ms: None,
            predictions: Predictions::new(matches!(models.prefill, PrefillLoadModel::Decay { .. })),
            order: VecDeque::new(),
            prefill_rate: PrefillRate::default(),
        }
    }

    /// The rate the oldest prefill decays at: configured, or fitted (the default before the
    /// first observation); `None` without the decay.
    fn decay_rate(&self, models: models::LoadModels) -> Option<f64> {
        match models.prefill {
            PrefillLoadModel::Full => None,
            PrefillLoadModel::Decay {
                tokens_per_sec: Some(rate),
            } => Some(rate as f64),
            PrefillLoadModel::Decay {
                tokens_per_sec: None,
            } => Some(
                self.prefill_rate
                    .tokens_per_sec(DEFAULT_PREFILL_TOKENS_PER_SEC),
            ),
        }
    }

    /// The load at `now_ms`; under the prefill decay the oldest prefill counts what is left of
    /// it then.
    fn observed(&self, models: models::LoadModels, now_ms: u64) -> Option<ObservedLoad> {
        if self.report.is_none() && self.predictions.is_empty() {
            return None;
        }
        let mut load = self.report.map(|(_, l)| l).unwrap_or_default();
        let predicted = self.predictions.totals();
        let mut prefill_tokens = predicted.prefill_tokens;
        if let Some(rate) = self.decay_rate(models)
            && let Some(oldest) = self.predictions.oldest()
        {
            let elapsed = now_ms.saturating_sub(oldest.added_ms);
            prefill_tokens -= oldest.prefill_tokens
                - models::remaining_prefill(oldest.prefill_tokens, elapsed, rate);
        }
        load.active_prefill_tokens += prefill_tokens;
        load.active_decode_blocks += predicted.blocks;
        load.active_requests += predicted.requests;
        load.output_blocks += predicted.output_milliblocks as f64 / MILLIBLOCKS as f64;
        Some(load)
    }

    fn insert(&mut self, request_id: RequestId, prediction: Prediction) {
        if self.predictions.insert(request_id, prediction).is_none() {
            self.order.push_back(request_id);
        }
        while self.predictions.len() > MAX_PREDICTIONS_PER_RANK {
            match self.order.pop_front() {
                Some(old) => {
                    self.predictions.remove(&old);
                }
                None => break,
            }
        }
    }

    /// Moves the learned interval towards the gap between this report's `ts` and the last
    /// one's, per report (a missed report doubles the gap, not the interval).
    fn learn_interval(&mut self, report: &WorkerLoad) {
        if let Some((seq, _)) = self.report
            && self.report_ts != 0
            && report.ts >= self.report_ts
            && report.seq > seq
        {
            let gap = (report.ts - self.report_ts) as f64 / (report.seq - seq) as f64;
            self.interval_ms = Some(match self.interval_ms {
                None => gap,
                Some(i) => i + (gap - i) / 8.0,
            });
        }
        self.report_ts = report.ts;
    }

    fn retain(&mut self, keep: impl Fn(&Prediction) -> bool) {
        self.predictions.retain(keep);
        let predictions = &self.predictions;
        self.order.retain(|id| predictions.contains_key(id));
    }
}

/// Reports and predictions per rank.
#[derive(Debug)]
pub(super) struct RankLoads {
    config: LoadViewConfig,
    /// Read once per candidate rank per selection: hashbrown's foldhash, not SipHash.
    ranks: hashbrown::HashMap<WorkerRank, RankLoad>,
}

impl RankLoads {
    pub fn new(config: LoadViewConfig) -> Self {
        Self {
            config,
            ranks: hashbrown::HashMap::new(),
        }
    }

    pub fn load(&self, rank: WorkerRank, now_ms: u64) -> Option<ObservedLoad> {
        self.ranks
            .get(&rank)
            .and_then(|r| r.observed(self.config.models, now_ms))
    }

    pub fn ranks(&self, now_ms: u64) -> Vec<RankView> {
        let models = self.config.models;
        let mut out: Vec<RankView> = self
            .ranks
            .iter()
            .map(|(rank, r)| RankView {
                rank: *rank,
                load: r.observed(models, now_ms),
                prefill_tokens_per_sec: r.decay_rate(models),
            })
            .collect();
        out.sort_by_key(|r| r.rank);
        out
    }

    fn rank_mut(&mut self, rank: WorkerRank) -> &mut RankLoad {
        let models = self.config.models;
        self.ranks
            .entry(rank)
            .or_insert_with(|| RankLoad::new(models))
    }

    /// Requests predicted and not yet finished, over all ranks.
    pub fn predictions(&self) -> usize {
        self.ranks.values().map(|r| r.predictions.len()).sum()
    }

    /// Charges `prediction` for `request_id` to `rank`.
    pub fn charge(&mut self, rank: WorkerRank, request_id: RequestId, prediction: Prediction) {
        self.rank_mut(rank).insert(request_id, prediction);
    }

    /// Releases `request_id`'s charge on `rank`, returning it.
    pub fn release(&mut self, rank: WorkerRank, request_id: &RequestId) -> Option<Prediction> {
        self.ranks
            .get_mut(&rank)
            .and_then(|r| r.predictions.remove(request_id))
    }

    /// Releases `request_id`'s charge on `rank` as if it had never been made (its place in
    /// the rank's order too).
    pub fn unmake(&mut self, rank: WorkerRank, request_id: &RequestId) {
        if let Some(r) = self.ranks.get_mut(&rank)
            && r.predictions.remove(request_id).is_some()
        {
            r.order.retain(|id| id != request_id);
        }
    }

    /// Moves `request_id`'s charge (if it still has one) from `from` to `to`.
    pub fn move_charge(&mut self, from: WorkerRank, to: WorkerRank, request_id: RequestId) {
        if let Some(p) = self.release(from, &request_id) {
            self.charge(to, request_id, p);
        }
    }

    /// What `d`'s request counts for `output_tokens` generated (0 unless output blocks are
    /// tracked).
    pub fn output_milliblocks(&self, d: &Decision, output_tokens: u64) -> u64 {
        if !self.config.models.track_output_blocks {
            return 0;
        }
        models::output_milliblocks(output_tokens, d.block_size, d.expected_output_tokens)
    }

    /// Whether `progress` events count (output blocks are tracked).
    pub fn tracks_output(&self) -> bool {
        self.config.models.track_output_blocks
    }

    /// A request's first `prefill_done` on `rank`: `tokens` prefilled in `elapsed_ms` since
    /// its decision teach the rank's prefill rate (when the decay fits it).
    pub fn observe_prefill(&mut self, rank: WorkerRank, tokens: u64, elapsed_ms: u64) {
        let fits_rate = matches!(
            self.config.models.prefill,
            PrefillLoadModel::Decay {
                tokens_per_sec: None
            }
        );
        if fits_rate {
            self.rank_mut(rank).prefill_rate.observe(tokens, elapsed_ms);
        }
    }

    /// A lifecycle event of `request_id` on `rank` (where it is charged now): prefill done
    /// and progress mark it prefilled, progress counts `output` (tokens, milliblocks) when
    /// given, finished releases it.
    pub fn lifecycle(
        &mut self,
        rank: WorkerRank,
        request_id: &RequestId,
        kind: LifecycleKind,
        output: Option<(u64, u64)>,
    ) {
        let Some(rank) = self.ranks.get_mut(&rank) else {
            return;
        };
        match kind {
            LifecycleKind::PrefillDone { .. } => rank.predictions.mark_prefilled(request_id),
            LifecycleKind::Progress { .. } => {
                // Generating output: past its prefill, whether or not that event came.
                rank.predictions.mark_prefilled(request_id);
                if let Some((tokens, milliblocks)) = output {
                    rank.predictions.progress(request_id, tokens, milliblocks);
                }
            }
            LifecycleKind::Finished { .. } => {
                rank.predictions.remove(request_id);
            }
        }
    }

    /// Takes a report (older sequence numbers than the last are dropped): it replaces the
    /// rank's last one and takes over the predictions it counts by age — those older than one
    /// report interval, or, for a report naming its new requests, those older than the confirm
    /// window (the caller releases the named ones). Returns whether the report was newer.
    pub fn report(&mut self, report: &WorkerLoad, now_ms: u64) -> bool {
        let config = self.config;
        let rank = self.rank_mut(WorkerRank::new(report.worker_id, report.dp_rank));
        if let Some((seq, _)) = rank.report
            && report.seq != 0
            && report.seq <= seq
        {
            return false;
        }
        rank.learn_interval(report);
        rank.report = Some((report.seq, ObservedLoad::from(report)));
        let interval = rank
            .interval_ms
            .map_or(config.report_interval_ms, |i| i.round() as u64)
            .max(MIN_REPORT_INTERVAL_MS);
        let window = match report.new_requests {
            None => interval,
            Some(_) => config.confirm_window_ms.max(interval.saturating_mul(2)),
        };
        let cutoff = now_ms.saturating_sub(window);
        rank.retain(|p| p.added_ms > cutoff);
        true
    }

    /// Forgets every rank of a departed worker.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|rank, _| rank.worker_id != worker_id);
    }

    /// Drops every prediction added before `cutoff_ms`; returns how many.
    pub fn forget_until(&mut self, cutoff_ms: u64) -> usize {
        let before = self.predictions();
        for rank in self.ranks.values_mut() {
            rank.retain(|p| p.added_ms > cutoff_ms);
        }
        before - self.predictions()
    }

    /// Drops predictions added at or before `cutoff_ms`, and ranks with nothing left (a
    /// rank's fitted prefill rate is kept while its worker is registered).
    pub fn expire(&mut self, cutoff_ms: u64) {
        for rank in self.ranks.values_mut() {
            rank.retain(|p| p.added_ms > cutoff_ms);
        }
        self.ranks.retain(|_, r| {
            r.report.is_some() || !r.predictions.is_empty() || r.prefill_rate.is_fitted()
        });
    }
}
