//! `kvroute-router-bench`: selections per second and latency of one router through NATS,
//! next to a bare NATS request/reply echo responder (the transport limit) in the same run.
//!
//! Per scenario (workers × overlap mode) it starts fresh servers (the test harness), an
//! indexer and a router in-process (each on its own runtime), registers synthetic workers in
//! etcd and publishes their index state (each of 64 8k-token documents held by one worker),
//! then drives `--concurrency` in-flight requests for `--seconds`: first at the echo
//! responder, then at the router. Run manually, in release:
//!
//! `cargo run --release -p kvroute-tests --bin kvroute-router-bench -- --workers 16,256`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use clap::Parser;
use futures::StreamExt;
use kvroute_common::codec::encode;
use kvroute_common::hashing::{local_block_hashes, seed_for_lora, sequence_hashes};
use kvroute_common::messages::{
    KvEvent, KvEventBatch, KvEventData, SchemaVersion, SelectRequest, SelectResponse, StorageTier,
    StoredBlock,
};
use kvroute_common::{Names, codec};
use kvroute_tests::{TestEnv, free_port, http_get, worker_card};

#[derive(Debug, Parser)]
struct Args {
    /// Fleet sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,256")]
    workers: Vec<u64>,
    /// Overlap modes, comma-separated (remote, local).
    #[arg(long, value_delimiter = ',', default_value = "remote,local")]
    modes: Vec<String>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 8192)]
    prompt_tokens: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Measured seconds per target (after one second of warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Two router replicas, requests sent to the one that does not own the partition (it
    /// forwards them to the owner); prints each replica's CPU per selection.
    #[arg(long)]
    forwarding: bool,
}

const DOCUMENTS: u32 = 64;
const BLOCK_SIZE: u32 = 16;

fn document(doc: u32, tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| doc * 1_000_000 + i).collect()
}

#[derive(Debug, Clone, Copy)]
struct Measured {
    per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    /// Selections answered in the measured seconds (and the warm-up).
    count: usize,
}

/// CPU time (user + system) of this process's threads named `name`, in seconds.
fn thread_cpu(name: &str) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let mut total = 0u64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let Some((_, after)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = after.split_whitespace().collect();
        // After the command: state is field 3, utime 14 and stime 15.
        for i in [11, 12] {
            total += fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    total as f64 / ticks
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    println!(
        "| workers | overlap | echo sel/s | router sel/s | ratio | echo p50 / p99 µs | router p50 / p99 µs |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &workers in &args.workers {
        for mode in &args.modes {
            let (echo, router, cpu) = driver.block_on(scenario(&args, workers, mode))?;
            println!(
                "| {workers} | {mode} | {:.0} | {:.0} | {:.0} % | {:.0} / {:.0} | {:.0} / {:.0} |",
                echo.per_sec,
                router.per_sec,
                100.0 * router.per_sec / echo.per_sec,
                echo.p50_us,
                echo.p99_us,
                router.p50_us,
                router.p99_us
            );
            match cpu {
                (receiver, Some(owner)) => eprintln!(
                    "{workers} {mode}: CPU per selection, forwarding replica {:.1} µs, owner {:.1} µs",
                    receiver * 1e6,
                    owner * 1e6
                ),
                (receiver, None) => eprintln!(
                    "{workers} {mode}: CPU per selection, router {:.1} µs",
                    receiver * 1e6
                ),
            }
        }
    }
    Ok(())
}

/// A runtime on its own thread running `f` until `stop` is set.
fn spawn_service<F>(name: &str, stop: Arc<AtomicBool>, f: F) -> std::thread::JoinHandle<()>
where
    F: FnOnce(
            std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>>>>
        + Send
        + 'static,
{
    let name = name.to_owned();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("svc-{name}"))
            .enable_all()
            .build()
            .expect("runtime");
        let shutdown = Box::pin(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        if let Err(e) = rt.block_on(f(shutdown)) {
            eprintln!("{name}: {e:#}");
        }
    })
}

/// The echo's and the router's figures, and the CPU per selection of the replica the requests
/// reach and (with `--forwarding`) of the owner they are forwarded to.
async fn scenario(
    args: &Args,
    workers: u64,
    mode: &str,
) -> anyhow::Result<(Measured, Measured, (f64, Option<f64>))> {
    let env = TestEnv::start()?;
    let names = Names::new(&env.namespace);
    let stop = Arc::new(AtomicBool::new(false));
    let common_args = |bin: &str| {
        vec![
            bin.to_owned(),
            "--namespace".into(),
            env.namespace.to_string(),
            "--nats-url".into(),
            env.nats.url(),
            "--etcd-endpoints".into(),
            env.etcd.endpoint(),
        ]
    };
    let mut ix_args = common_args("kvroute-indexer");
    ix_args.extend(["--http-addr".into(), format!("127.0.0.1:{}", free_port())]);
    let ix_config = kvroute_indexer::config::IndexerConfig::parse_from(ix_args);
    let indexer = spawn_service("indexer", stop.clone(), move |shutdown| {
        Box::pin(kvroute_indexer::service::run(ix_config, shutdown))
    });

    // Synthetic fleet: cards in etcd under one lease, documents in the event log.
    let nats = env.nats.connect().await?;
    let js = jetstream::new(nats.clone());
    let mut etcd = env.etcd.connect().await?;
    let lease = etcd.lease_grant(600, None).await?.id();
    for id in 1..=workers {
        let card = worker_card(&names, id, "bench");
        let opts = etcd_client::PutOptions::new().with_lease(lease);
        etcd.put(names.worker_key(id), encode(&card)?.to_vec(), Some(opts))
            .await?;
    }
    let start = Instant::now();
    while js.get_stream(names.events_stream()).await.is_err() {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(30),
            "no events stream"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seed = seed_for_lora(None);
    let mut next_event = std::collections::HashMap::new();
    for doc in 0..DOCUMENTS {
        let worker = u64::from(doc) % workers + 1;
        let local = local_block_hashes(
            &document(doc, args.prompt_tokens),
            BLOCK_SIZE as usize,
            seed,
        );
        let seq = sequence_hashes(&local, seed);
        let event_id = next_event.entry(worker).or_insert(0u64);
        let mut events = Vec::new();
        if *event_id == 0 {
            events.push(KvEvent {
                event_id: 0,
                data: KvEventData::Cleared,
            });
            *event_id = 1;
        }
        events.push(KvEvent {
            event_id: *event_id,
            data: KvEventData::Stored {
                parent_hash: None,
                blocks: local
                    .iter()
                    .zip(&seq)
                    .map(|(l, s)| StoredBlock {
                        block_hash: *s,
                        tokens_hash: *l,
                    })
                    .collect(),
                tier: StorageTier::Device,
            },
        });
        *event_id += 1;
        let batch = KvEventBatch {
            v: SchemaVersion::CURRENT,
            worker_id: worker,
            dp_rank: 0,
            events,
            ts: 0,
        };
        js.publish(names.kv_events(worker), encode(&batch)?)
            .await?
            .await?;
    }

    let http_port = free_port();
    let mut r_args = common_args("kvroute-router");
    r_args.extend([
        "--router-id".into(),
        "bench".into(),
        "--http-addr".into(),
        format!("127.0.0.1:{http_port}"),
        "--overlap-mode".into(),
        mode.to_owned(),
        "--seed".into(),
        "1".into(),
    ]);
    let ids: &[&str] = if args.forwarding {
        &["bench", "bench-b"]
    } else {
        &["bench"]
    };
    let mut routers = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let port = if i == 0 { http_port } else { free_port() };
        let mut r_args = r_args.clone();
        let at = r_args.iter().position(|a| a == "bench").expect("router id");
        r_args[at] = (*id).to_owned();
        let at = r_args
            .iter()
            .position(|a| a == "--http-addr")
            .expect("http")
            + 1;
        r_args[at] = format!("127.0.0.1:{port}");
        let r_config = kvroute_router::service::RouterConfig::parse_from(r_args);
        let prepared = kvroute_router::service::Prepared::new(
            r_config,
            &kvroute_router::registry::RouterPluginRegistry::with_builtins(),
        )?;
        routers.push(spawn_service(id, stop.clone(), move |shutdown| {
            Box::pin(kvroute_router::service::run(prepared, shutdown))
        }));
        let start = Instant::now();
        while !matches!(http_get(port, "/readyz"), Some((200, _))) {
            anyhow::ensure!(
                start.elapsed() < Duration::from_secs(60),
                "router {id} not ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Every replica registered, and watched by the others.
    let start = Instant::now();
    loop {
        let registered = etcd
            .get(
                names.routers_prefix(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await?
            .count();
        if registered == ids.len() as i64 {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(30),
            "routers not registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let owner = kvroute_router::decide::owner::owner(
        ids.iter().copied(),
        "bench",
        kvroute_common::messages::WorkerRole::Aggregated,
    )
    .expect("an owner");
    let receiver = ids.iter().copied().find(|id| *id != owner).unwrap_or(owner);
    let payloads: Vec<bytes::Bytes> = (0..DOCUMENTS)
        .map(|doc| {
            encode(&SelectRequest {
                model: "bench".into(),
                token_ids: Some(document(doc, args.prompt_tokens)),
                ..SelectRequest::default()
            })
        })
        .collect::<Result<_, _>>()?;
    // Every document is found in the index before measuring.
    let start = Instant::now();
    loop {
        let reply = nats
            .request(names.select(), payloads[DOCUMENTS as usize - 1].clone())
            .await?;
        if let SelectResponse::Ok(r) = codec::decode::<SelectResponse>(&reply.payload)?
            && r.overlap_blocks
                .get(&StorageTier::Device)
                .copied()
                .unwrap_or(0)
                > 0
        {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(60),
            "index never caught up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The echo responder answers with a reply of a router reply's size.
    let echo_subject = format!("kvroute-bench.{}.echo", env.namespace);
    let echo_reply = nats
        .request(names.select(), payloads[0].clone())
        .await?
        .payload;
    let echo_nats = env.nats.connect().await?;
    let echo_stop = stop.clone();
    let echo = spawn_service("echo", echo_stop, move |shutdown| {
        Box::pin(async move {
            let mut sub = echo_nats.subscribe(echo_subject).await?;
            let mut shutdown = shutdown;
            loop {
                tokio::select! {
                    Some(msg) = sub.next() => {
                        if let Some(inbox) = msg.reply {
                            echo_nats.publish(inbox, echo_reply.clone()).await?;
                        }
                    }
                    _ = &mut shutdown => return Ok(()),
                }
            }
        })
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let echo_subject = format!("kvroute-bench.{}.echo", env.namespace);
    let echo_result = drive(&nats, &echo_subject, &payloads, args).await?;
    let cpu_before = (
        thread_cpu(&format!("svc-{receiver}")),
        thread_cpu(&format!("svc-{owner}")),
    );
    let router_result = drive(&nats, &names.router_select(receiver), &payloads, args).await?;
    let cpu_after = (
        thread_cpu(&format!("svc-{receiver}")),
        thread_cpu(&format!("svc-{owner}")),
    );
    let per = |before: f64, after: f64| (after - before) / router_result.count.max(1) as f64;
    let cpu = (
        per(cpu_before.0, cpu_after.0),
        (receiver != owner).then(|| per(cpu_before.1, cpu_after.1)),
    );
    let (_, metrics) = http_get(http_port, "/metrics").context("metrics")?;
    for line in metrics.lines().filter(|l| {
        l.starts_with("kvroute_router_errors_total")
            || l.starts_with("kvroute_router_overlap_fallbacks")
    }) {
        eprintln!("{workers} {mode}: {line}");
    }
    stop.store(true, Ordering::Relaxed);
    for t in routers.into_iter().chain([indexer, echo]) {
        let _ = t.join();
    }
    etcd.lease_revoke(lease).await.ok();
    Ok((echo_result, router_result, cpu))
}

/// `concurrency` loops of request → reply for one warm-up second, then `seconds` measured.
async fn drive(
    nats: &async_nats::Client,
    subject: &str,
    payloads: &[bytes::Bytes],
    args: &Args,
) -> anyhow::Result<Measured> {
    let warmup = Duration::from_secs(1);
    let measured = Duration::from_secs(args.seconds);
    let begin = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        let nats = nats.clone();
        let subject = subject.to_owned();
        let payloads = payloads.to_vec();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut answered = 0usize;
            let mut i = c;
            loop {
                let now = Instant::now();
                let elapsed = now.duration_since(begin);
                if elapsed >= warmup + measured {
                    return Ok::<_, anyhow::Error>((latencies, answered));
                }
                let payload = payloads[i % payloads.len()].clone();
                i += 7;
                nats.request(subject.clone(), payload).await?;
                answered += 1;
                if elapsed >= warmup {
                    latencies.push(now.elapsed().as_secs_f64() * 1e6);
                }
            }
        }));
    }
    let mut all = Vec::new();
    let mut count = 0;
    for t in tasks {
        let (latencies, answered) = t.await??;
        all.extend(latencies);
        count += answered;
    }
    all.sort_by(f64::total_cmp);
    let pct = |p: f64| all[((all.len() as f64 - 1.0) * p) as usize];
    Ok(Measured {
        per_sec: all.len() as f64 / measured.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        count,
    })
}
