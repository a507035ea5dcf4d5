//! Router eligibility, router-owned and run before any policy: which ranks of the registered
//! workers may serve a request at all. Failures are typed and map onto wire error codes.

mod busy;
pub mod placement;
mod rules;

use std::collections::BTreeMap;

use kvroute_common::messages::{ErrorCode, WorkerCard, WorkerRole};

pub use busy::{Busy, BusyThresholds, InvalidThreshold, PrefillLimit};
pub use rules::{Ineligible, Rules};

use crate::signals::SignalSource;
use crate::worker::{WorkerRank, WorkerTarget};

/// A rank that passed every eligibility rule, with its worker's card.
#[derive(Debug, Clone, Copy)]
pub struct EligibleRank<'a> {
    pub worker: WorkerRank,
    pub card: &'a WorkerCard,
}

/// No rank can serve the request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EligibilityError {
    #[error("no worker is registered for model {model:?} and role {role}")]
    NoWorkers { model: String, role: WorkerRole },
    #[error("eligibility rules rejected all {} candidate ranks", reasons.len())]
    AllFiltered {
        reasons: Vec<(WorkerRank, Ineligible)>,
    },
    #[error("all {} eligible ranks are above the busy thresholds", reasons.len())]
    AllOverloaded { reasons: Vec<(WorkerRank, Busy)> },
    /// `reason` is `None` when the target is not registered for the model and role.
    #[error("pinned worker {target} is unavailable{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    PinnedUnavailable {
        target: WorkerTarget,
        reason: Option<Ineligible>,
    },
}

impl EligibilityError {
    pub fn code(&self) -> ErrorCode {
        match self {
            EligibilityError::NoWorkers { .. } => ErrorCode::NoWorkers,
            EligibilityError::AllFiltered { .. } => ErrorCode::AllFiltered,
            EligibilityError::AllOverloaded { .. } => ErrorCode::AllOverloaded,
            EligibilityError::PinnedUnavailable { .. } => ErrorCode::PinnedUnavailable,
        }
    }

    /// Per-rank reasons, keyed `"<worker>/<rank>"`, as carried in `SelectError::reasons`.
    pub fn reasons(&self) -> BTreeMap<String, String> {
        match self {
            EligibilityError::AllFiltered { reasons } => reasons
                .iter()
                .map(|(w, r)| (w.to_string(), r.to_string()))
                .collect(),
            EligibilityError::AllOverloaded { reasons } => reasons
                .iter()
                .map(|(w, b)| (w.to_string(), b.to_string()))
                .collect(),
            EligibilityError::PinnedUnavailable {
                target,
                reason: Some(reason),
            } => BTreeMap::from([(target.to_string(), reason.to_string())]),
            _ => BTreeMap::new(),
        }
    }
}

/// The ranks of `workers` that may serve a request with `rules`, in card order.
///
/// Reads load from `signals` only when `busy` has a threshold set.
pub fn eligible_ranks<'a>(
    rules: &Rules<'_>,
    workers: &'a [WorkerCard],
    busy: &BusyThresholds,
    signals: &dyn SignalSource,
) -> Result<Vec<EligibleRank<'a>>, EligibilityError> {
    if !workers.iter().any(|c| rules.serves(c)) {
        return Err(EligibilityError::NoWorkers {
            model: rules.model.to_owned(),
            role: rules.role,
        });
    }
    let serving = workers.iter().filter(|c| rules.serves(c));
    let ranks = serving.flat_map(|card| {
        card.dp_ranks()
            .map(move |rank| (WorkerRank::new(card.worker_id, rank), card))
    });
    let check = |worker: WorkerRank, card: &WorkerCard| -> Result<(), Ineligible> {
        rules.check(card, worker)?;
        if busy.is_enabled() {
            busy.check(card, signals.load(worker))
                .map_err(Ineligible::Busy)?;
        }
        Ok(())
    };

    if let Some(target) = rules.exact {
        let mut first_reason = None;
        let mut eligible = Vec::new();
        for (worker, card) in ranks.filter(|(w, _)| target.matches(*w)) {
            match check(worker, card) {
                Ok(()) => eligible.push(EligibleRank { worker, card }),
                Err(reason) => {
                    first_reason.get_or_insert(reason);
                }
            }
        }
        if eligible.is_empty() {
            return Err(EligibilityError::PinnedUnavailable {
                target,
                reason: first_reason,
            });
        }
        return Ok(eligible);
    }

    let mut eligible = Vec::with_capacity(workers.len());
    let mut filtered = Vec::new();
    let mut overloaded = Vec::new();
    for (worker, card) in ranks {
        match check(worker, card) {
            Ok(()) => eligible.push(EligibleRank { worker, card }),
            Err(Ineligible::Busy(busy)) => overloaded.push((worker, busy)),
            Err(reason) => filtered.push((worker, reason)),
        }
    }
    if !eligible.is_empty() {
        Ok(eligible)
    } else if !overloaded.is_empty() {
        Err(EligibilityError::AllOverloaded {
            reasons: overloaded,
        })
    } else {
        Err(EligibilityError::AllFiltered { reasons: filtered })
    }
}

#[cfg(test)]
mod tests;
