//! The load models against routing-concepts' formulas: output blocks (with and without an
//! expected output length, counted as generation crosses block boundaries) and the decay of a
//! rank's oldest prefill (at a configured rate, and at a rate fitted from observed prefills).

use super::*;
use crate::decide::load_view::models::{
    DEFAULT_PREFILL_TOKENS_PER_SEC, PrefillLoadModel, PrefillRate, output_milliblocks,
    remaining_prefill,
};

fn with_models(models: LoadModels) -> LoadView {
    LoadView::new(LoadViewConfig {
        models,
        ..view().config
    })
}

fn tracking() -> LoadView {
    with_models(LoadModels {
        track_output_blocks: true,
        ..LoadModels::OFF
    })
}

fn decaying(tokens_per_sec: Option<u64>) -> LoadView {
    with_models(LoadModels {
        prefill: PrefillLoadModel::Decay { tokens_per_sec },
        ..LoadModels::OFF
    })
}

fn progress(request_id: Uuid, output_tokens: u64) -> RequestLifecycle {
    lifecycle(1, request_id, LifecycleKind::Progress { output_tokens })
}

fn output_blocks(v: &LoadView) -> Option<f64> {
    v.load(W, 0).map(|l| l.output_blocks)
}

fn prefill(v: &LoadView, now_ms: u64) -> Option<u64> {
    v.load(W, now_ms).map(|l| l.active_prefill_tokens)
}

#[test]
fn output_blocks_are_full_blocks_weighted_by_the_output_still_expected() {
    // No expected length: floor(output / block size) at full weight.
    assert_eq!(output_milliblocks(63, 64, None), 0);
    assert_eq!(output_milliblocks(64, 64, None), 1_000);
    assert_eq!(output_milliblocks(200, 64, None), 3_000);
    assert_eq!(
        output_milliblocks(200, 64, Some(0)),
        3_000,
        "0: no expectation"
    );
    // Expected 256: weight 1 − output / 256.
    assert_eq!(output_milliblocks(64, 64, Some(256)), 750);
    assert_eq!(output_milliblocks(128, 64, Some(256)), 1_000);
    assert_eq!(output_milliblocks(192, 64, Some(256)), 750);
    assert_eq!(output_milliblocks(256, 64, Some(256)), 0);
    assert_eq!(
        output_milliblocks(400, 64, Some(256)),
        0,
        "past the expectation"
    );
    assert_eq!(output_milliblocks(640, 0, None), 0, "unknown block size");
}

#[test]
fn progress_adds_output_blocks_as_generation_crosses_block_boundaries() {
    let mut v = tracking();
    let r = Uuid::new_v4();
    // Block size 16, no expected output length.
    v.apply_decision(&decision(1, r, 10, 160), 0);
    assert_eq!(output_blocks(&v), Some(0.0));
    v.apply_lifecycle(&progress(r, 15), 1);
    assert_eq!(output_blocks(&v), Some(0.0), "no boundary crossed yet");
    v.apply_lifecycle(&progress(r, 16), 2);
    assert_eq!(output_blocks(&v), Some(1.0));
    v.apply_lifecycle(&progress(r, 40), 3);
    assert_eq!(output_blocks(&v), Some(2.0));
    v.apply_lifecycle(&progress(r, 20), 4);
    assert_eq!(
        output_blocks(&v),
        Some(2.0),
        "an older event changes nothing"
    );
    let l = v.load(W, 4).unwrap();
    assert_eq!((l.active_decode_blocks, l.decode_blocks()), (10, 12.0));
    // Generating output, the request is past its prefill even if `prefill_done` was lost.
    assert_eq!(l.active_prefill_tokens, 0);
    v.apply_lifecycle(
        &lifecycle(1, r, LifecycleKind::Finished { output_tokens: 50 }),
        5,
    );
    assert_eq!(v.load(W, 5), None, "finished removes everything");
}

#[test]
fn an_expected_output_length_weights_the_blocks_by_what_is_left() {
    let mut v = tracking();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    v.apply_decision(
        &Decision {
            expected_output_tokens: Some(64),
            ..decision(1, a, 4, 64)
        },
        0,
    );
    v.apply_decision(&decision(1, b, 4, 64), 0);
    v.apply_lifecycle(&progress(a, 32), 1);
    v.apply_lifecycle(&progress(b, 32), 1);
    // a: 2 blocks × (1 − 32/64); b: 2 blocks at full weight.
    assert_eq!(output_blocks(&v), Some(3.0));
    v.apply_lifecycle(&progress(a, 64), 2);
    assert_eq!(output_blocks(&v), Some(2.0), "a is at its expected length");
    // A report naming them takes both over, output blocks included.
    v.apply_report(&naming(1, 1, 2, 3, &[a, b]), 3);
    assert_eq!(output_blocks(&v), Some(0.0));
}

#[test]
fn without_output_block_tracking_progress_is_ignored() {
    let mut v = view();
    let r = Uuid::new_v4();
    v.apply_decision(&decision(1, r, 10, 160), 0);
    v.apply_lifecycle(&progress(r, 64), 1);
    let l = v.load(W, 1).unwrap();
    assert_eq!((l.output_blocks, l.active_prefill_tokens), (0.0, 160));
}

#[test]
fn the_oldest_prefill_decays_linearly_from_its_decision() {
    assert_eq!(remaining_prefill(1_000, 0, 1_000.0), 1_000);
    assert_eq!(remaining_prefill(1_000, 300, 1_000.0), 700);
    assert_eq!(remaining_prefill(1_000, 1_000, 1_000.0), 0);
    assert_eq!(remaining_prefill(1_000, 5_000, 1_000.0), 0);
    let mut v = decaying(Some(1_000));
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    v.apply_decision(&decision(1, a, 4, 1_000), 0);
    v.apply_decision(&decision(1, b, 4, 500), 100);
    assert_eq!(prefill(&v, 100), Some(1_400));
    assert_eq!(prefill(&v, 300), Some(1_200));
    // Only the oldest decays: a reaches 0 at 1 s (its predicted duration), b waits.
    assert_eq!(prefill(&v, 1_000), Some(500));
    assert_eq!(prefill(&v, 2_000), Some(500));
    // a's prefill is done; b is the oldest now, decaying from its own decision (100 ms).
    v.apply_lifecycle(
        &lifecycle(1, a, LifecycleKind::PrefillDone { cached_tokens: 0 }),
        400,
    );
    assert_eq!(prefill(&v, 400), Some(200));
    assert_eq!(prefill(&v, 600), Some(0));
    // The full model holds everything until `prefill_done`.
    let mut full = view();
    full.apply_decision(&decision(1, a, 4, 1_000), 0);
    assert_eq!(prefill(&full, 5_000), Some(1_000));
}

#[test]
fn the_prefill_rate_is_a_ratio_of_weighted_sums_within_bounds() {
    let mut rate = PrefillRate::default();
    assert_eq!(
        rate.tokens_per_sec(DEFAULT_PREFILL_TOKENS_PER_SEC),
        DEFAULT_PREFILL_TOKENS_PER_SEC as f64
    );
    rate.observe(0, 500);
    assert!(!rate.is_fitted(), "nothing to prefill: nothing learned");
    rate.observe(1_000, 100);
    assert_eq!(rate.tokens_per_sec(0), 10_000.0);
    // Tokens 1 000 + (1 000 − 1 000)/8, ms 100 + (500 − 100)/8 = 150.
    rate.observe(1_000, 500);
    assert!((rate.tokens_per_sec(0) - 1e6 / 150.0).abs() < 1e-9);
    let mut instant = PrefillRate::default();
    instant.observe(64, 0);
    assert_eq!(instant.tokens_per_sec(0), 10_000_000.0, "the ceiling");
    let mut slow = PrefillRate::default();
    slow.observe(1, 60_000);
    assert_eq!(slow.tokens_per_sec(0), 100.0, "the floor");
}

#[test]
fn the_decay_rate_is_fitted_per_rank_from_decision_to_prefill_done() {
    let mut v = decaying(None);
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    v.apply_decision(&decision(1, a, 4, 2_000), 1_000);
    // Before any observation, the default rate: 10 000 tokens/s.
    assert_eq!(prefill(&v, 1_100), Some(1_000));
    // 2 000 tokens prefilled 400 ms after the decision: 5 000 tokens/s; a second
    // `prefill_done` of the same request teaches nothing.
    let done = lifecycle(1, a, LifecycleKind::PrefillDone { cached_tokens: 0 });
    v.apply_lifecycle(&done, 1_400);
    v.apply_lifecycle(&done, 9_000);
    v.apply_decision(&decision(1, b, 4, 1_000), 10_000);
    assert_eq!(prefill(&v, 10_100), Some(500));
    // Another rank has learned nothing yet.
    v.apply_decision(&decision(2, Uuid::new_v4(), 4, 1_000), 10_000);
    let other = v.load(WorkerRank::new(2, 0), 10_050).unwrap();
    assert_eq!(other.active_prefill_tokens, 500);
    // The fit outlives the rank's predictions.
    v.apply_lifecycle(
        &lifecycle(1, b, LifecycleKind::Finished { output_tokens: 1 }),
        10_200,
    );
    v.expire(20_000);
    v.apply_decision(&decision(1, Uuid::new_v4(), 4, 1_000), 30_000);
    assert_eq!(prefill(&v, 30_100), Some(500));
}
