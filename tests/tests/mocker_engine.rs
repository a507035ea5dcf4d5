//! The mocker impersonating vLLM and SGLang on ZMQ: frames and per-rank sequence numbers, each
//! engine's batch and event shapes (maps and arrays), the stored blocks' tokens and hashes as
//! kvroute's hashing says, evictions and clears, the engines' own msgspec structs re-encoding
//! the bytes identically, replay of a missed range, data-parallel ranks, and the binary's
//! startup lines and port errors.

use std::collections::BTreeSet;
use std::time::Duration;

use kvroute_common::hashing::{BLOCK_HASH_SEED, BlockHashes, chain_hash, local_block_hashes};
use kvroute_mocker::engine_face::{EngineApi, EventFormat};
use kvroute_tests::{
    EngineFace, Sub, Supervised, decode_batch, face_config, field, free_port, http_get,
    kvroute_bin, map_keys, python_json, replay, run_to_exit,
};
use rmpv::Value;
use serde_json::json;

const BS: usize = 4;

/// `len` tokens from `from` on (or a later start), such that the first block's sequence hash
/// has its top bit set: negative as SGLang's signed hash, above i64::MAX as vLLM's.
fn high_prompt(mut from: u32, len: u32) -> Vec<u32> {
    loop {
        let tokens: Vec<u32> = (from..from + len).collect();
        if BlockHashes::of_tokens(&tokens, BS, None).sequence[0] >= 1 << 63 {
            return tokens;
        }
        from += 1;
    }
}

/// A `BlockStored` read from either form.
#[derive(Debug)]
struct Stored {
    hashes: Vec<u64>,
    /// The first hash as written (to see its sign).
    first_raw: Value,
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u64,
}

fn hash_of(api: EngineApi, v: &Value) -> u64 {
    match api {
        EngineApi::Sglang => v.as_i64().expect("SGLang hashes are signed 64-bit") as u64,
        _ => v.as_u64().expect("vLLM hashes are unsigned 64-bit"),
    }
}

/// Checks a `BlockStored`'s exact shape for `api` and `format`, and reads it.
fn stored(api: EngineApi, format: EventFormat, e: &Value) -> Stored {
    let slots: Vec<Value> = match format {
        EventFormat::Maps => {
            let want: &[&str] = match api {
                EngineApi::Sglang => &[
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                ],
                _ => &[
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                    "extra_keys",
                    "group_idx",
                ],
            };
            assert_eq!(map_keys(e), want, "{e}");
            if api == EngineApi::Vllm {
                assert!(field(e, "lora_name").is_nil());
                let blocks = field(e, "block_hashes").as_array().unwrap().len();
                assert_eq!(
                    field(e, "extra_keys"),
                    &Value::Array(vec![Value::Nil; blocks])
                );
                assert_eq!(field(e, "group_idx").as_u64(), Some(0));
            }
            want.iter().map(|k| field(e, k).clone()).collect()
        }
        EventFormat::Arrays => {
            let slots = e.as_array().expect("an array event").clone();
            let len = if api == EngineApi::Sglang { 10 } else { 8 };
            assert_eq!(slots.len(), len, "every slot present: {e}");
            assert!(
                slots[7..].iter().all(Value::is_nil),
                "unset slots are nil: {e}"
            );
            slots
        }
    };
    assert_eq!(slots[0].as_str(), Some("BlockStored"));
    assert!(slots[5].is_nil(), "lora_id");
    assert_eq!(slots[6].as_str(), Some("GPU"), "medium");
    let hashes: Vec<u64> = slots[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| hash_of(api, h))
        .collect();
    Stored {
        first_raw: slots[1].as_array().unwrap()[0].clone(),
        hashes,
        parent: (!slots[2].is_nil()).then(|| hash_of(api, &slots[2])),
        tokens: slots[3]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        block_size: slots[4].as_u64().unwrap(),
    }
}

/// A `BlockRemoved`'s hashes, its shape checked.
fn removed(api: EngineApi, format: EventFormat, e: &Value) -> Vec<u64> {
    let (tag, hashes, medium) = match format {
        EventFormat::Maps => {
            let want: &[&str] = match api {
                EngineApi::Sglang => &["type", "block_hashes", "medium"],
                _ => &["type", "block_hashes", "medium", "group_idx"],
            };
            assert_eq!(map_keys(e), want, "{e}");
            (
                field(e, "type"),
                field(e, "block_hashes"),
                field(e, "medium"),
            )
        }
        EventFormat::Arrays => {
            let slots = e.as_array().expect("an array event");
            assert_eq!(slots.len(), 3, "{e}");
            (&slots[0], &slots[1], &slots[2])
        }
    };
    assert_eq!(tag.as_str(), Some("BlockRemoved"));
    assert_eq!(medium.as_str(), Some("GPU"));
    hashes
        .as_array()
        .unwrap()
        .iter()
        .map(|h| hash_of(api, h))
        .collect()
}

/// The block hashes chain from `parent` over the tokens as kvroute's hashing says, and the
/// event carries `block_size` tokens per block.
fn assert_chain(s: &Stored) {
    assert_eq!(s.block_size, BS as u64);
    assert_eq!(
        s.tokens.len(),
        BS * s.hashes.len(),
        "block_size × blocks tokens"
    );
    let local = local_block_hashes(&s.tokens, BS, BLOCK_HASH_SEED);
    let mut prev = s.parent;
    for (h, l) in s.hashes.iter().zip(local) {
        let want = prev.map_or(l, |p| chain_hash(p, l, BLOCK_HASH_SEED));
        assert_eq!(*h, want, "sequence hash of the block after {prev:?}");
        prev = Some(*h);
    }
}

/// Three prompts on an 8-block cache, then a cache clear: frames, sequence numbers, shapes,
/// tokens, hashes, evictions; the same bytes through msgspec; replay of a missed range.
async fn events_flow(api: EngineApi, format: EventFormat) {
    let engine = if api == EngineApi::Sglang {
        "sglang"
    } else {
        "vllm"
    };
    let mut config = face_config(api, format);
    config.engine.num_blocks = 8;
    let face = EngineFace::start(&config).await.unwrap();
    let ep = face.endpoints[0].clone();
    let mut sub = Sub::connect(&ep.zmq[0], b"kv").await;
    let mut payloads = Vec::new();
    let mut next = |msg: Option<Vec<Vec<u8>>>| {
        let msg = msg.expect("a batch");
        assert_eq!(msg.len(), 3, "[topic, seq, payload]");
        assert_eq!(msg[0], b"kv", "the topic frame");
        assert_eq!(msg[1], (payloads.len() as u64).to_be_bytes(), "seq, from 0");
        payloads.push(msg[2].clone());
        let batch = decode_batch(&msg[2]);
        assert_eq!(batch.rank, 0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!((now - batch.ts).abs() < 60.0, "ts in seconds: {}", batch.ts);
        batch
    };

    // A: 10 tokens, two full blocks stored under no parent.
    let a = high_prompt(0, 10);
    let hash_a = BlockHashes::of_tokens(&a, BS, None).sequence;
    face.complete(&a, 2).await;
    let batch = next(sub.recv(5000).await);
    assert_eq!(batch.events.len(), 1);
    let s = stored(api, format, &batch.events[0]);
    assert_eq!(
        (s.parent, &s.hashes, &s.tokens[..]),
        (None, &hash_a, &a[..8])
    );
    match api {
        EngineApi::Sglang => assert!(s.first_raw.as_i64().unwrap() < 0, "signed"),
        _ => assert!(s.first_raw.as_u64().unwrap() > i64::MAX as u64, "unsigned"),
    }
    assert_chain(&s);

    // B shares A's first block: its two other blocks are stored under it.
    let mut b = a[..4].to_vec();
    b.extend(1000..1008);
    let hash_b = BlockHashes::of_tokens(&b, BS, None).sequence;
    let usage = face.complete(&b, 2).await["usage"].clone();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 4);
    let batch = next(sub.recv(5000).await);
    let s = stored(api, format, &batch.events[0]);
    assert_eq!(s.parent, Some(hash_a[0]));
    assert_eq!((&s.hashes[..], &s.tokens[..]), (&hash_b[1..], &b[4..]));
    assert_chain(&s);

    // C needs 7 of the 8 blocks: the 3 least recently used cached blocks go first.
    let c: Vec<u32> = (2000..2024).collect();
    face.complete(&c, 2).await;
    let batch = next(sub.recv(5000).await);
    let (last, evictions) = batch.events.split_last().unwrap();
    let mut gone = BTreeSet::new();
    for e in evictions {
        let hashes = removed(api, format, e);
        if api == EngineApi::Vllm {
            assert_eq!(
                hashes.len(),
                1,
                "vLLM reports each evicted block on its own"
            );
        }
        gone.extend(hashes);
    }
    let expected = match api {
        EngineApi::Sglang => 1,
        _ => 3,
    };
    assert_eq!(evictions.len(), expected);
    assert_eq!(gone, BTreeSet::from([hash_a[1], hash_b[1], hash_b[2]]));
    let s = stored(api, format, last);
    assert_eq!(s.hashes, BlockHashes::of_tokens(&c, BS, None).sequence);
    assert_chain(&s);

    // Clearing the cache publishes AllBlocksCleared.
    let clear = if api == EngineApi::Sglang {
        "/flush_cache"
    } else {
        "/reset_prefix_cache"
    };
    assert_eq!(face.post(clear, &json!({})).await.0, 200);
    let batch = next(sub.recv(5000).await);
    let cleared = match format {
        EventFormat::Maps => Value::Map(vec![("type".into(), "AllBlocksCleared".into())]),
        EventFormat::Arrays => Value::Array(vec!["AllBlocksCleared".into()]),
    };
    assert_eq!(batch.events, vec![cleared]);

    // The engines' own structs decode every batch strictly and re-encode the same bytes.
    let format_name = if format == EventFormat::Maps {
        "maps"
    } else {
        "arrays"
    };
    let seen = python_json(
        "engine_events.py",
        vec![
            "--replay".into(),
            ep.replay[0].clone(),
            "--engine".into(),
            engine.into(),
            "--format".into(),
            format_name.into(),
        ],
    )
    .await;
    assert_eq!(seen["errors"], json!([]), "{seen}");
    assert_eq!(seen["seqs"], json!([0, 1, 2, 3]));
    assert_eq!(seen["identical"], 4, "{seen}");
    assert_eq!(seen["end_marker"], json!(["", ""]));

    // Replay of a missed range: the same frames as live, then the end marker.
    let endpoint = ep.replay[0].clone();
    let replies = tokio::task::spawn_blocking(move || {
        let from_two = replay(&endpoint, &[b"", &2u64.to_be_bytes()]);
        let past_the_end = replay(&endpoint, &[b"", &9u64.to_be_bytes()]);
        // A request of the wrong shape is ignored; the next one is served.
        let bad = zmq::Context::new().socket(zmq::DEALER).unwrap();
        bad.connect(&endpoint).unwrap();
        bad.send_multipart([&b""[..], b"x", b"y"], 0).unwrap();
        let after_bad = replay(&endpoint, &[b"", &3u64.to_be_bytes()]);
        (from_two, past_the_end, after_bad)
    })
    .await
    .unwrap();
    let end = vec![b"".to_vec(), (-1i64).to_be_bytes().to_vec(), b"".to_vec()];
    let live = |seq: usize| {
        vec![
            b"kv".to_vec(),
            (seq as u64).to_be_bytes().to_vec(),
            payloads[seq].clone(),
        ]
    };
    assert_eq!(replies.0, vec![live(2), live(3), end.clone()]);
    assert_eq!(replies.1, vec![end.clone()]);
    assert_eq!(replies.2, vec![live(3), end]);
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_maps() {
    events_flow(EngineApi::Vllm, EventFormat::Maps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_maps() {
    events_flow(EngineApi::Sglang, EventFormat::Maps).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_arrays() {
    events_flow(EngineApi::Vllm, EventFormat::Arrays).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_arrays() {
    events_flow(EngineApi::Sglang, EventFormat::Arrays).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_only_the_last_buffered_batches() {
    let mut config = face_config(EngineApi::Sglang, EventFormat::Maps);
    config.face.engine_replay_buffer = 2;
    let face = EngineFace::start(&config).await.unwrap();
    for i in 0..3 {
        face.complete(&[i; 8], 1).await;
    }
    let endpoint = face.endpoints[0].replay[0].clone();
    let replies =
        tokio::task::spawn_blocking(move || replay(&endpoint, &[b"", &0u64.to_be_bytes()]))
            .await
            .unwrap();
    let seqs: Vec<Vec<u8>> = replies.iter().map(|r| r[1].clone()).collect();
    assert_eq!(
        seqs,
        vec![
            1u64.to_be_bytes().to_vec(),
            2u64.to_be_bytes().to_vec(),
            (-1i64).to_be_bytes().to_vec()
        ]
    );
    face.fleet.shutdown().await;
}

/// Starts a vLLM face with two ranks on explicit, consecutive ports (retrying if taken).
async fn two_rank_face() -> EngineFace {
    for _ in 0..5 {
        let base = free_port();
        let mut config = face_config(EngineApi::Vllm, EventFormat::Maps);
        config.face.engine_dp_size = 2;
        config.face.engine_zmq_port = base;
        config.face.engine_replay_port = base + 2;
        if let Ok(face) = EngineFace::start(&config).await {
            return face;
        }
    }
    panic!("no free run of four ports");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_independent_engines_on_their_own_ports() {
    let face = two_rank_face().await;
    let ep = face.endpoints[0].clone();
    let port = |e: &str| e.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    assert_eq!(port(&ep.zmq[1]), port(&ep.zmq[0]) + 1, "rank r at base + r");
    assert_eq!(port(&ep.replay[1]), port(&ep.replay[0]) + 1);
    let mut rank0 = Sub::connect(&ep.zmq[0], b"").await;
    let mut rank1 = Sub::connect(&ep.zmq[1], b"").await;
    let prompt: Vec<u32> = (0..12).collect();
    let pinned = |rank: &'static str| {
        let body = json!({"prompt": prompt, "max_tokens": 1});
        let face = &face;
        async move {
            let (status, body) = face
                .post_with("/v1/completions", &body, &[("X-data-parallel-rank", rank)])
                .await;
            assert_eq!(status, 200, "{body}");
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(pinned("1").await, 0);
    let msg = rank1.recv(5000).await.expect("rank 1 publishes");
    assert_eq!(msg[1], 0u64.to_be_bytes(), "each rank counts from 0");
    assert_eq!(decode_batch(&msg[2]).rank, 1);
    assert!(rank0.recv(300).await.is_none(), "rank 0 stored nothing");
    // Rank 0 has its own cache: the same prompt is a miss there, a hit on rank 1.
    assert_eq!(pinned("0").await, 0);
    let msg = rank0.recv(5000).await.expect("rank 0 publishes");
    assert_eq!(
        (msg[1].clone(), decode_batch(&msg[2]).rank),
        (0u64.to_be_bytes().to_vec(), 0)
    );
    assert_eq!(pinned("1").await, 11);
    let (status, _) = face.get("/metrics").await;
    assert_eq!(status, 200);
    let metrics = face.get("/metrics").await.1;
    for rank in ["0", "1"] {
        let line =
            format!("vllm:num_requests_running{{engine=\"{rank}\",model_name=\"mock-model\"}} 0.0");
        assert!(metrics.contains(&line), "{line}\n{metrics}");
    }
    assert!(
        metrics.contains("vllm:prompt_tokens_total{engine=\"1\",model_name=\"mock-model\"} 24.0")
    );
    let (status, body) = face
        .post_with(
            "/v1/completions",
            &json!({"prompt": "x", "max_tokens": 1}),
            &[("X-data-parallel-rank", "5")],
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], 400, "vLLM's error shape: {body}");
    face.fleet.shutdown().await;
}

fn mocker() -> std::path::PathBuf {
    kvroute_bin("kvroute-mocker", "kvroute-mocker").unwrap()
}

#[test]
fn the_binary_prints_each_workers_bridge_flags() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("mocker.log");
    let args = [
        "--engine-api",
        "sglang",
        "--workers",
        "2",
        "--engine-http-port",
        "0",
        "--engine-zmq-port",
        "0",
        "--engine-replay-port",
        "0",
    ];
    let child = Supervised::new(mocker(), args.iter().map(|a| a.to_string()).collect(), &log)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<String> = text
            .lines()
            .filter(|l| l.starts_with("kvroute-mocker: worker "))
            .map(str::to_owned)
            .collect();
        if lines.len() == 2 {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no endpoints printed:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    for (i, line) in lines.iter().enumerate() {
        assert!(line.starts_with(&format!("kvroute-mocker: worker {i} (sglang, dp size 1): --engine sglang --engine-url http://127.0.0.1:")), "{line}");
        for flag in [
            "--zmq-endpoint tcp://127.0.0.1:",
            "--zmq-replay-endpoint tcp://127.0.0.1:",
            "--dp-size 1",
        ] {
            assert!(line.contains(flag), "{line}");
        }
        let url = line.split("--engine-url http://127.0.0.1:").nth(1).unwrap();
        let port: u16 = url.split_whitespace().next().unwrap().parse().unwrap();
        assert_eq!(http_get(port, "/health").map(|r| r.0), Some(200));
        let info = http_get(port, "/get_server_info").unwrap().1;
        assert!(info.contains("\"page_size\":64"), "{info}");
    }
    child.stop().unwrap();
}

#[test]
fn port_errors_name_the_flag() {
    let run = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        run_to_exit(&mocker(), &args, &[], Duration::from_secs(20)).unwrap()
    };
    let out = run(&["--engine-api", "vllm", "--engine-dp-size", "2"]);
    assert_eq!(out.code, 2, "{out:?}");
    let line = out.last_line();
    assert!(line.contains("--engine-replay-port"), "{line}");
    assert!(
        line.contains(
            "port 5558 of worker 0 rank 0 is also --engine-zmq-port's port for worker 0 rank 1"
        ),
        "{line}"
    );
    // A port some other process holds, for each kind of socket.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    for flag in [
        "--engine-http-port",
        "--engine-zmq-port",
        "--engine-replay-port",
    ] {
        let mut args = vec![
            "--engine-api",
            "sglang",
            "--engine-http-port",
            "0",
            "--engine-zmq-port",
            "0",
            "--engine-replay-port",
            "0",
        ];
        let i = args.iter().position(|a| *a == flag).unwrap();
        args[i + 1] = &port;
        let out = run(&args);
        assert_eq!(out.code, 2, "{flag}: {out:?}");
        assert!(
            out.last_line()
                .contains(&format!("{flag} 127.0.0.1:{port}: address already in use")),
            "{flag}: {}",
            out.last_line()
        );
    }
}
