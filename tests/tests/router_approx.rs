//! Approximate mode through the real processes: a mixed fleet of kvroute-mocker workers — one
//! publishing KV events, two started with `--no-kv-events` (cards `kv_events: false`, a small
//! cache) — behind an indexer and two router replicas that each decide what they receive. A
//! worker without events that served a prompt wins the next request sharing its prefix on
//! either replica (both predict its cache from the published decisions), the worker with
//! events still wins what the index says it holds, a prompt pushed out by newer ones is
//! forgotten within the card's `total_kv_blocks`, and nothing is remembered past the TTL. And
//! engines with no event socket behind `kvroute-bridge --no-kv-events` (YAML `kv_events:
//! false`): registered so, publishing no events, routed by the same predictions.

use std::time::Duration;

use clap::Parser as _;
use kvroute_bridge::BridgeArgs;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{
    GenerateRequest, GenerateResponse, Pin, SelectReply, SelectRequest, SelectResponse,
    StorageTier, WorkerCard,
};
use kvroute_common::{Names, WorkerId};
use kvroute_mocker::engine_face::{EngineApi, EngineFleet};
use kvroute_mocker::fleet::{EngineArgs, Fleet, FleetConfig};
use kvroute_tests::{IndexerProcess, RouterProcess, TestEnv, request};
use uuid::Uuid;

const BLOCK: u32 = 16;
/// Device blocks of each worker without events (its card's `total_kv_blocks`).
const SMALL_CACHE: u64 = 48;
/// The routers' `--approx-cache-ttl-ms`.
const TTL: Duration = Duration::from_secs(4);
const TIMEOUT: Duration = Duration::from_secs(20);

fn fleet_config(first: WorkerId, workers: u32, num_blocks: u64, no_kv_events: bool) -> FleetConfig {
    FleetConfig {
        workers,
        worker_id_start: first,
        model: "m".into(),
        engine: EngineArgs {
            block_size: BLOCK,
            num_blocks,
            ..EngineArgs::default()
        },
        speedup: 100.0,
        load_interval_ms: 100,
        no_kv_events,
        ..FleetConfig::default()
    }
}

/// `blocks` full blocks of tokens unique to `seed`.
fn blocks(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 1_000_000 + i).collect()
}

/// `prefix`, then one block unique to `tail`, then the last token an engine always computes.
fn extending(prefix: &[u32], tail: u32) -> Vec<u32> {
    let mut tokens = prefix.to_vec();
    tokens.extend(blocks(500 + tail, 1));
    tokens.push(7);
    tokens
}

/// `prefix` and the last token: a prompt of exactly `prefix`'s blocks.
fn whole(prefix: &[u32]) -> Vec<u32> {
    let mut tokens = prefix.to_vec();
    tokens.push(7);
    tokens
}

fn device(reply: &SelectReply) -> u32 {
    reply
        .overlap_blocks
        .get(&StorageTier::Device)
        .copied()
        .unwrap_or(0)
}

struct Cluster {
    nats: async_nats::Client,
    names: Names,
}

impl Cluster {
    /// Selects `tokens` on replica `router` (restricted by `edit`), then serves the request on
    /// the chosen worker (so its lifecycle events release the load), and returns the reply.
    async fn serve(
        &self,
        router: &str,
        tokens: Vec<u32>,
        edit: impl FnOnce(&mut SelectRequest),
    ) -> SelectReply {
        let request_id = Uuid::new_v4();
        let mut select: SelectRequest = request("m", tokens.clone());
        select.request_id = Some(request_id);
        edit(&mut select);
        let answer = tokio::time::timeout(
            TIMEOUT,
            self.nats
                .request(self.names.router_select(router), encode(&select).unwrap()),
        )
        .await
        .expect("answered in time")
        .expect("a responder");
        let reply = match decode::<SelectResponse>(&answer.payload).unwrap() {
            SelectResponse::Ok(reply) => reply,
            SelectResponse::Error(e) => panic!("selection failed: {e:?}"),
        };
        let generate = GenerateRequest {
            request_id,
            token_ids: Some(tokens),
            max_tokens: 2,
            ..GenerateRequest::default()
        };
        let done = tokio::time::timeout(
            TIMEOUT,
            self.nats.request(
                self.names.worker_requests(reply.worker_id),
                encode(&generate).unwrap(),
            ),
        )
        .await
        .expect("served in time")
        .expect("a worker");
        assert!(matches!(
            decode::<GenerateResponse>(&done.payload).unwrap(),
            GenerateResponse::Ok(_)
        ));
        // The decision reaches the other replica, the lifecycle events both.
        tokio::time::sleep(Duration::from_millis(300)).await;
        reply
    }
}

fn pinned(worker_id: WorkerId) -> impl FnOnce(&mut SelectRequest) {
    move |r| {
        r.pin = Some(Pin {
            worker_id,
            dp_rank: None,
        })
    }
}

async fn cards(env: &TestEnv, names: &Names) -> Vec<WorkerCard> {
    let mut etcd = env.etcd.connect().await.unwrap();
    let resp = etcd
        .get(
            names.workers_prefix(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let mut cards: Vec<WorkerCard> = resp
        .kvs()
        .iter()
        .map(|kv| decode(kv.value()).unwrap())
        .collect();
    cards.sort_by_key(|c| c.worker_id);
    cards
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_routes_workers_without_events_by_the_replicas_predictions() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let etcd = env.etcd.connect().await.unwrap();
    let with_events = Fleet::start(
        &fleet_config(1, 1, 256, false),
        nats.clone(),
        etcd.clone(),
        &names,
    )
    .await
    .unwrap();
    let without = Fleet::start(
        &fleet_config(2, 2, SMALL_CACHE, true),
        nats.clone(),
        etcd,
        &names,
    )
    .await
    .unwrap();
    let registered = cards(&env, &names).await;
    assert_eq!(
        registered
            .iter()
            .map(|c| (c.worker_id, c.kv_events))
            .collect::<Vec<_>>(),
        [(1, true), (2, false), (3, false)]
    );
    let ttl_ms = TTL.as_millis().to_string();
    let flags = [
        "--no-partition-owner",
        "--predicted-overlap-ttl-ms",
        "0",
        "--approx-cache-ttl-ms",
        &ttl_ms,
    ];
    let a = RouterProcess::start(&env, "r-a", &flags).unwrap();
    let _b = RouterProcess::start(&env, "r-b", &flags).unwrap();
    let c = Cluster { nats, names };

    // The worker with events wins what its index says it holds.
    let q = blocks(2, 20);
    c.serve("r-a", whole(&q), |r| r.allowed_workers = Some(vec![1]))
        .await;
    let start = tokio::time::Instant::now();
    loop {
        let probe = c
            .serve("r-a", whole(&q), |r| r.allowed_workers = Some(vec![1]))
            .await;
        if device(&probe) == 20 {
            break;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "the index never learned worker 1's prompt"
        );
    }
    let held = c.serve("r-b", extending(&q, 3), |_| {}).await;
    assert_eq!((held.worker_id, device(&held)), (1, 20));

    // A prompt served by a worker without events (the first request may go only there)...
    // 32 blocks: a depth of the prefix-hash schedule, so a longer prompt sees all of it.
    let p = blocks(1, 32);
    let first = c
        .serve("r-a", whole(&p), |r| r.allowed_workers = Some(vec![2, 3]))
        .await;
    let w = first.worker_id;
    assert_eq!(device(&first), 0);
    // ...is where the next requests sharing it go, on either replica, with all of it cached.
    for (router, tail) in [("r-b", 1), ("r-a", 2)] {
        let next = c.serve(router, extending(&p, tail), |_| {}).await;
        assert_eq!((next.worker_id, device(&next)), (w, 32), "{router}");
        assert_eq!(next.router_id, router);
    }

    // A 40-block prompt on w pushes the older one out within its 48 blocks: both replicas
    // see all of the new one there, and at most 48 − 40 blocks of the old one.
    let r = blocks(3, 40);
    c.serve("r-a", whole(&r), pinned(w)).await;
    let again = c.serve("r-b", whole(&r), |_| {}).await;
    assert_eq!((again.worker_id, device(&again)), (w, 40));
    // Its metrics: two ranks predicted, each within its 48 blocks (read after a tick).
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(a.metric("kvroute_router_approx_ranks"), 2.0);
    let predicted = a.metric("kvroute_router_approx_blocks");
    assert!(
        (40.0..=2.0 * SMALL_CACHE as f64).contains(&predicted),
        "{predicted}"
    );
    // The old prompt (34 blocks with its two extensions, decided well within the TTL) lost its
    // most recent blocks to the LRU bound, deepest first: 48 − 40 = 8 are left.
    let old = c.serve("r-a", extending(&p, 4), pinned(w)).await;
    assert_eq!(
        device(&old),
        (SMALL_CACHE - 40) as u32,
        "the LRU bound: {old:?}"
    );

    // Past the TTL after their last decisions, both replicas have forgotten both prompts.
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    let forgotten = c.serve("r-a", whole(&r), pinned(w)).await;
    assert_eq!(device(&forgotten), 0, "r-a: {forgotten:?}");
    let forgotten = c.serve("r-b", extending(&p, 5), pinned(w)).await;
    assert_eq!(device(&forgotten), 0, "r-b: {forgotten:?}");

    // The workers without events published none.
    assert_eq!(without.metrics().kv_events.get(), 0);
    assert!(with_events.metrics().kv_events.get() > 0);
    without.shutdown().await;
    with_events.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_without_an_event_socket_behind_the_bridge_are_routed_by_prediction() {
    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _indexer = IndexerProcess::start(&env, "ix-1", &[]).unwrap();
    let _router = RouterProcess::start(&env, "r-a", &["--predicted-overlap-ttl-ms", "0"]).unwrap();
    // Two engines impersonating vLLM (they do publish on ZMQ; the bridge is told not to
    // listen, as for an engine without events).
    let mut config = fleet_config(1, 2, 256, false);
    config.face.engine_api = EngineApi::Vllm;
    config.face.engine_http_port = 0;
    config.face.engine_zmq_port = 0;
    config.face.engine_replay_port = 0;
    let engines = EngineFleet::start(&config).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let yaml: String = engines
        .endpoints()
        .iter()
        .map(|e| {
            format!(
                "  - engine: vllm\n    engine_url: {}\n    kv_events: false\n    worker_id: {}\n",
                e.url(),
                200 + e.index
            )
        })
        .collect();
    let file = dir.path().join("engines.yaml");
    std::fs::write(&file, format!("engines:\n{yaml}")).unwrap();
    let mut argv = vec!["kvroute-bridge".to_owned()];
    argv.extend(env.server_args());
    argv.extend(["--engines-file".to_owned(), file.display().to_string()]);
    let args = BridgeArgs::try_parse_from(argv).unwrap();
    let specs = args.engines().unwrap();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let bridge = tokio::spawn(kvroute_bridge::run::run(args, specs, async {
        let _ = stop_rx.await;
    }));
    let start = tokio::time::Instant::now();
    let registered = loop {
        let registered = cards(&env, &names).await;
        if registered.len() == 2 {
            break registered;
        }
        assert!(start.elapsed() < TIMEOUT, "the engines never registered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for card in &registered {
        assert!(!card.kv_events, "{card:?}");
        assert!(card.http_url.is_some());
    }
    // Give the router's watch a moment to see both cards.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let c = Cluster {
        nats: env.nats.connect().await.unwrap(),
        names: names.clone(),
    };
    // 16 blocks: a depth of the prefix-hash schedule, so a longer prompt sees all of it.
    let p = blocks(1, 16);
    let first = c.serve("r-a", whole(&p), |_| {}).await;
    assert_eq!(device(&first), 0);
    for tail in 1..=3 {
        let next = c.serve("r-a", extending(&p, tail), |_| {}).await;
        assert_eq!((next.worker_id, device(&next)), (first.worker_id, 16));
    }
    // The bridge published no KV events for them: the log is empty.
    let js = async_nats::jetstream::new(c.nats.clone());
    let mut stream = js.get_stream(names.events_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 0);

    drop(stop);
    bridge.await.unwrap().unwrap();
    engines.shutdown().await;
}
