//! The request's static placement rules (allow-list, pin, dp-rank bounds, taints) and the
//! per-rank check against them.

use std::fmt;

use kvroute_common::WorkerId;
use kvroute_common::messages::{DpRankRange, SelectRequest, WorkerCard, WorkerRole};

use super::busy::Busy;
use crate::worker::{WorkerRank, WorkerTarget};

/// What a request demands of the rank that serves it.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'r> {
    pub model: &'r str,
    pub role: WorkerRole,
    /// Only these workers (`None` or empty: all).
    pub allowed_workers: Option<&'r [WorkerId]>,
    /// Exactly this worker (and rank); an explicit pin or a hard session binding.
    pub exact: Option<WorkerTarget>,
    pub dp_rank_range: Option<DpRankRange>,
    /// A worker taint outside `tolerated_taints ∪ required_taints` makes the worker ineligible.
    pub tolerated_taints: &'r [String],
    /// Taints a worker must all carry.
    pub required_taints: &'r [String],
    /// The LoRA adapter the request names: a worker whose card lists its adapters must list it.
    pub lora_name: Option<&'r str>,
}

impl<'r> Rules<'r> {
    pub fn from_request(request: &'r SelectRequest) -> Self {
        Self {
            model: &request.model,
            role: request.role,
            allowed_workers: request.allowed_workers.as_deref(),
            exact: request.pin.map(WorkerTarget::from),
            dp_rank_range: request.dp_rank_range,
            tolerated_taints: &request.tolerated_taints,
            required_taints: &request.required_taints,
            lora_name: request.lora_name.as_deref().filter(|n| !n.is_empty()),
        }
    }

    /// Whether the card registers a worker for this model and role.
    pub fn serves(&self, card: &WorkerCard) -> bool {
        card.model == self.model && card.role == self.role
    }

    /// The first static rule `worker` breaks (the exact target is checked by the caller).
    pub fn check(&self, card: &WorkerCard, worker: WorkerRank) -> Result<(), Ineligible> {
        if let Some(allowed) = self.allowed_workers
            && !allowed.is_empty()
            && !allowed.contains(&worker.worker_id)
        {
            return Err(Ineligible::NotAllowed);
        }
        if let Some(range) = self.dp_rank_range
            && !(range.min..=range.max).contains(&worker.dp_rank)
        {
            return Err(Ineligible::DpRankOutOfRange {
                min: range.min,
                max: range.max,
            });
        }
        if let Some(name) = self.lora_name
            && !card.serves_adapter(name)
        {
            return Err(Ineligible::AdapterNotServed);
        }
        if let Some(taint) = self
            .required_taints
            .iter()
            .find(|t| !card.taints.contains(t))
        {
            return Err(Ineligible::MissingRequiredTaint {
                taint: taint.clone(),
            });
        }
        if let Some(taint) = card
            .taints
            .iter()
            .find(|t| !self.tolerated_taints.contains(t) && !self.required_taints.contains(t))
        {
            return Err(Ineligible::UntoleratedTaint {
                taint: taint.clone(),
            });
        }
        Ok(())
    }
}

/// Why one rank cannot serve the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Ineligible {
    NotAllowed,
    DpRankOutOfRange {
        min: u32,
        max: u32,
    },
    MissingRequiredTaint {
        taint: String,
    },
    UntoleratedTaint {
        taint: String,
    },
    /// The worker's card lists the adapters it serves, and not the request's.
    AdapterNotServed,
    Busy(Busy),
}

impl fmt::Display for Ineligible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ineligible::NotAllowed => f.write_str("not in the request's allowed workers"),
            Ineligible::DpRankOutOfRange { min, max } => {
                write!(f, "dp rank outside the requested range {min}..={max}")
            }
            Ineligible::MissingRequiredTaint { taint } => {
                write!(f, "missing required taint {taint:?}")
            }
            Ineligible::UntoleratedTaint { taint } => {
                write!(f, "carries taint {taint:?} the request does not tolerate")
            }
            Ineligible::AdapterNotServed => {
                f.write_str("does not serve the request's LoRA adapter")
            }
            Ineligible::Busy(busy) => busy.fmt(f),
        }
    }
}
