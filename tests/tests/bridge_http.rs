//! The bridge's HTTP side against real nats-server and etcd, with a fake engine in-process:
//! it registers the engine's card (facts from the engine's own endpoints), publishes its load
//! per rank, forwards GenerateRequests as streamed completions, deregisters an engine whose
//! `/health` fails and registers it again when it recovers.

mod fake_engine;

use std::time::{Duration, Instant};

use clap::Parser as _;
use fake_engine::{EngineState, FakeEngine, Kind};
use futures::StreamExt;
use kvroute_bridge::BridgeArgs;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateErrorCode, GenerateReply, GenerateRequest, GenerateResponse, LifecycleKind,
    RequestLifecycle, WorkerCard, WorkerLoad,
};
use kvroute_common::{Names, WorkerId};
use kvroute_tests::{TestEnv, free_port, http_get};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use uuid::Uuid;

const TIMEOUT: Duration = Duration::from_secs(15);
const LEASE_TTL: Duration = Duration::from_secs(2);
const WORKER: WorkerId = 42;

fn state(load: Vec<(u64, u64, f64)>) -> EngineState {
    EngineState {
        healthy: true,
        model: "Qwen/Qwen3-0.6B".into(),
        block_size: 16,
        num_gpu_blocks: 1000,
        dp_size: load.len() as u32,
        load,
        cached_tokens: Some(32),
        chunk_delay: Duration::from_millis(5),
        max_context: 4096,
        abort_after: None,
        prefix_cache: Vec::new(),
        reset_succeeds: true,
        resets: 0,
    }
}

struct Bridge {
    http_port: u16,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Bridge {
    fn start(env: &TestEnv, engine: &FakeEngine, kind: &str, extra: &[&str]) -> Self {
        let http_port = free_port();
        let mut argv: Vec<String> = vec!["kvroute-bridge".into()];
        argv.extend(env.server_args());
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{http_port}");
        let worker = WORKER.to_string();
        let url = engine.url();
        argv.extend(
            [
                "--engine",
                kind,
                "--engine-url",
                &url,
                "--zmq-endpoint",
                &zmq,
                "--worker-id",
                &worker,
                "--health-interval-ms",
                "100",
                "--health-failures",
                "2",
                "--load-interval-ms",
                "100",
                "--lease-ttl-secs",
                "2",
                "--http-addr",
                &http,
            ]
            .map(String::from),
        );
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = BridgeArgs::try_parse_from(argv).expect("flags parse");
        let engines = args.engines().expect("flags are valid");
        let (stop, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(kvroute_bridge::run::run(args, engines, async {
            let _ = stop_rx.await;
        }));
        Self {
            http_port,
            stop: Some(stop),
            task,
        }
    }

    async fn get(&mut self, path: &str) -> Option<(u16, String)> {
        if self.task.is_finished() {
            panic!("the bridge ended: {:?}", (&mut self.task).await);
        }
        let (port, path) = (self.http_port, path.to_owned());
        tokio::task::spawn_blocking(move || http_get(port, &path))
            .await
            .unwrap()
    }

    async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(TIMEOUT, self.task)
            .await
            .expect("the bridge stops in time")
            .unwrap()
            .expect("the bridge ends cleanly");
    }
}

async fn read_card(etcd: &mut etcd_client::Client, names: &Names) -> Option<WorkerCard> {
    let kvs = etcd.get(names.worker_key(WORKER), None).await.ok()?;
    let kv = kvs.kvs().first()?;
    Some(decode(kv.value()).expect("a WorkerCard"))
}

/// Waits until the card is present (`true`) or gone; returns it and how long that took.
async fn wait_card(
    etcd: &mut etcd_client::Client,
    names: &Names,
    present: bool,
    within: Duration,
) -> (Option<WorkerCard>, Duration) {
    let start = Instant::now();
    loop {
        let c = read_card(etcd, names).await;
        if c.is_some() == present {
            return (c, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "card {} after {within:?}",
            if present { "absent" } else { "still present" }
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn next_load(loads: &mut async_nats::Subscriber) -> WorkerLoad {
    let msg = tokio::time::timeout(TIMEOUT, loads.next())
        .await
        .expect("a load report in time")
        .expect("subscribed");
    decode(&msg.payload).expect("a WorkerLoad")
}

async fn generate(
    nats: &async_nats::Client,
    names: &Names,
    req: &GenerateRequest,
) -> GenerateResponse {
    generate_raw(nats, names, encode(req).unwrap()).await
}

async fn generate_raw(
    nats: &async_nats::Client,
    names: &Names,
    bytes: bytes::Bytes,
) -> GenerateResponse {
    let msg = tokio::time::timeout(TIMEOUT, nats.request(names.worker_requests(WORKER), bytes))
        .await
        .expect("a reply in time")
        .expect("the request was delivered");
    decode(&msg.payload).expect("a GenerateResponse")
}

fn request(tokens: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: Uuid::new_v4(),
        token_ids: Some((1..=tokens).collect()),
        max_tokens,
        ..GenerateRequest::default()
    }
}

fn ok(r: GenerateResponse) -> GenerateReply {
    match r {
        GenerateResponse::Ok(r) => r,
        GenerateResponse::Error(e) => panic!("the request failed: {e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_engine_registers_reports_serves_and_comes_back_after_failing() {
    let env = TestEnv::start().unwrap();
    let engine = FakeEngine::start(Kind::Vllm, state(vec![(3, 2, 0.25)])).await;
    let nats = env.nats.connect().await.unwrap();
    let mut etcd = env.etcd.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut loads = nats.subscribe(names.load(WORKER)).await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(WORKER)).await.unwrap();
    let mut bridge = Bridge::start(&env, &engine, "vllm", &[]);

    // The card carries the engine's own facts.
    let (card, _) = wait_card(&mut etcd, &names, true, TIMEOUT).await;
    let card = card.unwrap();
    assert_eq!(card.model, "Qwen/Qwen3-0.6B");
    assert_eq!((card.block_size, card.total_kv_blocks), (16, 1000));
    assert_eq!((card.dp_start_rank, card.dp_size), (0, 1));
    assert_eq!(card.http_url.as_deref(), Some(engine.url().as_str()));
    assert_eq!(card.software_version, "vllm 0.32.0");
    assert_eq!(
        card.labels.get("kvroute.bridge/engine").map(String::as_str),
        Some("vllm")
    );
    assert_eq!(card.request_subject, names.worker_requests(WORKER));

    // Loads: the engine's numbers, seq increasing.
    let first = next_load(&mut loads).await;
    assert_eq!((first.worker_id, first.dp_rank), (WORKER, 0));
    assert_eq!((first.active_requests, first.waiting_requests), (3, 2));
    assert_eq!((first.kv_used_blocks, first.total_kv_blocks), (250, 1000));
    assert_eq!(first.new_requests, None);
    let second = next_load(&mut loads).await;
    assert!(
        second.seq > first.seq && second.ts >= first.ts,
        "{first:?} {second:?}"
    );
    engine.set(|s| s.load[0] = (1, 0, 0.5));
    let changed = loop {
        let l = next_load(&mut loads).await;
        if l.active_requests == 1 {
            break l;
        }
    };
    assert_eq!((changed.waiting_requests, changed.kv_used_blocks), (0, 500));

    // A request: streamed through the engine, timed, with the engine's cached tokens.
    let req = request(40, 5);
    let reply = ok(generate(&nats, &names, &req).await);
    assert_eq!(
        (reply.request_id, reply.worker_id, reply.dp_rank),
        (req.request_id, WORKER, 0)
    );
    assert_eq!(
        (
            reply.prompt_tokens,
            reply.cached_tokens,
            reply.output_tokens
        ),
        (40, 32, 5)
    );
    assert!(
        reply.ttft_ms > 0.0 && reply.latency_ms > reply.ttft_ms,
        "{reply:?}"
    );
    let sent = engine.completions.lock().unwrap().last().cloned().unwrap();
    assert_eq!(sent.body["prompt"].as_array().unwrap().len(), 40);
    assert_eq!(sent.body["model"], "Qwen/Qwen3-0.6B");
    assert_eq!(sent.body["max_tokens"], 5);
    assert_eq!(
        (sent.body["stream"].clone(), sent.body["ignore_eos"].clone()),
        (true.into(), true.into())
    );
    assert_eq!(sent.body["stream_options"]["include_usage"], true);
    assert_eq!(
        sent.header("x-request-id"),
        Some(req.request_id.to_string().as_str())
    );
    assert_eq!(
        sent.header("x-data-parallel-rank"),
        None,
        "one rank: no rank named"
    );
    // Its lifecycle: prefill done at the first token, then finished.
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        let msg = tokio::time::timeout(TIMEOUT, lifecycle.next())
            .await
            .unwrap()
            .unwrap();
        let e: RequestLifecycle = decode(&msg.payload).unwrap();
        if e.request_id == req.request_id {
            kinds.push(e.kind);
        }
    }
    assert!(
        matches!(kinds[0], LifecycleKind::PrefillDone { .. }),
        "{kinds:?}"
    );
    assert_eq!(kinds[1], LifecycleKind::Finished { output_tokens: 5 });

    // Refusals: hashes only, and bytes that are no request.
    let hashed = GenerateRequest {
        token_ids: None,
        block_hashes: Some(vec![1, 2]),
        block_size: Some(16),
        ..request(1, 1)
    };
    let GenerateResponse::Error(e) = generate(&nats, &names, &hashed).await else {
        panic!("block hashes alone cannot run on an engine");
    };
    assert_eq!(e.code, GenerateErrorCode::BadRequest);
    assert!(e.message.contains("token ids"), "{}", e.message);
    let GenerateResponse::Error(e) =
        generate_raw(&nats, &names, bytes::Bytes::from_static(b"\xc1")).await
    else {
        panic!("garbage is refused");
    };
    assert_eq!(
        (e.code, e.request_id),
        (GenerateErrorCode::BadRequest, None)
    );
    // The engine's own refusal keeps its status's meaning and its message.
    let GenerateResponse::Error(e) = generate(&nats, &names, &request(4096, 1)).await else {
        panic!("a prompt above the context length is refused");
    };
    assert_eq!(e.code, GenerateErrorCode::BadRequest);
    assert!(
        e.message.contains("maximum context length is 4096"),
        "{}",
        e.message
    );

    let (status, _) = bridge.get("/readyz").await.unwrap();
    assert_eq!(status, 200);

    // /health fails: deregistered at once (well within the lease TTL + 2 s).
    engine.set(|s| s.healthy = false);
    let (_, gone_after) =
        wait_card(&mut etcd, &names, false, LEASE_TTL + Duration::from_secs(2)).await;
    eprintln!("card removed {gone_after:?} after /health began failing");
    let (status, body) = bridge.get("/readyz").await.unwrap();
    assert_eq!((status, body.trim()), (503, "not registered: vllm-42"));

    // Recovery: a new registration, a new incarnation, and load seqs that keep increasing.
    let before = next_load_or_none(&mut loads).await;
    engine.set(|s| s.healthy = true);
    let (card, _) = wait_card(&mut etcd, &names, true, TIMEOUT).await;
    assert_eq!(card.unwrap().block_size, 16);
    let after = next_load(&mut loads).await;
    if let Some(before) = before {
        assert!(after.seq > before.seq, "{before:?} then {after:?}");
    }
    assert!(after.seq > changed.seq);
    let reply = ok(generate(&nats, &names, &request(20, 2)).await);
    assert_eq!(reply.output_tokens, 2);
    let (_, metrics) = bridge.get("/metrics").await.unwrap();
    for line in [
        "kvroute_bridge_registrations_total{engine=\"vllm-42\",event=\"registered\"} 1",
        "kvroute_bridge_registrations_total{engine=\"vllm-42\",event=\"recovered\"} 1",
        "kvroute_bridge_registrations_total{engine=\"vllm-42\",event=\"deregistered\"} 1",
        "kvroute_bridge_requests_total{engine=\"vllm-42\",outcome=\"bad_request\"} 3",
        "kvroute_bridge_requests_total{engine=\"vllm-42\",outcome=\"ok\"} 2",
        "kvroute_bridge_registered{engine=\"vllm-42\"} 1",
        "kvroute_bridge_engines_registered 1",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }
    assert!(
        metrics
            .contains("kvroute_bridge_health_probes_total{engine=\"vllm-42\",outcome=\"failed\"}")
    );

    // Shutdown deregisters.
    bridge.shutdown().await;
    assert!(read_card(&mut etcd, &names).await.is_none());
}

/// The latest load report already queued, if any (drains the subscription without waiting).
async fn next_load_or_none(loads: &mut async_nats::Subscriber) -> Option<WorkerLoad> {
    let mut last = None;
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(300), loads.next()).await {
        last = Some(decode(&msg.payload).expect("a WorkerLoad"));
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_engine_with_two_ranks() {
    let env = TestEnv::start().unwrap();
    let mut s = state(vec![(5, 2, 0.5), (0, 0, 0.0)]);
    s.cached_tokens = None; // SGLang without --enable-cache-report
    let engine = FakeEngine::start(Kind::Sglang, s).await;
    let nats = env.nats.connect().await.unwrap();
    let mut etcd = env.etcd.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut loads = nats.subscribe(names.load(WORKER)).await.unwrap();
    let bridge = Bridge::start(&env, &engine, "sglang", &[]);

    let (card, _) = wait_card(&mut etcd, &names, true, TIMEOUT).await;
    let card = card.unwrap();
    assert_eq!(
        (card.dp_start_rank, card.dp_size),
        (0, 2),
        "dp_size from /server_info"
    );
    assert_eq!(
        (card.block_size, card.total_kv_blocks),
        (16, 1000),
        "page_size and tokens / page"
    );
    assert_eq!(card.max_num_batched_tokens, 8192);
    assert_eq!(card.software_version, "sglang 0.5.23");

    // One report per rank, each with its own increasing seq.
    let mut seen = [Vec::new(), Vec::new()];
    while seen.iter().any(|s| s.len() < 2) {
        let l = next_load(&mut loads).await;
        seen[l.dp_rank as usize].push(l);
    }
    let r0 = &seen[0][0];
    assert_eq!(
        (
            r0.active_requests,
            r0.waiting_requests,
            r0.active_prefill_tokens
        ),
        (5, 2, 200)
    );
    assert_eq!(r0.kv_used_blocks, 500, "num_used_tokens / page_size");
    assert_eq!(seen[1][0].active_requests, 0);
    for rank in &seen {
        assert!(rank[1].seq > rank[0].seq);
    }

    // A request for rank 1 names it the SGLang way; no cache report means 0 cached tokens.
    let req = GenerateRequest {
        dp_rank: Some(1),
        ..request(24, 3)
    };
    let reply = ok(generate(&nats, &names, &req).await);
    assert_eq!(
        (reply.dp_rank, reply.cached_tokens, reply.output_tokens),
        (1, 0, 3)
    );
    let sent = engine.completions.lock().unwrap().last().cloned().unwrap();
    assert_eq!(sent.body["routed_dp_rank"], 1);
    let req = GenerateRequest {
        dp_rank: Some(2),
        ..request(24, 3)
    };
    let GenerateResponse::Error(e) = generate(&nats, &names, &req).await else {
        panic!("rank 2 is not served");
    };
    assert_eq!(e.code, GenerateErrorCode::UnknownDpRank);
    // An abort inside the stream is the worker's failure.
    engine.set(|s| s.abort_after = Some(1));
    let GenerateResponse::Error(e) = generate(&nats, &names, &request(8, 4)).await else {
        panic!("an aborted stream fails the request");
    };
    assert_eq!(e.code, GenerateErrorCode::Unavailable);
    assert!(e.message.contains("Generation aborted."), "{}", e.message);
    engine.set(|s| s.abort_after = None);

    // Shutdown answers a request still running `cancelled`, and deregisters.
    engine.set(|s| s.chunk_delay = Duration::from_secs(1));
    let before = engine.completions.lock().unwrap().len();
    let running = {
        let (nats, names, req) = (nats.clone(), names.clone(), request(8, 50));
        tokio::spawn(async move { generate(&nats, &names, &req).await })
    };
    while engine.completions.lock().unwrap().len() == before {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bridge.shutdown().await;
    let GenerateResponse::Error(e) = running.await.unwrap() else {
        panic!("a running request is cancelled at shutdown");
    };
    assert_eq!(e.code, GenerateErrorCode::Cancelled);
    assert!(read_card(&mut etcd, &names).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_hides_its_cache_is_not_registered_until_it_tells() {
    let env = TestEnv::start().unwrap();
    let mut s = state(vec![(0, 0, 0.0)]);
    s.dp_size = 0; // no cache_config_info series on /metrics
    let engine = FakeEngine::start(Kind::Vllm, s).await;
    let mut etcd = env.etcd.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut bridge = Bridge::start(&env, &engine, "vllm", &["--block-size", "16"]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        read_card(&mut etcd, &names).await.is_none(),
        "no KV block count: no card"
    );
    let (status, body) = bridge.get("/readyz").await.unwrap();
    assert_eq!((status, body.trim()), (503, "not registered: vllm-42"));
    let (_, metrics) = bridge.get("/metrics").await.unwrap();
    assert!(
        metrics
            .contains("kvroute_bridge_registrations_total{engine=\"vllm-42\",event=\"refused\"}"),
        "{metrics}"
    );
    // The engine reports it now (e.g. done profiling): the next probe registers it.
    engine.set(|s| {
        s.dp_size = 1;
        s.num_gpu_blocks = 77;
    });
    let (card, _) = wait_card(&mut etcd, &names, true, TIMEOUT).await;
    assert_eq!(card.unwrap().total_kv_blocks, 77);
    bridge.shutdown().await;
}
