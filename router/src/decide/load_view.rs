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
//! Adapter residency ([`adapters`]): each rank's LoRA adapter slots as an LRU of the adapters
//! decisions sent it and its reports listed; and each adapter's share of its model's recent
//! adapter requests ([`adapter_demand`]), which sizes the adapter's placement.
//!
//! Two optional models refine what a prediction counts ([`models`], `LoadViewConfig::models`):
//! output blocks from `progress` events, and the decay of each rank's oldest prefill over its
//! predicted duration (which makes a rank's load depend on the time it is read at).

use kvroute_common::messages::{Decision, LifecycleKind, RequestLifecycle, WorkerCard, WorkerLoad};
use kvroute_common::{RequestId, WorkerId};

use self::adapter_demand::AdapterDemand;
use self::adapters::AdapterView;
use self::approx::ApproxCache;
use self::foresight::Foresight;
use self::models::LoadModels;
use self::predicted::PredictedOverlap;
use self::predictions::Prediction;
use self::ranks::RankLoads;
use self::retries::{Known, RetryMemory};
use crate::signals::{AdapterAffinity, ObservedLoad};
use crate::worker::WorkerRank;

pub mod adapter_demand;
pub mod adapters;

/// Adapter demand halves every minute ([`adapter_demand`]).
pub const ADAPTER_DEMAND_HALF_LIFE_MS: u64 = 60_000;
/// An adapter's peak share holds for two minutes before its replica count may shrink.
pub const ADAPTER_SHARE_HOLD_MS: u64 = 120_000;
pub mod approx;
mod foresight;
pub mod models;
pub mod predicted;
mod predictions;
mod ranks;
mod retries;

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

/// The load view: three parts, each with its own rules, and the rules that join them.
/// - load accounting ([`ranks`]): reports and predictions per rank;
/// - retry memory ([`retries`]): each recent request's decision and the rank its charge sits
///   on, and requests settled before their decision came;
/// - predicted overlap ([`foresight`]): recent decisions' prompts and the approximate caches
///   of workers without KV events.
#[derive(Debug)]
pub struct LoadView {
    config: LoadViewConfig,
    loads: RankLoads,
    retries: RetryMemory,
    foresight: Foresight,
    adapters: AdapterView,
    demand: AdapterDemand,
}

impl LoadView {
    pub fn new(config: LoadViewConfig) -> Self {
        Self {
            config,
            loads: RankLoads::new(config),
            retries: RetryMemory::default(),
            foresight: Foresight::new(config.predicted_overlap_ttl_ms, config.approx_cache_ttl_ms),
            adapters: AdapterView::new(config.prediction_max_age_ms),
            demand: AdapterDemand::new(ADAPTER_DEMAND_HALF_LIFE_MS, ADAPTER_SHARE_HOLD_MS),
        }
    }

    /// The rank's load at `now_ms` (which only the prefill decay reads); `None` when nothing
    /// is known of it.
    pub fn load(&self, rank: WorkerRank, now_ms: u64) -> Option<ObservedLoad> {
        self.loads.load(rank, now_ms)
    }

    /// How `rank` stands for LoRA adapter `name` (resident, a free slot, waiting, full);
    /// `None` when nothing is known of the rank's adapters.
    pub fn adapter_affinity(&self, rank: WorkerRank, name: &str) -> Option<AdapterAffinity> {
        self.adapters.affinity(rank, name)
    }

    /// The adapter slots `rank` reports (`None`: none reported, or 0).
    pub fn adapter_slots(&self, rank: WorkerRank) -> Option<u32> {
        self.adapters.slots(rank)
    }

    /// Adapter `name`'s held share of `model`'s recent adapter requests ([`adapter_demand`]).
    pub fn adapter_share(&self, model: &str, name: &str, now_ms: u64) -> f64 {
        self.demand.share(model, name, now_ms)
    }

    /// Every rank the view holds anything of, in rank order: its load at `now_ms` (when known)
    /// and, under the prefill decay, the rate its oldest prefill decays at.
    pub fn ranks(&self, now_ms: u64) -> Vec<RankView> {
        self.loads.ranks(now_ms)
    }

    /// Requests predicted and not yet finished, over all ranks.
    pub fn predictions(&self) -> usize {
        self.loads.predictions()
    }

    /// The predicted overlap of recent decisions' prompts.
    pub fn predicted(&self) -> &PredictedOverlap {
        &self.foresight.predicted
    }

    /// The approximate caches of workers without KV events.
    pub fn approx(&self) -> &ApproxCache {
        &self.foresight.approx
    }

    /// The registered workers are `cards`: those without KV events get approximate caches
    /// (see [`ApproxCache::set_workers`]).
    pub fn set_workers<'a>(&mut self, cards: impl IntoIterator<Item = &'a WorkerCard>) {
        self.foresight.set_workers(cards);
    }

    /// The decision already made for `request_id` (by any replica), if remembered.
    pub fn decided(&self, request_id: &RequestId) -> Option<&Decision> {
        self.retries.get(request_id).map(|d| &*d.decision)
    }

    /// Completes this replica's decision `d` with its decode hop, chosen after it: a retry of
    /// its request is then answered with the pair (other replicas learn the pair from the
    /// published decision).
    pub fn attach_decode(&mut self, d: &Decision) {
        if let Some(known) = self.retries.get_mut(&d.request_id)
            && known.decision.decision_id == d.decision_id
        {
            let mut paired = (*known.decision).clone();
            paired.decode = d.decode.clone();
            known.decision = std::sync::Arc::new(paired);
        }
    }

    /// Adds a decision's request to its rank, once per request (see the module docs).
    pub fn apply_decision(&mut self, d: &Decision, now_ms: u64) -> Applied {
        let applied = self.charge(d, now_ms);
        self.foresight.record(d, applied, now_ms);
        if matches!(
            applied,
            Applied::Added | Applied::Replaced | Applied::AlreadyCounted
        ) {
            self.adapters.record(d, now_ms);
            if let Some(name) = d.lora_name.as_deref().filter(|n| !n.is_empty())
                && d.role != kvroute_common::messages::WorkerRole::Decode
            {
                self.demand.record(&d.model, name, now_ms);
            }
        }
        applied
    }

    fn charge(&mut self, d: &Decision, now_ms: u64) -> Applied {
        let rank = WorkerRank::new(d.worker_id, d.dp_rank);
        match self.retries.compare(d) {
            Known::New => {
                self.retries.remember(d, rank, now_ms);
                if self.retries.take_settled_early(&d.request_id) {
                    return Applied::AlreadyCounted;
                }
                self.loads
                    .charge(rank, d.request_id, Prediction::of(d, now_ms));
                Applied::Added
            }
            Known::Same => Applied::Duplicate,
            Known::Loses => Applied::Superseded,
            Known::Wins { rank: old_rank } => {
                // The charge (if the request still has one) moves to the winning decision's
                // rank.
                if let Some(old) = self.loads.release(old_rank, &d.request_id) {
                    let prediction = Prediction {
                        prefill_tokens: d.prefill_tokens,
                        blocks: u64::from(d.request_blocks),
                        output_milliblocks: self.loads.output_milliblocks(d, old.output_tokens),
                        ..old
                    };
                    self.loads.charge(rank, d.request_id, prediction);
                }
                self.retries.remember(d, rank, now_ms);
                Applied::Replaced
            }
        }
    }

    /// Forgets `d`, a decision of this replica's that will not be used (its session commit
    /// lost a race or failed, or its request expired before the answer went out; it was never
    /// published): its charge goes and the request counts as undecided again. Returns whether
    /// it was the request's decision (one replaced since is left alone).
    pub fn withdraw(&mut self, d: &Decision) -> bool {
        let Some(rank) = self.retries.forget(d) else {
            return false;
        };
        self.loads.unmake(rank, &d.request_id);
        true
    }

    /// Prefill done: the prompt no longer counts as prefill (and its time since the decision
    /// teaches the rank's prefill rate). Progress: the output blocks generated so far count
    /// (when tracked; otherwise ignored). Finished: the request is gone. From another rank
    /// than the one charged, the event moves the charge there first; for a request with no
    /// decision yet, `finished` is remembered so its decision is not charged.
    pub fn apply_lifecycle(&mut self, event: &RequestLifecycle, now_ms: u64) {
        if matches!(event.kind, LifecycleKind::Progress { .. }) && !self.loads.tracks_output() {
            return;
        }
        let at = WorkerRank::new(event.worker_id, event.dp_rank);
        let id = event.request_id;
        let Some(known) = self.retries.get_mut(&id) else {
            if matches!(event.kind, LifecycleKind::Finished { .. }) {
                self.retries.settle_early(id, now_ms);
            } else {
                self.loads.lifecycle(at, &id, event.kind, None);
            }
            return;
        };
        if known.rank != at {
            let from = std::mem::replace(&mut known.rank, at);
            self.loads.move_charge(from, at, id);
        }
        if matches!(event.kind, LifecycleKind::PrefillDone { .. }) && !known.prefill_seen {
            known.prefill_seen = true;
            let elapsed_ms = now_ms.saturating_sub(known.added_ms);
            self.loads
                .observe_prefill(at, known.decision.prefill_tokens, elapsed_ms);
        }
        let output = match event.kind {
            LifecycleKind::Progress { output_tokens } => Some((
                output_tokens,
                self.loads
                    .output_milliblocks(&known.decision, output_tokens),
            )),
            _ => None,
        };
        self.loads.lifecycle(at, &id, event.kind, output);
    }

    /// Takes a report (older sequence numbers than the last are dropped) and hands it the
    /// predictions it counts (see the module docs). Returns whether the report was newer.
    pub fn apply_report(&mut self, report: &WorkerLoad, now_ms: u64) -> bool {
        if !self.loads.report(report, now_ms) {
            return false;
        }
        self.adapters.report(report, now_ms);
        let at = WorkerRank::new(report.worker_id, report.dp_rank);
        for id in report.new_requests.iter().flatten() {
            match self.retries.get_mut(id) {
                Some(known) => {
                    // Counted where it runs, whichever rank it was charged to.
                    let charged = std::mem::replace(&mut known.rank, at);
                    self.loads.release(charged, id);
                }
                None => self.retries.settle_early(*id, now_ms),
            }
        }
        true
    }

    /// Forgets every rank of a departed worker.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.loads.remove_worker(worker_id);
        self.foresight.remove_worker(worker_id);
        self.adapters.remove_worker(worker_id);
    }

    /// Drops every prediction added at or before `cutoff_ms`: after this replica lost its NATS
    /// connection, lifecycle events (and other replicas' decisions) of that time may have been
    /// missed, so the predictions it held then cannot be trusted; the next reports carry that
    /// load. The cutoff is when the connection is back, not when its loss was noticed: the
    /// messages read from the dead connection (decisions whose lifecycle events went with it)
    /// are applied until then, within the same millisecond as the loss as often as not.
    pub fn forget_predictions_until(&mut self, cutoff_ms: u64) -> usize {
        self.loads.forget_until(cutoff_ms)
    }

    /// Drops predictions and remembered decisions past the maximum age, and ranks with
    /// nothing left.
    pub fn expire(&mut self, now_ms: u64) {
        self.foresight.expire(now_ms);
        self.adapters.expire(now_ms);
        self.demand.expire(now_ms);
        let cutoff = now_ms.saturating_sub(self.config.prediction_max_age_ms);
        self.loads.expire(cutoff);
        self.retries.expire(cutoff, now_ms);
    }
}

#[cfg(test)]
mod tests;
