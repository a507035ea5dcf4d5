//! kvroute-bridge's recovery against the engines' own publisher code (see `bridge_events.rs`):
//! a chain longer than one NATS message, live and through a resync; a replay answer with a
//! hole (the replay socket's high-water mark); an engine restarted past its old numbering
//! without `/health` failing; an engine deemed down by its `/health` that answers again, with its
//! cache (only busy) or restarted; a cache reset through the bridge, withdrawn before the
//! engine's next step announces it; and an engine whose events never reach the bridge.

mod bridge_reference;
mod fake_engine;

use std::time::{Duration, Instant};

use clap::Parser as _;
use fake_engine::{EngineState, FakeEngine, Kind};
use kvroute_bridge::BridgeArgs;
use kvroute_common::Names;
use kvroute_common::messages::StorageTier;
use kvroute_tests::{
    Engine, EngineOptions, EnginePublisher, IndexerProcess, TestEnv, free_port, http_get,
};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use bridge_reference::*;

/// 30,000 blocks in one `BlockStored`: as one kvroute event, ~1.26 MB, over the 1 MiB limit of
/// a `KvEventBatch`. The bridge splits the chain, live and in the resync a fresh indexer asks
/// for after the log was purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_longer_than_one_message_reaches_the_index_live_and_by_resync() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let n = 30_000u64;
    let hashes: Vec<u64> = (1..=n).collect();
    let t = tokens(1_000, n as u32);
    publisher
        .publish(0, json!([stored(e, &hashes, None, &t, "GPU", None)]))
        .unwrap();
    let expected = reference(&[(0, chain(e, &hashes, None, &t, StorageTier::Device, None))]);
    wait_digest(&indexer, expected.digest(), "a 30,000-block chain, live").await;

    drop(indexer);
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    async_nats::jetstream::new(nats)
        .get_stream(names.events_stream())
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let fresh = IndexerProcess::start(&env, "b", NO_SNAPSHOTS).unwrap();
    wait_digest(&fresh, expected.digest(), "the same chain, by resync").await;
    drop(bridged);
}

/// A gap whose replay answer has a hole (batch 3 dropped, the end marker still sent) is applied
/// up to the hole and asked for again, never taken as complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_answer_with_a_hole_is_asked_again() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let ts: Vec<Vec<u32>> = (0..7).map(|i| tokens(100 * (i + 1), 1)).collect();
    let link = |i: usize| {
        let parent = (i > 0).then_some(i as u64);
        stored(e, &[i as u64 + 1], parent, &ts[i], "GPU", None)
    };
    publisher.publish(0, json!([link(0)])).unwrap();
    let first = reference(&[(0, chain(e, &[1], None, &ts[0], StorageTier::Device, None))]);
    wait_digest(&indexer, first.digest(), "before the gap").await;
    // Seqs 1..=5 never leave the PUB socket; the replay answer then lacks seq 3.
    for i in 1..6 {
        publisher.drop_next(0).unwrap();
        publisher.publish(0, json!([link(i)])).unwrap();
    }
    publisher.drop_replay(0, &[3]).unwrap();
    publisher.publish(0, json!([link(6)])).unwrap();
    let expected = reference(
        &(0..7)
            .map(|i| {
                let parent = (i > 0).then_some(i as u64);
                (
                    0,
                    chain(
                        e,
                        &[i as u64 + 1],
                        parent,
                        &ts[i],
                        StorageTier::Device,
                        None,
                    ),
                )
            })
            .collect::<Vec<_>>(),
    );
    wait_digest(&indexer, expected.digest(), "a gap replayed through a hole").await;
    let m = |name: &'static str, extra: &str| bridged.metrics.get(name, "e", Some(0), extra);
    assert_eq!(m("kvroute_bridge_replays_total", "hole"), 1.0);
    assert_eq!(m("kvroute_bridge_ranks_cleared_total", ""), 0.0);
}

/// An engine restarted without the bridge noticing (its `/health` never failed long enough)
/// whose new numbering has passed the old one by the time its first batch arrives: a forward
/// gap by the numbers, but its batch before the gap is not the one applied — a new
/// incarnation. The old blocks go; the new incarnation's missed batches are replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_past_its_old_numbering_is_a_new_incarnation() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let (t1, t2) = (tokens(100, 1), tokens(200, 1));
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    let before = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[2], Some(1), &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, before.digest(), "before the restart").await;
    // The new incarnation's seqs 0..=2 are missed; seq 3 is the first the bridge sees.
    publisher.restart().unwrap();
    // Time for the SUB to reconnect (libzmq retries every 100 ms).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ts: Vec<Vec<u32>> = (0..4).map(|i| tokens(500 + 100 * i, 1)).collect();
    for (i, t) in ts.iter().enumerate() {
        if i < 3 {
            publisher.drop_next(0).unwrap();
        }
        let seq = publisher
            .publish(
                0,
                json!([stored(e, &[10 + i as u64], None, t, "GPU", None)]),
            )
            .unwrap();
        assert_eq!(seq, i as u64);
    }
    let expected = reference(
        &ts.iter()
            .enumerate()
            .map(|(i, t)| {
                (
                    0,
                    chain(e, &[10 + i as u64], None, t, StorageTier::Device, None),
                )
            })
            .collect::<Vec<_>>(),
    );
    wait_digest(&indexer, expected.digest(), "the new incarnation only").await;
    let m = |name: &'static str| bridged.metrics.get(name, "e", Some(0), "");
    assert_eq!(m("kvroute_bridge_incarnations_total"), 1.0);
    assert_eq!(m("kvroute_bridge_ranks_cleared_total"), 0.0);
}

/// `kvroute-bridge` itself (the whole process) for a fake engine's HTTP API and an engine
/// publisher's sockets.
struct BridgeProcess {
    http_port: u16,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl BridgeProcess {
    fn start(env: &TestEnv, http: &FakeEngine, zmq: &str, replay: Option<&str>) -> Self {
        let http_port = free_port();
        let mut argv: Vec<String> = vec!["kvroute-bridge".into()];
        argv.extend(env.server_args());
        argv.extend(
            [
                "--engine",
                "vllm",
                "--engine-url",
                &http.url(),
                "--zmq-endpoint",
                zmq,
                "--worker-id",
                &WORKER.to_string(),
                "--dp-size",
                "2",
                "--health-interval-ms",
                "100",
                "--load-interval-ms",
                "100",
                "--http-addr",
                &format!("127.0.0.1:{http_port}"),
            ]
            .map(String::from),
        );
        if let Some(r) = replay {
            argv.extend(["--zmq-replay-endpoint".into(), r.to_owned()]);
        }
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

    async fn metrics(&self) -> String {
        let port = self.http_port;
        tokio::task::spawn_blocking(move || http_get(port, "/metrics"))
            .await
            .unwrap()
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    async fn wait_registered(&self) {
        self.wait_metric("kvroute_bridge_engines_registered 1")
            .await;
    }

    /// Waits (15 s at most) for a line of `/metrics` to start with `line`.
    async fn wait_metric(&self, line: &str) {
        let start = Instant::now();
        while !self.metrics().await.lines().any(|l| l.starts_with(line)) {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "never: {line}\n{}",
                self.metrics().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of the series `name` whose labels include each of `labels` (0 if none).
    async fn metric(&self, name: &str, labels: &[&str]) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| labels.iter().all(|label| l.contains(label)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for BridgeProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

fn engine_state() -> EngineState {
    EngineState {
        healthy: true,
        model: "m".into(),
        block_size: BS,
        num_gpu_blocks: 1000,
        dp_size: 2,
        load: vec![(0, 0, 0.0), (0, 0, 0.0)],
        cached_tokens: None,
        chunk_delay: Duration::ZERO,
        max_context: 4096,
        abort_after: None,
        prefix_cache: Vec::new(),
        reset_succeeds: true,
        resets: 0,
    }
}

/// vLLM publishes `AllBlocksCleared` after `/reset_prefix_cache` only with its next step. A
/// reset asked through the bridge (the worker's reset subject) withdraws the engine's blocks
/// as soon as the engine confirms, before any event of the engine; a refused reset keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_through_the_bridge_withdraws_the_blocks_at_once() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let http = FakeEngine::start(Kind::Vllm, engine_state()).await;
    let rank0 = &publisher.endpoints()[0];
    let bridge = BridgeProcess::start(&env, &http, &rank0.local, rank0.replay.as_deref());
    bridge.wait_registered().await;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let (t1, t2) = (tokens(100, 2), tokens(300, 1));
    publisher
        .publish(0, json!([stored(e, &[1, 2], None, &t1, "GPU", None)]))
        .unwrap();
    let held = reference(&[(0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None))]);
    wait_digest(&indexer, held.digest(), "blocks held").await;

    // Refused (blocks in use): nothing changes.
    http.set(|s| s.reset_succeeds = false);
    let reply = nats
        .request(names.worker_reset(WORKER), "".into())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&reply.payload).into_owned();
    assert!(text.starts_with("error: "), "{text}");
    // Done: the blocks go before the engine says anything.
    http.set(|s| s.reset_succeeds = true);
    let reply = nats
        .request(names.worker_reset(WORKER), "".into())
        .await
        .unwrap();
    assert_eq!(&reply.payload[..], b"ok");
    assert_eq!(http.state.lock().unwrap().resets, 2);
    wait_digest(&indexer, reference(&[]).digest(), "withdrawn at the reset").await;
    assert!(
        bridge
            .metrics()
            .await
            .contains("kvroute_bridge_cache_resets_total{engine=\"vllm-77\",outcome=\"ok\"} 1")
    );

    // The engine's next step: its `AllBlocksCleared`, then what it stores after the reset.
    publisher
        .publish(
            0,
            json!([
                {"type": "AllBlocksCleared"},
                stored(e, &[3], None, &t2, "GPU", None)
            ]),
        )
        .unwrap();
    let after = reference(&[(0, chain(e, &[3], None, &t2, StorageTier::Device, None))]);
    wait_digest(&indexer, after.digest(), "the engine's next step").await;
}

/// A bridge given a wrong `--zmq-endpoint` registers the engine, which serves prompts, but no
/// event ever arrives: once the engine has computed 8 blocks' worth of prompt tokens with no
/// batch from it, the bridge counts it per rank (and warns, naming the flag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_that_never_arrive_while_the_engine_computes_are_counted() {
    let env = TestEnv::start().unwrap();
    let mut state = engine_state();
    state.prefix_cache = vec![(1_000, 200), (0, 0)];
    let http = FakeEngine::start(Kind::Vllm, state).await;
    let nowhere = format!("tcp://127.0.0.1:{}", free_port());
    let bridge = BridgeProcess::start(&env, &http, &nowhere, None);
    bridge.wait_registered().await;
    let missing = "kvroute_bridge_events_missing_total{engine=\"vllm-77\",rank=\"0\"}";
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!bridge.metrics().await.contains(missing), "not before");
    // Rank 0 computes 32 prompt tokens (8 blocks of 4) more; rank 1 only looks up hits.
    http.set(|s| s.prefix_cache = vec![(1_040, 208), (5_000, 5_000)]);
    let start = Instant::now();
    loop {
        let m = bridge.metrics().await;
        if m.contains(missing) {
            assert!(
                !m.contains("events_missing_total{engine=\"vllm-77\",rank=\"1\"}"),
                "{m}"
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never counted:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An engine too busy to answer `/health` is deregistered after `--health-failures` probes and
/// registered again when it answers: it never restarted, so its cache — what it held, and what
/// it stored while deregistered — stays routable (its replay socket gives back the last batch
/// applied unchanged). Clearing it, as if every recovery were a restart, would lose blocks the
/// engine still holds: nothing makes an engine announce a cached block again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_only_missed_its_health_probes_keeps_its_blocks() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let http = FakeEngine::start(Kind::Vllm, engine_state()).await;
    let rank0 = &publisher.endpoints()[0];
    let bridge = BridgeProcess::start(&env, &http, &rank0.local, rank0.replay.as_deref());
    bridge.wait_registered().await;
    let (t1, t2) = (tokens(100, 2), tokens(300, 1));
    publisher
        .publish(0, json!([stored(e, &[1, 2], None, &t1, "GPU", None)]))
        .unwrap();
    let held = reference(&[(0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None))]);
    wait_digest(&indexer, held.digest(), "blocks held").await;

    http.set(|s| s.healthy = false);
    bridge
        .wait_metric("kvroute_bridge_engines_registered 0")
        .await;
    // Stored while deregistered: mirrored, published at the next registration.
    publisher
        .publish(0, json!([stored(e, &[3], Some(2), &t2, "GPU", None)]))
        .unwrap();
    http.set(|s| s.healthy = true);
    bridge.wait_registered().await;
    let kept = reference(&[
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[3], Some(2), &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, kept.digest(), "kept across the missed probes").await;
    bridge
        .wait_metric("kvroute_bridge_incarnation_checks_total{engine=\"vllm-77\",rank=\"0\",result=\"same\"} 1")
        .await;
    assert_eq!(
        bridge
            .metric("kvroute_bridge_incarnations_total", &[])
            .await,
        0.0
    );
    assert_eq!(
        bridge
            .metric(
                "kvroute_bridge_registrations_total",
                &["event=\"recovered\""]
            )
            .await,
        1.0
    );
}

/// An engine deemed down that restarted before answering `/health` again, and has sent nothing
/// since: no live batch says so, but its replay socket no longer has the last batch applied —
/// a new incarnation. Its old blocks go at the registration, and its first batch (seq 0) is
/// applied as the next in order, not taken for another restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_while_deemed_down_loses_its_blocks_at_registration() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let http = FakeEngine::start(Kind::Vllm, engine_state()).await;
    let rank0 = &publisher.endpoints()[0];
    let bridge = BridgeProcess::start(&env, &http, &rank0.local, rank0.replay.as_deref());
    bridge.wait_registered().await;
    let (t1, t2) = (tokens(100, 2), tokens(300, 1));
    publisher
        .publish(0, json!([stored(e, &[1, 2], None, &t1, "GPU", None)]))
        .unwrap();
    let held = reference(&[(0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None))]);
    wait_digest(&indexer, held.digest(), "blocks held").await;

    http.set(|s| s.healthy = false);
    bridge
        .wait_metric("kvroute_bridge_engines_registered 0")
        .await;
    publisher.restart().unwrap();
    http.set(|s| s.healthy = true);
    bridge.wait_registered().await;
    wait_digest(
        &indexer,
        reference(&[]).digest(),
        "a restarted engine's blocks gone",
    )
    .await;
    bridge
        .wait_metric("kvroute_bridge_incarnation_checks_total{engine=\"vllm-77\",rank=\"0\",result=\"new\"} 1")
        .await;
    // Time for the SUB to reconnect (libzmq retries every 100 ms).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seq = publisher
        .publish(0, json!([stored(e, &[7], None, &t2, "GPU", None)]))
        .unwrap();
    assert_eq!(seq, 0);
    let fresh = reference(&[(0, chain(e, &[7], None, &t2, StorageTier::Device, None))]);
    wait_digest(
        &indexer,
        fresh.digest(),
        "the new incarnation's first batch",
    )
    .await;
    assert_eq!(
        bridge
            .metric("kvroute_bridge_incarnations_total", &[])
            .await,
        1.0
    );
    assert_eq!(
        bridge
            .metric("kvroute_bridge_ranks_cleared_total", &[])
            .await,
        0.0
    );
}
