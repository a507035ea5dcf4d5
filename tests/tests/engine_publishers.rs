//! The wire format kvroute-bridge receives from real engines: vLLM's and SGLang's own
//! `ZmqEventPublisher` (the files of their wheels, run by tests/engines/engine_publisher.py)
//! publish; a plain ZMQ SUB and DEALER read, and the frames are decoded with rmpv.
//!
//! Both engines: a live batch is three frames `[topic, seq (u64, 8 bytes big-endian),
//! payload]`, one sequence per rank starting at 0; the payload is a msgpack array
//! `[ts (float64), events, rank]`; each event is a map whose first key `type` names its
//! struct, fields with a default are left out while unset, fields without one are present
//! (nil when None). Replay: a DEALER sends `["", start_seq]` to the rank's ROUTER and gets
//! `["", topic, seq, payload]` per buffered batch from `start_seq` on, then
//! `["", "", -1 (i64), ""]`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_tests::{Engine, EngineOptions, workspace_root};
use rmpv::Value as Mp;
use serde_json::{Value, json};

mod engine_sockets;

use engine_sockets::*;

/// An event as the engine publishes it, and its keys on the wire in order.
struct Case {
    event: Value,
    keys: &'static str,
}

const TWO_MAX: u64 = 1 << 63;
const BYTES_HASH: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// Per event type, the fields that have a default (None in every case), so are absent from
/// the wire while unset; every other field is always there.
const VLLM_DEFAULTED: [(&str, &str); 3] = [
    (
        "BlockStored",
        "extra_keys group_idx kv_cache_spec_kind kv_cache_spec_sliding_window locality \
         ownership session_id",
    ),
    ("BlockRemoved", "group_idx locality ownership"),
    ("AllBlocksCleared", ""),
];
/// vLLM 0.34 adds `lookahead_token_ids` (default None) to `BlockStored`.
const VLLM034_DEFAULTED: [(&str, &str); 3] = [
    (
        "BlockStored",
        "extra_keys group_idx kv_cache_spec_kind kv_cache_spec_sliding_window locality \
         ownership session_id lookahead_token_ids",
    ),
    ("BlockRemoved", "group_idx locality ownership"),
    ("AllBlocksCleared", ""),
];
const SGLANG_DEFAULTED: [(&str, &str); 3] = [
    ("BlockStored", "medium cache_salt session_id lora_name"),
    ("BlockRemoved", "medium"),
    ("AllBlocksCleared", ""),
];

/// vLLM 0.32: hashes are u64 by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the low 64
/// bits of the block hash), raw hash bytes when that is 0; the block pool always sets
/// `group_idx` and one `extra_keys` entry per block.
fn vllm_cases() -> Vec<Case> {
    let tokens: Vec<u32> = (0..32).collect();
    vec![
        Case {
            event: json!({
                "type": "BlockStored", "block_hashes": [u64::MAX, TWO_MAX],
                "parent_block_hash": TWO_MAX + 5, "token_ids": tokens, "block_size": 16,
                "lora_id": null, "medium": "GPU", "lora_name": null,
                "extra_keys": [null, null], "group_idx": 0,
            }),
            keys: "type block_hashes parent_block_hash token_ids block_size lora_id medium \
                   lora_name extra_keys group_idx",
        },
        Case {
            event: json!({
                "type": "BlockStored", "block_hashes": [{"bytes_hex": BYTES_HASH}],
                "parent_block_hash": null, "token_ids": &tokens[..16], "block_size": 16,
                "lora_id": 3, "medium": "CPU", "lora_name": "adapter-a",
            }),
            keys: "type block_hashes parent_block_hash token_ids block_size lora_id medium \
                   lora_name",
        },
        Case {
            event: json!({
                "type": "BlockRemoved", "block_hashes": [u64::MAX], "medium": "GPU",
                "group_idx": 0,
            }),
            keys: "type block_hashes medium group_idx",
        },
        Case {
            event: json!({"type": "BlockRemoved", "block_hashes": [7], "medium": null}),
            keys: "type block_hashes medium",
        },
        Case {
            event: json!({"type": "AllBlocksCleared"}),
            keys: "type",
        },
    ]
}

/// vLLM 0.34: 0.32's cases, and a store with hash lookahead (two tokens after each block).
fn vllm_034_cases() -> Vec<Case> {
    let mut cases = vllm_cases();
    let tokens: Vec<u32> = (0..32).collect();
    cases.push(Case {
        event: json!({
            "type": "BlockStored", "block_hashes": [21, 22], "parent_block_hash": 20,
            "token_ids": tokens, "block_size": 16, "lora_id": null, "medium": "GPU",
            "lora_name": null, "group_idx": 0, "lookahead_token_ids": [[16, 17], [32, 33]],
        }),
        keys: "type block_hashes parent_block_hash token_ids block_size lora_id medium \
               lora_name group_idx lookahead_token_ids",
    });
    cases
}

/// SGLang 0.5.23: hashes are signed 64-bit; `medium` and the newer fields have defaults.
fn sglang_cases() -> Vec<Case> {
    let tokens: Vec<u32> = (0..32).collect();
    vec![
        Case {
            event: json!({
                "type": "BlockStored", "block_hashes": [-1, i64::MIN, i64::MAX],
                "parent_block_hash": -42, "token_ids": tokens, "block_size": 16,
                "lora_id": null,
            }),
            keys: "type block_hashes parent_block_hash token_ids block_size lora_id",
        },
        Case {
            event: json!({
                "type": "BlockStored", "block_hashes": [5], "parent_block_hash": null,
                "token_ids": &tokens[..16], "block_size": 16, "lora_id": 7, "medium": "GPU",
                "cache_salt": "salt", "session_id": "s-1", "lora_name": "adapter-a",
            }),
            keys: "type block_hashes parent_block_hash token_ids block_size lora_id medium \
                   cache_salt session_id lora_name",
        },
        Case {
            event: json!({"type": "BlockRemoved", "block_hashes": [-7]}),
            keys: "type block_hashes",
        },
        Case {
            event: json!({"type": "BlockRemoved", "block_hashes": [-7], "medium": "CPU_PINNED"}),
            keys: "type block_hashes medium",
        },
        Case {
            event: json!({"type": "AllBlocksCleared"}),
            keys: "type",
        },
    ]
}

fn words(list: &str) -> Vec<&str> {
    list.split_whitespace().collect()
}

/// The engine's event classes (the driver's `info`): each field with a default is listed in
/// `defaulted`, and that default is None.
fn check_classes(shapes: &Value, defaulted: &[(&str, &str)]) {
    for (kind, names) in defaulted {
        let defaults = shapes[kind]["defaults"].as_object().unwrap();
        let fields = shapes[kind]["fields"].as_array().unwrap().iter();
        let with_default: Vec<&str> = fields
            .filter_map(|f| f.as_str().filter(|f| defaults.contains_key(*f)))
            .collect();
        assert_eq!(with_default, words(names), "{kind}");
        assert!(
            defaults.values().all(Value::is_null),
            "{kind}: {defaults:?}"
        );
    }
}

/// The keys msgspec's omit_defaults writes for `event` by the engine's class: `type`, then
/// every field in order, except one with a default that `event` leaves at it.
fn omitted_defaults(shapes: &Value, event: &Value) -> Vec<String> {
    let shape = &shapes[event["type"].as_str().unwrap()];
    let defaults = shape["defaults"].as_object().unwrap();
    let fields = shape["fields"].as_array().unwrap().iter();
    let written = fields
        .map(|f| f.as_str().unwrap())
        .filter(|f| match defaults.get(*f) {
            Some(default) => event.get(*f).is_some_and(|v| v != default),
            None => true,
        });
    std::iter::once("type")
        .chain(written)
        .map(str::to_owned)
        .collect()
}

/// The values every case's event must carry, beyond its keys.
fn check_values(engine: Engine, events: &[Mp]) {
    let tag = |i: usize| field(&events[i], "type").as_str().unwrap().to_owned();
    assert_eq!(
        (0..5).map(tag).collect::<Vec<_>>(),
        [
            "BlockStored",
            "BlockStored",
            "BlockRemoved",
            "BlockRemoved",
            "AllBlocksCleared"
        ]
    );
    let stored = &events[0];
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    let tokens: Vec<u64> = field(stored, "token_ids")
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(tokens, (0..32).collect::<Vec<_>>());
    assert!(field(stored, "lora_id").is_nil(), "None is written as nil");
    match engine {
        Engine::Vllm | Engine::Vllm034 => {
            // Above i64::MAX: a bridge must read vLLM's integer hashes as u64.
            let h = hashes(stored);
            assert_eq!((h[0].as_u64(), h[0].as_i64()), (Some(u64::MAX), None));
            assert_eq!((h[1].as_u64(), h[1].as_i64()), (Some(TWO_MAX), None));
            assert_eq!(
                field(stored, "parent_block_hash").as_u64(),
                Some(TWO_MAX + 5)
            );
            assert!(field(stored, "lora_name").is_nil());
            let extra = field(stored, "extra_keys").as_array().unwrap();
            assert!(extra.len() == 2 && extra.iter().all(Mp::is_nil));
            assert_eq!(field(stored, "group_idx").as_u64(), Some(0));
            // Bytes hashes are msgpack bin, not str.
            let bytes = &events[1];
            let expected: Vec<u8> = (0..32)
                .map(|i| u8::from_str_radix(&BYTES_HASH[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            assert_eq!(hashes(bytes), [Mp::Binary(expected)]);
            assert!(field(bytes, "parent_block_hash").is_nil());
            assert_eq!(field(bytes, "lora_id").as_u64(), Some(3));
            assert_eq!(field(bytes, "lora_name").as_str(), Some("adapter-a"));
            assert_eq!(field(&events[2], "medium").as_str(), Some("GPU"));
            assert!(
                field(&events[3], "medium").is_nil(),
                "medium has no default"
            );
            if engine == Engine::Vllm034 {
                let ahead: Vec<Vec<u64>> = field(&events[5], "lookahead_token_ids")
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|l| {
                        l.as_array()
                            .unwrap()
                            .iter()
                            .map(|t| t.as_u64().unwrap())
                            .collect()
                    })
                    .collect();
                assert_eq!(ahead, [[16, 17], [32, 33]]);
            }
        }
        Engine::Sglang => {
            // Negative: a bridge must read SGLang's hashes as i64.
            let h = hashes(stored);
            let signed: Vec<Option<i64>> = h.iter().map(Mp::as_i64).collect();
            assert_eq!(signed, [Some(-1), Some(i64::MIN), Some(i64::MAX)]);
            assert_eq!(h[0].as_u64(), None);
            assert_eq!(field(stored, "parent_block_hash").as_i64(), Some(-42));
            let full = &events[1];
            assert!(field(full, "parent_block_hash").is_nil());
            for (name, value) in [
                ("medium", "GPU"),
                ("cache_salt", "salt"),
                ("session_id", "s-1"),
                ("lora_name", "adapter-a"),
            ] {
                assert_eq!(field(full, name).as_str(), Some(value));
            }
            assert_eq!(hashes(&events[2])[0].as_i64(), Some(-7));
            assert_eq!(field(&events[3], "medium").as_str(), Some("CPU_PINNED"));
        }
    }
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Both ranks publish one batch of every event shape; each rank's SUB gets its own batch,
/// with the seq the engine gave it, the rank in the batch, and exactly the expected fields.
fn wire_format(engine: Engine, cases: Vec<Case>, defaulted: &[(&str, &str)]) {
    let mut publisher = start(options(engine));
    let root = workspace_root().join(".tools/engines").join(engine.name());
    let module = match engine {
        Engine::Vllm | Engine::Vllm034 => "vllm/distributed/kv_events.py",
        Engine::Sglang => "sglang/srt/disaggregation/kv_events.py",
    };
    assert_eq!(
        publisher.info["module"].as_str(),
        Some(root.join(module).to_str().unwrap()),
        "the wheel's own publisher is loaded"
    );
    let endpoints = publisher.endpoints().to_vec();
    let port = |e: &str| e.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    assert_eq!(
        port(&endpoints[1].endpoint),
        port(&endpoints[0].endpoint) + 1
    );
    let replay = |r: usize| port(endpoints[r].replay.as_ref().unwrap());
    assert_eq!(
        replay(1),
        replay(0) + 1,
        "the replay port is offset by rank too"
    );
    assert!(
        endpoints
            .iter()
            .all(|e| e.binds && e.endpoint.starts_with("tcp://*:"))
    );
    if engine == Engine::Sglang {
        // What SGLang advertises for local consumers: loopback in place of the wildcard.
        assert_eq!(
            publisher.info["ranks"][1]["local_source"],
            json!({
                "dp_rank": 1, "endpoint": endpoints[1].local, "topic": TOPIC,
                "block_size": 16, "replay_endpoint": endpoints[1].replay,
            })
        );
    }

    let shapes = &publisher.info["events"].clone();
    check_classes(shapes, defaulted);

    let ctx = zmq::Context::new();
    let subs: Vec<zmq::Socket> = endpoints
        .iter()
        .map(|e| subscriber(&ctx, &e.local, false))
        .collect();
    for (rank, sub) in subs.iter().enumerate() {
        join(&mut publisher, rank as u16, sub);
    }
    let events: Vec<Value> = cases.iter().map(|c| c.event.clone()).collect();
    for (rank, sub) in subs.iter().enumerate() {
        let before = now_s();
        let seq = publisher.publish(rank as u16, json!(events)).unwrap();
        let got = next_live(sub);
        assert_eq!(got.seq, seq, "the frame carries the engine's seq");
        let decoded = batch(&got.payload);
        assert_eq!(
            decoded.rank.as_u64(),
            Some(rank as u64),
            "the batch names its rank"
        );
        assert!(decoded.ts >= before - 1.0 && decoded.ts <= now_s() + 1.0);
        for (event, case) in decoded.events.iter().zip(&cases) {
            assert_eq!(
                keys(event),
                words(case.keys),
                "{} sent {event}",
                engine.name()
            );
            assert_eq!(keys(event), omitted_defaults(shapes, &case.event));
        }
        assert_eq!(decoded.events.len(), cases.len());
        check_values(engine, &decoded.events);
        for (other, other_sub) in subs.iter().enumerate().filter(|(o, _)| *o != rank) {
            assert!(
                recv(other_sub, QUIET).is_none(),
                "rank {rank}'s batch reached rank {other}'s port"
            );
        }
    }
}

#[test]
fn vllm_wire_format() {
    wire_format(Engine::Vllm, vllm_cases(), &VLLM_DEFAULTED);
}

#[test]
fn vllm_0_34_wire_format() {
    wire_format(Engine::Vllm034, vllm_034_cases(), &VLLM034_DEFAULTED);
}

#[test]
fn sglang_wire_format() {
    wire_format(Engine::Sglang, sglang_cases(), &SGLANG_DEFAULTED);
}

/// A replay reply: `["", topic, seq, payload]`, or the end marker `["", "", -1, ""]` (None).
fn replayed(frames: Vec<Vec<u8>>) -> Option<Live> {
    assert_eq!(
        frames.len(),
        4,
        "a replay reply is [\"\", topic, seq, payload]"
    );
    assert!(
        frames[0].is_empty(),
        "the DEALER's empty delimiter comes back first"
    );
    if frames[2] == END_SEQ {
        assert!(
            frames[1].is_empty() && frames[3].is_empty(),
            "end marker: {frames:?}"
        );
        return None;
    }
    Some(live(frames[1..].to_vec()))
}

/// Asks `dealer`'s ROUTER for the batches from `start` on; every batch before the end marker.
fn replay(dealer: &zmq::Socket, start: u64) -> Vec<Live> {
    dealer
        .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
        .unwrap();
    let mut batches = Vec::new();
    loop {
        let frames = recv(dealer, Duration::from_secs(10)).expect("a replay reply within 10 s");
        match replayed(frames) {
            Some(batch) => batches.push(batch),
            None => return batches,
        }
    }
}

fn seqs(batches: &[Live]) -> Vec<u64> {
    batches.iter().map(|b| b.seq).collect()
}

/// A batch the PUB socket dropped is a gap in the live seqs; the rank's ROUTER replays it
/// and what follows, byte for byte, then the end marker. A restart starts the seqs at 0 again
/// and empties the buffer.
fn replay_after_a_drop(engine: Engine) {
    let mut publisher = start(options(engine));
    let endpoints = publisher.endpoints().to_vec();
    let ctx = zmq::Context::new();
    let sub = subscriber(&ctx, &endpoints[1].local, false);
    let probes = join(&mut publisher, 1, &sub);

    publisher.drop_next(1).unwrap();
    let stored = json!([{
        "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": null,
        "token_ids": (0..32).collect::<Vec<u32>>(), "block_size": 16, "lora_id": null,
    }]);
    let stored = match engine {
        // vLLM's BlockStored has no default for medium and lora_name.
        Engine::Vllm | Engine::Vllm034 => {
            let mut s = stored;
            s[0]["medium"] = json!("GPU");
            s[0]["lora_name"] = Value::Null;
            s
        }
        Engine::Sglang => stored,
    };
    let dropped = publisher.publish(1, stored).unwrap();
    assert!(
        recv(&sub, QUIET).is_none(),
        "the dropped batch is not on the PUB socket"
    );
    let removed = json!([{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}]);
    let after = publisher.publish(1, removed).unwrap();
    let live_after = next_live(&sub);
    assert_eq!(after, dropped + 1);
    assert_eq!(
        live_after.seq, after,
        "the SUB sees a gap: {dropped} never came"
    );

    let dealer = socket(&ctx, zmq::DEALER);
    dealer
        .connect(endpoints[1].replay.as_ref().unwrap())
        .unwrap();
    let missed = replay(&dealer, dropped);
    assert_eq!(seqs(&missed), [dropped, after]);
    let events = batch(&missed[0].payload).events;
    assert_eq!(field(&events[0], "type").as_str(), Some("BlockStored"));
    let replayed_hashes: Vec<u64> = hashes(&events[0])
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    assert_eq!(replayed_hashes, [11, 12]);
    assert_eq!(
        missed[1].payload, live_after.payload,
        "replay sends the same bytes"
    );
    assert_eq!(batch(&missed[0].payload).rank.as_u64(), Some(1));

    // From 0: everything this rank kept (its probes first), in order; past the end: nothing.
    let all = replay(&dealer, 0);
    let mut expected = probes.clone();
    expected.extend([dropped, after]);
    assert_eq!(seqs(&all), expected);
    assert_eq!(expected, (0..expected.len() as u64).collect::<Vec<_>>());
    assert!(replay(&dealer, after + 1).is_empty());

    // Rank 0 has a buffer (and a ROUTER) of its own.
    let dealer0 = socket(&ctx, zmq::DEALER);
    dealer0
        .connect(endpoints[0].replay.as_ref().unwrap())
        .unwrap();
    assert!(replay(&dealer0, 0).is_empty(), "rank 0 published nothing");

    // A request without the empty delimiter frame is ignored (logged by the engine).
    dealer.send(&dropped.to_be_bytes()[..], 0).unwrap();
    assert!(recv(&dealer, QUIET).is_none());

    // A new incarnation: seqs from 0 again (the SUB reconnects by itself), buffer empty.
    publisher.restart().unwrap();
    let probes = join(&mut publisher, 1, &sub);
    assert_eq!(probes[0], 0);
    assert_eq!(seqs(&replay(&dealer, 0)), probes);
}

#[test]
fn vllm_replay_after_a_drop() {
    replay_after_a_drop(Engine::Vllm);
}

#[test]
fn vllm_0_34_replay_after_a_drop() {
    replay_after_a_drop(Engine::Vllm034);
}

#[test]
fn sglang_replay_after_a_drop() {
    replay_after_a_drop(Engine::Sglang);
}

/// The replay buffer keeps the last `buffer_steps` batches; a request for an older seq gets
/// the oldest kept one first, with no sign that anything was lost.
#[test]
fn replay_forgets_beyond_buffer_steps() {
    for engine in Engine::ALL {
        let mut publisher = start(EngineOptions {
            dp_size: 1,
            buffer_steps: 2,
            ..options(engine)
        });
        for expected in 0..4 {
            assert_eq!(publisher.publish(0, probe()).unwrap(), expected);
        }
        let ctx = zmq::Context::new();
        let dealer = socket(&ctx, zmq::DEALER);
        dealer
            .connect(publisher.endpoints()[0].replay.as_ref().unwrap())
            .unwrap();
        assert_eq!(seqs(&replay(&dealer, 0)), [2, 3], "{}", engine.name());
    }
}

/// With a concrete host (`tcp://127.0.0.1:P`) both engines connect their PUB sockets rather
/// than bind them: the subscriber must bind. SGLang then advertises no local source.
#[test]
fn engines_connect_to_a_concrete_host() {
    for engine in Engine::ALL {
        let mut publisher = start(EngineOptions {
            pub_host: "127.0.0.1".into(),
            replay: false,
            ..options(engine)
        });
        let endpoints = publisher.endpoints().to_vec();
        assert!(endpoints.iter().all(|e| !e.binds && e.endpoint == e.local));
        if engine == Engine::Sglang {
            assert!(publisher.info["ranks"][0]["local_source"].is_null());
        }
        let ctx = zmq::Context::new();
        for e in &endpoints {
            let sub = subscriber(&ctx, &e.local, true);
            let probes = join(&mut publisher, e.rank, &sub);
            let seq = publisher.publish(e.rank, probe()).unwrap();
            assert_eq!(seq, probes.len() as u64);
            assert_eq!(
                next_live(&sub).seq,
                seq,
                "{} rank {}",
                engine.name(),
                e.rank
            );
        }
    }
}

/// The driver builds only the engine's own structs: a field the engine's class lacks, or a
/// hash of the wrong kind, is an error reply, and the driver goes on.
#[test]
fn the_driver_refuses_what_the_engine_lacks() {
    let refusals = [
        (
            Engine::Vllm,
            json!({"type": "BlockRemoved", "block_hashes": [1], "medium": null, "cache_salt": "s"}),
            "has no field cache_salt",
        ),
        (
            Engine::Sglang,
            json!({"type": "BlockRemoved", "block_hashes": [1], "group_idx": 0}),
            "has no field group_idx",
        ),
        (
            Engine::Sglang,
            json!({"type": "BlockRemoved", "block_hashes": [{"bytes_hex": "00"}]}),
            "Expected `int`, got `bytes`",
        ),
        (
            Engine::Vllm,
            json!({"type": "BlockRemoved", "block_hashes": ["AQ=="], "medium": null}),
            "a block hash is an integer",
        ),
        (
            Engine::Vllm,
            json!({"type": "BlockRemoved", "block_hashes": [1]}),
            "missing required field `medium`",
        ),
    ];
    for engine in Engine::ALL {
        let mut publisher = start(EngineOptions {
            dp_size: 1,
            replay: false,
            ..options(engine)
        });
        for (_, event, error) in refusals.iter().filter(|(e, _, _)| *e == engine) {
            let command = json!({"op": "publish", "rank": 0, "events": [event]});
            let reply = publisher.request(&command).unwrap();
            assert_eq!(reply["ok"], false, "{reply}");
            assert!(reply["error"].as_str().unwrap().contains(error), "{reply}");
        }
        assert_eq!(publisher.publish(0, probe()).unwrap(), 0, "no seq was used");
    }
}
