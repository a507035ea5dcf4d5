//! Session behaviour through the selection machine: hard and soft affinity, rebinding, final requests, the
//! idle TTL, departed workers and failures that keep the binding. Races are in `race.rs`.

mod race;

use std::sync::{Arc, Mutex};

use futures::executor::block_on;
use kvroute_common::messages::{BindingState, SelectRequest, SessionContext, WorkerCard};
use kvroute_common::{Names, Namespace};
use rand::SeedableRng;
use rand::rngs::StdRng;
use uuid::Uuid;

use super::*;
use crate::decide::candidates::Partition;
use crate::decide::load_view::LoadView;
use crate::decide::prompt::{Prepared, Prompt};
use crate::decide::selection::{Context, Selection, Start};
use crate::decide::{Decided, Owned, PartitionPolicy};
use crate::drive::{self, Ended};
use crate::pipeline::{
    ComponentError, ScoredCandidate, WorkerInputs, WorkerPicker, WorkerSelectionPolicy,
};
use crate::policies::default::DefaultPolicyParameters;
use crate::request::RequestContext;
use crate::select::{Chosen, SelectFailure, SelectionSettings};
use crate::signals::{Overlap, SignalSnapshot};
use crate::testing::cards;
use crate::worker::{WorkerRank, WorkerTarget};

const TTL: u64 = 1_000;

fn in_session(id: &str) -> SelectRequest {
    SelectRequest {
        model: "m".to_owned(),
        session: Some(SessionContext {
            id: id.to_owned(),
            ..SessionContext::default()
        }),
        ..SelectRequest::default()
    }
}

fn final_in(id: &str) -> SelectRequest {
    let mut request = in_session(id);
    if let Some(session) = request.session.as_mut() {
        session.is_final = true;
    }
    request
}

/// Signals under which worker `hot` holds the whole prompt (and so is the cheapest).
fn prefix_on(hot: u64) -> SignalSnapshot {
    SignalSnapshot::new().with_overlap(
        WorkerRank::new(hot, 0),
        Overlap {
            device: 10,
            ..Overlap::default()
        },
    )
}

struct Harness<S> {
    table: SessionTable<S>,
    policy: PartitionPolicy,
    settings: SelectionSettings,
    names: Names,
    next_id: u128,
}

impl Harness<MemSessionStore> {
    fn new(mode: AffinityMode) -> Self {
        Self::with_store(MemSessionStore::new(), mode)
    }
}

impl<S: SessionStore> Harness<S> {
    fn with_store(store: S, mode: AffinityMode) -> Self {
        let settings = SelectionSettings::default();
        Self {
            table: SessionTable::new(
                store,
                SessionConfig {
                    mode,
                    idle_ttl_ms: TTL,
                },
            ),
            policy: PartitionPolicy::new(
                DefaultPolicyParameters::default().policy(),
                StdRng::seed_from_u64(3),
                &settings,
            ),
            settings,
            names: Names::new(&Namespace::new("t").unwrap()),
            next_id: 0,
        }
    }

    /// Selects through the selection machine and its driver, as every caller does, with a
    /// fresh load view each time (what these tests look at is the session).
    fn select(
        &mut self,
        request: &SelectRequest,
        workers: &[WorkerCard],
        signals: &SignalSnapshot,
        now_ms: u64,
    ) -> Result<Chosen, SelectFailure> {
        block_on(self.run(request, workers, signals, now_ms))
    }

    async fn run(
        &mut self,
        request: &SelectRequest,
        workers: &[WorkerCard],
        signals: &SignalSnapshot,
        now_ms: u64,
    ) -> Result<Chosen, SelectFailure> {
        self.next_id += 1;
        let id = Uuid::from_u128(self.next_id);
        let partition = Arc::new(Partition {
            cards: workers.to_vec(),
            block_size: 16,
        });
        let prompt = Prompt {
            hashes: (0..10).collect(),
            tokens: 160,
        };
        let prepared = Prepared::with_prompt(request.clone(), id, partition, prompt);
        let context = Context {
            settings: &self.settings,
            names: &self.names,
            router_id: "r",
            sessions: *self.table.config(),
        };
        let start = Start {
            decision_id: id,
            reads_cache: true,
            overlap: Some(signals.clone()),
            target: None,
            queues: false,
        };
        let mut view = LoadView::new(crate::testing::view_config());
        let mut state = Owned {
            policy: &mut self.policy,
            view: &mut view,
            now_ms,
        };
        let (selection, need) = Selection::start(&prepared, context, start, &mut state);
        let no_fetch = || std::future::ready(SignalSnapshot::new());
        match drive::run(selection, need, &mut state, self.table.store(), no_fetch).await {
            Ended::Reply(Ok(Decided::New(new))) => Ok(new.selection),
            Ended::Reply(Ok(other)) => panic!("a new request decided as {other:?}"),
            Ended::Reply(Err(e)) => Err(e),
            Ended::Join(_) => unreachable!("nothing queues here"),
        }
    }

    /// Selects with `policy` from now on.
    fn use_policy(&mut self, policy: WorkerSelectionPolicy) {
        self.policy = PartitionPolicy::new(policy, StdRng::seed_from_u64(3), &self.settings);
    }

    fn bound(&self, id: &str) -> Option<WorkerRank> {
        block_on(self.table.store().get(id))
            .unwrap()
            .map(|v| v.binding.worker())
    }
}

fn picked(selection: &Chosen) -> (u64, Option<BindingState>) {
    (selection.worker.worker_id, selection.binding)
}

#[test]
fn hard_binding_is_the_exact_target_while_eligible() {
    let mut h = Harness::new(AffinityMode::Hard);
    let workers = cards(3);
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::New)));
    // The prefix moved to worker 2, but the session stays on worker 1.
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 10)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::Kept)));
    assert_eq!(s.path, crate::select::SelectionPath::Exact);
    assert_eq!(h.bound("s"), Some(WorkerRank::new(1, 0)));
    let no_session = SelectRequest {
        session: None,
        ..in_session("s")
    };
    let s = h.select(&no_session, &workers, &prefix_on(2), 20).unwrap();
    assert_eq!(picked(&s), (2, None));
}

#[test]
fn hard_binding_rebinds_when_no_longer_eligible() {
    let mut h = Harness::new(AffinityMode::Hard);
    let mut workers = cards(3);
    h.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    workers[0].taints = vec!["draining".into()];
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 10)
        .unwrap();
    assert_eq!(picked(&s), (2, Some(BindingState::Rebound)));
    assert_eq!(h.bound("s"), Some(WorkerRank::new(2, 0)));
}

/// Follows the affinity target when it is a row; else the lowest cost. Records each target.
#[derive(Clone, Default)]
struct Sticky(Arc<Mutex<Vec<Option<WorkerTarget>>>>);

impl Sticky {
    fn offered(&self) -> Vec<Option<WorkerTarget>> {
        self.0.lock().unwrap().clone()
    }
}

impl WorkerPicker for Sticky {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }
    fn pick(
        &mut self,
        context: &RequestContext,
        rows: &[ScoredCandidate<'_>],
        _: &mut dyn rand::RngCore,
    ) -> Result<usize, ComponentError> {
        self.0.lock().unwrap().push(context.affinity_target());
        let target = context.affinity_target();
        let sticky = (0..rows.len()).find(|i| target.is_some_and(|t| t.matches(rows[*i].worker())));
        Ok(sticky.unwrap_or_else(|| {
            (0..rows.len())
                .min_by(|a, b| rows[*a].cost().total_cmp(&rows[*b].cost()))
                .unwrap_or(0)
        }))
    }
}

#[test]
fn soft_binding_is_offered_and_follows_the_policy_choice() {
    let mut h = Harness::new(AffinityMode::Soft);
    let workers = cards(3);
    // The default policy ignores the hint: the binding follows its choice.
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::New)));
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 10)
        .unwrap();
    assert_eq!(picked(&s), (2, Some(BindingState::Rebound)));
    assert_eq!(s.path, crate::select::SelectionPath::Policy);
    assert_eq!(h.bound("s"), Some(WorkerRank::new(2, 0)));

    // A policy that honours the hint keeps the session where it is.
    let sticky = Sticky::default();
    h.use_policy(WorkerSelectionPolicy::new(
        Vec::new(),
        Box::new(sticky.clone()),
    ));
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(3), 20)
        .unwrap();
    assert_eq!(picked(&s), (2, Some(BindingState::Kept)));
    assert_eq!(
        sticky.offered(),
        [Some(WorkerTarget::exact(WorkerRank::new(2, 0)))]
    );
}

#[test]
fn a_final_request_releases_the_binding() {
    let mut h = Harness::new(AffinityMode::Hard);
    let workers = cards(2);
    h.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    let s = h
        .select(&final_in("s"), &workers, &prefix_on(2), 10)
        .unwrap();
    assert_eq!(
        picked(&s),
        (1, Some(BindingState::Released)),
        "served by the binding"
    );
    assert_eq!(h.bound("s"), None);
    let s = h
        .select(&final_in("t"), &workers, &prefix_on(2), 20)
        .unwrap();
    assert_eq!(picked(&s), (2, None), "nothing to release");
    assert!(h.table.store().is_empty());
}

#[test]
fn an_idle_binding_expires_after_the_ttl() {
    let mut h = Harness::new(AffinityMode::Hard);
    let workers = cards(2);
    h.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    // Used at 900: idle time restarts, so 1800 is still within the TTL.
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 900)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::Kept)));
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 1_800)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::Kept)));
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(2), 2_801)
        .unwrap();
    assert_eq!(picked(&s), (2, Some(BindingState::New)));
}

#[test]
fn a_departed_workers_binding_is_invalid() {
    let mut h = Harness::new(AffinityMode::Soft);
    let sticky = Sticky::default();
    h.use_policy(WorkerSelectionPolicy::new(
        Vec::new(),
        Box::new(sticky.clone()),
    ));
    let workers = cards(3);
    h.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    let s = h
        .select(&in_session("s"), &workers, &prefix_on(1), 1)
        .unwrap();
    assert_eq!(picked(&s), (1, Some(BindingState::Kept)));
    let without_1 = &workers[1..];
    let s = h
        .select(&in_session("s"), without_1, &prefix_on(1), 2)
        .unwrap();
    assert_eq!(s.binding, Some(BindingState::Rebound));
    assert_ne!(s.worker.worker_id, 1);
    let w1 = Some(WorkerTarget::exact(WorkerRank::new(1, 0)));
    assert_eq!(
        sticky.offered(),
        [None, w1, None],
        "a departed binding is not offered"
    );
    // Hard mode: the departed binding is not used as the exact target either.
    let mut hard = Harness::new(AffinityMode::Hard);
    hard.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    let s = hard
        .select(&in_session("s"), without_1, &prefix_on(3), 1)
        .unwrap();
    assert_eq!(picked(&s), (3, Some(BindingState::Rebound)));
}

#[test]
fn a_failed_selection_leaves_the_binding_untouched() {
    let mut h = Harness::new(AffinityMode::Hard);
    let workers = cards(2);
    h.select(&in_session("s"), &workers, &prefix_on(1), 0)
        .unwrap();
    let before = block_on(h.table.store().get("s")).unwrap();
    let impossible = SelectRequest {
        required_taints: vec!["tpu".into()],
        ..in_session("s")
    };
    assert!(h.select(&impossible, &workers, &prefix_on(1), 10).is_err());
    assert!(h.select(&final_in("s"), &[], &prefix_on(1), 10).is_err());
    assert_eq!(block_on(h.table.store().get("s")).unwrap(), before);
}
