//! The core's entry points: [`select_worker`] (eligibility → policy, no session) and
//! [`select`] (session lookup → selection → commit). No I/O besides the session store; time,
//! randomness and signals come in as arguments.

mod failure;
mod host;
#[cfg(test)]
mod tests;

use kvroute_common::messages::{
    BindingState, CostBreakdown, SchemaVersion, SelectReply, SelectRequest, WorkerCard,
};
use kvroute_common::{DecisionId, RequestId};
use rand::RngCore;

pub use failure::SelectFailure;
pub use host::{HostConfig, HostConfigError};

use crate::eligibility::{EligibleRank, Rules, eligible_ranks};
use crate::pipeline::{PolicyChoice, WorkerSelectionPolicy};
use crate::request::RequestContext;
use crate::session::{
    BindingStatus, CommitOutcome, SessionError, SessionRoute, SessionStore, SessionTable,
};
use crate::signals::{Overlap, SignalSource};
use crate::worker::{WorkerRank, WorkerTarget};

/// How often [`select`] retries a binding commit that raced with another router.
const MAX_COMMIT_ATTEMPTS: usize = 4;

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
    /// Overlap and load, gathered for [`HostConfig::required_inputs`].
    pub signals: &'a (dyn SignalSource + Sync),
    pub host: &'a HostConfig,
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
pub struct Selection {
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

impl Selection {
    /// The wire reply for this selection.
    pub fn to_reply(
        &self,
        request_id: RequestId,
        decision_id: DecisionId,
        request_blocks: u32,
        router_id: &str,
    ) -> SelectReply {
        SelectReply {
            v: SchemaVersion::CURRENT,
            request_id,
            decision_id,
            worker_id: self.worker.worker_id,
            dp_rank: self.worker.dp_rank,
            request_subject: self.request_subject.clone(),
            overlap_blocks: self.overlap.map(|o| o.by_tier()).unwrap_or_default(),
            request_blocks,
            cost: self.cost.clone(),
            policy: self.policy.clone(),
            binding: self.binding,
            router_id: router_id.to_owned(),
        }
    }
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

/// Selects a rank for `input.request` without session state: host eligibility, then the
/// exact-target path (a pin, or `route`'s hard binding while it is eligible) or the policy.
pub fn select_worker(
    input: &SelectInput<'_>,
    policy: &mut WorkerSelectionPolicy,
    route: SessionRoute,
    rng: &mut dyn RngCore,
) -> Result<Selection, SelectFailure> {
    validate(input)?;
    let rules = Rules::from_request(input.request);
    let mut context =
        RequestContext::from_request(input.request, input.request_blocks, input.block_size);
    if rules.exact.is_none() {
        match route {
            SessionRoute::Exact(target) => {
                // A hard binding that is no longer eligible falls through to a rebind.
                if let Some(selection) = try_exact(input, policy, &context, target, rng) {
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
    policy: &mut WorkerSelectionPolicy,
    context: &RequestContext,
    target: WorkerTarget,
    rng: &mut dyn RngCore,
) -> Option<Result<Selection, SelectFailure>> {
    let mut rules = Rules::from_request(input.request);
    rules.exact = Some(target);
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
    Ok(eligible_ranks(
        rules,
        input.workers,
        &input.host.busy,
        input.signals,
    )?)
}

fn choose(
    input: &SelectInput<'_>,
    policy: &mut WorkerSelectionPolicy,
    context: &RequestContext,
    ranks: &[EligibleRank<'_>],
    path: SelectionPath,
    rng: &mut dyn RngCore,
) -> Result<Selection, SelectFailure> {
    let rows = input.host.rows(
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
    Ok(Selection {
        worker: row.worker(),
        request_subject: row.candidate().card().request_subject.clone(),
        overlap: row.cache().copied(),
        cost,
        policy: policy.name().to_owned(),
        binding: None,
        path,
    })
}

/// Selects a rank and, for a request in a session, commits its binding.
///
/// The binding is read before selection, and written only after a successful one. When
/// another router bound the session meanwhile (two first requests racing), the winner's rank
/// is adopted if it is eligible for this request; otherwise this choice is written over it.
pub async fn select<S: SessionStore>(
    input: &SelectInput<'_>,
    policy: &mut WorkerSelectionPolicy,
    sessions: &SessionTable<S>,
    now_ms: u64,
    rng: &mut (dyn RngCore + Send),
) -> Result<Selection, SelectFailure> {
    let Some(session) = &input.request.session else {
        return select_worker(input, policy, SessionRoute::Open { affinity: None }, rng);
    };
    let rules = Rules::from_request(input.request);
    let registered = |worker: WorkerRank| {
        input.workers.iter().any(|c| {
            c.worker_id == worker.worker_id
                && rules.serves(c)
                && c.dp_ranks().any(|r| r == worker.dp_rank)
        })
    };
    let mut lookup = sessions.lookup(session, &registered, now_ms).await?;
    let mut selection = select_worker(input, policy, lookup.route(sessions.config().mode), rng)?;
    for _ in 0..MAX_COMMIT_ATTEMPTS {
        match sessions
            .commit(&lookup, selection.worker, &registered, now_ms)
            .await?
        {
            CommitOutcome::Committed(state) => {
                selection.binding = state;
                return Ok(selection);
            }
            CommitOutcome::Conflict(fresh) => {
                if let BindingStatus::Live(winner) = fresh.status()
                    && input.request.pin.is_none()
                {
                    let context = RequestContext::from_request(
                        input.request,
                        input.request_blocks,
                        input.block_size,
                    );
                    let target = WorkerTarget::exact(winner);
                    if let Some(adopted) = try_exact(input, policy, &context, target, rng) {
                        selection = adopted?;
                    }
                }
                lookup = fresh;
            }
        }
    }
    Err(SessionError::Contention {
        session: session.id.clone(),
    }
    .into())
}
