//! Reader latency under one concurrent writer, for the locking designs considered for
//! `SharedIndex` (ARCHITECTURE.md, "Radix index"). Prints p50 / p99 per design.
//! Run: `cargo bench -p kvroute-indexer --features workload --bench concurrency`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvroute_common::trace::read_trace;
use kvroute_indexer::workload::{WorkloadConfig, WorkloadEvent, build};
use kvroute_indexer::{IndexConfig, RadixIndex, SharedIndex};

#[derive(Clone, Copy, Debug)]
enum Design {
    /// `SharedIndex`: RwLock, writer releases the lock every event.
    RwLockPerEvent,
    /// RwLock, writer holds it for 4,096 events at a time (a burst).
    RwLockBurst,
    /// Readers and writer serialize on one lock (a mutex), per event.
    Mutex,
}

fn main() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/conversation_trace.jsonl");
    let trace = read_trace(&path).expect("traces");
    let w = build(
        &trace,
        &WorkloadConfig {
            workers: 256,
            block_size: 16,
            cache_blocks: 32_768,
            max_requests: usize::MAX,
        },
    );
    let half = w.events.len() / 2;
    let queries: Vec<Vec<u64>> = w.queries.iter().step_by(5).cloned().collect();
    println!(
        "| design | reader p50 µs | reader p99 µs | reader max µs | writer M block events/s |"
    );
    println!("|---|---|---|---|---|");
    for design in [Design::RwLockPerEvent, Design::RwLockBurst, Design::Mutex] {
        let mut ix = RadixIndex::new(IndexConfig::default());
        for e in &w.events[..half] {
            let _ = ix.apply(e.worker_id, 0, &e.data);
        }
        let shared = SharedIndex::from_index(ix);
        let rest: Vec<WorkloadEvent> = w.events[half..].to_vec();
        let blocks: u64 = rest
            .iter()
            .map(|e| match &e.data {
                kvroute_common::messages::KvEventData::Stored { blocks, .. } => blocks.len() as u64,
                kvroute_common::messages::KvEventData::Removed { block_hashes, .. } => {
                    block_hashes.len() as u64
                }
                _ => 1,
            })
            .sum();
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (s, done) = (shared.clone(), done.clone());
            std::thread::spawn(move || {
                let t = Instant::now();
                match design {
                    Design::RwLockBurst => {
                        for chunk in rest.chunks(4096) {
                            s.with_write(|ix| {
                                for e in chunk {
                                    let _ = ix.apply(e.worker_id, 0, &e.data);
                                }
                            });
                        }
                    }
                    _ => {
                        for e in &rest {
                            let _ = s.apply(e.worker_id, 0, &e.data);
                        }
                    }
                }
                done.store(true, Ordering::Relaxed);
                t.elapsed().as_secs_f64()
            })
        };
        let mut lat = Vec::new();
        let mut i = 0;
        while !done.load(Ordering::Relaxed) {
            let q = &queries[i % queries.len()];
            i += 1;
            let t = Instant::now();
            let n = match design {
                Design::Mutex => shared.with_write(|ix| ix.find_matches(q).matches.len()),
                _ => shared.find_matches(q).matches.len(),
            };
            std::hint::black_box(n);
            lat.push(t.elapsed().as_nanos() as u64);
        }
        let secs = writer.join().unwrap();
        lat.sort_unstable();
        let p = |f: f64| lat[((lat.len() - 1) as f64 * f) as usize] as f64 / 1000.0;
        println!(
            "| {design:?} | {:.2} | {:.2} | {:.0} | {:.2} |",
            p(0.5),
            p(0.99),
            p(1.0),
            blocks as f64 / secs / 1e6
        );
    }
}
