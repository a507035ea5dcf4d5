//! `kvroute-bridge-bench`: the bridge's event path — engine ZMQ batches through a real `Relay`
//! (one rank) and a real `EventPublisher` into the JetStream events stream — against its two
//! transport limits, measured in one run on the same pre-generated vLLM 0.32 batches:
//!
//! 1. raw ZMQ: a libzmq PUB in its own thread sends every batch to a SUB that only receives;
//! 2. raw JetStream: the same batches as kvroute `KvEventBatch`es (what the mirror makes of each
//!    engine batch, without coalescing), published with acks and message ids — one in flight,
//!    as `EventPublisher` does, and pipelined (the upper limit);
//! 3. relay: the batches through the relay until the publisher has every event acked, with the
//!    CPU the process used (getrusage) and the CPU of the bridge's own threads;
//! 4. visibility: the PUB paced at `--latency-rate` block events/s; an in-process ordered
//!    consumer of the events stream applies it to a `RadixIndex`, as an indexer's ingest would,
//!    and each engine batch is timed from its ZMQ send until `find_matches` finds its last block.
//!
//! The harness's nats-server and etcd run on CPU 0, this whole process on CPU 1 (when there
//! are two). Run manually, in release:
//!
//! `cargo build --release -p kvroute-tests --bin kvroute-bridge-bench && target/release/kvroute-bridge-bench`

mod cpu_split;
mod engine_pub;
mod phases;
mod workload;

use std::time::Duration;

use async_nats::jetstream;
use clap::Parser;
use kvroute_common::Names;
use kvroute_common::events_stream::{StreamArgs, ensure_events_stream};
use kvroute_tests::{TestEnv, cpu};

use crate::cpu_split::Threads;
use crate::phases::Run;
use crate::workload::{Shape, core_run, generate, kv_batches};

#[derive(Debug, Parser)]
struct Args {
    /// Engine batches (ZMQ messages) per throughput phase.
    #[arg(long, default_value_t = 25_000)]
    batches: usize,
    /// `BlockStored` events per batch.
    #[arg(long, default_value_t = 4)]
    stores_per_batch: usize,
    /// Blocks per `BlockStored` (16 tokens each).
    #[arg(long, default_value_t = 16)]
    blocks: usize,
    /// Blocks of one chain (a prompt) before the next chain starts from the root.
    #[arg(long, default_value_t = 256)]
    chain_blocks: usize,
    /// Chains' worth of blocks held at once: past it, each batch also removes as many blocks
    /// as it stores, from the oldest chain's leaf end.
    #[arg(long, default_value_t = 64)]
    resident_chains: usize,
    /// Block events per second the PUB is paced at in the visibility phase.
    #[arg(long, default_value_t = 10_000)]
    latency_rate: u64,
    /// Seconds of the visibility phase.
    #[arg(long, default_value_t = 10)]
    latency_seconds: u64,
    /// Most JetStream acks outstanding in the pipelined raw publish.
    #[arg(long, default_value_t = 1024)]
    pipeline: usize,
    /// Most acks the relay's publisher keeps outstanding (its default when absent); the relay is
    /// also measured with one, as the publisher worked before.
    #[arg(long)]
    relay_in_flight: Option<usize>,
    /// Leave CPU placement to the scheduler (no pinning).
    #[arg(long)]
    no_pin: bool,
}

/// Worker ids per phase, so each phase's subjects and message ids are its own.
const RAW_ONE: u64 = 901;
const RAW_PIPELINED: u64 = 902;
const RELAY: u64 = 903;
const VISIBILITY: u64 = 904;
const RELAY_ONE: u64 = 905;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.batches > 0 && args.stores_per_batch > 0 && args.blocks > 0 && args.pipeline > 0,
        "--batches, --stores-per-batch, --blocks and --pipeline must be positive"
    );
    anyhow::ensure!(
        args.resident_chains > 1 && args.chain_blocks >= args.blocks && args.latency_rate > 0,
        "--resident-chains must be at least 2, --chain-blocks at least --blocks, --latency-rate positive"
    );
    // First, so every thread of the process inherits the placement.
    let pin = !args.no_pin && cpu::online_cpus() >= 2;
    if pin {
        cpu::pin_current_thread(1)?;
    }
    let main_tid = cpu::current_tid();

    let w = generate(&Shape {
        batches: args.batches,
        stores_per_batch: args.stores_per_batch,
        blocks: args.blocks,
        chain_blocks: args.chain_blocks,
        resident_chains: args.resident_chains,
    });
    let n = w.payloads.len();
    let total_blocks = w.total_blocks();
    let core = core_run(&w, 1_000_000)?;
    let (kv, encode_took) = kv_batches(&core, RAW_ONE, 0)?;
    let engine_bytes: usize = w.payloads.iter().map(Vec::len).sum();
    let kv_bytes: usize = kv.iter().map(bytes::Bytes::len).sum();
    println!(
        "workload: {n} vLLM batches of {} BlockStored × {} blocks (+ one BlockRemoved of as many once {} chains of {} blocks are held): {total_blocks} block events; {:.0} B per engine batch, {:.0} B per kvroute batch ({} kvroute events)",
        args.stores_per_batch,
        args.blocks,
        args.resident_chains,
        args.chain_blocks,
        engine_bytes as f64 / n as f64,
        kv_bytes as f64 / n as f64,
        core.kv_events()
    );

    let env = TestEnv::start()?;
    if pin {
        for pid in [env.nats.pid(), env.etcd.pid()].into_iter().flatten() {
            cpu::pin_process(pid, 0)?;
        }
        println!("placement: nats-server and etcd pinned to CPU 0, this process to CPU 1");
    } else {
        println!("placement: not pinned ({} CPUs)", cpu::online_cpus());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-rt")
        .enable_all()
        .build()?;
    // async-nats' JetStream context spawns its ack task where it is created.
    let _enter = rt.enter();
    let names = Names::new(&env.namespace);
    let js = jetstream::new(rt.block_on(env.nats.connect())?);
    let (stream, _) = rt.block_on(ensure_events_stream(&js, &names, &StreamArgs::default()))?;
    // The engine side's libzmq threads are told apart by appearing with its first socket.
    let pub_ctx = zmq::Context::new();
    let before: Vec<i32> = cpu::threads_cpu().into_keys().collect();
    let first_socket = pub_ctx.socket(zmq::PUB)?;
    let engine_tids = cpu::threads_cpu()
        .into_keys()
        .filter(|t| !before.contains(t))
        .collect();
    drop(first_socket);
    let mut run = Run {
        rt: &rt,
        env: &env,
        names,
        js,
        stream,
        pub_ctx,
        threads: Threads {
            main: main_tid,
            engine: engine_tids,
            nats_pid: env.nats.pid(),
        },
    };

    let zmq = run.raw_zmq(&w)?;
    eprintln!("raw ZMQ: {:.0} block events/s", zmq.blocks);
    let js_one = run.raw_jetstream(RAW_ONE, &kv, total_blocks, 1)?;
    run.purge()?;
    let js_pipe = run.raw_jetstream(RAW_PIPELINED, &kv, total_blocks, args.pipeline)?;
    run.purge()?;
    eprintln!(
        "raw JetStream: {:.0} / {:.0} block events/s",
        js_one.blocks, js_pipe.blocks
    );
    let in_flight = args
        .relay_in_flight
        .unwrap_or(kvroute_common::worker::PublisherConfig::default().max_in_flight);
    let relayed_one = run.relay(&w, core.kv_events(), RELAY_ONE, 1)?;
    run.purge()?;
    let relayed = run.relay(&w, core.kv_events(), RELAY, in_flight)?;
    run.purge()?;
    eprintln!(
        "relay: {:.0} block events/s ({:.0} with one ack in flight); {:?}",
        relayed.rate.blocks, relayed_one.rate.blocks, relayed.cpu
    );
    let vis = run.visibility(&w, args.latency_rate, args.latency_seconds, VISIBILITY)?;

    let slower_raw = zmq.blocks.min(js_one.blocks);
    let per_cpu = |c: Duration| total_blocks as f64 / c.as_secs_f64();
    let per_sec = |d: Duration| {
        (
            n as f64 / d.as_secs_f64(),
            total_blocks as f64 / d.as_secs_f64(),
        )
    };
    println!();
    println!("| measure | messages/s | block events/s | note |");
    println!("|---|---|---|---|");
    println!(
        "| raw ZMQ receive (libzmq PUB → SUB, receive only) | {:.0} | {:.0} | |",
        zmq.messages, zmq.blocks
    );
    println!(
        "| raw JetStream publish, 1 in flight (ack awaited, message ids) | {:.0} | {:.0} | one kvroute batch per engine batch |",
        js_one.messages, js_one.blocks
    );
    println!(
        "| raw JetStream publish, pipelined (≤ {} acks outstanding) | {:.0} | {:.0} | upper limit |",
        args.pipeline, js_pipe.messages, js_pipe.blocks
    );
    println!(
        "| relay, 1 ack in flight (as before) | {:.0} | {:.0} | {:.0} % of pipelined raw JetStream; {} JetStream messages |",
        relayed_one.rate.messages,
        relayed_one.rate.blocks,
        100.0 * relayed_one.rate.blocks / js_pipe.blocks,
        relayed_one.js_messages
    );
    println!(
        "| relay: ZMQ in → JetStream acked out (1 rank, ≤ {in_flight} acks in flight) | {:.0} | {:.0} | **{:.0} % of pipelined raw JetStream**, {:.2}× min(raw ZMQ, raw JetStream 1 in flight); all received after {:.0} ms, all acked after {:.0} ms; {} JetStream messages ({:.1} engine batches each) |",
        relayed.rate.messages,
        relayed.rate.blocks,
        100.0 * relayed.rate.blocks / js_pipe.blocks,
        relayed.rate.blocks / slower_raw,
        ms(relayed.all_received),
        ms(relayed.took),
        relayed.js_messages,
        n as f64 / relayed.js_messages.max(1) as f64
    );
    let c = &relayed.cpu;
    println!(
        "| relay CPU, whole process (getrusage) | | {:.0} per CPU-second | {:.0} ms CPU in {:.0} ms; of it the PUB's sending {:.0} ms, the bench's polling {:.0} ms |",
        per_cpu(c.process),
        ms(c.process),
        ms(relayed.took),
        ms(c.engine_side),
        ms(c.main)
    );
    let threads: Vec<String> = c
        .bridge
        .iter()
        .filter(|(_, d)| !d.is_zero())
        .map(|(name, d)| format!("{name} {:.0} ms", ms(*d)))
        .collect();
    println!(
        "| relay CPU, the bridge's threads | | {:.0} per CPU-second | {}; nats-server {:.0} ms |",
        per_cpu(c.bridge_total()),
        threads.join(", "),
        ms(c.nats_server)
    );
    let (m, b) = per_sec(core.decode_only);
    println!("| — decode only (`wire::decode_batch`, one thread) | {m:.0} | {b:.0} | |");
    let (m, b) = per_sec(core.decode_mirror);
    println!("| — decode + mirror (`RankMirror::apply`, one thread) | {m:.0} | {b:.0} | |");
    let (m, b) = per_sec(encode_took);
    println!("| — building and encoding the kvroute batches (one thread) | {m:.0} | {b:.0} | |");
    println!(
        "| visibility at {} block events/s: engine send → `find_matches` finds the batch's last block | {:.0} | {:.0} | **p50 / p99 / max {:.2} / {:.2} / {:.2} ms** ({} batches over {:.1} s; process CPU {:.0} ms, nats-server {:.0} ms) |",
        args.latency_rate,
        vis.rate.messages,
        vis.rate.blocks,
        ms(vis.percentile(0.50)),
        ms(vis.percentile(0.99)),
        ms(vis.percentile(1.0)),
        vis.latencies.len(),
        vis.took.as_secs_f64(),
        ms(vis.cpu.process),
        ms(vis.cpu.nats_server)
    );
    println!();
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    let p99 = vis.percentile(0.99);
    println!(
        "targets: ≥ 1 M block events/s per core: {:.2} M per bridge CPU-second, {:.2} M per process CPU-second ({}); relay ≥ 80 % of the slower raw rate: {:.0} % ({}); relay ≥ 80 % of pipelined raw JetStream: {:.0} % ({}); p99 visibility < 20 ms: {:.2} ms ({})",
        per_cpu(c.bridge_total()) / 1e6,
        per_cpu(c.process) / 1e6,
        verdict(per_cpu(c.bridge_total()) >= 1e6),
        100.0 * relayed.rate.blocks / slower_raw,
        verdict(relayed.rate.blocks >= 0.8 * slower_raw),
        100.0 * relayed.rate.blocks / js_pipe.blocks,
        verdict(relayed.rate.blocks >= 0.8 * js_pipe.blocks),
        ms(p99),
        verdict(p99 < Duration::from_millis(20))
    );
    Ok(())
}
