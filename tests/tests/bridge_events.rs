//! kvroute-bridge's event path against the engines' own publisher code (vLLM 0.32 and SGLang
//! 0.5.23 `ZmqEventPublisher`, run by tests/engines/engine_publisher.py): two data-parallel
//! ranks, stored / removed / cleared, LoRA, offloaded tiers, a second physical copy, a gap
//! replayed, a gap that cannot be replayed (no replay endpoint, or a replay buffer that no
//! longer reaches back to it), an engine restart and a resync — each time an indexer fed
//! through the bridge must hold exactly the state built from the same events by hand with
//! kvroute's hashing: the same digest, and the same answers to overlap queries.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_bridge::BridgeMetrics;
use kvroute_bridge::config::{EngineKind, EngineSpec};
use kvroute_bridge::relay::{Relay, RelaySettings};
use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::messages::{
    IndexQuery, IndexQueryResponse, KvEventBatch, KvEventData, StorageTier, StoredBlock,
    WorkerMatch,
};
use kvroute_common::worker::{PublisherConfig, RegistrationConfig, WorkerAgent, WorkerAgentConfig};
use kvroute_indexer::{IndexConfig, RadixIndex};
use kvroute_tests::{Engine, EngineOptions, EnginePublisher, IndexerProcess, TestEnv, sim_card};
use serde_json::{Value, json};

const WORKER: u64 = 77;
const BS: u32 = 4;
/// Indexer flags: state only in memory, so a purged log can only be recovered by resyncs.
const NO_SNAPSHOTS: &[&str] = &[
    "--snapshot-every-messages",
    "0",
    "--snapshot-interval-secs",
    "0",
];

/// A running bridge event path for one engine: the relay and the worker agent it publishes
/// through (what `kvroute-bridge` runs per engine, minus the HTTP side).
struct Bridged {
    relay: Relay,
    agent: Option<WorkerAgent>,
    metrics: Arc<BridgeMetrics>,
}

async fn bridge(env: &TestEnv, engine: &EnginePublisher) -> Bridged {
    let kind = match engine.options.engine {
        Engine::Vllm => EngineKind::Vllm,
        Engine::Sglang => EngineKind::Sglang,
    };
    let rank0 = &engine.endpoints()[0];
    let spec = EngineSpec {
        name: "e".into(),
        engine: kind,
        engine_url: "http://127.0.0.1:9".into(),
        zmq_endpoint: rank0.local.clone(),
        zmq_replay_endpoint: rank0.replay.clone(),
        zmq_topic: engine.options.topic.clone(),
        worker_id: Some(WORKER),
        dp_size: Some(2),
        dp_start_rank: 0,
        model: None,
        block_size: None,
        total_kv_blocks: None,
        max_num_batched_tokens: None,
        role: Default::default(),
        taints: vec![],
        labels: Default::default(),
    };
    let metrics = Arc::new(BridgeMetrics::default());
    let relay = Relay::start(
        &spec,
        vec![0, 1],
        RelaySettings {
            mirror_max_blocks: 100_000,
        },
        metrics.clone(),
    )
    .unwrap();
    let names = Names::new(&env.namespace);
    let mut card = sim_card(&names, WORKER, "m");
    card.block_size = BS;
    card.dp_size = 2;
    let config = WorkerAgentConfig {
        registration: RegistrationConfig {
            lease_ttl: Duration::from_secs(10),
            retry_interval: Duration::from_millis(100),
        },
        publisher: PublisherConfig {
            ack_timeout: Duration::from_millis(500),
            retry_interval: Duration::from_millis(100),
            ..Default::default()
        },
    };
    let mut agent = WorkerAgent::start(
        env.nats.connect().await.unwrap(),
        env.etcd.connect().await.unwrap(),
        &names,
        card,
        config,
        relay.resync_source(),
    )
    .await
    .unwrap();
    agent.wait_registered().await;
    relay.attach(agent.publisher().clone());
    Bridged {
        relay,
        agent: Some(agent),
        metrics,
    }
}

impl Drop for Bridged {
    fn drop(&mut self) {
        self.relay.shutdown();
        if let Some(a) = self.agent.take() {
            a.abandon();
        }
    }
}

/// Hashes as each engine writes them: vLLM unsigned (some above i64::MAX), SGLang signed.
fn h(engine: Engine, n: u64) -> Value {
    match engine {
        Engine::Vllm => json!(u64::MAX - n),
        Engine::Sglang => json!(-(n as i64) - 1),
    }
}

fn hv(engine: Engine, n: u64) -> u64 {
    match engine {
        Engine::Vllm => u64::MAX - n,
        Engine::Sglang => (-(n as i64) - 1) as u64,
    }
}

fn stored(
    engine: Engine,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    medium: &str,
    lora: Option<&str>,
) -> Value {
    let mut e = json!({
        "type": "BlockStored",
        "block_hashes": hashes.iter().map(|&n| h(engine, n)).collect::<Vec<_>>(),
        "parent_block_hash": parent.map(|p| h(engine, p)),
        "token_ids": tokens,
        "block_size": if tokens.is_empty() { 0 } else { BS },
        "lora_id": null,
        "medium": medium,
    });
    // A required field of vLLM's struct (nil when unset), optional in SGLang's.
    e["lora_name"] = json!(lora);
    e
}

fn removed(engine: Engine, hashes: &[u64], medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes.iter().map(|&n| h(engine, n)).collect::<Vec<_>>(), "medium": medium})
}

/// kvroute's view of blocks `hashes` holding `tokens` (hand-built with kvroute's hashing).
fn chain(
    engine: Engine,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    tier: StorageTier,
    lora: Option<&str>,
) -> KvEventData {
    let local = local_block_hashes(tokens, BS as usize, seed_for_lora(lora));
    KvEventData::Stored {
        parent_hash: parent.map(|p| hv(engine, p)),
        blocks: hashes
            .iter()
            .zip(local)
            .map(|(&n, t)| StoredBlock {
                block_hash: hv(engine, n),
                tokens_hash: t,
            })
            .collect(),
        tier,
    }
}

/// The index built by hand from kvroute's view of the events.
fn reference(events: &[(u32, KvEventData)]) -> RadixIndex {
    let mut index = RadixIndex::new(IndexConfig::default());
    for rank in 0..2 {
        index.apply(WORKER, rank, &KvEventData::Cleared).unwrap();
    }
    for (rank, e) in events {
        index.apply(WORKER, *rank, e).unwrap();
    }
    index
}

/// A prompt, and the leading blocks the index must report for it, written out by hand (so the
/// reference is checked too): one `(dp rank, device, host)` per rank of `WORKER` that matches.
struct Probe {
    what: &'static str,
    prompt: Vec<u32>,
    lora: Option<&'static str>,
    want: Vec<(u32, u32, u32)>,
}

fn probe(
    what: &'static str,
    prompt: Vec<u32>,
    lora: Option<&'static str>,
    want: &[(u32, u32, u32)],
) -> Probe {
    Probe {
        what,
        prompt,
        lora,
        want: want.to_vec(),
    }
}

/// The indexer's answer to an overlap query for `prompt` (token ids, the block size and the
/// LoRA name, for model "m"), asked on the replica's own query subject; `not_ready` answers are
/// asked again.
async fn query(
    nats: &async_nats::Client,
    names: &Names,
    indexer: &IndexerProcess,
    prompt: &[u32],
    lora: Option<&str>,
) -> Vec<WorkerMatch> {
    let q = IndexQuery {
        model: "m".into(),
        token_ids: Some(prompt.to_vec()),
        block_size: Some(BS),
        lora_name: lora.map(str::to_owned),
        ..Default::default()
    };
    let start = Instant::now();
    loop {
        let reply = nats
            .request(
                names.indexer_query(&indexer.replica_id),
                encode(&q).unwrap(),
            )
            .await;
        match reply.map(|r| decode::<IndexQueryResponse>(&r.payload).unwrap()) {
            Ok(IndexQueryResponse::Ok(r)) => return r.matches,
            other => assert!(
                start.elapsed() < Duration::from_secs(10),
                "the indexer never answered a query: {other:?}\n{}",
                indexer.log()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every probe's query answered by `indexer` exactly as by the reference index (rows with
/// their tiers and total blocks), and as the probe says.
async fn check_queries(
    nats: &async_nats::Client,
    names: &Names,
    indexer: &IndexerProcess,
    reference: &RadixIndex,
    probes: &[Probe],
    when: &str,
) {
    for p in probes {
        let want = reference
            .find_matches_for_tokens(&p.prompt, BS as usize, p.lora)
            .matches;
        let rows: Vec<_> = want
            .iter()
            .map(|m| {
                assert_eq!((m.worker_id, m.disk), (WORKER, 0), "{when}, {}", p.what);
                (m.dp_rank, m.device, m.host)
            })
            .collect();
        assert_eq!(rows, p.want, "{when}, {}: the reference", p.what);
        let got = query(nats, names, indexer, &p.prompt, p.lora).await;
        assert_eq!(
            got, want,
            "{when}, {}: the indexer vs the reference",
            p.what
        );
    }
}

async fn wait_digest(indexer: &IndexerProcess, want: u64, what: &str) {
    let start = Instant::now();
    loop {
        if let Ok((_, d)) = indexer.position()
            && d == want
        {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: indexer digest {:?} never became {want:#x}\n{}",
            indexer.position(),
            indexer.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tokens(base: u32, blocks: u32) -> Vec<u32> {
    (base..base + blocks * BS).collect()
}

/// Tokens of `blocks` full blocks: `base`'s first block, then fresh ones (a partial hit).
fn first_block_then_new(base: &[u32], blocks: u32) -> Vec<u32> {
    let mut t = base[..BS as usize].to_vec();
    t.extend(tokens(900, blocks - 1));
    t
}

const ADAPTER: Option<&str> = Some("sql-adapter");

/// Stored, removed, LoRA, offload to the host, a second copy, cleared — over two ranks; checked
/// once with LoRA blocks and an offloaded chain present, and again after removals, clears and
/// more LoRA blocks (the final state, which the mirror also recreates for a fresh indexer).
async fn full_history(engine: Engine) {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let mut publisher = EnginePublisher::start(EngineOptions::new(engine)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let e = engine;
    let t1 = tokens(100, 2);
    let t2 = tokens(200, 1);
    let t3 = tokens(300, 1);
    // Rank 0: a chain, a LoRA block holding t2, the chain offloaded to the host. Rank 1: a
    // plain block holding the same t2.
    publisher
        .publish(
            0,
            json!([
                stored(e, &[1, 2], None, &t1, "GPU", None),
                stored(e, &[3], None, &t2, "GPU", ADAPTER)
            ]),
        )
        .unwrap();
    publisher
        .publish(
            0,
            json!([stored(e, &[1, 2], None, &[], "CPU_PINNED", None)]),
        )
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[10], None, &t2, "GPU", None)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[3], None, &t2, StorageTier::Device, ADAPTER)),
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Host, None)),
        (1, chain(e, &[10], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, expected.digest(), "with LoRA blocks").await;
    let probes = [
        probe("the chain", t1.clone(), None, &[(0, 2, 0)]),
        probe(
            "its first block, then a new one",
            first_block_then_new(&t1, 2),
            None,
            &[(0, 1, 0)],
        ),
        // The same tokens under the adapter and without it are different blocks.
        probe("t2 without the adapter", t2.clone(), None, &[(1, 1, 0)]),
        probe("t2 with the adapter", t2.clone(), ADAPTER, &[(0, 1, 0)]),
        probe("the plain chain with the adapter", t1.clone(), ADAPTER, &[]),
        probe("a new prompt", tokens(900, 2), None, &[]),
    ];
    check_queries(
        &nats,
        &names,
        &indexer,
        &expected,
        &probes,
        "with LoRA blocks",
    )
    .await;

    // Rank 0: a second copy of the chain stored and one copy of its second block removed (the
    // other copy stays), the LoRA block removed, then the last device copy of the second block
    // removed (the host copy stays). Rank 1: a block and all cleared in one batch, a chain, and
    // a LoRA chain holding the same tokens as rank 0's plain chain.
    publisher
        .publish(
            0,
            json!([
                stored(e, &[1, 2], None, &t1, "GPU", None),
                removed(e, &[2], "GPU"),
                removed(e, &[3], "GPU")
            ]),
        )
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[2], "GPU")]))
        .unwrap();
    publisher
        .publish(
            1,
            json!([stored(e, &[14], None, &t3, "GPU", None), {"type": "AllBlocksCleared"}]),
        )
        .unwrap();
    publisher
        .publish(
            1,
            json!([
                stored(e, &[11], None, &t3, "GPU", None),
                stored(e, &[12], Some(11), &t2, "GPU", None)
            ]),
        )
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[15, 16], None, &t1, "GPU", ADAPTER)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[1, 2], None, &t1, StorageTier::Host, None)),
        (1, chain(e, &[11], None, &t3, StorageTier::Device, None)),
        (1, chain(e, &[12], Some(11), &t2, StorageTier::Device, None)),
        (
            1,
            chain(e, &[15, 16], None, &t1, StorageTier::Device, ADAPTER),
        ),
    ]);
    wait_digest(&indexer, expected.digest(), "after the history").await;
    let t3_t2: Vec<u32> = t3.iter().chain(&t2).copied().collect();
    let probes = [
        // Block 1 on the device, block 2 only on the host now.
        probe("the plain chain", t1.clone(), None, &[(0, 1, 1)]),
        probe(
            "the chain with the adapter",
            t1.clone(),
            ADAPTER,
            &[(1, 2, 0)],
        ),
        probe(
            "its first block with the adapter, then a new one",
            first_block_then_new(&t1, 2),
            ADAPTER,
            &[(1, 1, 0)],
        ),
        probe("rank 1's chain", t3_t2, None, &[(1, 2, 0)]),
        probe(
            "rank 1's first block, then a new one",
            first_block_then_new(&t3, 2),
            None,
            &[(1, 1, 0)],
        ),
        // Block 10 was cleared, block 12 holds t2 only under block 11, the LoRA block 3 is gone.
        probe("t2 alone", t2.clone(), None, &[]),
        probe("t2 with the adapter", t2.clone(), ADAPTER, &[]),
        probe("a new prompt", tokens(900, 2), None, &[]),
    ];
    check_queries(
        &nats,
        &names,
        &indexer,
        &expected,
        &probes,
        "after the history",
    )
    .await;
    assert!(
        bridged
            .metrics
            .get("kvroute_bridge_duplicate_copies_total", "e", Some(0), "")
            >= 2.0
    );

    // An indexer that lost its state and whose log was purged (no snapshots) asks every worker
    // to resync: the bridge recreates the same state from its mirror alone — the engines cannot
    // resend anything.
    drop(indexer);
    let js = async_nats::jetstream::new(nats.clone());
    js.get_stream(names.events_stream())
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    let fresh = IndexerProcess::start(&env, "b", NO_SNAPSHOTS).unwrap();
    let through_mirror = "a fresh indexer on a purged log, through the mirror";
    wait_digest(&fresh, expected.digest(), through_mirror).await;
    check_queries(&nats, &names, &fresh, &expected, &probes, through_mirror).await;
    assert!(fresh.log().contains("resync"), "{}", fresh.log());
    drop(bridged);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_history_through_the_bridge_matches_the_reference() {
    full_history(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_history_through_the_bridge_matches_the_reference() {
    full_history(Engine::Sglang).await;
}

/// A batch lost on the PUB socket is fetched from the engine's replay buffer; without a replay
/// endpoint the rank is cleared and rebuilt from the following events; an engine restart (seq
/// back to 0) is a new incarnation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_replayed_or_clear_the_rank_and_restarts_clear_it() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let e = Engine::Vllm;
    let (t1, t2, t3) = (tokens(100, 1), tokens(200, 1), tokens(300, 1));

    // With replay.
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    let bridged = bridge(&env, &publisher).await;
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher.drop_next(0).unwrap();
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[3], Some(2), &t3, "GPU", None)]))
        .unwrap();
    let expected = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (0, chain(e, &[2], Some(1), &t2, StorageTier::Device, None)),
        (0, chain(e, &[3], Some(2), &t3, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, expected.digest(), "a dropped batch replayed").await;
    // One gap (the dropped batch), filled from the replay socket (the start-up catch-up may
    // have fetched the first batch too).
    let m = |name: &'static str, extra: &str| bridged.metrics.get(name, "e", Some(0), extra);
    assert_eq!(m("kvroute_bridge_gaps_total", ""), 1.0);
    assert!(m("kvroute_bridge_replays_total", "ok") >= 1.0);
    assert_eq!(m("kvroute_bridge_ranks_cleared_total", ""), 0.0);

    // The engine restarts: its new seq 0 clears the rank.
    publisher.restart().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    publisher
        .publish(0, json!([stored(e, &[5], None, &t2, "GPU", None)]))
        .unwrap();
    // Should the resubscription have missed seq 0, seq 1 still shows the restart (and replay
    // brings seq 0 back).
    publisher.publish(0, json!([])).unwrap();
    let expected = reference(&[(0, chain(e, &[5], None, &t2, StorageTier::Device, None))]);
    wait_digest(&indexer, expected.digest(), "a restarted engine").await;
    drop(bridged);
    drop(publisher);

    // Without replay: the gap clears the rank, later events rebuild it.
    let mut options = EngineOptions::new(e);
    options.replay = false;
    let mut publisher = EnginePublisher::start(options).unwrap();
    let bridged = bridge(&env, &publisher).await;
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher.drop_next(0).unwrap();
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[4], None, &t3, "GPU", None)]))
        .unwrap();
    let expected = reference(&[(0, chain(e, &[4], None, &t3, StorageTier::Device, None))]);
    wait_digest(&indexer, expected.digest(), "a gap without replay").await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_ranks_cleared_total", "e", Some(0), ""),
        1.0
    );
}

/// A bridge started (or restarted) next to an engine that already has a history learns it from
/// the engine's replay buffer at once, without waiting for the engine's next batch — an engine
/// at rest may send none for a long time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_started_late_learns_the_history_without_a_new_batch() {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", NO_SNAPSHOTS).unwrap();
    let e = Engine::Sglang;
    let (t1, t2) = (tokens(100, 2), tokens(200, 1));
    let mut publisher = EnginePublisher::start(EngineOptions::new(e)).unwrap();
    publisher
        .publish(0, json!([stored(e, &[1, 2], None, &t1, "GPU", None)]))
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[3], None, &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[2], "GPU")]))
        .unwrap();
    let bridged = bridge(&env, &publisher).await;
    let local = local_block_hashes(&t1, BS as usize, seed_for_lora(None));
    let expected = reference(&[
        (
            0,
            KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: hv(e, 1),
                    tokens_hash: local[0],
                }],
                tier: StorageTier::Device,
            },
        ),
        (1, chain(e, &[3], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(
        &indexer,
        expected.digest(),
        "the engine's history, learnt at start",
    )
    .await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_replays_total", "e", Some(0), "ok"),
        1.0
    );
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_gaps_total", "e", Some(0), ""),
        0.0
    );
    // The engine goes on; its next batch continues the numbering.
    publisher
        .publish(0, json!([removed(e, &[1], "GPU")]))
        .unwrap();
    let expected = reference(&[(1, chain(e, &[3], None, &t2, StorageTier::Device, None))]);
    wait_digest(
        &indexer,
        expected.digest(),
        "the next batch after the catch-up",
    )
    .await;
    assert_eq!(
        bridged
            .metrics
            .get("kvroute_bridge_gaps_total", "e", Some(0), ""),
        0.0
    );
}

/// A gap the engine's replay buffer no longer reaches back to (it keeps the last 2 batches; 3
/// in a row were lost) cannot be filled: the bridge publishes `Cleared` for that rank only,
/// counts it, and rebuilds the rank from the following events — the blocks stored before the
/// gap are lost to routing until the engine stores them again.
async fn gap_older_than_the_replay_buffer(e: Engine) {
    let env = TestEnv::start().unwrap();
    let indexer = IndexerProcess::start(&env, "a", &[]).unwrap();
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut options = EngineOptions::new(e);
    options.buffer_steps = 2;
    let mut publisher = EnginePublisher::start(options).unwrap();
    let bridged = bridge(&env, &publisher).await;
    let mut events = nats.subscribe(names.kv_events(WORKER)).await.unwrap();
    let (t1, t2, t3) = (tokens(100, 1), tokens(200, 1), tokens(300, 1));
    publisher
        .publish(0, json!([stored(e, &[1], None, &t1, "GPU", None)]))
        .unwrap();
    publisher
        .publish(1, json!([stored(e, &[20], None, &t2, "GPU", None)]))
        .unwrap();
    let before = reference(&[
        (0, chain(e, &[1], None, &t1, StorageTier::Device, None)),
        (1, chain(e, &[20], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(&indexer, before.digest(), "before the gap").await;
    // Seqs 1-3 never leave the PUB socket; by seq 4 the buffer holds only seqs 3 and 4.
    for _ in 0..3 {
        publisher.drop_next(0).unwrap();
    }
    publisher
        .publish(0, json!([stored(e, &[2], Some(1), &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([stored(e, &[3], None, &t2, "GPU", None)]))
        .unwrap();
    publisher
        .publish(0, json!([removed(e, &[3], "GPU")]))
        .unwrap();
    let seq = publisher
        .publish(0, json!([stored(e, &[4], None, &t3, "GPU", None)]))
        .unwrap();
    assert_eq!(seq, 4);
    let expected = reference(&[
        (0, chain(e, &[4], None, &t3, StorageTier::Device, None)),
        (1, chain(e, &[20], None, &t2, StorageTier::Device, None)),
    ]);
    wait_digest(
        &indexer,
        expected.digest(),
        "a gap the buffer no longer covers",
    )
    .await;
    let probes = [
        probe("rank 0's block from before the gap", t1.clone(), None, &[]),
        probe(
            "rank 0's block from after the gap",
            t3.clone(),
            None,
            &[(0, 1, 0)],
        ),
        probe("rank 1's block", t2.clone(), None, &[(1, 1, 0)]),
    ];
    check_queries(&nats, &names, &indexer, &expected, &probes, "after the gap").await;

    let m =
        |rank, name: &'static str, extra: &str| bridged.metrics.get(name, "e", Some(rank), extra);
    assert_eq!(m(0, "kvroute_bridge_gaps_total", ""), 1.0);
    // (The start-up catch-up may have replayed seq 0 as "ok": it races the first publish.)
    assert_eq!(m(0, "kvroute_bridge_replays_total", "not_covered"), 1.0);
    assert_eq!(m(0, "kvroute_bridge_ranks_cleared_total", ""), 1.0);
    assert_eq!(m(1, "kvroute_bridge_ranks_cleared_total", ""), 0.0);

    // What the bridge published for rank 0 up to block 4: `Cleared`, then block 4 — nothing of
    // the lost batches, nor of seq 3, which the buffer still had. (What came before the gap may
    // be missing: the subscription raced its publication.)
    let last = chain(e, &[4], None, &t3, StorageTier::Device, None);
    let mut seen = Vec::new();
    let start = Instant::now();
    while seen.last() != Some(&last) {
        let left = Duration::from_secs(10).saturating_sub(start.elapsed());
        let msg = tokio::time::timeout(left, events.next())
            .await
            .unwrap_or_else(|_| panic!("rank 0's events never reached block 4: {seen:?}"))
            .unwrap();
        let batch: KvEventBatch = decode(&msg.payload).unwrap();
        assert_eq!(batch.worker_id, WORKER);
        if batch.dp_rank == 0 {
            seen.extend(batch.events.into_iter().map(|event| event.data));
        }
    }
    assert_eq!(seen[seen.len() - 2], KvEventData::Cleared, "{seen:?}");
    let lost = [hv(e, 2), hv(e, 3)];
    let names_lost = |d: &KvEventData| match d {
        KvEventData::Stored { blocks, .. } => blocks.iter().any(|b| lost.contains(&b.block_hash)),
        KvEventData::Removed { block_hashes, .. } => block_hashes.iter().any(|h| lost.contains(h)),
        KvEventData::Cleared => false,
    };
    assert!(!seen.iter().any(names_lost), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_gap_older_than_the_replay_buffer_clears_the_rank() {
    gap_older_than_the_replay_buffer(Engine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_gap_older_than_the_replay_buffer_clears_the_rank() {
    gap_older_than_the_replay_buffer(Engine::Sglang).await;
}
