//! The shared part of the bridge event tests (`bridge_events.rs`, `bridge_gaps.rs`): a bridge
//! event path for one engine publisher, the engines' event shapes built by hand, the reference
//! index built from the same events with kvroute's hashing, and the digest and overlap-query
//! checks against an indexer fed through the bridge.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_bridge::BridgeMetrics;
use kvroute_bridge::config::{EngineKind, EngineSpec};
use kvroute_bridge::relay::{Relay, RelaySettings};
use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::messages::{
    IndexQuery, IndexQueryResponse, KvEventData, StorageTier, StoredBlock, WorkerMatch,
};
use kvroute_common::worker::{PublisherConfig, RegistrationConfig, WorkerAgent, WorkerAgentConfig};
use kvroute_indexer::{IndexConfig, RadixIndex};
use kvroute_tests::{Engine, EnginePublisher, IndexerProcess, TestEnv, sim_card};
use serde_json::{Value, json};

pub const WORKER: u64 = 77;
pub const BS: u32 = 4;
/// Indexer flags: state only in memory, so a purged log can only be recovered by resyncs.
pub const NO_SNAPSHOTS: &[&str] = &[
    "--snapshot-every-messages",
    "0",
    "--snapshot-interval-secs",
    "0",
];

/// A running bridge event path for one engine: the relay and the worker agent it publishes
/// through (what `kvroute-bridge` runs per engine, minus the HTTP side).
pub struct Bridged {
    pub relay: Relay,
    pub agent: Option<WorkerAgent>,
    pub metrics: Arc<BridgeMetrics>,
}

pub async fn bridge(env: &TestEnv, engine: &EnginePublisher) -> Bridged {
    let kind = match engine.options.engine {
        Engine::Vllm | Engine::Vllm034 => EngineKind::Vllm,
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
        kv_events: true,
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
            shared_tier: true,
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
pub fn h(engine: Engine, n: u64) -> Value {
    match engine {
        Engine::Vllm | Engine::Vllm034 => json!(u64::MAX - n),
        Engine::Sglang => json!(-(n as i64) - 1),
    }
}

pub fn hv(engine: Engine, n: u64) -> u64 {
    match engine {
        Engine::Vllm | Engine::Vllm034 => u64::MAX - n,
        Engine::Sglang => (-(n as i64) - 1) as u64,
    }
}

pub fn stored(
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

pub fn removed(engine: Engine, hashes: &[u64], medium: &str) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes.iter().map(|&n| h(engine, n)).collect::<Vec<_>>(), "medium": medium})
}

/// kvroute's view of blocks `hashes` holding `tokens` (hand-built with kvroute's hashing).
pub fn chain(
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
pub fn reference(events: &[(u32, KvEventData)]) -> RadixIndex {
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
pub struct Probe {
    what: &'static str,
    prompt: Vec<u32>,
    lora: Option<&'static str>,
    want: Vec<(u32, u32, u32)>,
}

pub fn probe(
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
pub async fn query(
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
pub async fn check_queries(
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

pub async fn wait_digest(indexer: &IndexerProcess, want: u64, what: &str) {
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

pub fn tokens(base: u32, blocks: u32) -> Vec<u32> {
    (base..base + blocks * BS).collect()
}

/// Tokens of `blocks` full blocks: `base`'s first block, then fresh ones (a partial hit).
pub fn first_block_then_new(base: &[u32], blocks: u32) -> Vec<u32> {
    let mut t = base[..BS as usize].to_vec();
    t.extend(tokens(900, blocks - 1));
    t
}

pub const ADAPTER: Option<&str> = Some("sql-adapter");
