//! The load view's rules: charges, reconciliation with reports, one charge per request.

use kvroute_common::messages::SchemaVersion;
use uuid::Uuid;

use super::*;
use crate::testing::decision;

fn view() -> LoadView {
    LoadView::new(LoadViewConfig {
        report_interval_ms: 1000,
        confirm_window_ms: 2000,
        prediction_max_age_ms: 60_000,
        predicted_overlap_ttl_ms: 0,
        approx_cache_ttl_ms: 120_000,
        models: Default::default(),
    })
}

fn lifecycle(worker_id: u64, request_id: Uuid, kind: LifecycleKind) -> RequestLifecycle {
    RequestLifecycle {
        v: SchemaVersion::CURRENT,
        request_id,
        worker_id,
        dp_rank: 0,
        kind,
        ts: 0,
    }
}

fn report(worker_id: u64, seq: u64, requests: u64) -> WorkerLoad {
    WorkerLoad {
        v: SchemaVersion::CURRENT,
        worker_id,
        dp_rank: 0,
        seq,
        active_prefill_tokens: 0,
        active_decode_blocks: 0,
        active_requests: requests,
        waiting_requests: 0,
        kv_used_blocks: 0,
        total_kv_blocks: 0,
        ts: 0,
        new_requests: None,
        adapters: None,
    }
}

/// A report taken at `ts` that names the requests it counts for the first time.
fn naming(worker_id: u64, seq: u64, requests: u64, ts: u64, new: &[Uuid]) -> WorkerLoad {
    WorkerLoad {
        ts,
        new_requests: Some(new.to_vec()),
        adapters: None,
        ..report(worker_id, seq, requests)
    }
}

const W: WorkerRank = WorkerRank {
    worker_id: 1,
    dp_rank: 0,
};

#[test]
fn decisions_add_and_lifecycle_events_remove_predicted_load() {
    let mut v = view();
    assert_eq!(v.load(W, 0), None);
    let r = Uuid::new_v4();
    let d = decision(1, r, 10, 160);
    assert_eq!(v.apply_decision(&d, 0), Applied::Added);
    assert_eq!(v.apply_decision(&d, 0), Applied::Duplicate);
    let l = v.load(W, 0).unwrap();
    assert_eq!(
        (
            l.active_prefill_tokens,
            l.active_decode_blocks,
            l.active_requests
        ),
        (160, 10, 1)
    );
    v.apply_lifecycle(
        &lifecycle(1, r, LifecycleKind::PrefillDone { cached_tokens: 0 }),
        0,
    );
    let l = v.load(W, 0).unwrap();
    assert_eq!((l.active_prefill_tokens, l.active_decode_blocks), (0, 10));
    v.apply_lifecycle(
        &lifecycle(1, r, LifecycleKind::Finished { output_tokens: 5 }),
        0,
    );
    // Nothing predicted and no report: nothing known.
    assert_eq!(v.load(W, 0), None);
}

#[test]
fn a_newer_report_drops_predictions_older_than_one_interval() {
    let mut v = view();
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 1_000);
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 2_500);
    assert!(v.apply_report(&report(1, 5, 3), 3_000));
    // The first prediction (2 s old) is in the report now; the second (0.5 s) is not yet.
    let l = v.load(W, 0).unwrap();
    assert_eq!((l.active_requests, l.active_decode_blocks), (4, 4));
    // A stale report changes nothing.
    assert!(!v.apply_report(&report(1, 4, 0), 9_000));
    assert_eq!(v.load(W, 0).unwrap().active_requests, 4);
    // A lost `finished`: gone with the next report after one interval.
    assert!(v.apply_report(&report(1, 6, 0), 3_600));
    assert_eq!(v.load(W, 0).unwrap().active_requests, 0);
}

#[test]
fn a_report_naming_a_request_takes_over_its_prediction_at_once() {
    // The worker reports every 200 ms and on change; the router assumes 1 s. Predictions of
    // requests the report names must not be counted on top of it.
    let mut v = view();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    v.apply_decision(&decision(1, a, 4, 64), 1_000);
    v.apply_decision(&decision(1, b, 4, 64), 1_005);
    assert!(v.apply_report(&naming(1, 1, 1, 1_010, &[a]), 1_010));
    // `a` is in the report (1 request); `b` has not reached the worker yet.
    assert_eq!(requests(&v, 1), Some(2));
    assert!(v.apply_report(&naming(1, 2, 2, 1_020, &[b]), 1_020));
    assert_eq!(requests(&v, 1), Some(2));
    // Unnamed predictions go after the confirm window, not before.
    let c = Uuid::new_v4();
    v.apply_decision(&decision(1, c, 4, 64), 2_000);
    assert!(v.apply_report(&naming(1, 3, 2, 3_900, &[]), 3_900));
    assert_eq!(requests(&v, 1), Some(3));
    assert!(v.apply_report(&naming(1, 4, 2, 4_100, &[]), 4_100));
    assert_eq!(requests(&v, 1), Some(2));
}

#[test]
fn a_report_naming_a_request_before_its_decision_keeps_the_decision_uncharged() {
    let r = Uuid::new_v4();
    let mut v = view();
    v.apply_report(&naming(1, 1, 1, 0, &[r]), 0);
    assert_eq!(
        v.apply_decision(&decision(1, r, 4, 64), 5),
        Applied::AlreadyCounted
    );
    assert_eq!(requests(&v, 1), Some(1));
}

#[test]
fn a_report_naming_a_request_charged_elsewhere_moves_it_to_the_report() {
    let r = Uuid::new_v4();
    let mut v = view();
    v.apply_decision(&decision(1, r, 4, 64), 0);
    v.apply_report(&naming(2, 1, 1, 0, &[r]), 1);
    assert_eq!((requests(&v, 1), requests(&v, 2)), (None, Some(1)));
    // Its `finished` at the new rank finds nothing left to remove.
    v.apply_lifecycle(
        &lifecycle(2, r, LifecycleKind::Finished { output_tokens: 1 }),
        2,
    );
    assert_eq!(v.predictions(), 0);
}

#[test]
fn reports_that_name_nothing_count_predictions_older_than_the_learned_interval() {
    let mut v = view();
    // Reports every 200 ms on the worker's clock (which is 1 h off the router's).
    let worker_clock = 3_600_000;
    for seq in 1..=4 {
        let ts = worker_clock + seq * 200;
        v.apply_report(&report_at(1, seq, 0, ts), seq * 200);
    }
    let old = Uuid::new_v4();
    let new = Uuid::new_v4();
    v.apply_decision(&decision(1, old, 4, 64), 700);
    v.apply_decision(&decision(1, new, 4, 64), 950);
    // At 1 000 ms the report counts `old` (300 ms old, more than 200) but not `new` (50 ms).
    v.apply_report(&report_at(1, 5, 1, worker_clock + 1_000), 1_000);
    assert_eq!(requests(&v, 1), Some(2));
    // A missed report doubles one gap, not the interval.
    v.apply_report(&report_at(1, 7, 2, worker_clock + 1_400), 1_400);
    assert_eq!(requests(&v, 1), Some(2));
}

#[test]
fn until_two_reports_show_the_interval_the_configured_one_holds() {
    let mut v = view();
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 10_000);
    v.apply_report(&report_at(1, 1, 0, 10_500), 10_500);
    assert_eq!(
        requests(&v, 1),
        Some(1),
        "the 1 s assumed holds for the first report"
    );
    v.apply_report(&report_at(1, 2, 0, 10_800), 10_800);
    assert_eq!(requests(&v, 1), Some(0), "300 ms learned from the second");
}

fn report_at(worker_id: u64, seq: u64, requests: u64, ts: u64) -> WorkerLoad {
    WorkerLoad {
        ts,
        ..report(worker_id, seq, requests)
    }
}

fn requests(v: &LoadView, worker_id: u64) -> Option<u64> {
    v.load(WorkerRank::new(worker_id, 0), 0)
        .map(|l| l.active_requests)
}

#[test]
fn a_retried_request_is_charged_once_to_its_later_attempt_in_any_order() {
    let r = Uuid::new_v4();
    let first = decision(1, r, 4, 64);
    let retry = Decision {
        attempt: 1,
        ..decision(2, r, 4, 64)
    };
    let mut a = view();
    assert_eq!(a.apply_decision(&first, 0), Applied::Added);
    assert_eq!(a.apply_decision(&retry, 5), Applied::Replaced);
    assert_eq!(a.apply_decision(&first, 6), Applied::Superseded);
    assert_eq!(a.apply_decision(&retry, 7), Applied::Duplicate);
    let mut b = view();
    assert_eq!(b.apply_decision(&retry, 0), Applied::Added);
    assert_eq!(b.apply_decision(&first, 1), Applied::Superseded);
    for v in [&a, &b] {
        assert_eq!((requests(v, 1), requests(v, 2)), (None, Some(1)));
        assert_eq!(v.predictions(), 1);
        assert_eq!(
            v.decided(&r).map(|d| d.decision_id),
            Some(retry.decision_id)
        );
    }
}

#[test]
fn two_decisions_of_one_attempt_keep_the_lower_decision_id() {
    let r = Uuid::new_v4();
    let mut x = decision(1, r, 4, 64);
    let mut y = decision(2, r, 4, 64);
    if x.decision_id > y.decision_id {
        std::mem::swap(&mut x.decision_id, &mut y.decision_id);
    }
    let mut a = view();
    a.apply_decision(&x, 0);
    assert_eq!(a.apply_decision(&y, 0), Applied::Superseded);
    let mut b = view();
    b.apply_decision(&y, 0);
    assert_eq!(b.apply_decision(&x, 0), Applied::Replaced);
    for v in [&a, &b] {
        assert_eq!((requests(v, 1), requests(v, 2)), (Some(1), None));
    }
}

#[test]
fn a_finished_request_is_not_charged_again_by_a_late_winning_decision() {
    let r = Uuid::new_v4();
    let mut v = view();
    v.apply_decision(&decision(1, r, 4, 64), 0);
    v.apply_lifecycle(
        &lifecycle(1, r, LifecycleKind::Finished { output_tokens: 1 }),
        0,
    );
    let late = Decision {
        attempt: 1,
        ..decision(2, r, 4, 64)
    };
    assert_eq!(v.apply_decision(&late, 10), Applied::Replaced);
    assert_eq!(v.predictions(), 0);
}

#[test]
fn a_lifecycle_event_from_another_rank_moves_the_charge_there() {
    let r = Uuid::new_v4();
    let mut v = view();
    v.apply_decision(&decision(1, r, 4, 64), 0);
    v.apply_lifecycle(
        &lifecycle(2, r, LifecycleKind::PrefillDone { cached_tokens: 0 }),
        0,
    );
    assert_eq!(requests(&v, 1), None);
    let l = v.load(WorkerRank::new(2, 0), 0).unwrap();
    assert_eq!((l.active_requests, l.active_prefill_tokens), (1, 0));
    v.apply_lifecycle(
        &lifecycle(2, r, LifecycleKind::Finished { output_tokens: 1 }),
        0,
    );
    assert_eq!(v.predictions(), 0);
}

#[test]
fn a_finished_event_before_its_decision_keeps_the_decision_uncharged() {
    let r = Uuid::new_v4();
    let mut v = view();
    v.apply_lifecycle(
        &lifecycle(1, r, LifecycleKind::Finished { output_tokens: 1 }),
        0,
    );
    assert_eq!(
        v.apply_decision(&decision(1, r, 4, 64), 10),
        Applied::AlreadyCounted
    );
    assert_eq!(v.predictions(), 0);
    assert!(v.decided(&r).is_some(), "a retry still gets the decision");
    // Remembered for a minute only.
    let late = Uuid::new_v4();
    v.apply_lifecycle(
        &lifecycle(1, late, LifecycleKind::Finished { output_tokens: 1 }),
        0,
    );
    v.expire(60_001);
    assert_eq!(
        v.apply_decision(&decision(1, late, 4, 64), 60_001),
        Applied::Added
    );
}

#[test]
fn predictions_up_to_a_reconnection_can_be_dropped() {
    let mut v = view();
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 1_000);
    // Applied in the millisecond of the reconnection: read from the dead connection.
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 2_000);
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 3_000);
    assert_eq!(v.forget_predictions_until(2_000), 2);
    assert_eq!(requests(&v, 1), Some(1));
}

#[test]
fn remembered_decisions_expire_with_the_prediction_age() {
    let mut v = view();
    let r = Uuid::new_v4();
    v.apply_decision(&decision(1, r, 4, 64), 1_000);
    v.expire(60_000);
    assert!(v.decided(&r).is_some());
    v.expire(61_001);
    assert!(v.decided(&r).is_none());
    assert_eq!(v.predictions(), 0);
}

#[test]
fn departed_workers_and_old_predictions_are_forgotten() {
    let mut v = view();
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 64), 0);
    v.apply_decision(&decision(2, Uuid::new_v4(), 4, 64), 50_000);
    v.remove_worker(1);
    assert_eq!(v.load(W, 0), None);
    v.expire(70_000);
    assert_eq!(v.predictions(), 1);
    v.expire(120_000);
    assert_eq!(v.predictions(), 0);
    assert_eq!(v.load(WorkerRank::new(2, 0), 0), None);
}

mod models;
