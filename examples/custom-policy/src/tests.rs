//! The example plugins selected through YAML: the policy against the built-in default, and the
//! classifier's target followed by the policy.

use std::sync::Arc;

use kvroute_common::messages::{
    BindingState, SelectRequest, SessionContext, WorkerCard, WorkerLoad, WorkerRole,
};
use kvroute_common::{Names, Namespace};
use kvroute_router::classify::{ClassifyEvent, ClassifyRequest, RequestClassifierContext, Verdict};
use kvroute_router::decide::candidates::Partition;
use kvroute_router::decide::load_view::{LoadView, LoadViewConfig};
use kvroute_router::decide::prompt::{Prepared, Prompt};
use kvroute_router::decide::selection::{Context, Selection, Start};
use kvroute_router::decide::{Decided, Owned, PartitionPolicy};
use kvroute_router::drive::{self, Ended};
use kvroute_router::pipeline::{WorkerInputs, WorkerSelectionPolicy};
use kvroute_router::registry::{
    ConfigError, PluginKind, PolicyOverrides, RegistryError, RouterPluginRegistry,
    RouterPluginsConfig, WorkerSelectionConfig,
};
use kvroute_router::select::{Chosen, SelectInput, SelectionSettings, select_worker};
use kvroute_router::session::{AffinityMode, MemSessionStore, SessionConfig, SessionRoute};
use kvroute_router::signals::{ObservedLoad, Overlap, SignalSnapshot};
use kvroute_router::worker::WorkerRank;
use rand::SeedableRng;
use rand::rngs::StdRng;
use uuid::Uuid;

/// The walkthrough's configuration file, as the README runs it.
const YAML: &str = include_str!("../sticky.yaml");

/// Both plugins, as `sticky-serial.yaml` selects them.
const BOTH_YAML: &str = include_str!("../sticky-serial.yaml");

fn registry() -> RouterPluginRegistry {
    let mut registry = RouterPluginRegistry::with_builtins();
    crate::register(&mut registry).unwrap();
    registry
}

fn policy(yaml: &str) -> Result<WorkerSelectionPolicy, ConfigError> {
    let config = WorkerSelectionConfig::from_yaml(yaml)?;
    registry()
        .resolve(&config, &PolicyOverrides::default())?
        .build(WorkerRole::Aggregated, "m")
}

fn card(worker_id: u64) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: "m".into(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        total_kv_blocks: 1000,
        max_num_batched_tokens: 8192,
        dp_start_rank: 0,
        dp_size: 1,
        taints: Vec::new(),
        labels: Default::default(),
        request_subject: format!("worker.{worker_id}"),
        software_version: String::new(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

/// Worker 1 holds the prompt; active requests per worker as given.
fn signals(active: [u64; 2]) -> SignalSnapshot {
    let mut snapshot = SignalSnapshot::new().with_overlap(
        WorkerRank::new(1, 0),
        Overlap {
            device: 10,
            ..Overlap::default()
        },
    );
    for (i, requests) in active.into_iter().enumerate() {
        let load = ObservedLoad {
            active_requests: requests,
            ..ObservedLoad::default()
        };
        snapshot = snapshot.with_load(WorkerRank::new(i as u64 + 1, 0), load);
    }
    snapshot
}

fn request(session: Option<&str>) -> SelectRequest {
    SelectRequest {
        model: "m".into(),
        session: session.map(|id| SessionContext {
            id: id.into(),
            ..SessionContext::default()
        }),
        ..SelectRequest::default()
    }
}

#[test]
fn selecting_the_policy_in_yaml_changes_the_outcome() {
    let workers = [card(1), card(2)];
    let snapshot = signals([2, 0]);
    let settings = SelectionSettings::default();
    let req = request(None);
    let input = SelectInput {
        request: &req,
        request_blocks: 10,
        block_size: 16,
        workers: &workers,
        signals: &snapshot,
        settings: &settings,
    };
    let mut rng = StdRng::seed_from_u64(0);
    let open = SessionRoute::Open { affinity: None };

    let mut builtin = policy("worker_selection: {}\n").unwrap();
    let chosen = select_worker(&input, &mut builtin, open, &mut rng).unwrap();
    assert_eq!(
        (chosen.worker.worker_id, chosen.policy.as_str()),
        (1, "default")
    );

    let mut sticky = policy(YAML).unwrap();
    assert_eq!(
        sticky.required_inputs(),
        WorkerInputs::LOAD,
        "no index query"
    );
    let chosen = select_worker(&input, &mut sticky, open, &mut rng).unwrap();
    assert_eq!(
        (chosen.worker.worker_id, chosen.policy.as_str()),
        (2, "sticky")
    );
    assert_eq!(chosen.cost.terms["active_requests"], 0.0);
}

/// Runs one selection of `request` the way the router does (its selection machine, from
/// memory as `kvroute-sim` runs it): the session binding in `store`, worker 1 holding the
/// prompt, and each worker's active requests as its last load report says.
fn select_in_session(
    policy: &mut PartitionPolicy,
    store: &MemSessionStore,
    sessions: SessionConfig,
    request: &SelectRequest,
    active: [u64; 2],
    now_ms: u64,
) -> Chosen {
    let workers = vec![card(1), card(2)];
    let mut view = LoadView::new(LoadViewConfig {
        report_interval_ms: 1_000,
        confirm_window_ms: 2_000,
        prediction_max_age_ms: 60_000,
        predicted_overlap_ttl_ms: 0,
        approx_cache_ttl_ms: 0,
        models: Default::default(),
    });
    for (worker, &requests) in workers.iter().zip(&active) {
        let report = WorkerLoad {
            v: Default::default(),
            worker_id: worker.worker_id,
            dp_rank: 0,
            seq: 1,
            active_prefill_tokens: 0,
            active_decode_blocks: 0,
            active_requests: requests,
            waiting_requests: 0,
            kv_used_blocks: 0,
            total_kv_blocks: 1000,
            ts: now_ms,
            new_requests: None,
            adapters: None,
        };
        view.apply_report(&report, now_ms);
    }
    let partition = Arc::new(Partition {
        cards: workers,
        block_size: 16,
    });
    let prompt = Prompt {
        hashes: (0..10).collect(),
        tokens: 160,
    };
    let id = Uuid::from_u128(u128::from(now_ms) + 1);
    let prepared = Prepared::with_prompt(request.clone(), id, partition, prompt);
    let (settings, names) = (
        SelectionSettings::default(),
        Names::new(&Namespace::new("t").unwrap()),
    );
    let context = Context {
        settings: &settings,
        names: &names,
        router_id: "r",
        sessions,
    };
    let start = Start {
        decision_id: id,
        reads_cache: true,
        overlap: Some(signals([0, 0])),
        target: None,
        queues: false,
    };
    let mut state = Owned {
        policy,
        view: &mut view,
        now_ms,
    };
    let (selection, need) = Selection::start(&prepared, context, start, &mut state);
    match drive::now(selection, need, &mut state, store, SignalSnapshot::new) {
        Ended::Reply(Ok(Decided::New(new))) => new.selection,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_soft_session_moves_when_its_worker_gets_busy_then_stays() {
    let store = MemSessionStore::new();
    let sessions = SessionConfig {
        mode: AffinityMode::Soft,
        idle_ttl_ms: 60_000,
    };
    let settings = SelectionSettings::default();
    let mut sticky =
        PartitionPolicy::new(policy(YAML).unwrap(), StdRng::seed_from_u64(0), &settings);
    let req = request(Some("agent-7"));
    let mut run = |active: [u64; 2], now_ms: u64| {
        let s = select_in_session(&mut sticky, &store, sessions, &req, active, now_ms);
        (s.worker.worker_id, s.binding.unwrap())
    };
    assert_eq!(run([0, 1], 0), (1, BindingState::New));
    assert_eq!(
        run([3, 0], 1),
        (1, BindingState::Kept),
        "at the threshold: stay"
    );
    assert_eq!(run([4, 0], 2), (2, BindingState::Rebound), "busy: move");
    assert_eq!(
        run([0, 2], 3),
        (2, BindingState::Kept),
        "the binding followed"
    );
}

#[test]
fn bad_parameters_and_duplicate_registration_stop_startup() {
    let missing =
        policy("worker_selection:\n  instances:\n    - {name: s, type: sticky-until-busy}\n")
            .unwrap_err();
    assert!(
        missing
            .to_string()
            .contains("parameter `busy_threshold` is required"),
        "{missing}"
    );
    // Named by a request, the bare type says the same instead of "unknown policy".
    let resolved = registry()
        .resolve(
            &WorkerSelectionConfig::default(),
            &PolicyOverrides::default(),
        )
        .unwrap();
    let by_name = resolved
        .build_named(crate::TYPE_NAME, WorkerRole::Aggregated, "m")
        .expect("a registered type")
        .unwrap_err();
    assert!(matches!(by_name, ConfigError::NeedsParameters { .. }));
    assert!(
        by_name
            .to_string()
            .contains("parameter `busy_threshold` is required"),
        "{by_name}"
    );
    let inverted = policy(
        "worker_selection:\n  instances:\n    - name: s\n      type: sticky-until-busy\n      parameters: {busy_threshold: 5, max_active_requests: 5}\n",
    )
    .unwrap_err();
    assert!(
        inverted.to_string().contains("max_active_requests"),
        "{inverted}"
    );
    let mut registry = registry();
    assert_eq!(
        crate::register(&mut registry),
        Err(RegistryError::Duplicate {
            kind: PluginKind::WorkerSelection,
            type_name: crate::TYPE_NAME.into()
        })
    );
    let mut only_policy = RouterPluginRegistry::with_builtins();
    only_policy
        .register_worker_selection(crate::TYPE_NAME, std::sync::Arc::new(crate::provider))
        .unwrap();
    assert_eq!(
        crate::register(&mut only_policy),
        Err(RegistryError::Duplicate {
            kind: PluginKind::WorkerSelection,
            type_name: crate::TYPE_NAME.into()
        }),
        "a catalog registered twice is refused at its first type"
    );
}

#[test]
fn the_classifier_in_yaml_steers_a_session_and_the_policy_follows() {
    let plugins = registry()
        .resolve_plugins(
            &RouterPluginsConfig::from_yaml(BOTH_YAML).unwrap(),
            &PolicyOverrides::default(),
        )
        .unwrap();
    let classifier = plugins.classifier.expect("configured");
    assert_eq!(classifier.type_name(), crate::CLASSIFIER_TYPE_NAME);
    let workers = [card(1), card(2)];
    let mut admission = classifier.build(&RequestClassifierContext::from_cards(16, &workers));
    let mut sticky = plugins.policies.build(WorkerRole::Aggregated, "m").unwrap();
    let settings = SelectionSettings::default();
    let wire = request(Some("agent-7"));
    let mut rng = StdRng::seed_from_u64(0);
    let id = |n: u128| kvroute_common::RequestId::from_u128(n);
    let classify = |admission: &mut Box<dyn kvroute_router::classify::RequestClassifier>, n| {
        let mut request = ClassifyRequest::from_request(&wire, id(n), 160, 0);
        let verdict = admission.classify(&mut request, 0);
        (verdict, request.worker_selection_target())
    };

    // The first request has no history: no target, the policy picks idle worker 2.
    let (verdict, target) = classify(&mut admission, 1);
    assert!(matches!(verdict, Verdict::Admit(_)));
    assert_eq!(target, None);
    let snapshot = signals([1, 0]);
    let input = SelectInput {
        request: &wire,
        request_blocks: 10,
        block_size: 16,
        workers: &workers,
        signals: &snapshot,
        settings: &settings,
    };
    let open = SessionRoute::Open { affinity: target };
    let first = select_worker(&input, &mut sticky, open, &mut rng).unwrap();
    assert_eq!(first.worker.worker_id, 2);
    admission.on_event(
        &ClassifyEvent::Sent {
            request_id: id(1),
            worker: first.worker,
        },
        0,
    );

    // One request of the session at a time.
    assert_eq!(classify(&mut admission, 2).0, Verdict::Defer);
    admission.on_event(
        &ClassifyEvent::Completed {
            request_id: id(1),
            worker: Some(first.worker),
            outcome: kvroute_router::classify::Completion::Finished,
        },
        0,
    );
    // Released, with the session's worker as the target, which the policy keeps while it is
    // not busy although worker 1 is idler.
    let (verdict, target) = classify(&mut admission, 2);
    assert!(matches!(verdict, Verdict::Admit(_)));
    assert_eq!(target.map(|t| t.worker_id), Some(2));
    let snapshot = signals([0, 2]);
    let input = SelectInput {
        signals: &snapshot,
        ..input
    };
    let open = SessionRoute::Open { affinity: target };
    let second = select_worker(&input, &mut sticky, open, &mut rng).unwrap();
    assert_eq!(second.worker.worker_id, 2);

    // The stock registry does not know the classifier type.
    let err = RouterPluginRegistry::with_builtins()
        .resolve_plugins(
            &RouterPluginsConfig::from_yaml(BOTH_YAML).unwrap(),
            &PolicyOverrides::default(),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("unknown type \"sticky-until-busy\""),
        "{err}"
    );
    let classifier_only = "request_classifier:\n  type: session-serial\n  parameters: {max_in_flight_per_session: 1}\n";
    let err = RouterPluginRegistry::with_builtins()
        .resolve_plugins(
            &RouterPluginsConfig::from_yaml(classifier_only).unwrap(),
            &PolicyOverrides::default(),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("request_classifier.type \"session-serial\""),
        "{err}"
    );
}

#[test]
fn a_bad_classifier_parameter_stops_startup_naming_it() {
    let yaml = "request_classifier:\n  type: session-serial\n  parameters: {max_in_flight_per_session: 0}\n";
    let err = registry()
        .resolve_plugins(
            &RouterPluginsConfig::from_yaml(yaml).unwrap(),
            &PolicyOverrides::default(),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        ConfigError::InvalidClassifierParameters { .. }
    ));
    assert!(
        err.to_string()
            .contains("parameter `max_in_flight_per_session` must be at least 1"),
        "{err}"
    );
}
