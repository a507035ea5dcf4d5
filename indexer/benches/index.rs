//! Criterion benches of the radix index on the Mooncake conversation trace (see
//! `kvroute_indexer::workload`). The side-by-side table with peers, with p50 / p99 latencies,
//! is `bench/peers` (BENCHMARKS.md). Run: `cargo bench -p kvroute-indexer --features workload`.

use std::hint::black_box;
use std::path::Path;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_common::trace::read_trace;
use kvroute_indexer::workload::{Workload, WorkloadConfig, build};
use kvroute_indexer::{IndexConfig, RadixIndex};

fn workload(workers: usize, cache_blocks: usize) -> Workload {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/conversation_trace.jsonl");
    let trace = read_trace(&path).expect("traces in ../shared/traces");
    build(
        &trace,
        &WorkloadConfig {
            workers,
            block_size: 16,
            cache_blocks,
            max_requests: usize::MAX,
        },
    )
}

fn replay(w: &Workload) -> RadixIndex {
    let mut ix = RadixIndex::new(IndexConfig::default());
    for e in &w.events {
        let _ = ix.apply(e.worker_id, 0, &e.data);
    }
    ix
}

fn benches(c: &mut Criterion) {
    let big = workload(16, 131_072);
    let mut g = c.benchmark_group("apply");
    g.sample_size(10);
    g.throughput(Throughput::Elements(big.block_events));
    g.bench_function("conversation_16w_bs16", |b| {
        b.iter(|| black_box(replay(&big)))
    });
    g.finish();

    let full = replay(&big);
    eprintln!(
        "entries {} nodes {} bytes/entry {:.1}",
        full.len(),
        full.stats().nodes,
        full.stats().bytes_in_use as f64 / full.len() as f64
    );
    let mut g = c.benchmark_group("snapshot");
    g.sample_size(10);
    g.bench_function("write_2m", |b| b.iter(|| black_box(full.snapshot())));
    let bytes = full.snapshot();
    g.bench_function("restore_2m", |b| {
        b.iter_batched(
            || (),
            |()| black_box(RadixIndex::restore(&bytes).unwrap()),
            BatchSize::PerIteration,
        )
    });
    g.finish();
    drop(full);

    let mut g = c.benchmark_group("find_matches");
    for workers in [16usize, 256, 1024] {
        let w = workload(workers, 32_768);
        let ix = replay(&w);
        let typical: Vec<_> = w
            .queries
            .iter()
            .filter(|q| q.len() < 1000)
            .cloned()
            .collect();
        let long: Vec<_> = w
            .queries
            .iter()
            .filter(|q| q.len() >= 1000)
            .cloned()
            .collect();
        for (name, qs) in [("typical", typical), ("long", long)] {
            if qs.is_empty() {
                continue;
            }
            let mut i = 0;
            g.bench_function(format!("{workers}w_{name}"), |b| {
                b.iter(|| {
                    i = (i + 1) % qs.len();
                    black_box(ix.find_matches(&qs[i]))
                })
            });
        }
    }
    g.finish();
}

criterion_group!(index, benches);
criterion_main!(index);
