//! The decision core: charges seen by the next decision, retries, deadlines, and sessions
//! whose commit loses a race or fails.

use std::collections::BTreeMap;

use futures::executor::block_on;
use kvroute_common::Namespace;
use kvroute_common::messages::{BindingState, SessionContext};
use rand::SeedableRng;
use uuid::Uuid;

use super::selection::{Context, Selection, Start};
use super::*;
use crate::decide::load_view::LoadViewConfig;
use crate::decide::prompt::Prepared;
use crate::drive::{self, Ended};
use crate::policies::default::DefaultPolicyParameters;
use crate::session::{
    AffinityMode, MemSessionStore, SessionBinding, SessionConfig, SessionError, SessionStore,
    SessionTable, StoreError, Versioned, WriteOutcome,
};
use crate::testing::cards;

struct Fixture {
    policy: PartitionPolicy,
    view: LoadView,
    partition: std::sync::Arc<Partition>,
    settings: SelectionSettings,
    names: Names,
}

impl Fixture {
    fn new(workers: u64) -> Self {
        Self::predicting(workers, 2_000)
    }

    fn predicting(workers: u64, predicted_overlap_ttl_ms: u64) -> Self {
        let settings = SelectionSettings::default();
        Self {
            policy: PartitionPolicy::new(
                DefaultPolicyParameters::default().policy(),
                StdRng::seed_from_u64(7),
                &settings,
            ),
            view: LoadView::new(LoadViewConfig {
                report_interval_ms: 100,
                confirm_window_ms: 1_000,
                prediction_max_age_ms: 60_000,
                predicted_overlap_ttl_ms,
                approx_cache_ttl_ms: 120_000,
                models: Default::default(),
            }),
            partition: std::sync::Arc::new(Partition {
                cards: cards(workers),
                block_size: 16,
            }),
            settings,
            names: Names::new(&Namespace::new("t").unwrap()),
        }
    }

    fn decide_with<S: SessionStore>(
        &mut self,
        sessions: &SessionTable<S>,
        request: &SelectRequest,
        overlap: &SignalSnapshot,
        now_ms: u64,
    ) -> Result<Decided, SelectFailure> {
        self.decide_prompt(sessions, request, overlap, 0, now_ms)
    }

    /// Decides with a 32-block prompt whose blocks are `first..first + 32`.
    fn decide_prompt<S: SessionStore>(
        &mut self,
        sessions: &SessionTable<S>,
        request: &SelectRequest,
        overlap: &SignalSnapshot,
        first: u64,
        now_ms: u64,
    ) -> Result<Decided, SelectFailure> {
        let prompt = Prompt {
            hashes: (first..first + 32).collect(),
            tokens: 512,
        };
        let prepared = Prepared::with_prompt(
            request.clone(),
            request.request_id.unwrap(),
            self.partition.clone(),
            prompt,
        );
        let context = Context {
            settings: &self.settings,
            names: &self.names,
            router_id: "r1",
            sessions: *sessions.config(),
        };
        let start = Start {
            decision_id: Uuid::from_u128(request.request_id.unwrap().as_u128() | 1 << 100),
            reads_cache: true,
            overlap: Some(overlap.clone()),
            target: None,
            queues: false,
        };
        let mut state = Owned {
            policy: &mut self.policy,
            view: &mut self.view,
            now_ms,
        };
        let (selection, need) = Selection::start(&prepared, context, start, &mut state);
        let overlap_given = || std::future::ready(SignalSnapshot::new());
        match block_on(drive::run(
            selection,
            need,
            &mut state,
            sessions.store(),
            overlap_given,
        )) {
            Ended::Reply(decided) => decided,
            Ended::Join(_) => unreachable!("nothing queues here"),
        }
    }

    fn decide(&mut self, request: &SelectRequest, now_ms: u64) -> Result<Decided, SelectFailure> {
        self.decide_distinct(request, 0, now_ms)
    }

    /// Decides with the prompt `first..first + 32` and no session.
    fn decide_distinct(
        &mut self,
        request: &SelectRequest,
        first: u64,
        now_ms: u64,
    ) -> Result<Decided, SelectFailure> {
        let sessions = SessionTable::new(MemSessionStore::new(), SessionConfig::default());
        self.decide_prompt(&sessions, request, &SignalSnapshot::new(), first, now_ms)
    }
}

fn request(id: u128) -> SelectRequest {
    SelectRequest {
        request_id: Some(Uuid::from_u128(id)),
        model: "m".into(),
        ..SelectRequest::default()
    }
}

fn in_session(id: u128, session: &str) -> SelectRequest {
    SelectRequest {
        session: Some(SessionContext {
            id: session.into(),
            ..SessionContext::default()
        }),
        ..request(id)
    }
}

fn new(decided: Decided) -> NewDecision {
    match decided {
        Decided::New(new) => *new,
        other => panic!("expected a new decision, got {other:?}"),
    }
}

/// Worker 1 holds the whole prompt.
fn prefix_on_1() -> SignalSnapshot {
    SignalSnapshot::new().with_overlap(
        WorkerRank::new(1, 0),
        Overlap {
            device: 32,
            ..Overlap::default()
        },
    )
}

#[test]
fn a_burst_sees_each_earlier_decision_of_it() {
    let mut f = Fixture::new(4);
    let mut per_worker = BTreeMap::<u64, u32>::new();
    for i in 0..8u64 {
        // Prompts sharing nothing.
        let d = new(f
            .decide_distinct(&request(u128::from(i) + 1), i * 1_000, 1_000)
            .unwrap());
        assert_eq!(d.applied, Applied::Added);
        assert_eq!(d.decision.ts, 1_000);
        assert_eq!(d.decision.prefill_tokens, 512);
        assert_eq!(d.reply.worker_id, d.decision.worker_id);
        *per_worker.entry(d.decision.worker_id).or_default() += 1;
    }
    // Same cost everywhere but for the charges: eight requests go two per worker.
    assert_eq!(
        per_worker.values().copied().collect::<Vec<_>>(),
        [2, 2, 2, 2]
    );
    assert_eq!(f.view.predictions(), 8);
}

#[test]
fn a_burst_sharing_a_prompt_goes_where_the_first_one_will_have_it() {
    // Predicted overlap on: the first decision's prompt counts as held by its worker, so the
    // rest of the burst follows it (the index knows nothing yet).
    let mut f = Fixture::new(4);
    let first = new(f.decide(&request(1), 1_000).unwrap());
    assert_eq!(first.decision.prefix_hashes.len(), 16);
    assert_eq!(first.decision.overlap_blocks, 0);
    for i in 2..=4 {
        let d = new(f.decide(&request(i), 1_001).unwrap());
        assert_eq!(d.decision.worker_id, first.decision.worker_id);
        assert_eq!(d.decision.overlap_blocks, 32);
        assert_eq!(d.decision.prefill_tokens, 0);
    }
    // Past the TTL, the prediction is gone: the next one goes by load alone.
    let later = new(f.decide(&request(9), 3_001).unwrap());
    assert_eq!(later.decision.overlap_blocks, 0);
    assert_ne!(later.decision.worker_id, first.decision.worker_id);
    // Off: the burst spreads by load and decisions carry no prefix hashes.
    let mut off = Fixture::predicting(4, 0);
    let workers: std::collections::BTreeSet<u64> = (1..=4)
        .map(|i| new(off.decide(&request(i), 1_000).unwrap()).decision)
        .inspect(|d| assert!(d.prefix_hashes.is_empty()))
        .map(|d| d.worker_id)
        .collect();
    assert_eq!(workers.len(), 4);
}

#[test]
fn another_replicas_decision_predicts_overlap_here_too() {
    let mut a = Fixture::new(4);
    let mut b = Fixture::new(4);
    let theirs = new(a.decide(&request(1), 1_000).unwrap()).decision;
    let echoed: Decision =
        kvroute_common::codec::decode(&kvroute_common::codec::encode(&theirs).unwrap()).unwrap();
    assert_eq!(echoed.prefix_hashes, theirs.prefix_hashes);
    assert_eq!(b.view.apply_decision(&echoed, 1_005), Applied::Added);
    // The remembered decision does not keep the hashes.
    assert!(
        b.view
            .decided(&Uuid::from_u128(1))
            .unwrap()
            .prefix_hashes
            .is_empty()
    );
    let mine = new(b.decide(&request(2), 1_010).unwrap());
    assert_eq!(mine.decision.worker_id, theirs.worker_id);
    assert_eq!(mine.decision.overlap_blocks, 32);
}

#[test]
fn a_retry_gets_the_decision_already_made_and_is_charged_once() {
    let mut f = Fixture::new(4);
    let first = new(f.decide(&request(1), 1_000).unwrap());
    let again = f.decide(&request(1), 1_010).unwrap();
    let Decided::Known(reply) = again else {
        panic!("expected the known decision, got {again:?}");
    };
    assert_eq!(reply.decision_id, first.decision.decision_id);
    assert_eq!(reply.worker_id, first.decision.worker_id);
    assert_eq!(reply.request_subject, first.selection.request_subject);
    assert_eq!(f.view.predictions(), 1);
}

#[test]
fn a_request_past_its_deadline_is_neither_decided_nor_charged() {
    let mut f = Fixture::new(2);
    let mut late = request(1);
    late.deadline_ms = Some(999);
    assert_eq!(f.decide(&late, 1_000).unwrap(), Decided::Expired);
    assert_eq!(f.view.predictions(), 0);
    late.deadline_ms = Some(1_000);
    assert!(matches!(f.decide(&late, 1_000).unwrap(), Decided::New(_)));
}

#[test]
fn a_request_decided_by_another_replica_gets_that_decision() {
    let mut f = Fixture::new(4);
    let mut theirs = new(f.decide(&request(1), 1_000).unwrap()).decision;
    // Another replica decided attempt 1 of the same request, on another worker.
    f.view.withdraw(&theirs);
    theirs.attempt = 1;
    theirs.worker_id = if theirs.worker_id == 4 { 3 } else { 4 };
    theirs.decision_id = Uuid::from_u128(99);
    let mut mine = request(1);
    mine.attempt = 0;
    // It arrives just before this replica charges its own (attempt 0): simulated by applying
    // it first, then deciding; the core answers with the known decision.
    f.view.apply_decision(&theirs, 1_000);
    let Decided::Known(reply) = f.decide(&mine, 1_001).unwrap() else {
        panic!("expected the known decision");
    };
    assert_eq!(reply.worker_id, theirs.worker_id);
    assert_eq!(f.view.predictions(), 1);
}

/// A session store where another router binds `session` to `winner` just before this
/// router's first commit.
struct RacedStore {
    inner: MemSessionStore,
    winner: WorkerRank,
    raced: std::sync::atomic::AtomicBool,
}

impl SessionStore for RacedStore {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        self.inner.get(session).await
    }

    async fn create(
        &self,
        session: &str,
        binding: &SessionBinding,
    ) -> Result<WriteOutcome, StoreError> {
        if !self.raced.swap(true, std::sync::atomic::Ordering::SeqCst) {
            let theirs = SessionBinding::new(self.winner, 0);
            assert_eq!(
                self.inner.create(session, &theirs).await?,
                WriteOutcome::Written(1)
            );
        }
        self.inner.create(session, binding).await
    }

    async fn update(
        &self,
        session: &str,
        binding: &SessionBinding,
        revision: crate::session::Revision,
    ) -> Result<WriteOutcome, StoreError> {
        self.inner.update(session, binding, revision).await
    }

    async fn delete(&self, session: &str) -> Result<(), StoreError> {
        self.inner.delete(session).await
    }
}

#[test]
fn a_commit_that_lost_a_race_withdraws_its_charge_and_adopts_the_winner() {
    for mode in [AffinityMode::Hard, AffinityMode::Soft] {
        let mut f = Fixture::new(4);
        let winner = WorkerRank::new(3, 0);
        let sessions = SessionTable::new(
            RacedStore {
                inner: MemSessionStore::new(),
                winner,
                raced: false.into(),
            },
            SessionConfig {
                mode,
                idle_ttl_ms: 60_000,
            },
        );
        // The prompt is on worker 1: this router chooses it, then finds worker 3 bound.
        let d = new(f
            .decide_with(&sessions, &in_session(1, "s"), &prefix_on_1(), 1_000)
            .unwrap());
        assert_eq!(d.selection.worker, winner, "{mode:?}");
        assert_eq!(d.decision.worker_id, 3);
        assert_eq!(d.decision.binding, Some(BindingState::Kept));
        assert_eq!(d.reply.binding, Some(BindingState::Kept));
        // One charge, on the adopted worker; worker 1's was withdrawn.
        assert_eq!(f.view.predictions(), 1);
        assert_eq!(
            f.view
                .decided(&Uuid::from_u128(1))
                .map(|known| known.worker_id),
            Some(3)
        );
        assert!(
            f.view
                .load(WorkerRank::new(1, 0), 0)
                .is_none_or(|l| l.active_requests == 0)
        );
        let bound = block_on(sessions.store().get("s")).unwrap().unwrap();
        assert_eq!(bound.binding.worker(), winner);
    }
}

/// A session store that cannot be written.
struct Broken(MemSessionStore);

impl SessionStore for Broken {
    async fn get(&self, session: &str) -> Result<Option<Versioned>, StoreError> {
        self.0.get(session).await
    }

    async fn create(&self, _: &str, _: &SessionBinding) -> Result<WriteOutcome, StoreError> {
        Err(StoreError::new("down"))
    }

    async fn update(
        &self,
        _: &str,
        _: &SessionBinding,
        _: crate::session::Revision,
    ) -> Result<WriteOutcome, StoreError> {
        Err(StoreError::new("down"))
    }

    async fn delete(&self, _: &str) -> Result<(), StoreError> {
        Err(StoreError::new("down"))
    }
}

#[test]
fn a_failed_commit_leaves_no_charge_and_no_decision() {
    let mut f = Fixture::new(4);
    let sessions = SessionTable::new(Broken(MemSessionStore::new()), SessionConfig::default());
    let e = f
        .decide_with(&sessions, &in_session(1, "s"), &prefix_on_1(), 1_000)
        .unwrap_err();
    assert_eq!(
        e,
        SelectFailure::Session(SessionError::Store(StoreError::new("down")))
    );
    assert_eq!(f.view.predictions(), 0);
    assert!(f.view.decided(&Uuid::from_u128(1)).is_none());
    // The request can be decided again once the store is back.
    let sessions = SessionTable::new(MemSessionStore::new(), SessionConfig::default());
    let d = new(f
        .decide_with(&sessions, &in_session(1, "s"), &prefix_on_1(), 1_010)
        .unwrap());
    assert_eq!(d.decision.binding, Some(BindingState::New));
    assert_eq!(f.view.predictions(), 1);
}

/// Picks the affinity target when it is a row, else the first row.
struct TargetPicker;

impl crate::pipeline::WorkerPicker for TargetPicker {
    fn required_inputs(&self) -> WorkerInputs {
        WorkerInputs::NONE
    }

    fn pick(
        &mut self,
        context: &crate::request::RequestContext,
        rows: &[crate::pipeline::ScoredCandidate<'_>],
        _rng: &mut dyn rand::RngCore,
    ) -> Result<usize, crate::pipeline::ComponentError> {
        Ok(context
            .affinity_target()
            .and_then(|t| rows.iter().position(|r| t.matches(r.worker())))
            .unwrap_or(0))
    }
}

#[test]
fn a_selection_target_is_the_policys_affinity_target_but_never_beats_a_pin() {
    let mut f = Fixture::new(4);
    f.policy = PartitionPolicy::new(
        WorkerSelectionPolicy::new(Vec::new(), Box::new(TargetPicker)),
        StdRng::seed_from_u64(1),
        &f.settings,
    );
    let prompt = Prompt {
        hashes: (0..4).collect(),
        tokens: 64,
    };
    let overlap = SignalSnapshot::new();
    let mut decide =
        |request: &SelectRequest, target: Option<WorkerTarget>, route: SessionRoute| {
            let input = DecideInput {
                request,
                request_id: request.request_id.unwrap(),
                decision_id: Uuid::from_u128(9),
                prompt: &prompt,
                partition: &f.partition,
                overlap: &overlap,
                settings: &f.settings,
                names: &f.names,
                router_id: "r1",
                selection_target: target,
            };
            new(super::decide(&mut f.policy, &mut f.view, &input, route, 1_000).unwrap())
                .decision
                .worker_id
        };
    let open = SessionRoute::Open { affinity: None };
    let target = |w| Some(WorkerTarget::exact(WorkerRank::new(w, 0)));
    let first = decide(&request(1), None, open);
    assert_eq!(decide(&request(2), target(3), open), 3);
    // It replaces a soft session's hint...
    let soft = SessionRoute::Open {
        affinity: target(2),
    };
    assert_eq!(decide(&request(3), target(4), soft), 4);
    // ...but an exact route (a pin or a hard binding) stays authoritative.
    let exact = SessionRoute::Exact(WorkerTarget::exact(WorkerRank::new(2, 0)));
    assert_eq!(decide(&request(4), target(4), exact), 2);
    assert_eq!(
        first,
        cards(4)[0].worker_id,
        "without a target: the first row"
    );
}

/// A fleet of three whose workers 2 and 3 publish no KV events, with predicted overlap off:
/// what decides where a prompt's next request goes is the approximate cache.
fn mixed_fleet() -> Fixture {
    let mut f = Fixture::predicting(3, 0);
    let mut cards = cards(3);
    for c in cards.iter_mut().filter(|c| c.worker_id != 1) {
        c.kv_events = false;
    }
    f.view.set_workers(&cards);
    f.partition = std::sync::Arc::new(Partition {
        cards,
        block_size: 16,
    });
    f
}

fn finished(d: &Decision) -> kvroute_common::messages::RequestLifecycle {
    kvroute_common::messages::RequestLifecycle {
        v: Default::default(),
        request_id: d.request_id,
        worker_id: d.worker_id,
        dp_rank: 0,
        ts: 0,
        kind: kvroute_common::messages::LifecycleKind::Finished { output_tokens: 1 },
    }
}

#[test]
fn a_worker_without_events_that_served_a_prompt_wins_its_next_request_on_every_replica() {
    let mut a = mixed_fleet();
    let mut b = mixed_fleet();
    // Worker 1 (with events) holds a prompt the index knows of; the first request of another
    // prompt goes to a worker without events (worker 1 is the busiest), and its decision
    // carries the prefix hashes although predicted overlap is off.
    let busy = kvroute_common::messages::WorkerLoad {
        v: Default::default(),
        worker_id: 1,
        dp_rank: 0,
        seq: 1,
        active_prefill_tokens: 0,
        active_decode_blocks: 0,
        active_requests: 4,
        waiting_requests: 0,
        kv_used_blocks: 0,
        total_kv_blocks: 0,
        ts: 0,
        new_requests: None,
        adapters: None,
    };
    a.view.apply_report(&busy, 1_000);
    b.view.apply_report(&busy, 1_000);
    let first = new(a.decide_distinct(&request(1), 100, 1_000).unwrap()).decision;
    assert_ne!(first.worker_id, 1);
    assert!(!first.prefix_hashes.is_empty());
    assert_eq!(b.view.apply_decision(&first, 1_005), Applied::Added);
    for f in [&mut a, &mut b] {
        f.view.apply_lifecycle(&finished(&first), 2_000);
    }
    // A minute later, long past any predicted overlap, both replicas send the prompt's next
    // request to the worker that served it, which holds it whole.
    for (i, f) in [&mut a, &mut b].into_iter().enumerate() {
        let next = new(f
            .decide_distinct(&request(10 + i as u128), 100, 61_000)
            .unwrap());
        assert_eq!(next.decision.worker_id, first.worker_id);
        assert_eq!(next.decision.overlap_blocks, 32);
        f.view.apply_lifecycle(&finished(&next.decision), 61_500);
    }
    // The worker with events still wins what its index says it holds.
    let sessions = SessionTable::new(MemSessionStore::new(), SessionConfig::default());
    let d = new(a
        .decide_prompt(&sessions, &request(20), &prefix_on_1(), 0, 62_000)
        .unwrap());
    assert_eq!((d.decision.worker_id, d.decision.overlap_blocks), (1, 32));
    // Past the TTL after the last decision, the prompt is forgotten.
    let late = new(a
        .decide_distinct(&request(30), 100, 61_000 + 120_000)
        .unwrap());
    assert_eq!(late.decision.overlap_blocks, 0);
}

mod adapters;
