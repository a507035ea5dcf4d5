//! kvroute's radix index side by side with the indexes of NVIDIA Dynamo's router
//! (`dynamo-kv-router`: RadixTree, ConcurrentRadixTreeCompressed, PositionalIndexer) and of the
//! SGLang model gateway (`kv-index`: ChainIndex), on the same Mooncake-trace events and queries.
//! Prints one table (BENCHMARKS.md, "Radix index"). Run: `cd bench/peers && cargo bench`.

mod adapters;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use adapters::*;
use dynamo_kv_router::indexer::SyncIndexer;
use kvroute_common::trace::{TraceRequest, read_trace};
use kvroute_indexer::RadixIndex;
use kvroute_indexer::workload::{Workload, WorkloadConfig, build, rss_bytes};

const IMPLS: [&str; 5] = [
    "kvroute",
    "dynamo RadixTree",
    "dynamo CRTC",
    "dynamo Positional",
    "kv-index ChainIndex",
];
const CHILD_ENV: &str = "KVROUTE_PEERS_CHILD";

fn trace() -> Vec<TraceRequest> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/traces/conversation_trace.jsonl");
    read_trace(&p).expect("Mooncake trace in ../shared/traces")
}

fn workload(trace: &[TraceRequest], workers: usize, cache_blocks: usize) -> Workload {
    build(
        trace,
        &WorkloadConfig {
            workers,
            block_size: 16,
            cache_blocks,
            max_requests: usize::MAX,
        },
    )
}

fn new_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Child process: memory (RSS growth while building) then apply time for one index.
fn child(which: usize, trace: &[TraceRequest]) {
    let w = workload(trace, 16, 131_072);
    let rt = new_runtime();
    let (bytes, secs) = match which {
        0 => {
            let base = rss_bytes();
            let ix = ours(&w.events);
            let bytes = rss_bytes() - base;
            eprintln!(
                "kvroute stats bytes/entry {:.1}",
                ix.stats().bytes_in_use as f64 / ix.len() as f64
            );
            drop(ix);
            let t = Instant::now();
            let ix = ours(&w.events);
            let secs = t.elapsed().as_secs_f64();
            assert_eq!(ix.len(), w.final_entries);
            (bytes, secs)
        }
        1 => {
            let ev = to_router_events(&w.events);
            let base = rss_bytes();
            let mut t = dynamo_kv_router::RadixTree::new();
            for e in &ev {
                let _ = t.apply_event(e.clone());
            }
            let bytes = rss_bytes() - base;
            drop(t);
            let start = Instant::now();
            let t = radix_tree(ev);
            let secs = start.elapsed().as_secs_f64();
            drop(t);
            (bytes, secs)
        }
        2 | 3 => {
            let ev = to_router_events(&w.events);
            let base = rss_bytes();
            let mem = |ev: &[dynamo_kv_router::protocols::RouterEvent]| {
                if which == 2 {
                    let p = dynamo_kv_router::indexer::ThreadPoolIndexer::new(crtc(), 1, 16);
                    for c in ev.chunks(1000) {
                        feed_pool(&p, c.to_vec(), &rt);
                    }
                    let b = rss_bytes() - base;
                    drop(p);
                    b
                } else {
                    let p = dynamo_kv_router::indexer::ThreadPoolIndexer::new(positional(), 1, 16);
                    for c in ev.chunks(1000) {
                        feed_pool(&p, c.to_vec(), &rt);
                    }
                    let b = rss_bytes() - base;
                    drop(p);
                    b
                }
            };
            let bytes = mem(&ev);
            let start = Instant::now();
            let secs = if which == 2 {
                let p = pooled(crtc(), ev, &rt);
                let s = start.elapsed().as_secs_f64();
                drop(p);
                s
            } else {
                let p = pooled(positional(), ev, &rt);
                let s = start.elapsed().as_secs_f64();
                drop(p);
                s
            };
            (bytes, secs)
        }
        _ => {
            let ev = to_chain_events(&w.events);
            let base = rss_bytes();
            let mut c = ChainWriter::new(16);
            for e in &ev {
                c.apply(e);
            }
            let bytes = rss_bytes() - base;
            drop(c);
            let start = Instant::now();
            let mut c = ChainWriter::new(16);
            for e in &ev {
                c.apply(e);
            }
            let secs = start.elapsed().as_secs_f64();
            drop(c);
            (bytes, secs)
        }
    };
    println!(
        "RESULT {which} {bytes} {secs} {} {}",
        w.final_entries, w.block_events
    );
}

fn pct(mut v: Vec<u64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

/// Times `f` on each query; returns nanoseconds per call.
fn time_each(qs: &[Vec<u64>], mut f: impl FnMut(usize, &[u64]) -> usize) -> Vec<u64> {
    for (i, q) in qs.iter().enumerate().take(100) {
        std::hint::black_box(f(i, q));
    }
    qs.iter()
        .enumerate()
        .map(|(i, q)| {
            let t = Instant::now();
            std::hint::black_box(f(i, q));
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

/// Times `f` over the queries round-robin until `done`; nanoseconds per call.
fn time_until(qs: &[Vec<u64>], done: &AtomicBool, mut f: impl FnMut(&[u64]) -> usize) -> Vec<u64> {
    let mut out = Vec::new();
    let mut i = 0;
    while !done.load(Ordering::Relaxed) || out.len() < 50 {
        let q = &qs[i % qs.len()];
        i += 1;
        let t = Instant::now();
        std::hint::black_box(f(q));
        out.push(t.elapsed().as_nanos() as u64);
        if out.len() > 2_000_000 {
            break;
        }
    }
    out
}

struct Lat {
    p50: f64,
    p99: f64,
    n: usize,
}

fn lat(v: Vec<u64>) -> Lat {
    Lat {
        n: v.len(),
        p50: pct(v.clone(), 0.5),
        p99: pct(v, 0.99),
    }
}

/// Latencies for one worker count: [impl][typical, long, typical+writer, long+writer].
fn latencies(trace: &[TraceRequest], workers: usize) -> (Vec<Vec<Option<Lat>>>, Vec<usize>) {
    let w = workload(trace, workers, 32_768);
    let half = w.events.len() / 2;
    let (pre, rest) = w.events.split_at(half);
    let sample = |long: bool| -> Vec<Vec<u64>> {
        let all: Vec<_> = w
            .queries
            .iter()
            .filter(|q| (q.len() >= 1000) == long)
            .collect();
        let n = if long { 400 } else { 2000 };
        let step = (all.len() / n).max(1);
        all.into_iter().step_by(step).take(n).cloned().collect()
    };
    let qsets = [sample(false), sample(true)];
    eprintln!(
        "{workers} workers: {} events, {} typical / {} long queries",
        w.events.len(),
        qsets[0].len(),
        qsets[1].len()
    );
    let rt = new_runtime();
    let mut rows: Vec<Vec<Option<Lat>>> = Vec::new();
    let mut mismatches = vec![0usize; IMPLS.len()];

    // kvroute
    let ours_ix = ours_shared(pre);
    let reference: Vec<Vec<Answer>> = qsets
        .iter()
        .map(|qs| qs.iter().map(|q| ours_answer(&ours_ix, q)).collect())
        .collect();
    let mut row = Vec::new();
    for qs in &qsets {
        row.push(
            (!qs.is_empty())
                .then(|| lat(time_each(qs, |_, q| ours_ix.find_matches(q).matches.len()))),
        );
    }
    for qs in &qsets {
        if qs.is_empty() {
            row.push(None);
            continue;
        }
        let ix = ours_shared(pre);
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (ix, done, rest) = (ix.clone(), done.clone(), rest.to_vec());
            std::thread::spawn(move || {
                for e in &rest {
                    let _ = ix.apply(e.worker_id, 0, &e.data);
                }
                done.store(true, Ordering::Relaxed);
            })
        };
        row.push(Some(lat(time_until(qs, &done, |q| {
            ix.find_matches(q).matches.len()
        }))));
        writer.join().unwrap();
    }
    drop(ours_ix);
    rows.push(row);

    // dynamo RadixTree (single-threaded: no concurrent-writer figures)
    let ev_pre = to_router_events(pre);
    let t = radix_tree(ev_pre.clone());
    let mut row = Vec::new();
    for (k, qs) in qsets.iter().enumerate() {
        for (i, q) in qs.iter().enumerate() {
            if dynamo_answer(t.find_matches(to_local(q), false)) != reference[k][i] {
                mismatches[1] += 1;
            }
        }
        let locals: Vec<_> = qs.iter().map(|q| to_local(q)).collect();
        row.push((!qs.is_empty()).then(|| {
            lat(time_each(qs, |i, _| {
                let l = locals[i].clone();
                t.find_matches(l, false).scores.len()
            }))
        }));
    }
    row.extend([None, None]);
    drop(t);
    rows.push(row);

    // dynamo CRTC and Positional, through their thread pool (one writer thread)
    for which in [2usize, 3] {
        let mut row = Vec::new();
        macro_rules! run_pool {
            ($mk:expr) => {{
                let p = pooled($mk, ev_pre.clone(), &rt);
                for (k, qs) in qsets.iter().enumerate() {
                    for (i, q) in qs.iter().enumerate() {
                        if dynamo_answer(p.backend().find_matches(&to_local(q), false))
                            != reference[k][i]
                        {
                            mismatches[which] += 1;
                        }
                    }
                    let locals: Vec<_> = qs.iter().map(|q| to_local(q)).collect();
                    row.push((!qs.is_empty()).then(|| {
                        lat(time_each(qs, |i, _| {
                            p.backend().find_matches(&locals[i], false).scores.len()
                        }))
                    }));
                }
                drop(p);
                for qs in &qsets {
                    if qs.is_empty() {
                        row.push(None);
                        continue;
                    }
                    let p = Arc::new(pooled($mk, ev_pre.clone(), &rt));
                    let done = Arc::new(AtomicBool::new(false));
                    let locals: Vec<_> = qs.iter().map(|q| to_local(q)).collect();
                    let feeder = {
                        let (p, done, ev) = (p.clone(), done.clone(), to_router_events(rest));
                        std::thread::spawn(move || {
                            feed_pool(&p, ev, &new_runtime());
                            done.store(true, Ordering::Relaxed);
                        })
                    };
                    let mut i = 0;
                    row.push(Some(lat(time_until(qs, &done, |_| {
                        i += 1;
                        p.backend()
                            .find_matches(&locals[(i - 1) % locals.len()], false)
                            .scores
                            .len()
                    }))));
                    feeder.join().unwrap();
                }
            }};
        }
        if which == 2 {
            run_pool!(crtc())
        } else {
            run_pool!(positional())
        }
        rows.push(row);
    }

    // kv-index ChainIndex: the writer owns the block maps; readers share the index.
    let ev_pre = to_chain_events(pre);
    let mut row = Vec::new();
    {
        let mut c = ChainWriter::new(workers);
        for e in &ev_pre {
            c.apply(e);
        }
        let ids = c.worker_ids();
        for (k, qs) in qsets.iter().enumerate() {
            for (i, q) in qs.iter().enumerate() {
                if chain_answer(c.index.find_matches(&to_content(q), false), &ids)
                    != reference[k][i]
                {
                    mismatches[4] += 1;
                }
            }
            let content: Vec<_> = qs.iter().map(|q| to_content(q)).collect();
            row.push((!qs.is_empty()).then(|| {
                lat(time_each(qs, |i, _| {
                    c.index.find_matches(&content[i], false).scores.len()
                }))
            }));
        }
    }
    for qs in &qsets {
        if qs.is_empty() {
            row.push(None);
            continue;
        }
        let mut c = ChainWriter::new(workers);
        for e in &ev_pre {
            c.apply(e);
        }
        let index = c.index.clone();
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (done, ev) = (done.clone(), to_chain_events(rest));
            std::thread::spawn(move || {
                for e in &ev {
                    c.apply(e);
                }
                done.store(true, Ordering::Relaxed);
            })
        };
        let content: Vec<_> = qs.iter().map(|q| to_content(q)).collect();
        let mut i = 0;
        row.push(Some(lat(time_until(qs, &done, |_| {
            i += 1;
            index
                .find_matches(&content[(i - 1) % content.len()], false)
                .scores
                .len()
        }))));
        writer.join().unwrap();
    }
    rows.push(row);
    (rows, mismatches)
}

fn fmt(x: f64) -> String {
    if x.is_nan() {
        "n/a".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// One table row: ours, each peer, the best peer and ours / best (or best / ours when
/// `higher_is_better`, so a ratio above 1 always favours kvroute).
fn print_row(name: &str, vals: &[f64], higher_is_better: bool) {
    let peers: Vec<f64> = vals[1..].iter().copied().filter(|v| !v.is_nan()).collect();
    let best = if higher_is_better {
        peers.iter().copied().fold(f64::NAN, f64::max)
    } else {
        peers.iter().copied().fold(f64::NAN, f64::min)
    };
    let ratio = if higher_is_better {
        vals[0] / best
    } else {
        best / vals[0]
    };
    let cells: Vec<String> = vals.iter().map(|&v| fmt(v)).collect();
    println!(
        "| {name} | {} | {} | {:.2}× |",
        cells.join(" | "),
        fmt(best),
        ratio
    );
}

fn main() {
    let trace = trace();
    if let Ok(which) = std::env::var(CHILD_ENV) {
        child(which.parse().unwrap(), &trace);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut apply = vec![f64::NAN; IMPLS.len()];
    let mut mem = vec![f64::NAN; IMPLS.len()];
    let mut entries = 0;
    for which in 0..IMPLS.len() {
        let out = Command::new(&exe)
            .env(CHILD_ENV, which.to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        let Some(line) = text.lines().find(|l| l.starts_with("RESULT")) else {
            eprintln!("{} failed", IMPLS[which]);
            continue;
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        let (bytes, secs): (f64, f64) = (f[2].parse().unwrap(), f[3].parse().unwrap());
        entries = f[4].parse().unwrap();
        let block_events: f64 = f[5].parse().unwrap();
        apply[which] = block_events / secs / 1e6;
        mem[which] = bytes / entries as f64;
        eprintln!(
            "{}: {:.2} M block events/s, {:.1} B/entry",
            IMPLS[which], apply[which], mem[which]
        );
    }

    let mut lat_rows = Vec::new();
    for workers in [16usize, 256, 1024] {
        let (rows, mism) = latencies(&trace, workers);
        eprintln!(
            "{workers} workers: answers differing from kvroute's: {:?}",
            mism.iter()
                .zip(IMPLS)
                .map(|(m, n)| format!("{n}: {m}"))
                .collect::<Vec<_>>()
        );
        lat_rows.push((workers, rows));
    }

    // Snapshot at ≥ 2 million entries (kvroute only).
    let w = workload(&trace, 16, 131_072);
    let ix = ours(&w.events);
    let mut write = Duration::MAX;
    let mut restore = Duration::MAX;
    let mut size = 0;
    for _ in 0..3 {
        let t = Instant::now();
        let bytes = ix.snapshot();
        write = write.min(t.elapsed());
        size = bytes.len();
        let t = Instant::now();
        let back = RadixIndex::restore(&bytes).unwrap();
        restore = restore.min(t.elapsed());
        assert_eq!(back.len(), ix.len());
    }

    println!(
        "\n| metric | {} | best peer | kvroute vs best |",
        IMPLS.join(" | ")
    );
    println!("|---|{}---|---|", "---|".repeat(IMPLS.len()));
    print_row(
        "apply, M block events/s (16 workers, 1 writer)",
        &apply,
        true,
    );
    print_row(
        &format!("memory, bytes per (block, worker) entry ({entries} entries)"),
        &mem,
        false,
    );
    for (workers, rows) in &lat_rows {
        for (k, label) in [
            "typical",
            "long ≥1000 blocks",
            "typical + writer",
            "long + writer",
        ]
        .iter()
        .enumerate()
        {
            for (p, pname) in [(0, "p50"), (1, "p99")] {
                let vals: Vec<f64> = rows
                    .iter()
                    .map(|r| {
                        r[k].as_ref()
                            .map_or(f64::NAN, |l| if p == 0 { l.p50 } else { l.p99 })
                    })
                    .collect();
                print_row(
                    &format!("find_matches {pname} µs, {workers} workers, {label}"),
                    &vals,
                    false,
                );
            }
        }
    }
    println!(
        "\nkvroute snapshot of {} entries ({:.1} MB): write {:.0} ms, restore {:.0} ms",
        ix.len(),
        size as f64 / 1e6,
        write.as_secs_f64() * 1e3,
        restore.as_secs_f64() * 1e3
    );
    for (workers, rows) in &lat_rows {
        let n: Vec<String> = rows
            .iter()
            .map(|r| {
                r.iter()
                    .map(|l| l.as_ref().map_or(0, |l| l.n).to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .collect();
        println!(
            "samples at {workers} workers (typical/long/typical+w/long+w): {}",
            n.join(", ")
        );
    }
}
