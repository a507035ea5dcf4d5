//! Selection scenarios through the entry point: cache affinity, load spreading, sampling,
//! exact targets and wire-error mapping.

use kvroute_common::messages::{ErrorCode, Pin, SelectRequest, WorkerCard};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::policies::default::DefaultPolicyParameters;
use crate::policies::pickers::softmax_probabilities;
use crate::signals::{ObservedLoad, SignalSnapshot};
use crate::testing::cards;

pub(crate) fn request() -> SelectRequest {
    SelectRequest {
        model: "m".to_owned(),
        ..SelectRequest::default()
    }
}

pub(crate) fn input<'a>(
    request: &'a SelectRequest,
    workers: &'a [WorkerCard],
    signals: &'a SignalSnapshot,
    settings: &'a SelectionSettings,
) -> SelectInput<'a> {
    SelectInput {
        request,
        request_blocks: 10,
        block_size: 16,
        workers,
        signals,
        settings,
    }
}

fn device(blocks: u32) -> Overlap {
    Overlap {
        device: blocks,
        ..Overlap::default()
    }
}

fn decode(blocks: u64) -> ObservedLoad {
    ObservedLoad {
        active_decode_blocks: blocks,
        ..ObservedLoad::default()
    }
}

fn open() -> SessionRoute {
    SessionRoute::Open { affinity: None }
}

#[test]
fn a_request_goes_to_the_worker_holding_its_prefix() {
    let workers = cards(4);
    let signals = SignalSnapshot::new().with_overlap(WorkerRank::new(3, 0), device(8));
    let settings = SelectionSettings::default();
    let req = request();
    let mut policy = DefaultPolicyParameters::default().policy();
    let mut rng = StdRng::seed_from_u64(0);
    let s = select_worker(
        &input(&req, &workers, &signals, &settings),
        &mut policy,
        open(),
        &mut rng,
    )
    .unwrap();
    assert_eq!(s.worker, WorkerRank::new(3, 0));
    assert_eq!(s.overlap.unwrap().device, 8);
    // prefill_load_scale 64 × (10 request blocks − 8 cached) + 10 decode blocks.
    assert_eq!(s.cost.total, 138.0);
    assert_eq!(s.cost.terms["prefill"], 128.0);
    assert_eq!(s.cost.terms["decode"], 10.0);
    assert_eq!(s.policy, "default");
    assert_eq!(s.path, SelectionPath::Policy);
    assert_eq!(s.request_subject, "worker.3");
}

#[test]
fn equal_overlap_spreads_by_load() {
    let workers = cards(3);
    let settings = SelectionSettings::default();
    let req = request();
    let mut policy = DefaultPolicyParameters::default().policy();
    let mut rng = StdRng::seed_from_u64(0);
    let mut signals = SignalSnapshot::new();
    for w in 1..=3 {
        signals = signals.with_overlap(WorkerRank::new(w, 0), device(4));
    }
    // Place requests one by one, charging each pick's decode blocks to its worker.
    let mut load = [0u64; 3];
    for _ in 0..9 {
        let mut snap = signals.clone();
        for w in 1..=3u64 {
            snap = snap.with_load(WorkerRank::new(w, 0), decode(load[w as usize - 1]));
        }
        let s = select_worker(
            &input(&req, &workers, &snap, &settings),
            &mut policy,
            open(),
            &mut rng,
        )
        .unwrap();
        load[s.worker.worker_id as usize - 1] += 10;
    }
    assert_eq!(load, [30, 30, 30]);
}

/// The worker each of `draws` selections picks, with generator `seed`.
fn picks(
    parameters: DefaultPolicyParameters,
    signals: &SignalSnapshot,
    seed: u64,
    draws: usize,
) -> Vec<u64> {
    let workers = cards(3);
    let settings = SelectionSettings::default();
    let req = request();
    let mut policy = parameters.policy();
    let mut rng = StdRng::seed_from_u64(seed);
    (0..draws)
        .map(|_| {
            select_worker(
                &input(&req, &workers, signals, &settings),
                &mut policy,
                open(),
                &mut rng,
            )
            .unwrap()
            .worker
            .worker_id
        })
        .collect()
}

#[test]
fn ties_go_to_a_random_tied_worker_reproducibly() {
    // Workers 2 and 3 tie at the lowest cost; worker 1 carries decode load.
    let signals = SignalSnapshot::new().with_load(WorkerRank::new(1, 0), decode(5));
    let defaults = DefaultPolicyParameters::default();
    let a = picks(defaults, &signals, 7, 200);
    assert!(!a.contains(&1), "a costlier worker is never a tie");
    let twos = a.iter().filter(|w| **w == 2).count();
    assert!(
        (60..=140).contains(&twos),
        "both tied workers are picked: {twos}/200"
    );
    assert_eq!(
        a,
        picks(defaults, &signals, 7, 200),
        "same seed, same picks"
    );
    assert_ne!(
        a,
        picks(defaults, &signals, 8, 200),
        "another seed, other picks"
    );

    // Cost 650 against 655 (64 × 10 prefill + 10 decode, + 5 decode): a tie only within a
    // tolerance above 5 / 650 ≈ 0.77 %.
    let tolerant = DefaultPolicyParameters {
        tie_tolerance: 0.01,
        ..defaults
    };
    assert!(picks(tolerant, &signals, 7, 200).contains(&1));
    let narrow = DefaultPolicyParameters {
        tie_tolerance: 0.005,
        ..defaults
    };
    assert!(!picks(narrow, &signals, 7, 200).contains(&1));
}

#[test]
fn temperature_samples_in_proportion_to_the_softmax() {
    let workers = cards(3);
    let settings = SelectionSettings::default();
    let req = request();
    // Credit 1: costs 650, 330, 10 (no load): normalized 1, 0.5, 0.
    let signals = SignalSnapshot::new()
        .with_overlap(WorkerRank::new(2, 0), device(5))
        .with_overlap(WorkerRank::new(3, 0), device(10));
    let parameters = DefaultPolicyParameters {
        temperature: 0.5,
        overlap_score_credit: 1.0,
        ..DefaultPolicyParameters::default()
    };
    let mut policy = parameters.policy();
    let mut rng = StdRng::seed_from_u64(42);
    let n = 20_000;
    let mut observed = [0f64; 3];
    for _ in 0..n {
        let s = select_worker(
            &input(&req, &workers, &signals, &settings),
            &mut policy,
            open(),
            &mut rng,
        )
        .unwrap();
        observed[s.worker.worker_id as usize - 1] += 1.0;
    }
    let expected: Vec<f64> = softmax_probabilities(&[20.0, 15.0, 10.0], 0.5)
        .into_iter()
        .map(|p| p * n as f64)
        .collect();
    let chi_square: f64 = observed
        .iter()
        .zip(&expected)
        .map(|(o, e)| (o - e).powi(2) / e)
        .sum();
    // 2 degrees of freedom: P(χ² > 13.8) = 0.001.
    assert!(
        chi_square < 13.8,
        "χ² = {chi_square}, {observed:?} vs {expected:?}"
    );
    assert!(observed[0] > 0.0, "the worst worker is still sampled");

    // A per-request override of 0 makes the same policy deterministic.
    let cold = SelectRequest {
        temperature: Some(0.0),
        ..request()
    };
    for _ in 0..50 {
        let s = select_worker(
            &input(&cold, &workers, &signals, &settings),
            &mut policy,
            open(),
            &mut rng,
        )
        .unwrap();
        assert_eq!(s.worker.worker_id, 3);
    }
}

#[test]
fn a_pin_takes_the_exact_path_and_bypasses_cost() {
    let workers = cards(3);
    let settings = SelectionSettings::default();
    let signals = SignalSnapshot::new().with_overlap(WorkerRank::new(3, 0), device(10));
    let req = SelectRequest {
        pin: Some(Pin {
            worker_id: 1,
            dp_rank: None,
        }),
        ..request()
    };
    let mut policy = DefaultPolicyParameters::default().policy();
    let mut rng = StdRng::seed_from_u64(0);
    let s = select_worker(
        &input(&req, &workers, &signals, &settings),
        &mut policy,
        open(),
        &mut rng,
    )
    .unwrap();
    assert_eq!((s.worker.worker_id, s.path), (1, SelectionPath::Exact));
    assert_eq!(s.cost.total, 64.0 * 10.0 + 10.0);
}

#[test]
fn failures_map_onto_wire_codes_with_reasons() {
    let workers = cards(2);
    let settings = SelectionSettings::default();
    let signals = SignalSnapshot::new();
    let mut policy = DefaultPolicyParameters::default().policy();
    let mut rng = StdRng::seed_from_u64(0);
    let mut run = |req: &SelectRequest| {
        select_worker(
            &input(req, &workers, &signals, &settings),
            &mut policy,
            open(),
            &mut rng,
        )
        .unwrap_err()
    };
    let none = run(&SelectRequest {
        model: "x".into(),
        ..request()
    });
    assert_eq!(none.to_select_error(None).code, ErrorCode::NoWorkers);
    let filtered = run(&SelectRequest {
        required_taints: vec!["gpu".into()],
        ..request()
    });
    let wire = filtered.to_select_error(None);
    assert_eq!(wire.code, ErrorCode::AllFiltered);
    assert_eq!(wire.reasons.len(), 2);
    let hot = run(&SelectRequest {
        temperature: Some(f64::NAN),
        ..request()
    });
    assert_eq!(hot.code(), ErrorCode::BadRequest);
}

#[test]
fn a_policy_without_cache_inputs_reports_no_overlap() {
    let workers = cards(2);
    let settings = SelectionSettings::default();
    let signals = SignalSnapshot::new().with_overlap(WorkerRank::new(2, 0), device(10));
    let req = request();
    let mut policy = crate::policies::tests::build(crate::policies::least_busy::provider, "");
    let mut rng = StdRng::seed_from_u64(0);
    let s = select_worker(
        &input(&req, &workers, &signals, &settings),
        &mut policy,
        open(),
        &mut rng,
    )
    .unwrap();
    assert_eq!(s.overlap, None);
    let reply = crate::decide::wire::reply(
        &s,
        Default::default(),
        Default::default(),
        10,
        "r1",
        Default::default(),
    );
    assert!(reply.overlap_blocks.is_empty());
    assert_eq!(reply.cost.terms["active_requests"], 0.0);
}
