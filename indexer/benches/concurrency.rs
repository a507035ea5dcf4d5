//! Readers under one concurrent writer, and the writer under a concurrent snapshot, for the
//! designs considered for `SharedIndex` (`indexer/src/index/shared.rs`), in one run.
//!
//! Run: `cargo bench -p kvroute-indexer --features workload --bench concurrency [-- WORKERS]`
//! (default 256 workers, 32,768-block caches). The index holds the first half of the trace's
//! events; the writer applies the second half in messages (runs of one worker's consecutive
//! events, at most 64, as the event log carries them); one reader thread times queries
//! back to back meanwhile. "alone" is the same reader on the same index with no writer, for
//! the same time.

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a benchmark measures wall time"
)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvroute_common::messages::KvEventData;
use kvroute_common::trace::read_trace;
use kvroute_indexer::workload::{WorkloadConfig, WorkloadEvent, build};
use kvroute_indexer::{IndexConfig, RadixIndex, SharedIndex};

/// What is shared between the writer and the readers.
enum Design {
    /// One index behind a `std::sync::RwLock`, the writer taking it once per message (the
    /// `SharedIndex` before the two copies).
    RwLock(Arc<RwLock<RadixIndex>>),
    /// `SharedIndex`: two copies, readers on the front one.
    TwoCopies(SharedIndex),
}

impl Design {
    fn name(&self) -> &'static str {
        match self {
            Design::RwLock(_) => "RwLock, one hold per message",
            Design::TwoCopies(_) => "SharedIndex: two views",
        }
    }

    fn query(&self, q: &[u64]) -> usize {
        match self {
            Design::RwLock(l) => l.read().unwrap().find_matches(q).matches.len(),
            Design::TwoCopies(s) => s.find_matches(q).matches.len(),
        }
    }

    fn write(&self, (worker, events): &Message) {
        match self {
            Design::RwLock(l) => {
                let mut ix = l.write().unwrap();
                for data in events {
                    let _ = ix.apply(*worker, 0, data);
                }
            }
            Design::TwoCopies(s) => {
                s.apply_events(*worker, 0, events);
            }
        }
    }

    /// A snapshot as the indexer takes one: under the read lock, or from a pinned copy.
    fn snapshot(&self) -> Vec<u8> {
        match self {
            Design::RwLock(l) => l.read().unwrap().snapshot(),
            Design::TwoCopies(s) => {
                let pin = s.try_pin().expect("no other pin");
                pin.snapshot()
            }
        }
    }

    fn clone_handle(&self) -> Design {
        match self {
            Design::RwLock(l) => Design::RwLock(l.clone()),
            Design::TwoCopies(s) => Design::TwoCopies(s.clone()),
        }
    }
}

/// One log message: a worker's consecutive events.
type Message = (u64, Vec<KvEventData>);

/// Runs of one worker's consecutive events, at most 64 each.
fn messages(events: &[WorkloadEvent]) -> Vec<Message> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=events.len() {
        if i == events.len() || events[i].worker_id != events[start].worker_id || i - start == 64 {
            let run = &events[start..i];
            out.push((
                run[0].worker_id,
                run.iter().map(|e| e.data.clone()).collect(),
            ));
            start = i;
        }
    }
    out
}

fn blocks(events: &[WorkloadEvent]) -> u64 {
    events
        .iter()
        .map(|e| match &e.data {
            KvEventData::Stored { blocks, .. } => blocks.len() as u64,
            KvEventData::Removed { block_hashes, .. } => block_hashes.len() as u64,
            KvEventData::Cleared => 1,
        })
        .sum()
}

struct Reader {
    lat: Vec<u64>,
    secs: f64,
}

impl Reader {
    fn p(&self, f: f64) -> f64 {
        self.lat[((self.lat.len() - 1) as f64 * f) as usize] as f64 / 1000.0
    }
    /// Lookups that took more than 100 µs, per million.
    fn over_100us_ppm(&self) -> f64 {
        let over = self.lat.iter().filter(|&&ns| ns > 100_000).count();
        over as f64 * 1e6 / self.lat.len() as f64
    }
    fn per_sec(&self) -> f64 {
        self.lat.len() as f64 / self.secs
    }
}

fn read_until(design: &Design, queries: &[Vec<u64>], done: impl Fn(usize) -> bool) -> Reader {
    let start = Instant::now();
    let mut lat = Vec::new();
    let mut i = 0;
    while !done(i) {
        let q = &queries[i % queries.len()];
        i += 1;
        let t = Instant::now();
        std::hint::black_box(design.query(q));
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let secs = start.elapsed().as_secs_f64();
    lat.sort_unstable();
    Reader { lat, secs }
}

/// Writes the messages over and over on another thread while `snapshot` runs here; returns the
/// writer's longest message and the snapshot's time.
fn writer_during(
    design: &Design,
    msgs: &[Message],
    snapshot: impl FnOnce() -> Vec<u8>,
) -> (Duration, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (d, stop) = (design.clone_handle(), stop.clone());
        let msgs = msgs.to_vec();
        std::thread::spawn(move || {
            let mut longest = Duration::ZERO;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                d.write(&msgs[i % msgs.len()]);
                longest = longest.max(t.elapsed());
                i += 1;
            }
            longest
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let bytes = snapshot();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let longest = writer.join().unwrap();
    // Freed after the writer stops: unmapping a buffer this large holds the process's memory
    // map while other threads fault pages in (see BENCHMARKS.md).
    drop(std::hint::black_box(bytes));
    (longest, ms)
}

fn main() {
    let workers: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(256);
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/conversation_trace.jsonl");
    let trace = read_trace(&path).expect("traces");
    let w = build(
        &trace,
        &WorkloadConfig {
            workers,
            block_size: 16,
            cache_blocks: 32_768,
            max_requests: usize::MAX,
        },
    );
    let half = w.events.len() / 2;
    let queries: Vec<Vec<u64>> = w.queries.iter().step_by(5).cloned().collect();
    let rest = &w.events[half..];
    let msgs = messages(rest);
    let rest_blocks = blocks(rest);
    let base = {
        let mut ix = RadixIndex::new(IndexConfig::default());
        for e in &w.events[..half] {
            let _ = ix.apply(e.worker_id, 0, &e.data);
        }
        ix
    };
    println!(
        "{workers} workers, {} entries held, {} messages ({} block events) written",
        base.len(),
        msgs.len(),
        rest_blocks
    );
    println!();
    println!(
        "| design | reader alone p50 / p99 / p99.99 / max µs (> 100 µs per million) | + writer, the same | lookups/s + writer / alone | writer M block events/s | writer's longest message, ms: with readers / under a snapshot (snapshot ms) / while another index is snapshotted |"
    );
    println!("|---|---|---|---|---|---|");
    let designs = [
        Design::RwLock(Arc::new(RwLock::new(base.clone()))),
        Design::TwoCopies(SharedIndex::from_index(base.clone())),
    ];
    for design in designs {
        // The reader alone, for 2 s.
        let t = Instant::now();
        let alone = read_until(&design, &queries, |_| t.elapsed() >= Duration::from_secs(2));
        // The reader while the writer applies the second half.
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (d, done) = (design.clone_handle(), done.clone());
            let msgs = msgs.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let mut longest = Duration::ZERO;
                for m in &msgs {
                    let one = Instant::now();
                    d.write(m);
                    longest = longest.max(one.elapsed());
                }
                done.store(true, Ordering::Relaxed);
                (t.elapsed().as_secs_f64(), longest)
            })
        };
        let busy = read_until(&design, &queries, |_| done.load(Ordering::Relaxed));
        let (secs, longest_alone) = writer.join().unwrap();
        // The writer while a snapshot is taken on another thread: its longest message.
        let (longest, snap_ms) = writer_during(&design, &msgs, || design.snapshot());
        // The same while a separate index of the same size is snapshotted: what the two
        // threads sharing two cores and the memory bus cost, with no lock between them.
        let apart = base.clone();
        let (longest_apart, _) = writer_during(&design, &msgs, || apart.snapshot());
        drop(apart);
        println!(
            "| {} | {:.2} / {:.2} / {:.0} / {:.0} ({:.0}) | {:.2} / {:.2} / {:.0} / {:.0} ({:.0}) | {:.0} / {:.0} ({:.0} %) | {:.2} | {:.2} / {:.2} ({:.0}) / {:.2} |",
            design.name(),
            alone.p(0.5),
            alone.p(0.99),
            alone.p(0.9999),
            alone.p(1.0),
            alone.over_100us_ppm(),
            busy.p(0.5),
            busy.p(0.99),
            busy.p(0.9999),
            busy.p(1.0),
            busy.over_100us_ppm(),
            busy.per_sec(),
            alone.per_sec(),
            100.0 * busy.per_sec() / alone.per_sec(),
            rest_blocks as f64 / secs / 1e6,
            longest_alone.as_secs_f64() * 1e3,
            longest.as_secs_f64() * 1e3,
            snap_ms,
            longest_apart.as_secs_f64() * 1e3,
        );
    }
}
