//! The core's selection of one rank: [`select_worker`] (validate → eligibility → a pin or a
//! hard binding, or the policy) under the route a session gives. No I/O; randomness and
//! signals come in as arguments. `crate::decide` runs it for every request, with the session
//! steps around it.

mod failure;
mod settings;
#[cfg(test)]
mod tests;

use kvroute_common::messages::{BindingState, CostBreakdown, SelectRequest, WorkerCard};
use rand::RngCore;

pub use failure::SelectFailure;
pub use settings::{SelectionSettings, SelectionSettingsError};

use crate::eligibility::{EligibleRank, Rules, eligible_ranks, placement};
use crate::pipeline::{PolicyChoice, WorkerSelectionPolicy};
use crate::request::RequestContext;
use crate::session::SessionRoute;
use crate::signals::{Overlap, SignalSource};
use crate::worker::{WorkerRank, WorkerTarget};

/// Everything one selection reads.
#[derive(Clone, Copy)]
pub struct SelectInput<'a> {
    pub request: &'a SelectRequest,
    /// Full blocks in the prompt (the service hashed it).
    pub request_blocks: u32,
    /// Tokens per block for this model.
    pub block_size: u32,
    /// Registered workers (any model or role: the core keeps the request's).
    pub workers: &'a [WorkerCard],
    /// Overlap and load, gathered for [`SelectionSettings::required_inputs`].
    pub signals: &'a (dyn SignalSource + Sync),
    pub settings: &'a SelectionSettings,
}

impl std::fmt::Debug for SelectInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectInput")
            .field("model", &self.request.model)
            .field("request_blocks", &self.request_blocks)
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

/// How the chosen rank was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionPath {
    /// Filters, scorers and picker over the eligible ranks.
    Policy,
    /// An explicit pin or a hard session binding: scored only.
    Exact,
}

/// A successful selection.
#[derive(Debug, Clone, PartialEq)]
pub struct Chosen {
    pub worker: WorkerRank,
    /// The chosen worker card's request subject.
    pub request_subject: String,
    /// The request's overlap with the chosen rank; `None` when no component read `CACHE`.
    pub overlap: Option<Overlap>,
    pub cost: CostBreakdown,
    /// The policy's configured instance name.
    pub policy: String,
    /// What happened to the session binding (`None` without a session).
    pub binding: Option<BindingState>,
    pub path: SelectionPath,
}

fn validate(input: &SelectInput<'_>) -> Result<(), SelectFailure> {
    let bad = |message: &str| {
        Err(SelectFailure::BadRequest {
            message: message.to_owned(),
        })
    };
    if input.block_size == 0 {
        return bad("block size must be above 0");
    }
    if input
        .request
        .temperature
        .is_some_and(|t| !t.is_finite() || t < 0.0)
    {
        return bad("temperature must be a finite number ≥ 0");
    }
    if let Some(range) = input.request.dp_rank_range
        && range.min > range.max
    {
        return bad("dp_rank_range.min is above dp_rank_range.max");
    }
    Ok(())
}

/// Selects a rank for `input.request` without session state: router eligibility, then the
/// exact-target path (a pin, or `route`'s hard binding while it is eligible) or the policy.
pub fn select_worker(
    input: &SelectInput<'_>,
    policy: &mut WorkerSelectionPolicy,
    route: SessionRoute,
    rng: &mut dyn RngCore,
) -> Result<Chosen, SelectFailure> {
    validate(input)?;
    let rules = Rules::from_request(input.request);
    let mut context =
        RequestContext::from_request(input.request, input.request_blocks, input.block_size);
    if rules.exact.is_none() {
        match route {
            SessionRoute::Exact(target) => {
                // A hard binding that is no longer eligible falls through to a rebind.
                if let Some(selection) = try_exact(input, &rules, policy, &context, target, rng) {
                    return selection;
                }
            }
            SessionRoute::Open { affinity } => {
                context = context.with_affinity_target(affinity);
            }
        }
    }
    let path = if rules.exact.is_some() {
        SelectionPath::Exact
    } else {
        SelectionPath::Policy
    };
    let ranks = eligible(input, &rules)?;
    choose(input, policy, &context, &ranks, path, rng)
}

/// The exact-target path for `target`, or `None` when no rank of it is eligible.
fn try_exact(
    input: &SelectInput<'_>,
    rules: &Rules<'_>,
    policy: &mut WorkerSelectionPolicy,
    context: &RequestContext,
    target: WorkerTarget,
    rng: &mut dyn RngCore,
) -> Option<Result<Chosen, SelectFailure>> {
    let rules = Rules {
        exact: Some(target),
        ..*rules
    };
    let ranks = eligible(input, &rules).ok()?;
    Some(choose(
        input,
        policy,
        context,
        &ranks,
        SelectionPath::Exact,
        rng,
    ))
}

fn eligible<'a>(
    input: &SelectInput<'a>,
    rules: &Rules<'_>,
) -> Result<Vec<EligibleRank<'a>>, SelectFailure> {
    let ranks = eligible_ranks(rules, input.workers, &input.settings.busy, input.signals)?;
    Ok(match rules.lora_name {
        Some(name) if rules.exact.is_none() && input.settings.adapter_placement => {
            placement::adapter_home(name, ranks, input.signals)
        }
        _ => ranks,
    })
}

fn choose(
    input: &SelectInput<'_>,
    policy: &mut WorkerSelectionPolicy,
    context: &RequestContext,
    ranks: &[EligibleRank<'_>],
    path: SelectionPath,
    rng: &mut dyn RngCore,
) -> Result<Chosen, SelectFailure> {
    let rows = input.settings.rows(
        input.request,
        context,
        ranks,
        input.signals,
        policy.required_inputs(),
    );
    let PolicyChoice { row, cost } = match (path, rows.as_slice()) {
        // One exact rank: nothing to filter or pick, only scored for the breakdown.
        (SelectionPath::Exact, [only]) => policy.score_exact(context, *only)?,
        _ => policy.run(context, rows, rng)?,
    };
    Ok(Chosen {
        worker: row.worker(),
        request_subject: row.candidate().card().request_subject.clone(),
        overlap: row.cache().copied(),
        cost,
        policy: policy.name().to_owned(),
        binding: None,
        path,
    })
}
