//! Profiling harness (not a benchmark): `cargo run --release -p kvroute-indexer --features
//! workload --example prof -- [apply|query] [workers] [cache_blocks] [max_requests]`.

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a benchmark measures wall time"
)]
use std::time::Instant;

use kvroute_common::messages::KvEventData;
use kvroute_common::trace::read_trace;
use kvroute_indexer::workload::{WorkloadConfig, build, rss_bytes};
use kvroute_indexer::{IndexConfig, RadixIndex};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("apply", String::as_str).to_string();
    let workers: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);
    let cache: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(131_072);
    let max_requests: usize = args
        .get(4)
        .and_then(|s| s.parse().ok())
        .unwrap_or(usize::MAX);
    let trace = read_trace(std::path::Path::new(
        "/work/shared/traces/conversation_trace.jsonl",
    ))
    .unwrap();
    let w = build(
        &trace,
        &WorkloadConfig {
            workers,
            block_size: 16,
            cache_blocks: cache,
            max_requests,
        },
    );
    let events: &[_] = if mode == "query" {
        &w.events[..w.events.len() / 2]
    } else {
        &w.events
    };
    let rss_before = rss_bytes();
    let t = Instant::now();
    let mut ix = RadixIndex::new(IndexConfig::default());
    // Time per kind of event, too (stored and removed blocks cost differently).
    let (mut stored, mut removed) = ((0f64, 0u64), (0f64, 0u64));
    for e in events {
        let start = Instant::now();
        let _ = ix.apply(e.worker_id, 0, &e.data);
        let d = start.elapsed().as_secs_f64();
        match &e.data {
            KvEventData::Stored { blocks, .. } => {
                stored.0 += d;
                stored.1 += blocks.len() as u64;
            }
            KvEventData::Removed { block_hashes, .. } => {
                removed.0 += d;
                removed.1 += block_hashes.len() as u64;
            }
            KvEventData::Cleared => {}
        }
    }
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "stored {:.1} ns/block ({} blocks), removed {:.1} ns/block ({} blocks)",
        stored.0 * 1e9 / stored.1.max(1) as f64,
        stored.1,
        removed.0 * 1e9 / removed.1.max(1) as f64,
        removed.1
    );
    let st = ix.stats();
    eprintln!(
        "apply: {:.2} M block events/s ({} events) entries {} blocks {} runs {} bytes/entry {:.1}",
        (stored.1 + removed.1) as f64 / secs / 1e6,
        events.len(),
        ix.len(),
        st.nodes,
        st.runs,
        st.bytes_in_use as f64 / ix.len().max(1) as f64
    );
    eprintln!(
        "RSS growth while applying: {:.1} MB, {:.2} B/entry",
        (rss_bytes() - rss_before) as f64 / 1e6,
        (rss_bytes() - rss_before) as f64 / ix.len().max(1) as f64
    );
    for (part, bytes) in ix.memory_parts() {
        eprintln!(
            "  {part}: {:.1} MB, {:.2} B/entry",
            bytes as f64 / 1e6,
            bytes as f64 / ix.len().max(1) as f64
        );
    }
    if mode == "query" {
        let mut lat: Vec<(u64, usize)> = Vec::new();
        for _ in 0..3 {
            for q in &w.queries {
                let t = Instant::now();
                std::hint::black_box(ix.find_matches(q));
                lat.push((t.elapsed().as_nanos() as u64, q.len()));
            }
        }
        for long in [false, true] {
            let mut v: Vec<u64> = lat
                .iter()
                .filter(|x| (x.1 >= 1000) == long)
                .map(|x| x.0)
                .collect();
            v.sort_unstable();
            if v.is_empty() {
                continue;
            }
            let p = |f: f64| v[((v.len() - 1) as f64 * f) as usize] as f64 / 1e3;
            eprintln!(
                "long={long} n={} p50 {:.2} p99 {:.2} max {:.2} µs",
                v.len(),
                p(0.5),
                p(0.99),
                p(1.0)
            );
        }
    }
}
