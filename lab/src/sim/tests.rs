use std::time::Duration;

use kvroute_common::messages::Disaggregation;
use kvroute_common::trace::TraceRequest;
use kvroute_mocker::engine::{EngineConfig, StepWork};
use kvroute_router::registry::DisaggregationConfig;
use kvroute_router::registry::{PolicyOverrides, RouterPluginRegistry, WorkerSelectionConfig};

use super::*;
use crate::replay::{Mode, ModeReport, Plan, oracle_hit_rates};

/// `conversations` conversations of `turns` turns each, one turn every 3 s per conversation
/// (interleaved), every prompt extending the previous turn's by two 512-token blocks; all
/// start with the same shared block, as the Mooncake conversation trace does.
fn conversations(conversations: u64, turns: u64) -> Vec<TraceRequest> {
    let mut out = Vec::new();
    let mut next_id = 1;
    let mut chains: Vec<Vec<u64>> = vec![vec![0]; conversations as usize];
    for turn in 0..turns {
        for (c, chain) in chains.iter_mut().enumerate() {
            chain.extend([next_id, next_id + 1]);
            next_id += 2;
            out.push(TraceRequest {
                timestamp: turn * 3000 + c as u64 * 10,
                input_length: (chain.len() * 512) as u32,
                output_length: 20,
                hash_ids: chain.clone(),
                ..TraceRequest::default()
            });
        }
    }
    out.sort_by_key(|r| r.timestamp);
    out
}

fn engine() -> EngineConfig {
    EngineConfig {
        num_blocks: 2048,
        ..EngineConfig::default()
    }
}

fn settings(mode: Mode, routers: u32, seed: u64) -> SimSettings {
    SimSettings {
        mode,
        engine: engine(),
        workers: 4,
        prefill_workers: 0,
        decode_workers: 0,
        disaggregation: Default::default(),
        kv_transfer_per_block: Duration::from_micros(400),
        routers,
        event_delay: Duration::from_millis(5),
        signal_delay: Duration::from_millis(5),
        load_interval: Duration::from_millis(200),
        load_reports: true,
        report_covers: Duration::from_millis(1000),
        prediction_confirm: Duration::from_secs(2),
        prediction_max_age: Duration::from_secs(600),
        predicted_overlap_ttl: Duration::from_secs(2),
        approx_cache_ttl: Duration::from_secs(120),
        no_kv_events_workers: 0,
        seed,
        send_sessions: true,
        adapter_placement: true,
        running_adapters_only: false,
        sessions: Default::default(),
        cpu_workers: 0,
        cpu_slowdown: 1.0,
        shared_cache_blocks: 0,
        load_models: Default::default(),
    }
}

fn builtins() -> kvroute_router::registry::ResolvedPolicies {
    RouterPluginRegistry::with_builtins()
        .resolve(
            &WorkerSelectionConfig::default(),
            &PolicyOverrides::default(),
        )
        .unwrap()
}

fn run(plan: &Plan, mode: Mode, routers: u32, seed: u64) -> ModeReport {
    simulate(plan, &settings(mode, routers, seed), &builtins(), |_| {}).unwrap()
}

/// The report without its wall-clock figure (selection latency).
fn simulated(mut r: ModeReport) -> ModeReport {
    r.selection_latency_us = Default::default();
    r
}

#[test]
fn kv_routing_keeps_conversations_on_their_prefix_and_beats_round_robin() {
    // 13 conversations on 4 workers: round-robin sends each turn of a conversation elsewhere.
    let plan = Plan::new(conversations(13, 6), 0, 1.0, None);
    let oracle = oracle_hit_rates(&plan.requests, 64, 4 * 2048);
    let kv = run(&plan, Mode::Kv, 1, 1);
    let rr = run(&plan, Mode::RoundRobin, 1, 1);
    for r in [&kv, &rr] {
        assert_eq!((r.completed, r.errors), (78, 0), "{r:?}");
        assert!(r.hit_rate <= oracle.infinite + 1e-9);
    }
    // Each turn after the first finds its whole previous prompt cached when it goes back to
    // its worker: 2 new blocks of 2k+1 (k = turn), the infinite oracle's rate.
    assert!(
        kv.hit_rate > 0.95 * oracle.infinite,
        "kv {} vs infinite oracle {}",
        kv.hit_rate,
        oracle.infinite
    );
    assert!(
        rr.hit_rate < 0.5 * kv.hit_rate,
        "round-robin {} vs kv {}",
        rr.hit_rate,
        kv.hit_rate
    );
    assert!(kv.ttft_ms.p50 < rr.ttft_ms.p50);
    assert!(
        kv.load_cv_requests < 0.5,
        "kv spreads conversations: {kv:?}"
    );
}

#[test]
fn a_run_is_a_pure_function_of_its_inputs_and_seed() {
    let plan = Plan::new(conversations(8, 4), 0, 1.0, None);
    for mode in [Mode::Kv, Mode::Random] {
        let a = simulated(run(&plan, mode, 2, 7));
        let b = simulated(run(&plan, mode, 2, 7));
        assert_eq!(a, b, "{mode}");
    }
    // Random routing differs with the seed.
    let c = simulated(run(&plan, Mode::Random, 2, 8));
    assert_ne!(simulated(run(&plan, Mode::Random, 2, 7)), c);
}

#[test]
fn the_load_models_run_deterministically() {
    use kvroute_router::decide::load_view::models::{LoadModels, PrefillLoadModel};
    let plan = Plan::new(conversations(8, 4), 0, 1.0, None);
    let with_models = |tokens_per_sec| SimSettings {
        load_models: LoadModels {
            track_output_blocks: true,
            prefill: PrefillLoadModel::Decay { tokens_per_sec },
        },
        // Without reports, the predictions (and so the models) carry the load.
        load_reports: false,
        ..settings(Mode::Kv, 2, 7)
    };
    for rate in [None, Some(20_000)] {
        let run = || simulated(simulate(&plan, &with_models(rate), &builtins(), |_| {}).unwrap());
        let a = run();
        assert_eq!((a.completed, a.errors), (32, 0), "{a:?}");
        assert_eq!(a, run());
    }
}

#[test]
fn several_router_replicas_share_decisions_and_complete() {
    let plan = Plan::new(conversations(12, 6), 0, 1.0, None);
    let one = run(&plan, Mode::Kv, 1, 1);
    let four = run(&plan, Mode::Kv, 4, 1);
    assert_eq!((four.completed, four.errors), (72, 0));
    assert!(
        (four.hit_rate - one.hit_rate).abs() < 0.05,
        "1 replica {} vs 4 {}",
        one.hit_rate,
        four.hit_rate
    );
}

#[test]
fn the_ttft_floor_is_the_engine_alone_with_the_oracle_prefix() {
    let e = engine();
    let requests = vec![
        TraceRequest {
            timestamp: 0,
            input_length: 10_000,
            output_length: 1,
            hash_ids: vec![],
            ..TraceRequest::default()
        },
        TraceRequest {
            timestamp: 0,
            input_length: 1_000,
            output_length: 1,
            hash_ids: vec![],
            ..TraceRequest::default()
        },
    ];
    // 10,000 uncached tokens: a step of 8,192 and one of 1,808; 1,000 with 15 of 15 full
    // blocks cached: 40 tokens in one step.
    let floor = crate::replay::ttft_floor(&requests, &[0, 15], &e);
    let step = |tokens: u64| 10.0 + tokens as f64 * 0.04;
    assert!(
        (floor.max - (step(8192) + step(1808))).abs() < 1e-6,
        "{floor:?}"
    );
    let small = step(1000 - 15 * 64);
    assert!((floor.p50 - (small + (step(8192) + step(1808))) / 2.0).abs() < 1e-6);
}

/// A small generated session trace: 24 sessions of 4–6 turns sharing 3 templates, arriving
/// at 2/s, so several are in flight at once.
fn session_plan() -> Plan {
    let params = crate::tracegen::SessionTraceParams {
        sessions: 24,
        turns: crate::tracegen::TokenRange::new(4, 6),
        templates: 3,
        session_rate: 2.0,
        think_time_secs: 2.0,
        ..Default::default()
    };
    Plan::new(crate::tracegen::generate(&params), 0, 1.0, None)
}

fn run_sessions(plan: &Plan, mode: Mode, send: bool) -> ModeReport {
    let settings = SimSettings {
        send_sessions: send,
        ..settings(mode, 2, 1)
    };
    simulate(plan, &settings, &builtins(), |_| {}).unwrap()
}

#[test]
fn sessions_sent_keep_their_turns_on_one_worker() {
    let plan = session_plan();
    let n = plan.len() as u64;
    let kv = run_sessions(&plan, Mode::Kv, true);
    let rr = run_sessions(&plan, Mode::RoundRobin, true);
    let rr_unsent = run_sessions(&plan, Mode::RoundRobin, false);
    for r in [&kv, &rr, &rr_unsent] {
        assert_eq!((r.completed, r.errors), (n, 0), "{r:?}");
    }
    let (kv, rr, rr_unsent) = (
        kv.sessions.unwrap(),
        rr.sessions.unwrap(),
        rr_unsent.sessions.unwrap(),
    );
    assert_eq!(kv.sessions, 24);
    // Hard affinity: the binding is the target whatever the policy.
    for s in [&kv, &rr] {
        assert!(s.sent);
        assert_eq!(
            (s.stickiness, s.single_worker),
            (Some(1.0), Some(1.0)),
            "{s:?}"
        );
    }
    // Without sessions, round-robin spreads a session's turns over the 4 workers.
    assert!(!rr_unsent.sent);
    assert!(rr_unsent.stickiness.unwrap() < 0.6, "{rr_unsent:?}");
    // Its later turns still find the shared template, but not their own conversation.
    assert!(
        rr_unsent.later_hit_rate.unwrap() < 0.8 * rr.later_hit_rate.unwrap(),
        "{rr_unsent:?} vs {rr:?}"
    );
    // A later turn finds its conversation where it left it: close to one shared cache.
    let oracle = crate::replay::oracle_with_hits(&plan.requests, 64, 4 * 2048).1;
    let oracle =
        crate::replay::session_oracle(plan.sessions.as_ref().unwrap(), &plan.requests, &oracle, 64);
    let bound = oracle.finite.unwrap();
    assert!(
        kv.later_hit_rate.unwrap() > 0.95 * bound,
        "{kv:?} vs {oracle:?}"
    );
}

#[test]
fn soft_affinity_leaves_the_choice_to_the_policy() {
    // The built-in policies read no affinity hint: soft round-robin goes round.
    let plan = session_plan();
    let settings = SimSettings {
        sessions: kvroute_router::session::SessionConfig {
            mode: kvroute_router::session::AffinityMode::Soft,
            ..Default::default()
        },
        ..settings(Mode::RoundRobin, 1, 1)
    };
    let soft = simulate(&plan, &settings, &builtins(), |_| {}).unwrap();
    assert!(soft.sessions.unwrap().stickiness.unwrap() < 0.6);
}

#[test]
fn a_policy_file_with_a_request_classifier_is_refused_naming_it() {
    use clap::Parser;
    let dir = std::env::temp_dir().join(format!("kvroute-sim-classifier-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args = |file: &str, text: &str| {
        let path = dir.join(file);
        std::fs::write(&path, text).unwrap();
        let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        SimArgs::try_parse_from([
            "kvroute-sim",
            "--trace",
            trace,
            "--policy-config",
            path.to_str().unwrap(),
        ])
        .unwrap()
    };
    let registry = RouterPluginRegistry::with_builtins();
    let with_classifier = args(
        "classifier.yaml",
        "worker_selection: {aggregated: round-robin}\nrequest_classifier: {type: pass-through}\n",
    );
    let err = load_policies(&with_classifier, &registry, "kvroute-sim")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("--policy-config "), "{err}");
    assert!(
        err.contains("request_classifier is configured, but kvroute-sim cannot run"),
        "{err}"
    );
    let without = args(
        "selection.yaml",
        "worker_selection: {aggregated: round-robin}\n",
    );
    let policies = load_policies(&without, &registry, "kvroute-sim")
        .unwrap()
        .policies;
    assert_eq!(
        policies
            .selection(kvroute_common::messages::WorkerRole::Aggregated)
            .instance,
        "round-robin"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn approximate_mode_keeps_conversations_on_their_workers_without_events() {
    // Turns 3 s apart: far beyond the predicted overlap's 2 s, and no sessions, so what brings
    // a turn back to its worker is the approximate cache.
    let plan = Plan::new(conversations(13, 6), 0, 1.0, None);
    let run = |settings: SimSettings| {
        let settings = SimSettings {
            send_sessions: false,
            ..settings
        };
        simulate(&plan, &settings, &builtins(), |_| {}).unwrap()
    };
    let kv = run(settings(Mode::Kv, 2, 1));
    let approx = run(settings(Mode::KvApprox, 2, 1));
    let rr = run(settings(Mode::RoundRobin, 2, 1));
    assert_eq!((approx.completed, approx.errors), (78, 0), "{approx:?}");
    assert!(
        approx.hit_rate >= 0.85 * kv.hit_rate,
        "kv-approx {} vs kv {}",
        approx.hit_rate,
        kv.hit_rate
    );
    assert!(rr.hit_rate < 0.5 * approx.hit_rate);
    // Off (TTL 0), the same fleet is routed on load alone: a turn finds its conversation's
    // blocks only when load happens to send it back.
    let off = run(SimSettings {
        approx_cache_ttl: Duration::ZERO,
        ..settings(Mode::KvApprox, 2, 1)
    });
    assert!(
        off.hit_rate < 0.75 * approx.hit_rate,
        "off {} vs on {}",
        off.hit_rate,
        approx.hit_rate
    );
    // A mixed fleet (workers 1 and 2 without events, 3 and 4 with) does as well.
    let mixed = run(SimSettings {
        no_kv_events_workers: 2,
        ..settings(Mode::Kv, 2, 1)
    });
    assert!(
        mixed.hit_rate >= 0.85 * kv.hit_rate,
        "mixed {} vs kv {}",
        mixed.hit_rate,
        kv.hit_rate
    );
}

/// `settings(Kv, 1 router)` on `prefill` prefill and `decode` decode workers (no aggregated
/// ones) in `mode`.
fn split(prefill: u32, decode: u32, mode: Disaggregation) -> SimSettings {
    SimSettings {
        workers: 0,
        prefill_workers: prefill,
        decode_workers: decode,
        disaggregation: DisaggregationConfig {
            mode,
            ..DisaggregationConfig::default()
        },
        ..settings(Mode::Kv, 1, 1)
    }
}

/// `n` requests at once, each of `blocks` distinct 512-token blocks and `output` tokens.
fn burst(n: u64, blocks: u64, output: u32) -> Plan {
    let requests = (0..n)
        .map(|i| TraceRequest {
            timestamp: 0,
            input_length: (blocks * 512) as u32,
            output_length: output,
            hash_ids: (i * 100..i * 100 + blocks).collect(),
            ..TraceRequest::default()
        })
        .collect();
    Plan::new(requests, 0, 1.0, None)
}

fn pairs(r: &ModeReport) -> &crate::replay::DisaggregationReport {
    r.disaggregation
        .as_ref()
        .expect("a fleet with prefill and decode workers")
}

fn run_split(plan: &Plan, settings: &SimSettings) -> ModeReport {
    simulate(plan, settings, &builtins(), |_| {}).unwrap()
}

#[test]
fn a_paired_request_is_charged_to_a_prefill_and_a_decode_worker() {
    // Without load reports and with late lifecycle events, a replica knows a worker's load
    // only from its own charges: four requests at once spread 2 / 2 over the prefill workers
    // and over the decode workers only if each decision charged both.
    let plan = burst(4, 4, 20);
    let settings = SimSettings {
        load_reports: false,
        signal_delay: Duration::from_secs(30),
        ..split(2, 2, Disaggregation::Always)
    };
    let r = run_split(&plan, &settings);
    assert_eq!((r.completed, r.errors), (4, 0), "{r:?}");
    let d = pairs(&r);
    assert_eq!((d.paired, d.unpaired), (4, 0), "{d:?}");
    assert_eq!(d.load_cv_decode_requests, 0.0, "{d:?}");
    assert_eq!(r.load_cv_requests, 0.0, "prefill workers: {r:?}");
    // The hit is the prefill worker's (nothing cached): the decode worker's transferred
    // tokens are not cache hits.
    assert_eq!(r.cached_prompt_tokens, 0);
    assert_eq!(r.output_tokens, 4 * 20);
}

#[test]
fn a_paired_requests_ttft_is_its_prefill_its_transfer_and_the_decodes_first_step() {
    // One request of 2048 uncached tokens, alone: the prefill worker computes them in one
    // step, 32 blocks of 64 tokens move, and the decode worker computes the last token.
    let plan = burst(1, 4, 10);
    let e = engine();
    let step = |work| e.step_duration(work).as_secs_f64() * 1e3;
    let prefill = step(StepWork {
        prefill_tokens: 2048,
        ..StepWork::default()
    });
    let last_token = step(StepWork {
        prefill_tokens: 1,
        ..StepWork::default()
    });
    let transfer = 32.0 * 0.4;
    let r = run_split(&plan, &split(1, 1, Disaggregation::Always));
    let expected = prefill + transfer + last_token;
    assert!(
        (r.ttft_ms.p50 - expected).abs() < 1e-6,
        "{} vs {expected}",
        r.ttft_ms.p50
    );
    assert!((pairs(&r).transfer_ms.p50 - transfer).abs() < 1e-9);
    assert!((pairs(&r).prefill_ms.p50 - prefill).abs() < 1e-6);
    // Free transfers take exactly the transfer out.
    let free = run_split(
        &plan,
        &SimSettings {
            kv_transfer_per_block: Duration::ZERO,
            ..split(1, 1, Disaggregation::Always)
        },
    );
    assert!((r.ttft_ms.p50 - free.ttft_ms.p50 - transfer).abs() < 1e-6);
    // Aggregated, the same request has no transfer and no second step.
    let agg = run_split(&plan, &split(1, 1, Disaggregation::Never));
    assert!((agg.ttft_ms.p50 - prefill).abs() < 1e-6, "{agg:?}");
    assert_eq!((pairs(&agg).paired, pairs(&agg).unpaired), (0, 1));
    // The decode worker streams its tokens at its own pace: 9 gaps of one decode step.
    let itl = r.itl_ms.unwrap();
    assert_eq!(itl.count, 9);
    assert!(itl.max < last_token + 1.0, "{itl:?}");
}

#[test]
fn conditional_keeps_a_mostly_cached_prompt_on_its_prefill_worker() {
    // Turn 1: 3 blocks, at most 1 cached (the shared one): disaggregated. Turn k ≥ 2: 2 new
    // blocks of 2k + 1, the rest on the prefill worker the KV-aware cost brings it back to:
    // under half uncached, so served there end to end.
    let plan = Plan::new(conversations(4, 4), 0, 1.0, None);
    let conditional = run_split(&plan, &split(2, 2, Disaggregation::Conditional));
    let always = run_split(&plan, &split(2, 2, Disaggregation::Always));
    for r in [&conditional, &always] {
        assert_eq!((r.completed, r.errors), (16, 0), "{r:?}");
    }
    assert_eq!(
        (pairs(&conditional).paired, pairs(&conditional).unpaired),
        (4, 12)
    );
    assert_eq!((pairs(&always).paired, pairs(&always).unpaired), (16, 0));
    // The later turns found their conversation where they left it either way.
    assert!(conditional.hit_rate > 0.5, "{conditional:?}");
    assert!((conditional.hit_rate - always.hit_rate).abs() < 1e-9);
    // Unpaired, a later turn skips the transfer and the decode worker's step.
    assert!(conditional.ttft_ms.p50 < always.ttft_ms.p50);
}

#[test]
fn a_disaggregated_run_is_a_pure_function_of_its_inputs_and_seed() {
    let plan = Plan::new(conversations(8, 4), 0, 1.0, None);
    for mode in [Disaggregation::Always, Disaggregation::Conditional] {
        let settings = SimSettings {
            routers: 2,
            ..split(2, 2, mode)
        };
        let a = simulated(run_split(&plan, &settings));
        assert_eq!((a.completed, a.errors), (32, 0), "{a:?}");
        assert_eq!(a, simulated(run_split(&plan, &settings)), "{mode:?}");
    }
}

mod adapters;
