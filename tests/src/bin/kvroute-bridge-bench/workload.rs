//! The engine batches every phase sends, generated once: vLLM 0.32's wire format exactly as its
//! `ZmqEventPublisher` writes it (tests/tests/engine_publishers.rs checks that format against the
//! wheel's own code), and what the bridge's pure core makes of them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute_bridge::config::EngineKind;
use kvroute_bridge::mirror::{RankMirror, Translation};
use kvroute_bridge::wire::decode_batch;
use kvroute_common::codec::encode;
use kvroute_common::hashing::{chain_hash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::{KvEvent, KvEventBatch, KvEventData, SchemaVersion, now_ms};
use kvroute_common::{DpRank, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rmpv::Value;

pub const BLOCK_SIZE: usize = 16;
/// Token ids are drawn from a vocabulary of this size (Qwen2's), so some take 3 and some 5
/// bytes of MessagePack, as real prompts' do.
const VOCAB: u32 = 151_936;

/// The shape of the generated stream.
#[derive(Debug, Clone)]
pub struct Shape {
    pub batches: usize,
    pub stores_per_batch: usize,
    pub blocks: usize,
    pub chain_blocks: usize,
    pub resident_chains: usize,
}

/// The pre-generated engine batches and what the phases need to know about them.
#[derive(Debug)]
pub struct Workload {
    /// vLLM payloads: `[ts, [BlockStored..., BlockRemoved?], rank]`.
    pub payloads: Vec<Vec<u8>>,
    /// Block events per payload: stored blocks plus removed hashes.
    pub blocks: Vec<u64>,
    /// Per payload: its last stored block as (chain, depth).
    pub last_stored: Vec<(usize, usize)>,
    /// Every chain's local (tokens) hashes, root first: the visibility queries.
    pub chains: Vec<Vec<u64>>,
    /// `[ts, [], 0]`: a batch without events, for joining the PUB.
    pub probe: Vec<u8>,
}

impl Workload {
    pub fn total_blocks(&self) -> u64 {
        self.blocks.iter().sum()
    }
}

fn write(value: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, value).expect("writing to a Vec");
    buf
}

/// An event as msgspec writes a `tag=True` struct: `type` first, then the fields in order.
fn tagged(kind: &str, fields: Vec<(&str, Value)>) -> Value {
    let mut map = vec![(Value::from("type"), Value::from(kind))];
    map.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
    Value::Map(map)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&v| Value::from(v)).collect())
}

/// vLLM's batch envelope (msgspec `array_like`): `[ts (float64), events, data_parallel_rank]`.
fn envelope(events: Vec<Value>) -> Vec<u8> {
    write(&Value::Array(vec![
        Value::F64(now_ms() as f64 / 1000.0),
        Value::Array(events),
        Value::from(0),
    ]))
}

/// vLLM's `BlockStored` as its block pool publishes it (no LoRA, device, group 0, one nil
/// extra-keys entry per block).
fn block_stored(hashes_: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    tagged(
        "BlockStored",
        vec![
            ("block_hashes", hashes(hashes_)),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            (
                "token_ids",
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            ),
            ("block_size", Value::from(BLOCK_SIZE)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("GPU")),
            ("lora_name", Value::Nil),
            ("extra_keys", Value::Array(vec![Value::Nil; hashes_.len()])),
            ("group_idx", Value::from(0)),
        ],
    )
}

fn block_removed(hashes_: &[u64]) -> Value {
    tagged(
        "BlockRemoved",
        vec![
            ("block_hashes", hashes(hashes_)),
            ("medium", Value::from("GPU")),
            ("group_idx", Value::from(0)),
        ],
    )
}

/// Each batch stores `stores_per_batch` chains of `blocks` blocks, each continuing the previous
/// one, until a chain has `chain_blocks` blocks and the next starts from the root; once more
/// than `resident_chains` chains' worth of blocks are held, each batch also removes as many
/// blocks as it stores from the oldest chain, leaf first (as an LRU evicts), so the mirror and
/// the index stay bounded. Seeded: every run sends the same bytes.
pub fn generate(shape: &Shape) -> Workload {
    let mut rng = StdRng::seed_from_u64(7);
    let seed = seed_for_lora(None);
    let per_batch = shape.stores_per_batch * shape.blocks;
    let max_resident = shape.resident_chains * shape.chain_blocks;
    let mut chains: Vec<Vec<u64>> = vec![Vec::new()];
    // Engine hashes of the chains still held, oldest first (the last one is being built).
    let mut held: VecDeque<Vec<u64>> = VecDeque::from([Vec::new()]);
    let mut resident = 0usize;
    let mut w = Workload {
        payloads: Vec::with_capacity(shape.batches),
        blocks: Vec::with_capacity(shape.batches),
        last_stored: Vec::with_capacity(shape.batches),
        chains: Vec::new(),
        probe: envelope(Vec::new()),
    };
    for _ in 0..shape.batches {
        let mut events = Vec::new();
        for _ in 0..shape.stores_per_batch {
            if chains.last().expect("a chain").len() >= shape.chain_blocks {
                chains.push(Vec::new());
                held.push_back(Vec::new());
            }
            let tokens: Vec<u32> = (0..shape.blocks * BLOCK_SIZE)
                .map(|_| rng.random_range(0..VOCAB))
                .collect();
            let local = local_block_hashes(&tokens, BLOCK_SIZE, seed);
            let engine_chain = held.back_mut().expect("a chain");
            let parent = engine_chain.last().copied();
            // Content-derived like vLLM's (the low 64 bits of a chained SHA-256), and above
            // i64::MAX, which a decoder must read as u64.
            let mut prev = parent.unwrap_or(0);
            let block_hashes: Vec<u64> = local
                .iter()
                .map(|&l| {
                    prev = chain_hash(prev, l, seed) | 1 << 63;
                    prev
                })
                .collect();
            events.push(block_stored(&block_hashes, parent, &tokens));
            chains.last_mut().expect("a chain").extend(local);
            engine_chain.extend(block_hashes);
            resident += shape.blocks;
        }
        let mut removed = Vec::new();
        while resident > max_resident && removed.len() < per_batch && held.len() > 1 {
            match held.front_mut().expect("held chains").pop() {
                Some(h) => {
                    removed.push(h);
                    resident -= 1;
                }
                None => {
                    held.pop_front();
                }
            }
        }
        if held.len() > 1 && held.front().is_some_and(Vec::is_empty) {
            held.pop_front();
        }
        let mut block_events = per_batch as u64;
        if !removed.is_empty() {
            block_events += removed.len() as u64;
            events.push(block_removed(&removed));
        }
        w.payloads.push(envelope(events));
        w.blocks.push(block_events);
        w.last_stored
            .push((chains.len() - 1, chains.last().expect("a chain").len()));
    }
    w.chains = chains;
    w
}

/// The bridge's pure core alone on one thread, and what each payload becomes.
#[derive(Debug)]
pub struct CoreRun {
    pub decode_only: Duration,
    pub decode_mirror: Duration,
    /// kvroute's events per payload, as the relay hands them to the publisher.
    pub translations: Vec<Vec<KvEventData>>,
}

impl CoreRun {
    pub fn kv_events(&self) -> usize {
        self.translations.iter().map(Vec::len).sum()
    }
}

/// Decodes every payload (`wire::decode_batch`), then decodes and mirrors them (`RankMirror`);
/// checks each batch is translated one block event for one.
pub fn core_run(w: &Workload, max_blocks: usize) -> anyhow::Result<CoreRun> {
    let t = Instant::now();
    for p in &w.payloads {
        std::hint::black_box(decode_batch(EngineKind::Vllm, p)?);
    }
    let decode_only = t.elapsed();
    let t = Instant::now();
    let mut mirror = RankMirror::new(max_blocks);
    let mut translations = Vec::with_capacity(w.payloads.len());
    for (i, p) in w.payloads.iter().enumerate() {
        let batch = decode_batch(EngineKind::Vllm, p)?;
        anyhow::ensure!(batch.skipped.is_empty(), "batch {i}: {:?}", batch.skipped);
        let mut out = Translation::default();
        for e in &batch.events {
            mirror.apply(e, &mut out);
        }
        anyhow::ensure!(
            out.ignored.is_empty() && out.duplicate_copies == 0,
            "batch {i} was not translated one for one: {out:?}"
        );
        translations.push(out.events);
    }
    let decode_mirror = t.elapsed();
    for (i, (t, &b)) in translations.iter().zip(&w.blocks).enumerate() {
        let out: u64 = t.iter().map(|d| d.block_count() as u64).sum();
        anyhow::ensure!(out == b, "batch {i}: {b} block events in, {out} out");
    }
    Ok(CoreRun {
        decode_only,
        decode_mirror,
        translations,
    })
}

/// The translations as encoded `KvEventBatch`es, one per engine batch, event ids from 1: what
/// the relay would publish without coalescing. Returns them and the encoding time.
pub fn kv_batches(
    core: &CoreRun,
    worker_id: WorkerId,
    dp_rank: DpRank,
) -> anyhow::Result<(Vec<bytes::Bytes>, Duration)> {
    let mut next_id = 1u64;
    let t = Instant::now();
    let mut out = Vec::with_capacity(core.translations.len());
    for events in &core.translations {
        let events: Vec<KvEvent> = events
            .iter()
            .map(|data| {
                next_id += 1;
                KvEvent {
                    event_id: next_id - 1,
                    data: data.clone(),
                }
            })
            .collect();
        out.push(encode(&KvEventBatch {
            v: SchemaVersion::CURRENT,
            worker_id,
            dp_rank,
            events,
            ts: now_ms(),
        })?);
    }
    Ok((out, t.elapsed()))
}
