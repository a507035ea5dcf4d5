//! Scale benchmark of the radix index: a fleet of many workers holding tens of millions of
//! (block, worker) entries. Not a test; the figures go to BENCHMARKS.md ("Scale").
//!
//! The Mooncake conversation trace is replayed `--passes` times, each pass with its trace
//! blocks renamed (so a pass is a new set of conversations of the same shape), onto
//! `--workers` simulated LRU caches of `--cache-blocks` blocks each
//! (`kvroute_indexer::workload`). With the defaults the caches fill up during the replay, so the
//! index ends at about 10,000 × 5,000 = 50 M entries, and the last passes are steady churn: every
//! stored block evicts one.
//!
//! Measured, one `RadixIndex` (the writer's parts and one view; a serving replica,
//! `SharedIndex`, holds a second view):
//! - apply rate over the whole replay and over its last quarter (the index at full size);
//! - memory per entry (`IndexStats::bytes_in_use`), by part, and the process's peak RSS;
//! - `find_matches` p50 / p99 / max of the last `--queries` typical (< 1,000 blocks) and long
//!   prompts of the replay;
//! - snapshot write and restore time, and the snapshot's size.
//!
//! Run: `cargo run --release -p kvroute-indexer --features workload --example scale --
//! [--workers 10000] [--cache-blocks 5000] [--passes 8]`

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a benchmark measures wall time"
)]

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kvroute_common::trace::{TraceRequest, read_trace};
use kvroute_indexer::workload::{WorkloadConfig, build};
use kvroute_indexer::{IndexConfig, RadixIndex};

#[derive(Debug, Parser)]
struct Args {
    /// Mooncake trace (JSONL).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces/conversation_trace.jsonl"))]
    trace: PathBuf,
    /// Simulated workers (worker ids `0..workers`, dp rank 0).
    #[arg(long, default_value_t = 10_000)]
    workers: usize,
    /// LRU capacity of each worker, in blocks.
    #[arg(long, default_value_t = 5_000)]
    cache_blocks: usize,
    /// Replays of the trace, each with renamed blocks.
    #[arg(long, default_value_t = 8)]
    passes: u64,
    /// Tokens per engine block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Queries of each kind (typical, long) timed, from the end of the replay.
    #[arg(long, default_value_t = 2_000)]
    queries: usize,
    /// Times each query is repeated.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

/// Peak resident set of this process, from `/proc/self/status` (`VmHWM`), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Times `find_matches` on the last `count` typical and long prompts of `queries`, `repeats`
/// times each, and prints the figures under `label`.
fn time_queries(ix: &RadixIndex, queries: &[Vec<u64>], count: usize, repeats: usize, label: &str) {
    for long in [false, true] {
        let picked: Vec<&Vec<u64>> = queries
            .iter()
            .rev()
            .filter(|q| (q.len() >= 1000) == long)
            .take(count)
            .collect();
        if picked.is_empty() {
            println!(
                "{label} find_matches {}: no such prompt in the replay",
                if long { "long" } else { "typical" }
            );
            continue;
        }
        let mut lat = Vec::with_capacity(picked.len() * repeats);
        // Each prompt's fastest repeat: its own cost, without what the machine added to a run.
        let mut fastest = vec![u64::MAX; picked.len()];
        let mut rows = 0u64;
        for _ in 0..repeats {
            for (i, q) in picked.iter().enumerate() {
                let t = Instant::now();
                let scores = std::hint::black_box(ix.find_matches(q));
                let ns = t.elapsed().as_nanos() as u64;
                lat.push(ns);
                fastest[i] = fastest[i].min(ns);
                rows += scores.matches.len() as u64;
            }
        }
        lat.sort_unstable();
        fastest.sort_unstable();
        let mean_len = picked.iter().map(|q| q.len()).sum::<usize>() as f64 / picked.len() as f64;
        println!(
            "{label} find_matches {} ({} prompts, mean {:.0} blocks, {:.0} (worker, rank) rows per \
             answer): p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs, {} of {} over 10 ms",
            if long { "long" } else { "typical" },
            picked.len(),
            mean_len,
            rows as f64 / lat.len().max(1) as f64,
            percentile(&lat, 0.50) as f64 / 1e3,
            percentile(&lat, 0.99) as f64 / 1e3,
            lat.last().copied().unwrap_or(0) as f64 / 1e3,
            lat.iter().filter(|&&ns| ns > 10_000_000).count(),
            lat.len()
        );
        println!(
            "  each prompt's fastest of {} repeats: p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs",
            repeats,
            percentile(&fastest, 0.50) as f64 / 1e3,
            percentile(&fastest, 0.99) as f64 / 1e3,
            fastest.last().copied().unwrap_or(0) as f64 / 1e3
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let trace = read_trace(&args.trace)?;
    // Pass p renames trace block h to h + p * 2^40: the same conversation shapes, new prefixes.
    let requests: Vec<TraceRequest> = (0..args.passes)
        .flat_map(|p| {
            trace.iter().map(move |r| TraceRequest {
                hash_ids: r.hash_ids.iter().map(|h| h + (p << 40)).collect(),
                ..r.clone()
            })
        })
        .collect();
    let started = Instant::now();
    let w = build(
        &requests,
        &WorkloadConfig {
            workers: args.workers,
            block_size: args.block_size,
            cache_blocks: args.cache_blocks,
            max_requests: usize::MAX,
        },
    );
    drop(requests);
    eprintln!(
        "workload: {} requests, {} events, {} block events, {} entries at the end ({:.1} s)",
        w.queries.len(),
        w.events.len(),
        w.block_events,
        w.final_entries,
        started.elapsed().as_secs_f64()
    );

    // Apply, timing the last quarter of the block events on its own.
    let quarter_from = w.block_events - w.block_events / 4;
    let mut ix = RadixIndex::new(IndexConfig::default());
    let (mut done, mut tail_start, mut tail_blocks) = (0u64, None, 0u64);
    let t = Instant::now();
    for e in &w.events {
        let n = e.data.block_count() as u64;
        if tail_start.is_none() && done >= quarter_from {
            tail_start = Some(Instant::now());
        }
        if tail_start.is_some() {
            tail_blocks += n;
        }
        let _ = ix.apply(e.worker_id, 0, &e.data);
        done += n;
    }
    let apply_secs = t.elapsed().as_secs_f64();
    let tail_secs = tail_start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    assert_eq!(
        ix.len(),
        w.final_entries,
        "the index holds what the caches hold"
    );
    let stats = ix.stats();
    let workers = ix.workers().len();
    println!(
        "apply: {:.2} M block events/s over the replay ({:.1} s); last quarter, at full size: \
         {:.2} M/s",
        w.block_events as f64 / apply_secs / 1e6,
        apply_secs,
        tail_blocks as f64 / tail_secs / 1e6
    );
    println!(
        "index: {} workers, {} entries, {} nodes, {:.2} bytes per entry (the writer's parts and one view), {:.2} GiB",
        workers,
        ix.len(),
        stats.nodes,
        stats.bytes_in_use as f64 / ix.len().max(1) as f64,
        stats.bytes_in_use as f64 / f64::from(1u32 << 30)
    );
    // By part: a serving replica (`SharedIndex`) holds the writer's parts once and the view
    // twice.
    for (part, bytes) in ix.memory_parts() {
        println!(
            "  {part}: {:.2} GiB, {:.2} B/entry",
            bytes as f64 / f64::from(1u32 << 30),
            bytes as f64 / ix.len().max(1) as f64
        );
    }
    let queries = w.queries;
    drop(w.events);

    time_queries(&ix, &queries, args.queries, args.repeats, "built:");

    let t = Instant::now();
    let digest = ix.digest();
    let digest_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let bytes = ix.snapshot();
    let write_secs = t.elapsed().as_secs_f64();
    drop(ix);
    let t = Instant::now();
    let restored = RadixIndex::restore(&bytes)?;
    let restore_secs = t.elapsed().as_secs_f64();
    assert_eq!(restored.digest(), digest, "restore gives the same state");
    // The same prompts on the restored index (its nodes laid out in snapshot order).
    time_queries(&restored, &queries, args.queries, args.repeats, "restored:");
    drop(queries);
    println!(
        "snapshot: write {:.2} s, {:.2} GiB ({:.1} bytes per entry); restore {:.2} s; digest {:.2} s",
        write_secs,
        bytes.len() as f64 / f64::from(1u32 << 30),
        bytes.len() as f64 / restored.len().max(1) as f64,
        restore_secs,
        digest_secs
    );
    if let Some(rss) = peak_rss() {
        println!(
            "peak RSS of this process (workload + index + snapshot + restored copy): {:.1} GiB",
            rss as f64 / f64::from(1u32 << 30)
        );
    }
    Ok(())
}
