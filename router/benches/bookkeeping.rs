//! What one selection costs the service besides the policy and the network: charging the
//! decision to the load view (which also remembers it by request id), looking the request id
//! up for a retry, the `finished` that ends it, and the watchdog's in-flight entry. Run with
//! `cargo bench -p kvroute-router --bench bookkeeping`; BENCHMARKS.md compares it with the
//! ~150 µs a selection costs in all.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvroute_common::messages::{
    CostBreakdown, Decision, LifecycleKind, RequestLifecycle, SchemaVersion,
};
use kvroute_common::ops::InFlight;
use kvroute_router::decide::load_view::{LoadView, LoadViewConfig};
use uuid::Uuid;

fn decision(i: u64) -> Decision {
    Decision {
        v: SchemaVersion::CURRENT,
        decision_id: Uuid::from_u128(u128::from(i) << 64 | 1),
        request_id: Uuid::from_u128(u128::from(i)),
        router_id: "router-1".into(),
        model: "model".into(),
        role: Default::default(),
        worker_id: i % 16,
        dp_rank: 0,
        session_id: None,
        request_blocks: 128,
        overlap_blocks: 100,
        prefill_tokens: 1792,
        expected_output_tokens: Some(200),
        block_size: 16,
        cost: CostBreakdown {
            total: 1.0,
            terms: [("default".to_owned(), 1.0)].into(),
        },
        policy: "default".into(),
        binding: None,
        ts: 0,
        attempt: 0,
        prefix_hashes: Vec::new(),
        decode: None,
        lora_name: None,
    }
}

fn view() -> LoadView {
    LoadView::new(LoadViewConfig {
        report_interval_ms: 1000,
        confirm_window_ms: 2000,
        prediction_max_age_ms: 600_000,
        predicted_overlap_ttl_ms: 2_000,
        approx_cache_ttl_ms: 120_000,
        models: Default::default(),
    })
}

fn bench(c: &mut Criterion) {
    // A view already remembering 65,536 decisions (its cap), so inserts also evict.
    let warm = || {
        let mut v = view();
        for i in 0..65_536 {
            v.apply_decision(&decision(i), 0);
        }
        v
    };
    let next: Vec<Decision> = (1_000_000..1_001_000).map(decision).collect();
    c.bench_function("one request: decided? + charge + finished (x1000)", |b| {
        b.iter_batched_ref(
            warm,
            |v| {
                for d in &next {
                    black_box(v.decided(&d.request_id));
                    v.apply_decision(d, 1);
                    v.apply_lifecycle(
                        &RequestLifecycle {
                            v: SchemaVersion::CURRENT,
                            request_id: d.request_id,
                            worker_id: d.worker_id,
                            dp_rank: 0,
                            kind: LifecycleKind::Finished { output_tokens: 1 },
                            ts: 0,
                        },
                        2,
                    );
                }
            },
            BatchSize::LargeInput,
        )
    });
    let in_flight = InFlight::new();
    let _others: Vec<_> = (0..8).map(|_| in_flight.enter()).collect();
    c.bench_function("in-flight entry: enter + drop", |b| {
        b.iter(|| drop(black_box(in_flight.enter())))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
