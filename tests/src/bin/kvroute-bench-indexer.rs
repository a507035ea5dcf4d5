//! Indexer benchmark, against a real nats-server and etcd started for the run:
//!
//! 1. **Ingest**: the Mooncake conversation trace, replayed onto simulated LRU caches, is
//!    published into the events stream; then the same messages are read (a) by a bare ordered
//!    consumer that only counts them — the transport limit — and (b) by the indexer's own
//!    consumer feeding `ReplicaState::apply`, as the service does. Alternating, best of N.
//! 2. **Cold start**: a snapshot of the state after all but the last `--catch-up` messages is
//!    put in the object store; a `kvroute-indexer` process is started and timed until
//!    `/readyz` (with `--ready-max-lag 0`: the whole log applied).
//!
//! Run: `cargo build --release --workspace --bins && target/release/kvroute-bench-indexer`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull};
use clap::Parser;
use futures::StreamExt;
use kvroute_common::codec::encode;
use kvroute_common::events_stream::{StreamArgs, ensure_events_stream};
use kvroute_common::messages::{KvEvent, KvEventBatch, KvEventData, SchemaVersion};
use kvroute_common::{Names, Namespace};
use kvroute_indexer::index::IndexConfig;
use kvroute_indexer::replica::ReplicaState;
use kvroute_indexer::service::SnapshotStore;
use kvroute_indexer::service::ingest::spawn_consumer;
use kvroute_indexer::workload::{WorkloadConfig, build};
use kvroute_tests::{EtcdServer, NatsServer, Supervised, free_port, http_get, workspace_root};

#[derive(Debug, Parser)]
struct Args {
    /// Mooncake trace (JSONL).
    #[arg(long, default_value = "../shared/traces/conversation_trace.jsonl")]
    trace: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 16)]
    workers: usize,
    /// Tokens per engine block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// LRU capacity per worker, in blocks (16 × 131,072 ≈ 2.1 M entries when full).
    #[arg(long, default_value_t = 131_072)]
    cache_blocks: usize,
    /// Most blocks per published batch.
    #[arg(long, default_value_t = 2048)]
    batch_blocks: usize,
    /// Messages left for the restarted replica to catch up after its snapshot.
    #[arg(long, default_value_t = 2000)]
    catch_up: usize,
    /// Repetitions of each ingest measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// The workload as encoded batches per worker, interleaved in replay order.
fn batches(args: &Args) -> anyhow::Result<(Vec<bytes::Bytes>, Vec<u64>, u64, usize)> {
    let path = if args.trace.is_absolute() {
        args.trace.clone()
    } else {
        workspace_root().join(&args.trace)
    };
    let trace = kvroute_common::trace::read_trace(&path)?;
    let config = WorkloadConfig {
        workers: args.workers,
        block_size: args.block_size,
        cache_blocks: args.cache_blocks,
        max_requests: usize::MAX,
    };
    let workload = build(&trace, &config);
    let mut next_id = vec![1u64; args.workers];
    let mut out = Vec::new();
    let mut worker_of = Vec::new();
    // Every worker starts an incarnation.
    for w in 0..args.workers {
        out.push(encode(&batch(
            w as u64,
            vec![KvEvent {
                event_id: 0,
                data: KvEventData::Cleared,
            }],
        ))?);
        worker_of.push(w as u64);
    }
    let mut current: Option<(u64, Vec<KvEvent>, usize)> = None;
    for e in workload.events {
        let n = e.data.block_count();
        if let Some((w, events, blocks)) = current.as_mut()
            && (*w != e.worker_id || *blocks + n > args.batch_blocks)
        {
            out.push(encode(&batch(*w, std::mem::take(events)))?);
            worker_of.push(*w);
            current = None;
        }
        let (_, events, blocks) = current.get_or_insert((e.worker_id, Vec::new(), 0));
        let id = &mut next_id[e.worker_id as usize];
        events.push(KvEvent {
            event_id: *id,
            data: e.data,
        });
        *id += 1;
        *blocks += n;
    }
    if let Some((w, events, _)) = current {
        out.push(encode(&batch(w, events))?);
        worker_of.push(w);
    }
    Ok((
        out,
        worker_of,
        workload.block_events,
        workload.final_entries,
    ))
}

fn batch(worker_id: u64, events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        v: SchemaVersion::CURRENT,
        worker_id,
        dp_rank: 0,
        events,
        ts: 0,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let (messages, worker_of, block_events, final_entries) = batches(&args)?;
    let bytes: usize = messages.iter().map(|m| m.len()).sum();
    println!(
        "workload: {} messages, {} block events, {:.1} MB, {} final entries (built in {:.1?})",
        messages.len(),
        block_events,
        bytes as f64 / 1e6,
        final_entries,
        started.elapsed()
    );

    let nats = NatsServer::start()?;
    let etcd = EtcdServer::start()?;
    let ns = Namespace::new("bench")?;
    let names = Names::new(&ns);
    let client = nats.connect().await?;
    let js = jetstream::new(client.clone());
    let (stream, _) = ensure_events_stream(
        &js,
        &names,
        &StreamArgs {
            max_bytes: -1,
            max_age_secs: 0,
            ..Default::default()
        },
    )
    .await?;

    let publish_start = Instant::now();
    let mut acks = Vec::with_capacity(1024);
    for (payload, w) in messages.iter().zip(&worker_of) {
        acks.push(js.publish(names.kv_events(*w), payload.clone()).await?);
        if acks.len() == 1024 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks.drain(..) {
        ack.await?;
    }
    println!("published in {:.2?}", publish_start.elapsed());
    let total = messages.len() as u64;

    // Where ingest time goes: decoding alone, then applying already-decoded batches.
    let t = Instant::now();
    let mut decoded = Vec::with_capacity(messages.len());
    for m in &messages {
        decoded.push(kvroute_common::codec::decode::<KvEventBatch>(m)?);
    }
    let decode_only = t.elapsed();
    let t = Instant::now();
    let mut index = kvroute_indexer::index::RadixIndex::new(IndexConfig::default());
    for b in &decoded {
        index.apply_batch(b);
    }
    let apply_only = t.elapsed();
    drop((decoded, index));
    println!(
        "decode only {:.2?} ({:.0} block events/s), apply only {:.2?} ({:.0} block events/s)",
        decode_only,
        block_events as f64 / decode_only.as_secs_f64(),
        apply_only,
        block_events as f64 / apply_only.as_secs_f64()
    );

    let mut raw_best = Duration::MAX;
    let mut ingest_best = Duration::MAX;
    let mut catch_up_best = Duration::MAX;
    let mut digest = 0;
    for round in 0..args.rounds {
        // (a) the transport limit: an ordered consumer that only counts.
        let t = Instant::now();
        let consumer = stream
            .create_consumer(pull::OrderedConfig::default())
            .await?;
        let mut msgs = consumer.messages().await?;
        let mut n = 0u64;
        while n < total {
            let m = msgs.next().await.context("stream ended")??;
            std::hint::black_box(&m.payload);
            n += 1;
        }
        let raw = t.elapsed();
        drop(msgs);
        // (b) the indexer's consumer and apply loop: a replica catching up (its index one
        // view) and a serving one (two views, so that its readers never wait).
        let mut ingests = [Duration::ZERO; 2];
        for (serving, took) in ingests.iter_mut().enumerate() {
            let t = Instant::now();
            let (tx, mut rx) = tokio::sync::mpsc::channel(8192);
            let task = spawn_consumer(names.clone(), client.clone(), stream.clone(), 1, tx);
            let mut state = ReplicaState::new(&names, IndexConfig::default());
            if serving == 1 {
                state.index().attach_second_copy();
            }
            while state.applied_seq() < total {
                let m = rx.recv().await.context("consumer ended")?;
                state.apply_entry(m.seq, m.entry);
            }
            *took = t.elapsed();
            task.abort();
            digest = state.digest();
            anyhow::ensure!(state.index().stats().entries > 0, "nothing ingested");
        }
        let [catch_up, ingest] = ingests;
        println!(
            "round {round}: raw consume {:.2?} ({:.0} block events/s), ingest catching up (one view) {:.2?} ({:.0} block events/s), serving (two views) {:.2?} ({:.0} block events/s)",
            raw,
            block_events as f64 / raw.as_secs_f64(),
            catch_up,
            block_events as f64 / catch_up.as_secs_f64(),
            ingest,
            block_events as f64 / ingest.as_secs_f64(),
        );
        raw_best = raw_best.min(raw);
        ingest_best = ingest_best.min(ingest);
        catch_up_best = catch_up_best.min(catch_up);
    }
    let raw_rate = block_events as f64 / raw_best.as_secs_f64();
    let ingest_rate = block_events as f64 / ingest_best.as_secs_f64();
    let catch_up_rate = block_events as f64 / catch_up_best.as_secs_f64();

    // Cold start: snapshot at total - catch_up, then a fresh process catches up the rest.
    let snap_seq = total.saturating_sub(args.catch_up as u64).max(1);
    let mut state = ReplicaState::new(&names, IndexConfig::default());
    for (i, (payload, w)) in messages
        .iter()
        .zip(&worker_of)
        .enumerate()
        .take(snap_seq as usize)
    {
        state.apply(i as u64 + 1, &names.kv_events(*w), payload);
    }
    let entries = state.index().stats().entries;
    let t = Instant::now();
    let snapshot = state.snapshot();
    let write = t.elapsed();
    let t = Instant::now();
    let restored = ReplicaState::restore(&names, &snapshot)?;
    let restore = t.elapsed();
    assert_eq!(restored.digest(), state.digest());
    let snapshot_mb = snapshot.len() as f64 / 1e6;
    SnapshotStore::open(&js, &names, 1)
        .await?
        .save(snap_seq, snapshot)
        .await?;

    let bin = std::env::current_exe()?.with_file_name("kvroute-indexer");
    let http = free_port();
    let spec = Supervised::new(
        bin,
        vec![
            "--namespace".into(),
            "bench".into(),
            "--nats-url".into(),
            nats.url(),
            "--etcd-endpoints".into(),
            etcd.endpoint(),
            "--http-addr".into(),
            format!("127.0.0.1:{http}"),
            "--ready-max-lag".into(),
            "0".into(),
            "--replica-id".into(),
            "cold".into(),
            "--stream-max-bytes=-1".into(),
            "--stream-max-age-secs".into(),
            "0".into(),
        ],
        nats.data_dir().join("cold.log"),
    );
    let t = Instant::now();
    let child = spec.spawn()?;
    while !matches!(http_get(http, "/readyz"), Some((200, _))) {
        if t.elapsed() > Duration::from_secs(120) {
            let log = std::fs::read_to_string(nats.data_dir().join("cold.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            anyhow::bail!("cold start did not finish; log tail:\n{}", tail.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cold = t.elapsed();
    let status = http_get(http, "/status").context("status")?.1;
    let status: serde_json::Value = serde_json::from_str(&status)?;
    anyhow::ensure!(
        status["applied_seq"].as_u64() == Some(total),
        "cold replica at {status}"
    );
    anyhow::ensure!(
        status["digest"]
            .as_str()
            .and_then(kvroute_common::messages::parse_digest_hex)
            == Some(digest),
        "cold replica digest differs"
    );
    child.stop()?;

    println!();
    println!("| measure | kvroute | limit / peer | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| ingest through JetStream into a serving replica (two views; block events/s) | {:.0} | raw consume of the same messages: {:.0} | {:.2} (target ≥ 0.80) |",
        ingest_rate,
        raw_rate,
        ingest_rate / raw_rate
    );
    println!(
        "| — into a replica catching up (one view) | {:.0} | | {:.2} |",
        catch_up_rate,
        catch_up_rate / raw_rate
    );
    println!(
        "| cold start to ready, {} entries (snapshot {:.1} MB + {} messages catch-up) | {:.2?} | target 2 s; leading peer reports 46–50 s for 2.28 M events | {:.2} of target |",
        entries,
        snapshot_mb,
        total - snap_seq,
        cold,
        cold.as_secs_f64() / 2.0
    );
    println!(
        "| snapshot write / restore in memory | {:.2?} / {:.2?} | | |",
        write, restore
    );
    Ok(())
}
