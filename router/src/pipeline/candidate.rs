//! One row of the candidate table as components see it: identity, the worker's card and the
//! optional signal groups that were materialized for this selection.

use kvroute_common::messages::WorkerCard;

use crate::signals::{AdapterAffinity, ObservedLoad, Overlap};
use crate::worker::WorkerRank;

/// Load signals of one rank, projected for this request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoadSignals {
    /// Prompt tokens currently active in the rank's prefill stage.
    pub active_prefill_tokens: u64,
    /// Active decode footprint including this request's blocks: active decode blocks (with
    /// output placeholders when the load view tracks them) plus the request's blocks.
    pub decode_cost_blocks: f64,
    /// Requests currently active on the rank.
    pub active_requests: u64,
    /// Waiting requests whose prompt tokens `active_prefill_tokens` does not count
    /// ([`ObservedLoad::unsized_waiting_requests`]).
    pub unsized_waiting_requests: u64,
}

impl LoadSignals {
    /// Projects an observed load (absent: idle) for a request of `request_blocks` blocks.
    pub fn project(observed: Option<ObservedLoad>, request_blocks: u32) -> Self {
        let observed = observed.unwrap_or_default();
        Self {
            active_prefill_tokens: observed.active_prefill_tokens,
            decode_cost_blocks: observed.decode_blocks() + f64::from(request_blocks),
            active_requests: observed.active_requests,
            unsized_waiting_requests: observed.unsized_waiting_requests,
        }
    }
}

/// A router-eligible rank with the signals requested by the policy.
#[derive(Debug, Clone, Copy)]
pub struct WorkerCandidate<'a> {
    worker: WorkerRank,
    card: &'a WorkerCard,
    cache: Option<Overlap>,
    load: Option<LoadSignals>,
    preferred_taint_multiplier: Option<f64>,
    adapter: Option<AdapterAffinity>,
}

impl<'a> WorkerCandidate<'a> {
    /// A row with no optional signal; add groups with the `with_*` methods.
    pub fn new(worker: WorkerRank, card: &'a WorkerCard) -> Self {
        Self {
            worker,
            card,
            cache: None,
            load: None,
            preferred_taint_multiplier: None,
            adapter: None,
        }
    }

    pub fn with_cache(mut self, overlap: Overlap) -> Self {
        self.cache = Some(overlap);
        self
    }

    pub fn with_load(mut self, load: LoadSignals) -> Self {
        self.load = Some(load);
        self
    }

    pub fn with_preferred_taint_multiplier(mut self, multiplier: Option<f64>) -> Self {
        self.preferred_taint_multiplier = multiplier;
        self
    }

    pub fn with_adapter(mut self, affinity: Option<AdapterAffinity>) -> Self {
        self.adapter = affinity;
        self
    }

    pub fn worker(&self) -> WorkerRank {
        self.worker
    }

    /// The worker's registration (taints, labels, capacity).
    pub fn card(&self) -> &'a WorkerCard {
        self.card
    }

    /// One label of the worker's card (e.g. the device it runs on), read from the card when
    /// asked: nothing is gathered for components that never call it.
    pub fn label(&self, key: &str) -> Option<&'a str> {
        self.card.labels.get(key).map(String::as_str)
    }

    /// Present when some component requested [`super::WorkerInputs::CACHE`].
    pub fn cache(&self) -> Option<&Overlap> {
        self.cache.as_ref()
    }

    /// Present when some component requested [`super::WorkerInputs::LOAD`].
    pub fn load(&self) -> Option<&LoadSignals> {
        self.load.as_ref()
    }

    /// Present when [`super::WorkerInputs::PREFERRED_TAINT`] was requested and the request
    /// names preferred taints: below 1 when the worker carries one of them, else 1.
    pub fn preferred_taint_multiplier(&self) -> Option<f64> {
        self.preferred_taint_multiplier
    }

    /// With [`super::WorkerInputs::ADAPTER`] requested: how the rank stands for the request's
    /// LoRA adapter; `None` when the request names none or nothing is known of the rank's.
    pub fn adapter(&self) -> Option<AdapterAffinity> {
        self.adapter
    }
}

/// A candidate that survived the filters, with the sum of all scorer costs.
#[derive(Debug, Clone, Copy)]
pub struct ScoredCandidate<'a> {
    candidate: WorkerCandidate<'a>,
    cost: f64,
}

impl<'a> ScoredCandidate<'a> {
    pub fn new(candidate: WorkerCandidate<'a>, cost: f64) -> Self {
        Self { candidate, cost }
    }

    pub fn worker(&self) -> WorkerRank {
        self.candidate.worker
    }

    /// Total cost over all scorers; finite; lower is better by convention.
    pub fn cost(&self) -> f64 {
        self.cost
    }

    pub fn candidate(&self) -> &WorkerCandidate<'a> {
        &self.candidate
    }

    pub fn cache(&self) -> Option<&Overlap> {
        self.candidate.cache()
    }

    pub fn load(&self) -> Option<&LoadSignals> {
        self.candidate.load()
    }

    pub fn preferred_taint_multiplier(&self) -> Option<f64> {
        self.candidate.preferred_taint_multiplier()
    }
}
