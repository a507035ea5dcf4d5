//! kvroute-mocker against real servers: a fleet registers, serves GenerateRequests with prefix
//! caching, publishes KV events that rebuild its caches exactly, answers resync and reset,
//! refuses bad requests without dying, and deregisters on shutdown (in-process and on SIGTERM).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateErrorCode, GenerateReply, GenerateRequest, GenerateResponse, KvEventBatch, KvEventData,
    LifecycleKind, RequestLifecycle, WorkerCard, WorkerLoad,
};
use kvroute_common::{Names, WorkerId};
use kvroute_indexer::{IndexConfig, RadixIndex};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig, SPEEDUP_LABEL, StopMode};
use kvroute_mocker::{Engine, SimRequest};
use kvroute_tests::{Supervised, TestEnv, free_port, http_get};
use uuid::Uuid;

const TIMEOUT: Duration = Duration::from_secs(20);
const BLOCK: u32 = 16;

fn fleet_config(workers: u32) -> FleetConfig {
    FleetConfig {
        workers,
        worker_id_start: 1,
        model: "m".into(),
        engine: EngineArgs {
            block_size: BLOCK,
            num_blocks: 32,
            ..EngineArgs::default()
        },
        speedup: 100.0,
        lease_ttl_secs: 2,
        load_interval_ms: 100,
        ..FleetConfig::default()
    }
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| seed * 100_000 + i).collect()
}

fn request(tokens: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: Uuid::new_v4(),
        token_ids: Some(tokens.to_vec()),
        max_tokens,
        ..GenerateRequest::default()
    }
}

async fn generate(
    nats: &async_nats::Client,
    names: &Names,
    worker: WorkerId,
    bytes: bytes::Bytes,
) -> GenerateResponse {
    let msg = tokio::time::timeout(TIMEOUT, nats.request(names.worker_requests(worker), bytes))
        .await
        .expect("reply in time")
        .expect("request delivered");
    decode(&msg.payload).expect("a GenerateResponse")
}

async fn generate_ok(
    nats: &async_nats::Client,
    names: &Names,
    worker: WorkerId,
    req: &GenerateRequest,
) -> GenerateReply {
    match generate(nats, names, worker, encode(req).unwrap()).await {
        GenerateResponse::Ok(r) => r,
        GenerateResponse::Error(e) => panic!("request failed: {e:?}"),
    }
}

async fn cards(etcd: &mut etcd_client::Client, names: &Names) -> Vec<WorkerCard> {
    let resp = etcd
        .get(
            names.workers_prefix(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    resp.kvs()
        .iter()
        .map(|kv| decode(kv.value()).unwrap())
        .collect()
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !check().await {
        assert!(start.elapsed() < TIMEOUT, "{what} within {TIMEOUT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every event batch in the stream, in stream order.
async fn all_batches(js: &jetstream::Context, names: &Names) -> Vec<KvEventBatch> {
    let mut stream = js.get_stream(names.events_stream()).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::new();
    while out.len() < total {
        let msg = tokio::time::timeout(TIMEOUT, messages.next())
            .await
            .expect("stream message")
            .unwrap()
            .unwrap();
        out.push(decode(&msg.payload).unwrap());
    }
    out
}

/// The same requests, one after another, on a local engine: its cache ends where the
/// worker's must.
fn local_replica(prompts: &[(Vec<u32>, u32)]) -> Engine {
    let mut engine = Engine::new(fleet_config(1).engine.engine_config()).unwrap();
    let mut now = Duration::ZERO;
    for (tokens, max_tokens) in prompts {
        let req = SimRequest::from_tokens(Uuid::new_v4(), tokens, *max_tokens, BLOCK, None);
        engine.submit(req, now).unwrap();
        while let Some(t) = engine.next_wakeup() {
            now = t;
            engine.advance_to(now);
        }
    }
    engine
}

#[tokio::test]
async fn fleet_serves_caches_and_its_events_rebuild_the_caches_exactly() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let mut etcd = env.etcd.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle_all()).await.unwrap();
    let mut loads = nats.subscribe(names.load_all()).await.unwrap();
    let fleet = Fleet::start(&fleet_config(3), nats.clone(), etcd.clone(), &names)
        .await
        .unwrap();
    assert_eq!(fleet.worker_ids(), vec![1, 2, 3]);

    let registered = cards(&mut etcd, &names).await;
    assert_eq!(registered.len(), 3);
    for card in &registered {
        assert_eq!(card.request_subject, names.worker_requests(card.worker_id));
        assert_eq!((card.block_size, card.total_kv_blocks), (BLOCK, 32));
        assert_eq!(card.labels[SPEEDUP_LABEL], "100");
    }

    // A repeated prompt hits the cache the second time (all full blocks but the last token).
    let first = request(&prompt(1, 100), 8);
    let r1 = generate_ok(&nats, &names, 1, &first).await;
    assert_eq!(
        (r1.worker_id, r1.prompt_tokens, r1.cached_tokens),
        (1, 100, 0)
    );
    assert_eq!(r1.output_tokens, 8);
    assert!(r1.ttft_ms > 0.0 && r1.latency_ms >= r1.ttft_ms, "{r1:?}");
    let again = request(&prompt(1, 100), 8);
    let r2 = generate_ok(&nats, &names, 1, &again).await;
    assert_eq!(r2.cached_tokens, 96, "6 full blocks of 16 were cached");
    assert!(r2.ttft_ms < r1.ttft_ms, "a cached prefix prefills faster");

    // More distinct prompts than the 32-block cache holds: eviction happens.
    let mut sent = vec![(prompt(1, 100), 8), (prompt(1, 100), 8)];
    for seed in 2..8 {
        let tokens = prompt(seed, 90);
        generate_ok(&nats, &names, 1, &request(&tokens, 4)).await;
        sent.push((tokens, 4));
    }
    // Worker 2 serves one prompt; worker 3 none.
    generate_ok(&nats, &names, 2, &request(&prompt(9, 40), 2)).await;

    // Lifecycle events and load reports flow.
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        let msg = tokio::time::timeout(TIMEOUT, lifecycle.next())
            .await
            .unwrap()
            .unwrap();
        let event: RequestLifecycle = decode(&msg.payload).unwrap();
        if event.request_id == first.request_id {
            kinds.push(event.kind);
        }
    }
    assert_eq!(
        kinds,
        vec![
            LifecycleKind::PrefillDone { cached_tokens: 0 },
            LifecycleKind::Finished { output_tokens: 8 }
        ]
    );
    let msg = tokio::time::timeout(TIMEOUT, loads.next())
        .await
        .unwrap()
        .unwrap();
    let load: WorkerLoad = decode(&msg.payload).unwrap();
    assert_eq!(load.total_kv_blocks, 32);

    // Resync flushes the publisher before answering: afterwards the stream has everything.
    let reply = nats
        .request(names.worker_resync(1), "".into())
        .await
        .unwrap();
    assert_eq!(&reply.payload[..], b"ok");
    let js = jetstream::new(nats.clone());
    let batches = all_batches(&js, &names).await;
    let expected = local_replica(&sent);
    let held = expected.cache().held_blocks().len() as u64;
    assert!(held > 0 && held <= 32);

    // Replaying up to the resync's Cleared, and replaying everything, give the same state:
    // exactly the blocks the engine holds.
    let resync_at = batches
        .iter()
        .position(|b| {
            b.worker_id == 1
                && b.events
                    .iter()
                    .any(|e| e.event_id > 0 && e.data == KvEventData::Cleared)
        })
        .expect("the resync's Cleared is in the stream");
    let mut before = RadixIndex::new(IndexConfig::default());
    let mut after = RadixIndex::new(IndexConfig::default());
    for (i, b) in batches.iter().enumerate() {
        // Batches coalesce events, so stop short of the resync exactly by event.
        if i < resync_at {
            assert_eq!(before.apply_batch(b).refused, 0);
        } else if i == resync_at {
            let cut = b
                .events
                .iter()
                .position(|e| e.event_id > 0 && e.data == KvEventData::Cleared);
            let head = KvEventBatch {
                events: b.events[..cut.unwrap()].to_vec(),
                ..b.clone()
            };
            before.apply_batch(&head);
        }
        assert_eq!(after.apply_batch(b).refused, 0, "every event applies");
    }
    for index in [&before, &after] {
        let stats = index.stats();
        let blocks_of = |w: WorkerId| {
            stats
                .blocks_per_worker
                .iter()
                .find(|b| b.worker_id == w)
                .map_or(0, |b| b.blocks)
        };
        assert_eq!(
            blocks_of(1),
            held,
            "worker 1 holds exactly the engine's blocks"
        );
        assert_eq!(blocks_of(2), 2);
        assert_eq!(blocks_of(3), 0);
        for (tokens, _) in &sent {
            let m = index.find_matches_for_tokens(tokens, BLOCK as usize, None);
            let device = m
                .matches
                .iter()
                .find(|m| m.worker_id == 1)
                .map_or(0, |m| m.device);
            let hashes =
                kvroute_common::hashing::BlockHashes::of_tokens(tokens, BLOCK as usize, None);
            assert_eq!(device, expected.cache().cached_prefix(&hashes));
        }
    }

    // Reset: the cache is gone (and `Cleared` is published), so the prompt is cold again.
    let reply = nats
        .request(names.worker_reset(1), "".into())
        .await
        .unwrap();
    assert_eq!(&reply.payload[..], b"ok");
    let cold = generate_ok(&nats, &names, 1, &request(&prompt(1, 100), 2)).await;
    assert_eq!(cold.cached_tokens, 0);
    let last_cleared = all_batches(&js, &names)
        .await
        .into_iter()
        .filter(|b| b.worker_id == 1)
        .flat_map(|b| b.events)
        .filter(|e| e.data == KvEventData::Cleared)
        .count();
    assert_eq!(last_cleared, 3, "start, resync, reset");

    fleet.shutdown().await;
    assert!(
        cards(&mut etcd, &names).await.is_empty(),
        "all deregistered at once"
    );
}

#[tokio::test]
async fn bad_requests_get_error_replies_and_the_worker_keeps_serving() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let etcd = env.etcd.connect().await.unwrap();
    let fleet = Fleet::start(&fleet_config(1), nats.clone(), etcd, &names)
        .await
        .unwrap();
    let code = |r: GenerateResponse| match r {
        GenerateResponse::Error(e) => e.code,
        GenerateResponse::Ok(r) => panic!("unexpectedly served: {r:?}"),
    };
    assert_eq!(
        code(generate(&nats, &names, 1, "garbage".into()).await),
        GenerateErrorCode::BadRequest
    );
    let wrong_rank = GenerateRequest {
        dp_rank: Some(4),
        ..request(&prompt(1, 40), 1)
    };
    assert_eq!(
        code(generate(&nats, &names, 1, encode(&wrong_rank).unwrap()).await),
        GenerateErrorCode::UnknownDpRank
    );
    let huge = request(&prompt(1, 33 * BLOCK), 1);
    assert_eq!(
        code(generate(&nats, &names, 1, encode(&huge).unwrap()).await),
        GenerateErrorCode::TooLarge
    );
    let empty = request(&[], 1);
    assert_eq!(
        code(generate(&nats, &names, 1, encode(&empty).unwrap()).await),
        GenerateErrorCode::BadRequest
    );
    // Block hashes instead of tokens work too.
    let tokens = prompt(2, 64);
    let hashes = kvroute_common::hashing::BlockHashes::of_tokens(&tokens, BLOCK as usize, None);
    let by_hash = GenerateRequest {
        token_ids: None,
        block_hashes: Some(hashes.local),
        block_size: Some(BLOCK),
        ..request(&[], 3)
    };
    generate_ok(&nats, &names, 1, &by_hash).await;
    let r = generate_ok(&nats, &names, 1, &request(&tokens, 3)).await;
    assert_eq!(
        r.cached_tokens, 63,
        "the hashed request's blocks are reused"
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_crashed_worker_stops_answering_and_expires_with_its_lease() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let nats = env.nats.connect().await.unwrap();
    let mut etcd = env.etcd.connect().await.unwrap();
    let mut fleet = Fleet::start(&fleet_config(2), nats.clone(), etcd.clone(), &names)
        .await
        .unwrap();
    assert!(fleet.stop_worker(2, StopMode::Crash).await);
    assert_eq!(
        cards(&mut etcd, &names).await.len(),
        2,
        "card outlives the crash"
    );
    let err = nats
        .request(
            names.worker_requests(2),
            encode(&request(&prompt(1, 20), 1)).unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        async_nats::client::RequestErrorKind::NoResponders
    );
    wait_for("the crashed worker's card expires", async || {
        cards(&mut etcd, &names).await.len() == 1
    })
    .await;
    generate_ok(&nats, &names, 1, &request(&prompt(1, 20), 1)).await;
    fleet.shutdown().await;
}

/// The `kvroute-mocker` binary (built by the harness if needed).
fn mocker_binary() -> PathBuf {
    kvroute_tests::kvroute_bin("kvroute-mocker", "kvroute-mocker").expect("kvroute-mocker builds")
}

#[tokio::test]
async fn the_binary_validates_flags_and_deregisters_on_sigterm() {
    let bin = mocker_binary();
    let help = Command::new(&bin).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--workers",
        "--worker-id-start",
        "--model",
        "--block-size",
        "--num-blocks",
        "--speedup",
        "--lease-ttl-secs",
        "--http-addr",
        "--prefill-ns-per-token",
        "[default: 8192]",
    ] {
        assert!(help.contains(flag), "--help documents {flag}:\n{help}");
    }
    let bad = Command::new(&bin)
        .args(["--workers", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--workers"), "{stderr}");
    let bad = Command::new(&bin)
        .args(["--stream-max-age-secs", "60"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains(
            "--stream-max-age-secs: must be 0 or at least --stream-duplicate-window-secs"
        ),
        "{stderr}"
    );

    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let mut etcd = env.etcd.connect().await.unwrap();
    let http_port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--workers",
        "2",
        "--worker-id-start",
        "40",
        "--speedup",
        "50",
        "--http-addr",
        &format!("127.0.0.1:{http_port}"),
        "--namespace",
        env.namespace.as_str(),
        "--nats-url",
        &env.nats.url(),
        "--etcd-endpoints",
        &env.etcd.endpoint(),
        // The first process to need the events stream creates it with its --stream-* flags.
        "--stream-max-bytes",
        "33554432",
        "--stream-max-age-secs",
        "7200",
    ];
    let spec = Supervised::new(
        &bin,
        args.iter().map(|s| s.to_string()).collect(),
        dir.path().join("mocker.log"),
    );
    let child = spec.spawn().unwrap();
    wait_for("both workers registered", async || {
        cards(&mut etcd, &names).await.len() == 2
    })
    .await;
    wait_for("/readyz", async || {
        matches!(http_get(http_port, "/readyz"), Some((200, _)))
    })
    .await;
    let nats = env.nats.connect().await.unwrap();
    let mut stream = jetstream::new(nats.clone())
        .get_stream(names.events_stream())
        .await
        .unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.max_bytes, 33_554_432);
    assert_eq!(config.max_age, Duration::from_secs(7200));
    generate_ok(&nats, &names, 41, &request(&prompt(3, 50), 2)).await;
    let (status, metrics) = http_get(http_port, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("kvroute_mocker_requests_finished_total{outcome=\"ok\"} 1"),
        "{metrics}"
    );

    child.stop().unwrap();
    let log = std::fs::read_to_string(dir.path().join("mocker.log")).unwrap_or_default();
    assert!(
        cards(&mut etcd, &names).await.is_empty(),
        "SIGTERM deregisters every worker at once; log:\n{log}"
    );
    assert!(
        log.contains("mocker fleet stopped"),
        "clean exit; log:\n{log}"
    );
}
