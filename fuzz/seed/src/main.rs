//! Writes the fuzz targets' seed corpora into `fuzz/corpus/<target>/`: real encoded messages of
//! the kinds the unit and integration tests build (valid ones, so the fuzzer starts from inputs
//! that reach past the envelope). Run by `scripts/fuzz --seed`; the output is committed.

use std::path::{Path, PathBuf};

use kvroute_common::codec::{WireMessage, encode};
use kvroute_common::messages::{
    ControlAction, ControlRecord, KvEvent, KvEventBatch, KvEventData, SchemaVersion, StorageTier,
    StoredBlock,
};
use kvroute_common::{Names, Namespace};
use kvroute_indexer::replica::ReplicaState;
use kvroute_indexer::{IndexConfig, SharedIndex};
use rmpv::Value;
use serde_json::json;

/// The namespace the log-entry and worker-card targets use.
const NS: &str = "fuzz";
/// The worker whose subject and key those targets give to inputs of mode 1 / 0.
const WORKER: u64 = 7;

fn main() {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus"));
    let names = Names::new(&Namespace::new(NS).expect("valid namespace"));
    let batches = batches();
    let control = wire(&ControlRecord {
        v: SchemaVersion::CURRENT,
        action: ControlAction::WorkerRemoved { worker_id: WORKER },
        replica_id: "indexer-1".into(),
        term: 0,
        at_ms: 0,
    });

    let mut out = Corpus::new(&root);
    out.target("wire_kv_event_batch", batches.iter().map(wire));
    out.target("wire_control_record", [control.clone()]);
    out.target(
        "wire_worker_load",
        loads()
            .into_iter()
            .map(|v| json_wire::<kvroute_common::messages::WorkerLoad>(v)),
    );
    out.target(
        "wire_decision",
        decisions()
            .into_iter()
            .map(json_wire::<kvroute_common::messages::Decision>),
    );
    out.target(
        "wire_request_lifecycle",
        lifecycles()
            .into_iter()
            .map(json_wire::<kvroute_common::messages::RequestLifecycle>),
    );
    out.target(
        "wire_generate_request",
        generates()
            .into_iter()
            .map(json_wire::<kvroute_common::messages::GenerateRequest>)
            .flat_map(with_token_array),
    );
    out.target(
        "wire_index_query",
        queries()
            .into_iter()
            .map(json_wire::<kvroute_common::messages::IndexQuery>)
            .flat_map(with_token_array),
    );
    out.target("wire_replies", replies());
    out.target(
        "select_request",
        selects()
            .into_iter()
            .map(json_wire::<kvroute_common::messages::SelectRequest>)
            .flat_map(with_token_array),
    );

    let mut entries = vec![prefixed(0, &control)];
    for b in &batches {
        entries.push(prefixed(1, &wire(b)));
    }
    let mut on_subject = names.kv_events(WORKER).into_bytes();
    on_subject.push(b'\n');
    on_subject.extend_from_slice(&wire(&batches[0]));
    entries.push(prefixed(2, &on_subject));
    out.target("log_entry", entries);

    // Snapshots: of the tests' batches applied in turn (the last one with the shared tier, so
    // format v3), without their checksum (the target appends it).
    let mut snapshots = Vec::new();
    let mut states = Vec::new();
    let index = SharedIndex::new(IndexConfig::default());
    let capped = SharedIndex::new(IndexConfig {
        max_entries: Some(4),
        ..IndexConfig::default()
    });
    let mut state = ReplicaState::new(&names, IndexConfig::default());
    for (seq, b) in batches.iter().enumerate() {
        index.apply_batch(b);
        capped.apply_batch(b);
        for ix in [&index, &capped] {
            let s = ix.snapshot();
            snapshots.push(s[..s.len() - 8].to_vec());
        }
        state.apply(seq as u64 + 1, &names.kv_events(b.worker_id), &wire(b));
        states.push(state.snapshot());
    }
    state.apply(99, &names.kv_control(), &control);
    states.push(state.snapshot());
    out.target("index_snapshot", snapshots);
    out.target("replica_state", states);

    let cards = cards();
    let mut card_inputs: Vec<Vec<u8>> = cards.iter().map(|c| prefixed(0, c)).collect();
    let mut keyed = names.worker_key(WORKER).into_bytes();
    keyed.push(b'\n');
    keyed.extend_from_slice(&cards[0]);
    card_inputs.push(prefixed(1, &keyed));
    out.target("worker_card", card_inputs);

    out.target("engine_metrics", metrics_pages());
    out.target("engine_vllm", engine_batches(false));
    out.target("engine_sglang", engine_batches(true));
    out.target("gateway_openai", openai_bodies());
    out.target("gateway_select", select_bodies());
    println!("seed: wrote {} files under {}", out.files, root.display());
}

struct Corpus {
    root: PathBuf,
    files: usize,
}

impl Corpus {
    fn new(root: &Path) -> Self {
        Self {
            root: root.to_owned(),
            files: 0,
        }
    }

    /// Replaces the target's seeds with `inputs`, named `seed-<n>`; other inputs (crashes a
    /// fuzzer found, kept as regressions) stay.
    fn target(&mut self, name: &str, inputs: impl IntoIterator<Item = Vec<u8>>) {
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
        for entry in std::fs::read_dir(&dir).expect("read the corpus directory") {
            let path = entry.expect("a corpus entry").path();
            if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seed-"))
            {
                std::fs::remove_file(&path).expect("remove an old seed");
            }
        }
        for (i, input) in inputs.into_iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), input).expect("write a seed");
            self.files += 1;
        }
    }
}

fn wire<T: WireMessage>(msg: &T) -> Vec<u8> {
    encode(msg).expect("a seed encodes").to_vec()
}

fn json_wire<T: WireMessage>(v: serde_json::Value) -> Vec<u8> {
    let msg: T = serde_json::from_value(v).expect("a seed reads from JSON");
    wire(&msg)
}

fn prefixed(mode: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![mode];
    out.extend_from_slice(bytes);
    out
}

/// The message as encoded, and when it has `token_ids` (a bin) also with them as an array of
/// integers, the other form readers accept.
fn with_token_array(bytes: Vec<u8>) -> Vec<Vec<u8>> {
    let mut value = rmpv::decode::read_value(&mut &bytes[..]).expect("valid MessagePack");
    let mut changed = false;
    if let Value::Map(fields) = &mut value {
        for (k, v) in fields.iter_mut() {
            if k.as_str() == Some("token_ids")
                && let Value::Binary(b) = v
            {
                let ints = b
                    .chunks_exact(4)
                    .map(|c| Value::from(u32::from_le_bytes(c.try_into().unwrap())))
                    .collect();
                *v = Value::Array(ints);
                changed = true;
            }
        }
    }
    if !changed {
        return vec![bytes];
    }
    vec![bytes, msgpack(&value)]
}

fn msgpack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("write to a Vec");
    out
}

fn stored(id: u64, parent: Option<u64>, hashes: &[u64], tier: StorageTier) -> KvEvent {
    KvEvent {
        event_id: id,
        data: KvEventData::Stored {
            parent_hash: parent,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    block_hash: h,
                    tokens_hash: h.wrapping_mul(31),
                })
                .collect(),
            tier,
        },
    }
}

fn batches() -> Vec<KvEventBatch> {
    let batch = |dp_rank, events: Vec<KvEvent>| KvEventBatch {
        v: KvEventBatch::required_version(&events),
        worker_id: WORKER,
        dp_rank,
        events,
        ts: 1_700_000_000_000,
    };
    vec![
        batch(
            0,
            vec![
                KvEvent {
                    event_id: 0,
                    data: KvEventData::Cleared,
                },
                stored(1, None, &[11, 12, 13], StorageTier::Device),
                stored(2, Some(13), &[14, 15], StorageTier::Device),
            ],
        ),
        batch(
            0,
            vec![
                stored(3, Some(12), &[21], StorageTier::Host),
                KvEvent {
                    event_id: 4,
                    data: KvEventData::Removed {
                        block_hashes: vec![15],
                        tier: StorageTier::Device,
                    },
                },
                stored(5, None, &[11], StorageTier::Disk),
            ],
        ),
        batch(1, vec![stored(0, None, &[11, 12], StorageTier::Device)]),
        batch(0, vec![stored(6, None, &[11, 12, 31], StorageTier::Shared)]),
    ]
}

fn loads() -> Vec<serde_json::Value> {
    vec![
        json!({"worker_id": WORKER, "dp_rank": 0, "seq": 3, "active_prefill_tokens": 512,
               "active_decode_blocks": 40, "active_requests": 4, "waiting_requests": 1,
               "kv_used_blocks": 900, "total_kv_blocks": 1000, "ts": 1_700_000_000_000u64}),
        json!({"worker_id": WORKER, "dp_rank": 1, "seq": 4, "ts": 1_700_000_000_500u64,
               "new_requests": ["0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01",
                                "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d02"]}),
        json!({"worker_id": WORKER, "dp_rank": 0, "seq": 5, "ts": 1_700_000_001_000u64,
               "adapters": {"loaded": ["sql", "poem"], "waiting": ["chat"], "max_loaded": 2}}),
    ]
}

fn decisions() -> Vec<serde_json::Value> {
    let base = json!({"decision_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d10",
        "request_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01", "router_id": "router-1",
        "model": "m", "role": "aggregated", "worker_id": WORKER, "dp_rank": 0,
        "request_blocks": 8, "overlap_blocks": 5, "prefill_tokens": 48, "block_size": 16,
        "cost": {"total": 1.25, "terms": {"overlap": -5.0, "load": 6.25}},
        "policy": "default", "ts": 1_700_000_000_000u64});
    let mut with_session = base.clone();
    with_session["session_id"] = json!("chat-1");
    with_session["binding"] = json!("kept");
    with_session["expected_output_tokens"] = json!(64);
    with_session["attempt"] = json!(1);
    with_session["prefix_hashes"] = json!([1, 2, 3, 18446744073709551615u64]);
    let mut with_adapter = base.clone();
    with_adapter["lora_name"] = json!("sql");
    vec![base, with_session, with_adapter]
}

fn lifecycles() -> Vec<serde_json::Value> {
    let id = "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01";
    [
        json!({"type": "prefill_done", "cached_tokens": 32}),
        json!({"type": "progress", "output_tokens": 16}),
        json!({"type": "finished", "output_tokens": 40}),
    ]
    .into_iter()
    .map(|kind| {
        json!({"request_id": id, "worker_id": WORKER, "dp_rank": 1, "kind": kind,
                        "ts": 1_700_000_000_000u64})
    })
    .collect()
}

fn generates() -> Vec<serde_json::Value> {
    let id = "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01";
    vec![
        json!({"request_id": id, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 16,
               "dp_rank": 0, "decision_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d10"}),
        json!({"request_id": id, "block_hashes": [11, 12], "block_size": 16,
               "prompt_tokens": 40, "max_tokens": 1, "lora_name": "adapter"}),
    ]
}

fn queries() -> Vec<serde_json::Value> {
    vec![
        json!({"model": "m", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4}),
        json!({"model": "", "block_hashes": [11, 12, 13], "lora_name": "a",
               "deadline_ms": 1_700_000_000_000u64}),
    ]
}

fn selects() -> Vec<serde_json::Value> {
    vec![
        json!({"model": "m", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}),
        json!({"request_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01", "model": "m",
               "role": "prefill", "block_hashes": [11, 12], "block_size": 16,
               "lora_name": "a", "session": {"id": "chat-1", "parent_id": "chat-0",
               "final": false, "trigger": "user_message"},
               "allowed_workers": [7, 8], "pin": {"worker_id": 7, "dp_rank": 1},
               "dp_rank_range": {"min": 0, "max": 3}, "tolerated_taints": ["spot"],
               "required_taints": ["gpu"], "preferred_taints": ["fast"],
               "expected_output_tokens": 64, "priority": 2, "priority_jump_ms": 500,
               "temperature": 0.5, "policy": "round-robin",
               "deadline_ms": 1_700_000_000_000u64, "attempt": 1,
               "queue_timeout_ms": 2000}),
    ]
}

fn replies() -> Vec<Vec<u8>> {
    use kvroute_common::messages::{
        GenerateResponse, IndexQueryResponse, ReplicaStatus, SelectResponse, SessionBindingRecord,
    };
    let id = "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01";
    vec![
        prefixed(
            0,
            &json_wire::<IndexQueryResponse>(json!({"status": "ok", "matches": [
            {"worker_id": 7, "dp_rank": 0, "device": 3, "host": 1, "disk": 0, "shared": 2,
             "total_blocks": 100}], "query_blocks": 4, "applied_seq": 12,
            "replica_id": "indexer-1"})),
        ),
        prefixed(
            0,
            &json_wire::<IndexQueryResponse>(json!({"status": "error",
            "code": "not_ready", "message": "catching up", "replica_id": "indexer-2"})),
        ),
        prefixed(
            1,
            &json_wire::<SelectResponse>(json!({"status": "ok", "request_id": id,
            "decision_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d10", "worker_id": 7,
            "dp_rank": 1, "request_subject": "kvroute.fuzz.worker.7",
            "overlap_blocks": {"device": 3, "host": 1}, "request_blocks": 4,
            "cost": {"total": 0.5, "terms": {"overlap": -3.0}}, "policy": "default",
            "binding": "new", "router_id": "router-1"})),
        ),
        prefixed(
            1,
            &json_wire::<SelectResponse>(json!({"status": "error", "request_id": id,
            "code": "all_filtered", "message": "none", "reasons": {"7": "busy"}})),
        ),
        prefixed(
            2,
            &json_wire::<GenerateResponse>(json!({"status": "ok", "request_id": id,
            "worker_id": 7, "dp_rank": 0, "ttft_ms": 12.5, "latency_ms": 80.0,
            "prompt_tokens": 40, "cached_tokens": 32, "output_tokens": 16})),
        ),
        prefixed(
            2,
            &json_wire::<GenerateResponse>(json!({"status": "error",
            "request_id": id, "code": "bad_request", "message": "no prompt"})),
        ),
        prefixed(
            3,
            &json_wire::<SessionBindingRecord>(json!({"worker_id": 7, "dp_rank": 2,
            "last_used_ms": 1_700_000_000_000u64})),
        ),
        prefixed(
            4,
            &json_wire::<ReplicaStatus>(json!({"replica_id": "indexer-1",
            "applied_seq": 12, "digest": 18446744073709551615u64, "ready": true,
            "leader": true, "entries": 40, "stream_last_seq": 12})),
        ),
    ]
}

fn cards() -> Vec<Vec<u8>> {
    use kvroute_common::messages::WorkerCard;
    vec![
        json_wire::<WorkerCard>(
            json!({"worker_id": WORKER, "model": "m", "role": "aggregated",
            "block_size": 16, "total_kv_blocks": 1000, "max_num_batched_tokens": 2048,
            "dp_start_rank": 0, "dp_size": 2, "taints": ["spot"],
            "labels": {"zone": "a", "kvroute.bridge/engine": "vllm"},
            "request_subject": "kvroute.fuzz.worker.7", "software_version": "0.1.0",
            "http_url": "http://127.0.0.1:8000"}),
        ),
        json_wire::<WorkerCard>(json!({"worker_id": WORKER, "model": "m", "role": "prefill",
            "block_size": 64, "total_kv_blocks": 10,
            "request_subject": "kvroute.fuzz.worker.7"})),
        json_wire::<WorkerCard>(json!({"worker_id": WORKER, "model": "m",
            "block_size": 16, "total_kv_blocks": 1000, "request_subject": "kvroute.fuzz.worker.7",
            "http_url": "http://127.0.0.1:8000", "lora_adapters": ["poem", "sql"]})),
    ]
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints(v: &[i64]) -> Value {
    Value::Array(v.iter().map(|&x| Value::from(x)).collect())
}

/// Batches as the engines' publishers write them: vLLM's (integer or bytes hashes, extra keys,
/// maps and positional events) or SGLang's (signed hashes, `attn_dp_rank`).
/// vLLM `/metrics` pages: loads and cache facts, and LoRA slots as prometheus_client prints
/// vLLM's info gauge (one series per label set, valued at when it was last current).
fn metrics_pages() -> Vec<Vec<u8>> {
    [
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n\
         vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
         vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
         vllm:cache_config_info{block_size=\"32\",engine=\"0\",num_gpu_blocks=\"64\"} 1.0\n",
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
         # TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"sql\"} 1.7964664500219235e+09\n\
         vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.7964664505107772e+09\n\
         vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"chat\",waiting_lora_adapters=\"chat,sql\"} 1.796466450505553e+09\n",
    ]
    .map(|page| page.as_bytes().to_vec())
    .to_vec()
}

fn engine_batches(sglang: bool) -> Vec<Vec<u8>> {
    let hashes = if sglang {
        ints(&[-1, 42, -7])
    } else {
        Value::Array(vec![
            Value::from(u64::MAX - 5),
            Value::Binary(vec![1, 2, 3, 4]),
            Value::from(9),
        ])
    };
    let stored = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", hashes.clone()),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&[1, 2, 3, 4, 5, 6])),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
    ]);
    let mut extra = stored.clone();
    if let Value::Map(fields) = &mut extra {
        fields.push((
            s("extra_keys"),
            Value::Array(vec![
                Value::Array(vec![s("img"), Value::from(3)]),
                Value::Nil,
                Value::Array(vec![Value::from(1.5)]),
            ]),
        ));
        fields.push((s("cache_salt"), s("salt")));
    }
    let removed = map(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(&[42])),
        ("medium", s("CPU")),
    ]);
    let cleared = map(vec![("type", s("AllBlocksCleared"))]);
    let positional = Value::Array(vec![
        s("BlockStored"),
        hashes,
        Value::from(5),
        ints(&[7, 8, 9, 10, 11, 12]),
        Value::from(2),
        Value::Nil,
        s("GPU"),
    ]);
    let events = Value::Array(vec![stored, extra, removed, cleared, positional]);
    let rank_key = if sglang {
        "attn_dp_rank"
    } else {
        "data_parallel_rank"
    };
    vec![
        msgpack(&Value::Array(vec![
            Value::F64(1.5),
            events.clone(),
            Value::from(1),
        ])),
        msgpack(&Value::Array(vec![Value::F64(1.5), events.clone()])),
        msgpack(&map(vec![
            ("ts", Value::F64(2.0)),
            ("events", events),
            (rank_key, Value::from(3)),
        ])),
    ]
}

fn openai_bodies() -> Vec<Vec<u8>> {
    let bodies = [
        (
            0u8,
            json!({"model": "m", "prompt": "Hello there", "max_tokens": 16,
                     "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            0,
            json!({"model": "m", "prompt": [[1, 2, 3], [4, 5]], "kvroute":
                   {"session": {"id": "chat-1", "parent_id": "chat-0", "final": true},
                    "policy": "round-robin"}}),
        ),
        (
            1,
            json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                   "max_completion_tokens": 32, "tools": [], "add_generation_prompt": true}),
        ),
        // Session headers taken from the start of the body (mode bits 1 and 2).
        (
            1 | 2 | 4 | (6 << 3),
            json!({"model": "m", "messages": [{"role": "user",
                   "content": "x"}], "kvroute": {"session": {"id": "s"}}}),
        ),
    ];
    bodies
        .into_iter()
        .map(|(mode, body)| prefixed(mode, &serde_json::to_vec(&body).unwrap()))
        .collect()
}

fn select_bodies() -> Vec<Vec<u8>> {
    [
        json!({"model": "m", "token_ids": [1, 2, 3, 4]}),
        json!({"model": "m", "block_hashes": [11, 12], "block_size": 16,
               "request_id": "0192d4c4-7f3a-7c1e-9a43-2b1f0c6e8d01",
               "session": {"id": "chat-1"}, "pin": {"worker_id": 7},
               "dp_rank_range": {"min": 0, "max": 1}, "priority": 1, "temperature": 0.0}),
        json!({"model": "m", "text": "Hello", "lora_name": "a", "allowed_workers": [7]}),
        json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
               "add_generation_prompt": true, "tools": null, "policy": "default",
               "required_taints": ["gpu"], "expected_output_tokens": 8}),
    ]
    .iter()
    .map(|b| serde_json::to_vec(b).unwrap())
    .collect()
}
