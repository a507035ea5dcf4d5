//! One test per eligibility rule, and the typed failure each produces.

use kvroute_common::messages::{DpRankRange, ErrorCode, Pin, SelectRequest, WorkerRole};

use super::*;
use crate::signals::{ObservedLoad, SignalSnapshot};
use crate::testing::{card, cards};

fn request() -> SelectRequest {
    SelectRequest {
        model: "m".to_owned(),
        ..SelectRequest::default()
    }
}

fn ranks(
    request: &SelectRequest,
    workers: &[WorkerCard],
    busy: &BusyThresholds,
    signals: &SignalSnapshot,
) -> Result<Vec<WorkerRank>, EligibilityError> {
    eligible_ranks(&Rules::from_request(request), workers, busy, signals)
        .map(|rows| rows.into_iter().map(|r| r.worker).collect())
}

fn open(
    request: &SelectRequest,
    workers: &[WorkerCard],
) -> Result<Vec<WorkerRank>, EligibilityError> {
    ranks(
        request,
        workers,
        &BusyThresholds::default(),
        &SignalSnapshot::new(),
    )
}

fn ids(ranks: &[WorkerRank]) -> Vec<u64> {
    ranks.iter().map(|r| r.worker_id).collect()
}

#[test]
fn model_and_role_must_match_or_there_are_no_workers() {
    let mut workers = cards(2);
    workers[1].role = WorkerRole::Decode;
    assert_eq!(ids(&open(&request(), &workers).unwrap()), [1]);
    let other_model = SelectRequest {
        model: "other".to_owned(),
        ..request()
    };
    let err = open(&other_model, &workers).unwrap_err();
    assert!(matches!(err, EligibilityError::NoWorkers { .. }));
    assert_eq!(err.code(), ErrorCode::NoWorkers);
}

#[test]
fn every_dp_rank_is_a_row() {
    let mut workers = cards(1);
    workers[0].dp_start_rank = 2;
    workers[0].dp_size = 3;
    let rows = open(&request(), &workers).unwrap();
    assert_eq!(
        rows,
        [
            WorkerRank::new(1, 2),
            WorkerRank::new(1, 3),
            WorkerRank::new(1, 4)
        ]
    );
}

#[test]
fn the_allow_list_restricts_workers() {
    let req = SelectRequest {
        allowed_workers: Some(vec![2, 3]),
        ..request()
    };
    assert_eq!(ids(&open(&req, &cards(3)).unwrap()), [2, 3]);
    let none = SelectRequest {
        allowed_workers: Some(vec![9]),
        ..request()
    };
    let err = open(&none, &cards(3)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::AllFiltered);
    assert_eq!(err.reasons().len(), 3);
    assert!(err.reasons()["1/0"].contains("allowed"));
    let empty = SelectRequest {
        allowed_workers: Some(Vec::new()),
        ..request()
    };
    assert_eq!(open(&empty, &cards(3)).unwrap().len(), 3, "empty list: all");
}

#[test]
fn a_pin_names_exactly_one_worker_and_rank() {
    let mut workers = cards(2);
    workers[1].dp_size = 2;
    let pin = |worker_id, dp_rank| SelectRequest {
        pin: Some(Pin { worker_id, dp_rank }),
        ..request()
    };
    assert_eq!(
        open(&pin(2, Some(1)), &workers).unwrap(),
        [WorkerRank::new(2, 1)]
    );
    assert_eq!(open(&pin(2, None), &workers).unwrap().len(), 2);
    let err = open(&pin(2, Some(5)), &workers).unwrap_err();
    assert_eq!(err.code(), ErrorCode::PinnedUnavailable);
    let err = open(&pin(7, None), &workers).unwrap_err();
    assert!(matches!(
        err,
        EligibilityError::PinnedUnavailable { reason: None, .. }
    ));
    let mut tainted = pin(1, None);
    workers[0].taints = vec!["gpu-h100".to_owned()];
    tainted.allowed_workers = None;
    let err = open(&tainted, &workers).unwrap_err();
    assert!(matches!(
        err,
        EligibilityError::PinnedUnavailable {
            reason: Some(Ineligible::UntoleratedTaint { .. }),
            ..
        }
    ));
    assert_eq!(err.reasons().len(), 1);
}

#[test]
fn dp_rank_bounds_are_inclusive() {
    let mut workers = cards(1);
    workers[0].dp_size = 4;
    let req = SelectRequest {
        dp_rank_range: Some(DpRankRange { min: 1, max: 2 }),
        ..request()
    };
    assert_eq!(
        open(&req, &workers).unwrap(),
        [WorkerRank::new(1, 1), WorkerRank::new(1, 2)]
    );
}

#[test]
fn required_taints_must_all_be_present() {
    let mut workers = cards(3);
    workers[0].taints = vec!["a".into(), "b".into()];
    workers[1].taints = vec!["a".into()];
    let req = SelectRequest {
        required_taints: vec!["a".into(), "b".into()],
        ..request()
    };
    assert_eq!(ids(&open(&req, &workers).unwrap()), [1]);
    let req = SelectRequest {
        required_taints: vec!["c".into()],
        ..request()
    };
    let err = open(&req, &workers).unwrap_err();
    assert!(err.reasons()["3/0"].contains("missing required taint"));
}

#[test]
fn a_taint_must_be_tolerated_or_required() {
    let mut workers = cards(3);
    workers[0].taints = vec!["spot".into()];
    workers[1].taints = vec!["spot".into(), "eu".into()];
    assert_eq!(ids(&open(&request(), &workers).unwrap()), [3]);
    let tolerant = SelectRequest {
        tolerated_taints: vec!["spot".into()],
        ..request()
    };
    assert_eq!(ids(&open(&tolerant, &workers).unwrap()), [1, 3]);
    let both = SelectRequest {
        tolerated_taints: vec!["spot".into()],
        required_taints: vec!["eu".into()],
        ..request()
    };
    assert_eq!(ids(&open(&both, &workers).unwrap()), [2]);
}

#[test]
fn busy_ranks_are_skipped_and_all_busy_is_overloaded() {
    let workers = cards(2);
    let busy = BusyThresholds {
        decode_blocks_fraction: Some(0.5),
        prefill_tokens: Some(PrefillLimit::Tokens(100)),
    };
    let hot = ObservedLoad {
        active_decode_blocks: 900,
        ..Default::default()
    };
    let prefilling = ObservedLoad {
        active_prefill_tokens: 101,
        ..Default::default()
    };
    let signals = SignalSnapshot::new().with_load(WorkerRank::new(1, 0), hot);
    assert_eq!(
        ids(&ranks(&request(), &workers, &busy, &signals).unwrap()),
        [2]
    );
    let signals = signals.with_load(WorkerRank::new(2, 0), prefilling);
    let err = ranks(&request(), &workers, &busy, &signals).unwrap_err();
    assert_eq!(err.code(), ErrorCode::AllOverloaded);
    assert!(err.reasons()["2/0"].contains("prefill"));
    let mut only_one = cards(1);
    only_one[0].taints = vec!["x".into()];
    only_one.push(card(2));
    let err = ranks(&request(), &only_one, &busy, &signals).unwrap_err();
    assert_eq!(
        err.code(),
        ErrorCode::AllOverloaded,
        "overloaded wins when every rule-passing rank is busy"
    );
}

#[test]
fn a_request_for_an_adapter_goes_only_where_the_card_lists_it() {
    let with = |id: u64, adapters: Option<&[&str]>| WorkerCard {
        lora_adapters: adapters.map(|a| a.iter().map(|s| s.to_string()).collect()),
        ..crate::testing::card(id)
    };
    let cards = vec![
        with(1, Some(&["sql"])),
        with(2, Some(&["sql", "poem"])),
        with(3, None),
        with(4, Some(&[])),
    ];
    let ids = |request: &SelectRequest| open(request, &cards).map(|r| self::ids(&r));
    let mut request = request();
    assert_eq!(ids(&request).unwrap(), [1, 2, 3, 4], "the base model: all");
    request.lora_name = Some("poem".into());
    assert_eq!(ids(&request).unwrap(), [2, 3], "listed, or not known");
    request.lora_name = Some("sql".into());
    assert_eq!(ids(&request).unwrap(), [1, 2, 3]);
    request.lora_name = Some(String::new());
    assert_eq!(ids(&request).unwrap(), [1, 2, 3, 4], "empty: none named");
    request.lora_name = Some("poem".into());
    request.pin = Some(Pin {
        worker_id: 1,
        dp_rank: None,
    });
    assert_eq!(
        ids(&request).unwrap_err(),
        EligibilityError::PinnedUnavailable {
            target: WorkerTarget {
                worker_id: 1,
                dp_rank: None
            },
            reason: Some(Ineligible::AdapterNotServed),
        }
    );
    request.pin = None;
    request.allowed_workers = Some(vec![1, 4]);
    let Err(EligibilityError::AllFiltered { reasons }) = ids(&request) else {
        panic!("all filtered")
    };
    assert_eq!(
        reasons[0],
        (WorkerRank::new(1, 0), Ineligible::AdapterNotServed)
    );
}
