//! The real-engine path end to end without GPUs: `kvroute-mocker --engine-api vllm` workers
//! behind `kvroute-bridge` (its whole process: relay, mirror, registration, load, requests),
//! driven by `kvroute-replay` like native mocker workers. KV-aware routing through the bridge
//! reaches the native run's hit rate; the engine's metrics arrive as `WorkerLoad`s; an engine
//! whose `/health` fails leaves within the lease TTL + 2 s and comes back. One engine
//! impersonating vLLM, and one impersonating SGLang, each behind a bridge: the card the bridge
//! learns, a request through the bridge whose prompt then shows in the index, and load reports
//! whose running and waiting counts follow the engine's requests.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser as _;
use futures::StreamExt;
use kvroute_bridge::BridgeArgs;
use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateRequest, GenerateResponse, IndexQuery, IndexQueryResponse, WorkerCard, WorkerLoad,
    WorkerMatch,
};
use kvroute_lab::replay::{self, ReplayArgs};
use kvroute_mocker::engine_face::{EngineApi, EngineFleet, WorkerEndpoints};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig};
use kvroute_tests::{IndexerProcess, RouterProcess, TestEnv};
use tokio::sync::oneshot;

const WORKERS: u32 = 4;
const SPEEDUP: f64 = 50.0;
const BLOCKS: u64 = 1024;

/// A fleet of `workers` × `blocks` blocks of 64 tokens at `speedup`.
#[derive(Debug, Clone, Copy)]
struct Setup {
    workers: u32,
    blocks: u64,
    speedup: f64,
}

/// Health probes every 100 ms, deregistered after 2 failures, leases of 2 s.
const QUICK_HEALTH: &[&str] = &[
    "--health-interval-ms",
    "100",
    "--health-failures",
    "2",
    "--lease-ttl-secs",
    "2",
];

const SMALL: Setup = Setup {
    workers: WORKERS,
    blocks: BLOCKS,
    speedup: SPEEDUP,
};

fn fleet_config(setup: Setup) -> FleetConfig {
    FleetConfig {
        workers: setup.workers,
        worker_id_start: 1,
        model: "m".into(),
        engine: EngineArgs {
            block_size: 64,
            num_blocks: setup.blocks,
            ..EngineArgs::default()
        },
        speedup: setup.speedup,
        lease_ttl_secs: 2,
        load_interval_ms: 100,
        ..FleetConfig::default()
    }
}

/// `n` requests `spacing_ms` (trace time) apart; request `i` reads document `i % docs` (a
/// 4-block shared prefix of 512-token trace blocks) and then a block of its own.
fn write_trace(dir: &Path, n: u64, docs: u64, spacing_ms: u64) -> PathBuf {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let d = i % docs;
            let ids: Vec<String> = (0..4).map(|k| (d * 100 + k).to_string()).chain([(10_000 + i).to_string()]).collect();
            format!(r#"{{"timestamp": {}, "input_length": 2460, "output_length": 8, "hash_ids": [{}]}}"#, i * spacing_ms, ids.join(", "))
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// The kv mode's hit rate of one replay (of the first `limit` requests; 0: all) through the
/// routers.
async fn kv_hit_rate(env: &TestEnv, setup: Setup, trace: &Path, limit: u64) -> f64 {
    let argv: Vec<String> = [
        "kvroute-replay",
        "--trace",
        &trace.display().to_string(),
        "--limit",
        &limit.to_string(),
        "--model",
        "m",
        "--quiet",
        "--modes",
        "kv",
        "--no-reset",
        "--speedup",
        &setup.speedup.to_string(),
        "--settle-ms",
        "100",
        "--namespace",
        env.namespace.as_str(),
        "--nats-url",
        &env.nats.url(),
        "--etcd-endpoints",
        &env.etcd.endpoint(),
    ]
    .map(str::to_owned)
    .to_vec();
    let args = ReplayArgs::try_parse_from(argv).unwrap();
    let report = replay::run(&args).await.unwrap();
    assert_eq!(report.workers, setup.workers);
    let kv = &report.modes[0];
    assert_eq!(kv.mode, "kv");
    assert_eq!(
        kv.errors, 0,
        "every request served: {:?}",
        kv.errors_by_kind
    );
    kv.hit_rate
}

/// `kvroute-bridge` in-process for `engines` (an engines file), until the returned sender drops.
fn start_bridge(
    env: &TestEnv,
    dir: &Path,
    engines: &[WorkerEndpoints],
    extra: &[&str],
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let yaml: String = engines
        .iter()
        .map(|e| format!("  - engine: {}\n    engine_url: {}\n    zmq_endpoint: {}\n    zmq_replay_endpoint: {}\n    worker_id: {}\n", e.engine.as_str(), e.url(), e.zmq[0], e.replay[0], 100 + e.index))
        .collect();
    let file = dir.join("engines.yaml");
    std::fs::write(&file, format!("engines:\n{yaml}")).unwrap();
    let mut argv = vec!["kvroute-bridge".to_owned()];
    argv.extend(env.server_args());
    argv.extend(["--engines-file", &file.display().to_string()].map(String::from));
    argv.extend(extra.iter().map(|s| s.to_string()));
    let args = BridgeArgs::try_parse_from(argv).unwrap();
    let engines = args.engines().unwrap();
    let (stop, stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(kvroute_bridge::run::run(args, engines, async {
        let _ = stop_rx.await;
    }));
    (stop, task)
}

async fn workers_registered(env: &TestEnv) -> usize {
    let mut etcd = env.etcd.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let prefix = names.worker_key(0);
    let prefix = prefix.trim_end_matches('0');
    etcd.get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .kvs()
        .len()
}

async fn wait_until(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

/// The kv hit rate of `trace` on native mocker workers and on the same engines impersonating
/// vLLM behind the bridge; the bridged fleet is left running for more checks.
async fn native_and_bridged(
    setup: Setup,
    trace: &Path,
    limit: u64,
    dir: &Path,
    bridge_flags: &[&str],
) -> (f64, f64, Bridged) {
    let native = {
        let env = TestEnv::start().unwrap();
        let _indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
        let _router = RouterProcess::start(&env, "r", &[]).unwrap();
        let names = Names::new(&env.namespace);
        let fleet = Fleet::start(
            &fleet_config(setup),
            env.nats.connect().await.unwrap(),
            env.etcd.connect().await.unwrap(),
            &names,
        )
        .await
        .unwrap();
        let rate = kv_hit_rate(&env, setup, trace, limit).await;
        fleet.shutdown().await;
        rate
    };
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let router = RouterProcess::start(&env, "r", &[]).unwrap();
    let mut config = fleet_config(setup);
    config.face.engine_api = EngineApi::Vllm;
    config.face.engine_http_port = 0;
    config.face.engine_zmq_port = 0;
    config.face.engine_replay_port = 0;
    let engines = EngineFleet::start(&config).await.unwrap();
    let endpoints = engines.endpoints();
    let (stop, bridge) = start_bridge(&env, dir, &endpoints, bridge_flags);
    wait_until(
        "every engine registered",
        Duration::from_secs(20),
        async || workers_registered(&env).await == setup.workers as usize,
    )
    .await;
    let bridged = kv_hit_rate(&env, setup, trace, limit).await;
    eprintln!("kv hit rate: native {native:.4}, through the bridge {bridged:.4}");
    (
        native,
        bridged,
        Bridged {
            env,
            _indexer: indexer,
            _router: router,
            engines,
            endpoints,
            stop,
            bridge,
        },
    )
}

struct Bridged {
    env: TestEnv,
    _indexer: IndexerProcess,
    _router: RouterProcess,
    engines: EngineFleet,
    endpoints: Vec<WorkerEndpoints>,
    stop: oneshot::Sender<()>,
    bridge: tokio::task::JoinHandle<anyhow::Result<()>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mocker_as_vllm_behind_bridges_routes_like_native_workers() {
    let dir = tempfile::tempdir().unwrap();
    // 48 requests over 8 shared documents, ~100 ms of wall time apart.
    let trace = write_trace(dir.path(), 48, 8, 5_000);
    let (native, bridged, b) = native_and_bridged(SMALL, &trace, 0, dir.path(), QUICK_HEALTH).await;
    assert!(
        native > 0.5,
        "the trace rewards KV-aware routing (native {native})"
    );
    assert!(
        (bridged - native).abs() <= 0.02,
        "through the bridge {bridged} vs native {native}"
    );
    let (env, endpoints) = (&b.env, &b.endpoints);
    // The engine's /metrics arrive as WorkerLoads: its capacity, with seq increasing.
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut loads = nats.subscribe(names.load(100)).await.unwrap();
    let mut seqs = Vec::new();
    while seqs.len() < 3 {
        let msg = tokio::time::timeout(Duration::from_secs(5), loads.next())
            .await
            .expect("load reports")
            .unwrap();
        let load: WorkerLoad = decode(&msg.payload).unwrap();
        assert_eq!((load.worker_id, load.total_kv_blocks), (100, BLOCKS));
        assert!(
            load.new_requests.is_none(),
            "engines do not name the requests they count"
        );
        seqs.push(load.seq);
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");

    // An engine whose /health fails leaves within the lease TTL + 2 s, and comes back.
    let http = reqwest::Client::new();
    let url = endpoints[0].url();
    http.post(format!("{url}/kvroute/fail-health"))
        .send()
        .await
        .unwrap();
    let gone = wait_until(
        "the failing engine deregistered",
        Duration::from_secs(4),
        async || workers_registered(env).await == WORKERS as usize - 1,
    )
    .await;
    http.post(format!("{url}/kvroute/recover-health"))
        .send()
        .await
        .unwrap();
    wait_until(
        "the engine registered again",
        Duration::from_secs(10),
        async || workers_registered(env).await == WORKERS as usize,
    )
    .await;
    eprintln!("deregistered {gone:?} after /health began failing");

    drop(b.stop);
    b.bridge.await.unwrap().unwrap();
    assert_eq!(
        workers_registered(env).await,
        0,
        "a stopped bridge deregisters its engines"
    );
    b.engines.shutdown().await;
}

/// The card registered for worker `id`.
async fn card(env: &TestEnv, id: u64) -> WorkerCard {
    let mut etcd = env.etcd.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let got = etcd.get(names.worker_key(id), None).await.unwrap();
    let kv = got.kvs().first().expect("the card");
    decode(kv.value()).unwrap()
}

/// The next load report of the subscription that satisfies `want` (within 10 s).
async fn load_where(
    loads: &mut async_nats::Subscriber,
    what: &str,
    want: impl Fn(&WorkerLoad) -> bool,
) -> WorkerLoad {
    let start = Instant::now();
    let mut last = None;
    loop {
        let left = Duration::from_secs(10).saturating_sub(start.elapsed());
        let Ok(Some(msg)) = tokio::time::timeout(left, loads.next()).await else {
            panic!("no load report with {what} within 10 s; the last: {last:?}");
        };
        let load: WorkerLoad = decode(&msg.payload).unwrap();
        if want(&load) {
            return load;
        }
        last = Some(load);
    }
}

/// A streamed completion of `prompt` that runs until dropped (at real time, 10 ms a step,
/// 20 000 tokens take minutes); returned once the engine answered its headers.
async fn long_stream(http: &reqwest::Client, url: &str, prompt: Vec<u32>) -> reqwest::Response {
    let body = serde_json::json!({
        "model": "m",
        "prompt": prompt,
        "max_tokens": 20_000,
        "stream": true,
    });
    let response = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response
}

/// One engine of `api` (2 request slots, real time) behind a bridge: the card the bridge
/// registers from the engine's own endpoints; a request on the worker's NATS subject answered
/// by the engine, whose prompt the index then holds on that worker; load reports whose running
/// and waiting counts are those of the engine's requests, back to 0 once they end.
async fn one_engine_behind_a_bridge(api: EngineApi) {
    const ID: u64 = 100;
    let dir = tempfile::tempdir().unwrap();
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let mut config = fleet_config(Setup {
        workers: 1,
        blocks: BLOCKS,
        speedup: 1.0,
    });
    config.engine.max_num_seqs = 2;
    config.face.engine_api = api;
    config.face.engine_http_port = 0;
    config.face.engine_zmq_port = 0;
    config.face.engine_replay_port = 0;
    let engines = EngineFleet::start(&config).await.unwrap();
    let endpoints = engines.endpoints();
    let url = endpoints[0].url();
    let (stop, bridge) = start_bridge(&env, dir.path(), &endpoints, QUICK_HEALTH);
    wait_until(
        "the engine registered",
        Duration::from_secs(20),
        async || workers_registered(&env).await == 1,
    )
    .await;
    let c = card(&env, ID).await;
    assert_eq!(
        (c.model.as_str(), c.block_size, c.total_kv_blocks, c.dp_size),
        ("m", 64, BLOCKS, 1)
    );
    assert_eq!(c.http_url.as_deref(), Some(url.as_str()));

    // A request through the bridge: the engine's answer, then its prompt's 4 blocks in the
    // index on this worker.
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let prompt: Vec<u32> = (1000..1000 + 4 * 64).collect();
    let request = GenerateRequest {
        request_id: uuid::Uuid::new_v4(),
        token_ids: Some(prompt.clone()),
        max_tokens: 4,
        ..GenerateRequest::default()
    };
    let reply = nats
        .request(names.worker_requests(ID), encode(&request).unwrap())
        .await
        .unwrap();
    match decode::<GenerateResponse>(&reply.payload).unwrap() {
        GenerateResponse::Ok(r) => {
            assert_eq!((r.worker_id, r.request_id), (ID, request.request_id));
            assert_eq!(
                (r.prompt_tokens, r.cached_tokens, r.output_tokens),
                (256, 0, 4)
            );
        }
        GenerateResponse::Error(e) => panic!("the request failed: {e:?}"),
    }
    let query = IndexQuery {
        model: "m".into(),
        token_ids: Some(prompt),
        block_size: Some(64),
        ..IndexQuery::default()
    };
    let mut matches: Vec<WorkerMatch> = Vec::new();
    wait_until(
        "the prompt's blocks in the index",
        Duration::from_secs(10),
        async || {
            // No responders while the indexer (started beside the bridge) has not joined its
            // queue group yet: not an answer, ask again.
            let Ok(reply) = nats
                .request(names.index_query(), encode(&query).unwrap())
                .await
            else {
                return false;
            };
            if let IndexQueryResponse::Ok(r) = decode(&reply.payload).unwrap() {
                matches = r.matches;
            }
            matches.iter().any(|m| m.device == 4)
        },
    )
    .await;
    assert_eq!(matches.len(), 1, "{matches:?}\n{}", indexer.log());
    assert_eq!(
        (matches[0].worker_id, matches[0].dp_rank, matches[0].device),
        (ID, 0, 4)
    );

    // Load: three long requests on two slots are 2 running and 1 waiting, holding blocks; once
    // their clients leave (the engines abort them) the counts go back to 0.
    let mut loads = nats.subscribe(names.load(ID)).await.unwrap();
    let idle = load_where(&mut loads, "no requests", |l| l.active_requests == 0).await;
    assert_eq!((idle.waiting_requests, idle.total_kv_blocks), (0, BLOCKS));
    let http = reqwest::Client::new();
    let mut streams = Vec::new();
    for i in 0..3u32 {
        let prompt = (0..4 * 64).map(|t| 100_000 * (i + 1) + t).collect();
        streams.push(long_stream(&http, &url, prompt).await);
    }
    let busy = load_where(&mut loads, "2 running and 1 waiting", |l| {
        (l.active_requests, l.waiting_requests) == (2, 1)
    })
    .await;
    assert!(busy.kv_used_blocks > 0, "{busy:?}");
    // SGLang reports the waiting prompt's uncached tokens; vLLM reports nothing of the kind.
    match api {
        EngineApi::Sglang => assert!(busy.active_prefill_tokens >= 256, "{busy:?}"),
        _ => assert_eq!(busy.active_prefill_tokens, 0, "{busy:?}"),
    }
    // The waiting one takes the slot of a running one that ends.
    streams.remove(0);
    load_where(&mut loads, "2 running and none waiting", |l| {
        (l.active_requests, l.waiting_requests) == (2, 0)
    })
    .await;
    drop(streams);
    let done = load_where(&mut loads, "none running or waiting", |l| {
        (l.active_requests, l.waiting_requests) == (0, 0)
    })
    .await;
    assert_eq!(done.kv_used_blocks, 0, "{done:?}");

    drop(stop);
    bridge.await.unwrap().unwrap();
    engines.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mocker_as_vllm_behind_a_bridge_reports_its_requests_as_load() {
    one_engine_behind_a_bridge(EngineApi::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mocker_as_sglang_behind_a_bridge_registers_indexes_and_reports_load() {
    one_engine_behind_a_bridge(EngineApi::Sglang).await;
}
