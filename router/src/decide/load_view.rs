//! The shared load view: each rank's last `WorkerLoad` report plus the load the routers
//! predicted for it — every replica's decisions add a request's prefill tokens and blocks,
//! lifecycle events remove them, and reports take them over once they count them. A report
//! that names its new requests (`new_requests`) takes over exactly those; a report that does
//! not is assumed to count every request decided more than one report interval before it,
//! the interval learned per rank from the reports' own `ts` (the configured one until two
//! reports are seen), so no flag has to match the workers' reporting rate. A prediction no
//! report names goes after the confirm window (the request never reached its worker, or the
//! report naming it was lost). Pure: time comes in as `now_ms`.
//!
//! One request is charged once, however many decisions it got: decisions are remembered by
//! request id, so a retry is answered with the decision already made ([`LoadView::decided`]),
//! and when two replicas decided the same request (a retry raced a late answer) every replica
//! keeps the same one — the later attempt's, which the client waited for; on a tie the lower
//! decision id — and moves the charge to it. A lifecycle event from another rank than the
//! charged one moves the charge to where the request actually runs, and a `finished` or a
//! report naming the request that arrives before its decision (they come from different
//! publishers, which NATS does not order) keeps that decision from being charged.
//!
//! Two optional models refine what a prediction counts ([`models`], `LoadViewConfig::models`):
//! output blocks from `progress` events, and the decay of each rank's oldest prefill over its
//! predicted duration (which makes a rank's load depend on the time it is read at).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvroute_common::messages::{Decision, LifecycleKind, RequestLifecycle, WorkerCard, WorkerLoad};
use kvroute_common::{RequestId, WorkerId};

use self::models::{
    DEFAULT_PREFILL_TOKENS_PER_SEC, LoadModels, MILLIBLOCKS, PrefillLoadModel, PrefillRate,
};
use self::predictions::{Prediction, Predictions};
use super::approx::ApproxCache;
use super::predicted::{PredictedOverlap, PromptPrefixes};
use crate::signals::ObservedLoad;
use crate::worker::WorkerRank;

pub mod models;
mod predictions;

/// Decisions remembered per request id (de-duplication, retries).
const RECENT_DECISIONS: usize = 65_536;
/// Predictions kept per rank; the oldest go first beyond it.
const MAX_PREDICTIONS_PER_RANK: usize = 16_384;
/// Requests a worker already accounts for (finished, or named by a report) before any decision
/// of theirs arrived, remembered so that decision is not charged.
const SETTLED_EARLY: usize = 16_384;
/// How long such a request is remembered.
const SETTLED_EARLY_MS: u64 = 60_000;
/// The shortest report interval assumed: a request decided this recently may not have reached
/// its worker yet, however often the worker reports.
const MIN_REPORT_INTERVAL_MS: u64 = 20;

/// Settings of a [`LoadView`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadViewConfig {
    /// Report interval assumed for a rank until two of its reports show the real one: a
    /// report that does not name its new requests drops predictions older than the interval.
    pub report_interval_ms: u64,
    /// A prediction that no report of a rank naming its new requests has named goes after
    /// this long (or after two of the rank's report intervals, if longer).
    pub confirm_window_ms: u64,
    /// A prediction with no lifecycle event and no newer report goes after this long (and a
    /// decision is remembered for at most this long).
    pub prediction_max_age_ms: u64,
    /// How long a decision's prompt counts as held by its rank ([`PredictedOverlap`]); 0: no
    /// predicted overlap.
    pub predicted_overlap_ttl_ms: u64,
    /// How long a prefix decided for a worker without KV events counts as held in its
    /// approximate cache after its last decision ([`ApproxCache`]); 0: approximate mode off.
    pub approx_cache_ttl_ms: u64,
    /// Output blocks and prefill decay (both off by default).
    pub models: LoadModels,
}

/// One rank as the view sees it ([`LoadView::ranks`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankView {
    pub rank: WorkerRank,
    pub load: Option<ObservedLoad>,
    /// The prefill decay's rate for the rank (configured, fitted or the default); `None`
    /// without the decay.
    pub prefill_tokens_per_sec: Option<f64>,
}

/// What applying a decision did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Added,
    /// Seen before (this replica's own decision, or a redelivery).
    Duplicate,
    /// Another decision of the same request wins; this one is not charged.
    Superseded,
    /// This decision wins over the one known for its request; the charge moved to it.
    Replaced,
    /// The request's `finished`, or a report counting it, came first (decisions, lifecycle
    /// events and reports come from different publishers, which NATS does not order):
    /// remembered, not charged.
    AlreadyCounted,
}

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
    fn new(models: LoadModels) -> Self {
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
    fn decay_rate(&self, models: LoadModels) -> Option<f64> {
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
    fn observed(&self, models: LoadModels, now_ms: u64) -> Option<ObservedLoad> {
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

/// The decision a request got, and where it is charged.
#[derive(Debug, Clone)]
struct Decided {
    decision: Arc<Decision>,
    /// The rank holding its prediction (the decision's, unless a lifecycle event moved it).
    rank: WorkerRank,
    added_ms: u64,
    /// Its `prefill_done` has been seen (the prefill rate learns from the first only).
    prefill_seen: bool,
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

/// Reports and predictions per rank.
#[derive(Debug)]
pub struct LoadView {
    config: LoadViewConfig,
    /// Read once per candidate rank per selection: hashbrown's foldhash, not SipHash.
    ranks: hashbrown::HashMap<WorkerRank, RankLoad>,
    decided: HashMap<RequestId, Decided>,
    /// Insertion order of `decided`, for the cap and the age limit.
    decided_order: VecDeque<RequestId>,
    /// Requests the worker accounted for before any decision of theirs arrived, and when.
    settled_early: HashMap<RequestId, u64>,
    settled_early_order: VecDeque<RequestId>,
    /// The prompts of recent decisions, as overlap their ranks are about to have.
    predicted: PredictedOverlap,
    /// The predicted caches of workers without KV events.
    approx: ApproxCache,
}

impl LoadView {
    pub fn new(config: LoadViewConfig) -> Self {
        Self {
            config,
            ranks: hashbrown::HashMap::new(),
            decided: HashMap::new(),
            decided_order: VecDeque::new(),
            settled_early: HashMap::new(),
            settled_early_order: VecDeque::new(),
            predicted: PredictedOverlap::new(config.predicted_overlap_ttl_ms),
            approx: ApproxCache::new(config.approx_cache_ttl_ms),
        }
    }

    /// The rank's load at `now_ms` (which only the prefill decay reads); `None` when nothing
    /// is known of it.
    pub fn load(&self, rank: WorkerRank, now_ms: u64) -> Option<ObservedLoad> {
        self.ranks
            .get(&rank)
            .and_then(|r| r.observed(self.config.models, now_ms))
    }

    /// Every rank the view holds anything of, in rank order: its load at `now_ms` (when known)
    /// and, under the prefill decay, the rate its oldest prefill decays at.
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

    /// The predicted overlap of recent decisions' prompts.
    pub fn predicted(&self) -> &PredictedOverlap {
        &self.predicted
    }

    /// The approximate caches of workers without KV events.
    pub fn approx(&self) -> &ApproxCache {
        &self.approx
    }

    /// The registered workers are `cards`: those without KV events get approximate caches
    /// (see [`ApproxCache::set_workers`]).
    pub fn set_workers<'a>(&mut self, cards: impl IntoIterator<Item = &'a WorkerCard>) {
        self.approx.set_workers(cards);
    }

    /// The decision already made for `request_id` (by any replica), if remembered.
    pub fn decided(&self, request_id: &RequestId) -> Option<&Decision> {
        self.decided.get(request_id).map(|d| &*d.decision)
    }

    /// Adds a decision's request to its rank, once per request (see the module docs).
    pub fn apply_decision(&mut self, d: &Decision, now_ms: u64) -> Applied {
        let applied = self.charge(d, now_ms);
        if matches!(
            applied,
            Applied::Added | Applied::Replaced | Applied::AlreadyCounted
        ) {
            let rank = WorkerRank::new(d.worker_id, d.dp_rank);
            self.predicted.record(rank, &d.prefix_hashes, d.ts, now_ms);
        }
        // Every distinct decision is credited to its worker's approximate cache, a superseded
        // one too: replicas that see a request's decisions in different orders then credit the
        // same ones.
        let rank = WorkerRank::new(d.worker_id, d.dp_rank);
        if applied != Applied::Duplicate
            && self.approx.tracks(rank)
            && let Some(prompt) = PromptPrefixes::of_decision(&d.prefix_hashes, d.request_blocks)
        {
            self.approx.record(rank, &prompt, d.ts, now_ms);
        }
        applied
    }

    fn charge(&mut self, d: &Decision, now_ms: u64) -> Applied {
        let rank = WorkerRank::new(d.worker_id, d.dp_rank);
        let Some(known) = self.decided.get(&d.request_id) else {
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
            self.trim_decided();
            if self.settled_early.remove(&d.request_id).is_some() {
                return Applied::AlreadyCounted;
            }
            self.rank_mut(rank)
                .insert(d.request_id, Prediction::of(d, now_ms));
            return Applied::Added;
        };
        if known.decision.decision_id == d.decision_id {
            return Applied::Duplicate;
        }
        if !supersedes(d, &known.decision) {
            return Applied::Superseded;
        }
        // The charge (if the request still has one) moves to the winning decision's rank.
        let old_rank = known.rank;
        let moved = self
            .ranks
            .get_mut(&old_rank)
            .and_then(|r| r.predictions.remove(&d.request_id));
        if let Some(old) = moved {
            let prediction = Prediction {
                prefill_tokens: d.prefill_tokens,
                blocks: u64::from(d.request_blocks),
                output_milliblocks: self.output_milliblocks(d, old.output_tokens),
                ..old
            };
            self.rank_mut(rank).insert(d.request_id, prediction);
        }
        let known = self
            .decided
            .get_mut(&d.request_id)
            .expect("looked up above");
        known.decision = remembered(d);
        known.rank = rank;
        Applied::Replaced
    }

    /// Forgets `d`, a decision of this replica's that will not be used (its session commit
    /// lost a race or failed, or its request expired before the answer went out; it was never
    /// published): its charge goes and the request counts as undecided again. Returns whether
    /// it was the request's decision (one replaced since is left alone).
    pub fn withdraw(&mut self, d: &Decision) -> bool {
        let Some(known) = self.decided.get(&d.request_id) else {
            return false;
        };
        if known.decision.decision_id != d.decision_id {
            return false;
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
        if let Some(r) = self.ranks.get_mut(&rank)
            && r.predictions.remove(&d.request_id).is_some()
        {
            r.order.retain(|id| *id != d.request_id);
        }
        true
    }

    fn trim_decided(&mut self) {
        while self.decided_order.len() > RECENT_DECISIONS {
            if let Some(old) = self.decided_order.pop_front() {
                self.decided.remove(&old);
            }
        }
    }

    /// What `d`'s request counts for `output_tokens` generated (0 unless output blocks are
    /// tracked).
    fn output_milliblocks(&self, d: &Decision, output_tokens: u64) -> u64 {
        if !self.config.models.track_output_blocks {
            return 0;
        }
        models::output_milliblocks(output_tokens, d.block_size, d.expected_output_tokens)
    }

    /// Prefill done: the prompt no longer counts as prefill (and its time since the decision
    /// teaches the rank's prefill rate). Progress: the output blocks generated so far count
    /// (when tracked; otherwise ignored). Finished: the request is gone. From another rank
    /// than the one charged, the event moves the charge there first; for a request with no
    /// decision yet, `finished` is remembered so its decision is not charged.
    pub fn apply_lifecycle(&mut self, event: &RequestLifecycle, now_ms: u64) {
        if matches!(event.kind, LifecycleKind::Progress { .. })
            && !self.config.models.track_output_blocks
        {
            return;
        }
        let at = WorkerRank::new(event.worker_id, event.dp_rank);
        let known = self.decided.get_mut(&event.request_id);
        if known.is_none() && matches!(event.kind, LifecycleKind::Finished { .. }) {
            self.settle_early(event.request_id, now_ms);
            return;
        }
        // What the rank's prefill rate learns from a first `prefill_done`: (tokens, ms).
        let mut prefill_observed = None;
        if let Some(known) = known {
            if known.rank != at {
                let from = std::mem::replace(&mut known.rank, at);
                let moved = self
                    .ranks
                    .get_mut(&from)
                    .and_then(|r| r.predictions.remove(&event.request_id));
                if let Some(p) = moved {
                    let models = self.config.models;
                    self.ranks
                        .entry(at)
                        .or_insert_with(|| RankLoad::new(models))
                        .insert(event.request_id, p);
                }
            }
            if matches!(event.kind, LifecycleKind::PrefillDone { .. }) && !known.prefill_seen {
                known.prefill_seen = true;
                prefill_observed = Some((
                    known.decision.prefill_tokens,
                    now_ms.saturating_sub(known.added_ms),
                ));
            }
        }
        let fits_rate = matches!(
            self.config.models.prefill,
            PrefillLoadModel::Decay {
                tokens_per_sec: None
            }
        );
        if let (true, Some((tokens, elapsed_ms))) = (fits_rate, prefill_observed) {
            self.rank_mut(at).prefill_rate.observe(tokens, elapsed_ms);
        }
        let output = match event.kind {
            LifecycleKind::Progress { output_tokens } => {
                let d = &self.decided.get(&event.request_id);
                d.map(|d| {
                    (
                        output_tokens,
                        self.output_milliblocks(&d.decision, output_tokens),
                    )
                })
            }
            _ => None,
        };
        let Some(rank) = self.ranks.get_mut(&at) else {
            return;
        };
        match event.kind {
            LifecycleKind::PrefillDone { .. } => {
                rank.predictions.mark_prefilled(&event.request_id);
            }
            LifecycleKind::Progress { .. } => {
                // Generating output: past its prefill, whether or not that event came.
                rank.predictions.mark_prefilled(&event.request_id);
                if let Some((tokens, milliblocks)) = output {
                    rank.predictions
                        .progress(&event.request_id, tokens, milliblocks);
                }
            }
            LifecycleKind::Finished { .. } => {
                rank.predictions.remove(&event.request_id);
            }
        }
    }

    /// Takes a report (older sequence numbers than the last are dropped) and hands it the
    /// predictions it counts (see the module docs). Returns whether the report was newer.
    pub fn apply_report(&mut self, report: &WorkerLoad, now_ms: u64) -> bool {
        let at = WorkerRank::new(report.worker_id, report.dp_rank);
        let models = self.config.models;
        let rank = self
            .ranks
            .entry(at)
            .or_insert_with(|| RankLoad::new(models));
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
            .map_or(self.config.report_interval_ms, |i| i.round() as u64)
            .max(MIN_REPORT_INTERVAL_MS);
        let Some(ids) = &report.new_requests else {
            let cutoff = now_ms.saturating_sub(interval);
            rank.retain(|p| p.added_ms > cutoff);
            return true;
        };
        let window = self
            .config
            .confirm_window_ms
            .max(interval.saturating_mul(2));
        let cutoff = now_ms.saturating_sub(window);
        rank.retain(|p| p.added_ms > cutoff);
        for id in ids {
            match self.decided.get_mut(id) {
                Some(known) => {
                    // Counted where it runs, whichever rank it was charged to.
                    let charged = std::mem::replace(&mut known.rank, at);
                    if let Some(r) = self.ranks.get_mut(&charged) {
                        r.predictions.remove(id);
                    }
                }
                None => self.settle_early(*id, now_ms),
            }
        }
        true
    }

    /// Remembers that a worker accounts for `request_id`, whose decision is not known yet.
    fn settle_early(&mut self, request_id: RequestId, now_ms: u64) {
        if self.settled_early.insert(request_id, now_ms).is_none() {
            self.settled_early_order.push_back(request_id);
        }
        while self.settled_early_order.len() > SETTLED_EARLY {
            if let Some(old) = self.settled_early_order.pop_front() {
                self.settled_early.remove(&old);
            }
        }
    }

    /// Forgets every rank of a departed worker.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|rank, _| rank.worker_id != worker_id);
        self.predicted.remove_worker(worker_id);
        self.approx.remove_worker(worker_id);
    }

    /// Drops every prediction added before `cutoff_ms`: after this replica lost its NATS
    /// connection, lifecycle events (and other replicas' decisions) of that time may have been
    /// missed, so its older predictions cannot be trusted; the next reports carry that load.
    pub fn forget_predictions_before(&mut self, cutoff_ms: u64) -> usize {
        let before = self.predictions();
        for rank in self.ranks.values_mut() {
            rank.retain(|p| p.added_ms >= cutoff_ms);
        }
        before - self.predictions()
    }

    /// Drops predictions and remembered decisions past the maximum age, and ranks with
    /// nothing left.
    pub fn expire(&mut self, now_ms: u64) {
        self.predicted.expire(now_ms);
        self.approx.expire(now_ms);
        let cutoff = now_ms.saturating_sub(self.config.prediction_max_age_ms);
        for rank in self.ranks.values_mut() {
            rank.retain(|p| p.added_ms > cutoff);
        }
        // A rank's fitted prefill rate is kept while its worker is registered.
        self.ranks.retain(|_, r| {
            r.report.is_some() || !r.predictions.is_empty() || r.prefill_rate.is_fitted()
        });
        while let Some(id) = self.decided_order.front() {
            match self.decided.get(id) {
                Some(d) if d.added_ms > cutoff => break,
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
mod tests;
