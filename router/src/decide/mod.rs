//! The decision core: one request's step from signals to a charged decision, as plain functions
//! over plain state, shared by the router service, `kvroute-sim` and anything else that
//! decides (their figures follow the service's code by construction).
//!
//! [`decide`] runs under the caller's critical section (a partition's [`PartitionPolicy`] and
//! the [`LoadView`]): it answers a request that already has a decision with that decision,
//! drops one past its deadline, reads load from the view, runs router eligibility and the
//! policy ([`crate::select::select_worker`]), builds the [`Decision`] and charges it to the
//! view, so the next request of a burst sees it. [`selection::Selection`] runs a whole request
//! as steps around it: the overlap, the session binding's read and commit (the store's round
//! trips, outside the critical section), a commit that lost a race withdrawing the charge and
//! deciding again, the queue or the reply.
//!
//! No I/O and no clock: the caller answers the steps' I/O, and passes the ids and the time
//! (read by the [`DecisionState`] when it takes its lock).

pub mod candidates;
pub mod load_view;
pub mod owner;
pub mod pairing;
pub mod prompt;
pub mod selection;
pub mod wire;

use kvroute_common::Names;
use kvroute_common::messages::{BindingState, Decision, SelectReply, SelectRequest};
use kvroute_common::{DecisionId, RequestId};
use rand::rngs::StdRng;

use self::candidates::Partition;
use self::load_view::{Applied, LoadView, predicted};
use self::prompt::Prompt;
use crate::pipeline::{WorkerInputs, WorkerSelectionPolicy};
use crate::select::{Chosen, SelectFailure, SelectInput, SelectionSettings, select_worker};
use crate::session::SessionRoute;
use crate::signals::{AdapterAffinity, ObservedLoad, Overlap, SignalSnapshot, SignalSource};
use crate::worker::{WorkerRank, WorkerTarget};

/// A partition's policy and its random generator, used by one decision at a time.
pub struct PartitionPolicy {
    pub policy: WorkerSelectionPolicy,
    pub rng: StdRng,
    /// The signal groups a decision must gather: the policy's, plus `LOAD` when busy
    /// thresholds are set.
    pub inputs: WorkerInputs,
}

impl PartitionPolicy {
    pub fn new(policy: WorkerSelectionPolicy, rng: StdRng, settings: &SelectionSettings) -> Self {
        let inputs = settings.required_inputs(&policy);
        Self {
            policy,
            rng,
            inputs,
        }
    }
}

impl std::fmt::Debug for PartitionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionPolicy")
            .field("policy", &self.policy.name())
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

/// Everything one decision reads besides the locked state.
#[derive(Debug, Clone, Copy)]
pub struct DecideInput<'a> {
    pub request: &'a SelectRequest,
    pub request_id: RequestId,
    /// The id a new decision gets (a re-decision after a lost commit reuses it: the withdrawn
    /// one was never published).
    pub decision_id: DecisionId,
    pub prompt: &'a Prompt,
    pub partition: &'a Partition,
    /// The prompt's overlap per rank (empty when the policy does not read `CACHE`, or the
    /// index could not answer).
    pub overlap: &'a SignalSnapshot,
    pub settings: &'a SelectionSettings,
    /// Where a decision's reply says to send the request when its worker's card is gone.
    pub names: &'a Names,
    pub router_id: &'a str,
    /// A request classifier's soft preference: replaces the affinity target the policy sees
    /// (a session's soft binding) unless the route is exact (a pin or a hard binding).
    pub selection_target: Option<WorkerTarget>,
}

/// A new decision, charged to the load view; published once its binding (if any) is committed.
#[derive(Debug, Clone, PartialEq)]
pub struct NewDecision {
    pub selection: Chosen,
    pub decision: Decision,
    /// The reply announcing it (built with the decision, so answering it builds nothing).
    pub reply: SelectReply,
    /// What charging it to the view did (`Added`, or `AlreadyCounted` when its worker had
    /// already reported the request).
    pub applied: Applied,
}

impl NewDecision {
    fn bound(&mut self, state: Option<BindingState>) {
        self.selection.binding = state;
        self.decision.binding = state;
        self.reply.binding = state;
    }
}

/// What became of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decided {
    New(Box<NewDecision>),
    /// The request already had a decision (a retry, answered by this replica or another):
    /// answer with it, publish nothing.
    Known(Box<SelectReply>),
    /// Past its deadline when its turn came: nobody waits for an answer.
    Expired,
}

/// The load and policy state a decision runs under, and the clock.
pub trait DecisionState {
    /// Runs `f` with the partition's policy and the load view held, and the time at which
    /// they were taken.
    fn with<R>(&mut self, f: impl FnOnce(&mut PartitionPolicy, &mut LoadView, u64) -> R) -> R;

    /// The time now, without taking anything (dates a session binding's read and commit).
    fn now_ms(&self) -> u64;
}

/// The overlap the caller fetched grown by the predicted overlap, and the view's load at the
/// decision's time when the policy reads it.
struct Signals<'a> {
    overlap: &'a SignalSnapshot,
    predicted: Vec<(WorkerRank, u32)>,
    view: Option<&'a LoadView>,
    /// The request's adapter and the view, when the policy reads `ADAPTER`.
    adapter: Option<(&'a LoadView, &'a str)>,
    /// The adapter's held share of demand, when adapters are placed.
    adapter_share: Option<f64>,
    now_ms: u64,
}

impl SignalSource for Signals<'_> {
    fn overlap(&self, worker: WorkerRank) -> Overlap {
        let overlap = self.overlap.overlap(worker);
        match self.predicted.iter().find(|(r, _)| *r == worker) {
            Some(&(_, blocks)) => predicted::with_predicted(overlap, blocks),
            None => overlap,
        }
    }

    fn load(&self, worker: WorkerRank) -> Option<ObservedLoad> {
        self.view.and_then(|v| v.load(worker, self.now_ms))
    }

    fn adapter(&self, worker: WorkerRank) -> Option<AdapterAffinity> {
        // A rank that reports no adapter slots (and was sent none) counts as a free slot.
        self.adapter.map(|(view, name)| {
            view.adapter_affinity(worker, name)
                .unwrap_or(AdapterAffinity::FreeSlot)
        })
    }

    fn adapter_share(&self) -> Option<f64> {
        self.adapter_share
    }

    fn adapter_slots(&self, worker: WorkerRank) -> Option<u32> {
        self.adapter
            .and_then(|(view, _)| view.adapter_slots(worker))
    }
}

/// One decision (see the module docs), at `now_ms`, under `route`.
pub fn decide(
    policy: &mut PartitionPolicy,
    view: &mut LoadView,
    input: &DecideInput<'_>,
    route: SessionRoute,
    now_ms: u64,
) -> Result<Decided, SelectFailure> {
    if let Some(known) = view.decided(&input.request_id) {
        return Ok(known_reply(input, known));
    }
    if input.request.deadline_ms.is_some_and(|d| now_ms > d) {
        return Ok(Decided::Expired);
    }
    let route = match (route, input.selection_target) {
        (SessionRoute::Open { .. }, Some(target)) => SessionRoute::Open {
            affinity: Some(target),
        },
        (route, _) => route,
    };
    let reads_cache = policy.inputs.contains(WorkerInputs::CACHE);
    let prefixes = (reads_cache && (view.predicted().is_enabled() || view.approx().is_enabled()))
        .then(|| predicted::PromptPrefixes::of(&input.prompt.hashes));
    let adapter = input
        .request
        .lora_name
        .as_deref()
        .filter(|name| !name.is_empty() && policy.inputs.contains(WorkerInputs::ADAPTER));
    let signals = Signals {
        overlap: input.overlap,
        predicted: prefixes
            .as_ref()
            .map(|p| predicted_overlap(view, p, now_ms))
            .unwrap_or_default(),
        view: policy.inputs.contains(WorkerInputs::LOAD).then_some(&*view),
        adapter: adapter.map(|name| (&*view, name)),
        adapter_share: adapter
            .filter(|_| input.settings.adapter_placement)
            .map(|name| view.adapter_share(&input.request.model, name, now_ms)),
        now_ms,
    };
    let select_input = SelectInput {
        request: input.request,
        request_blocks: input.prompt.blocks(),
        block_size: input.partition.block_size,
        workers: &input.partition.cards,
        signals: &signals,
        settings: input.settings,
    };
    let selection = select_worker(&select_input, &mut policy.policy, route, &mut policy.rng)?;
    let mut decision = wire::decision(input, &selection, now_ms);
    if let Some(prefixes) = &prefixes {
        decision.prefix_hashes = prefixes.hashes();
    }
    // The view has been held since the check above, so no other decision of this request
    // arrived meanwhile: this one is added (or was already counted by its worker).
    let applied = view.apply_decision(&decision, now_ms);
    debug_assert!(matches!(applied, Applied::Added | Applied::AlreadyCounted));
    let reply = wire::reply(
        &selection,
        input.request_id,
        input.decision_id,
        decision.request_blocks,
        input.router_id,
        input.request.role,
    );
    Ok(Decided::New(Box::new(NewDecision {
        selection,
        decision,
        reply,
        applied,
    })))
}

/// Each rank's predicted leading blocks of `prompt`: the recent decisions' (predicted overlap)
/// or, for a worker without KV events, its approximate cache's, whichever is deeper.
fn predicted_overlap(
    view: &LoadView,
    prompt: &predicted::PromptPrefixes,
    now_ms: u64,
) -> Vec<(WorkerRank, u32)> {
    let mut found = view.predicted().matches(prompt, now_ms);
    for (rank, blocks) in view.approx().matches(prompt, now_ms) {
        match found.iter_mut().find(|(r, _)| *r == rank) {
            Some((_, b)) => *b = (*b).max(blocks),
            None => found.push((rank, blocks)),
        }
    }
    found
}

fn known_reply(input: &DecideInput<'_>, known: &Decision) -> Decided {
    let subject = input
        .partition
        .cards
        .iter()
        .find(|c| c.worker_id == known.worker_id)
        .map_or_else(
            || input.names.worker_requests(known.worker_id),
            |c| c.request_subject.clone(),
        );
    Decided::Known(Box::new(wire::from_decision(known, subject)))
}

/// A [`DecisionState`] over state the caller owns outright (a simulator, a test): the clock
/// is the caller's `now_ms`.
#[derive(Debug)]
pub struct Owned<'a> {
    pub policy: &'a mut PartitionPolicy,
    pub view: &'a mut LoadView,
    pub now_ms: u64,
}

impl DecisionState for Owned<'_> {
    fn with<R>(&mut self, f: impl FnOnce(&mut PartitionPolicy, &mut LoadView, u64) -> R) -> R {
        f(self.policy, self.view, self.now_ms)
    }

    fn now_ms(&self) -> u64 {
        self.now_ms
    }
}

#[cfg(test)]
mod tests;
