//! Garbage on an engine's ZMQ socket — wrong frame counts, a bad seq frame, truncated or random
//! MessagePack, an envelope of the wrong shape, an oversize batch — is counted by reason and
//! skipped; the relay keeps running and applies the next good batch. A batch that cannot be
//! decoded but carried a valid seq clears the rank (what it said is lost).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_bridge::BridgeMetrics;
use kvroute_bridge::config::EngineSpec;
use kvroute_bridge::relay::{Relay, RelaySettings};
use rmpv::Value;

fn stored(hash: u64) -> Vec<u8> {
    let event = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(hash)]),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (
            Value::from("token_ids"),
            Value::Array((0..4).map(Value::from).collect()),
        ),
        (Value::from("block_size"), Value::from(4)),
        (Value::from("lora_id"), Value::Nil),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("lora_name"), Value::Nil),
    ]);
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![event]),
        Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn garbage_is_counted_and_skipped_and_the_relay_goes_on() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let spec: EngineSpec = serde_norway::from_str(&format!(
        "name: g\nengine: vllm\nengine_url: http://127.0.0.1:9\nzmq_endpoint: {endpoint}\n"
    ))
    .unwrap();
    let metrics = Arc::new(BridgeMetrics::default());
    let relay = Relay::start(
        &spec,
        vec![0],
        RelaySettings {
            mirror_max_blocks: 1000,
            shared_tier: true,
        },
        metrics.clone(),
    )
    .unwrap();
    let errors =
        |reason: &str| metrics.get("kvroute_bridge_decode_errors_total", "g", Some(0), reason);
    let send = |frames: Vec<Vec<u8>>| publisher.send_multipart(frames, 0).unwrap();
    let frame =
        |seq: u64, payload: Vec<u8>| vec![b"".to_vec(), seq.to_be_bytes().to_vec(), payload];

    // Join: a fresh engine's first batch (no replay endpoint: a missed start clears the rank,
    // which is harmless here) until the relay holds it.
    let mut seq = 0;
    wait("the relay to receive", || {
        send(frame(seq, stored(1)));
        seq += 1;
        relay.mirror_blocks() == 1
    });
    let cleared_before = metrics.get("kvroute_bridge_ranks_cleared_total", "g", Some(0), "");
    let gaps = || metrics.get("kvroute_bridge_gaps_total", "g", Some(0), "");
    let gaps_before = gaps();

    // No seq to judge: skipped, the tracker untouched.
    send(vec![b"".to_vec(), seq.to_be_bytes().to_vec()]);
    send(vec![
        b"".to_vec(),
        seq.to_be_bytes().to_vec(),
        vec![],
        vec![],
    ]);
    send(vec![b"".to_vec(), vec![0; 7], stored(2)]);
    // Valid seqs, undecodable payloads: each counted and clearing the rank.
    let good = stored(3);
    let undecodable: Vec<(Vec<u8>, &str)> = vec![
        (good[..good.len() - 3].to_vec(), "truncated"),
        (vec![0xc1, 0x00, 0xff], "invalid_msgpack"),
        (
            {
                let mut v = Vec::new();
                rmpv::encode::write_value(&mut v, &Value::from("not a batch")).unwrap();
                v
            },
            "bad_envelope",
        ),
        (
            {
                let mut v = good.clone();
                v.push(0);
                v
            },
            "trailing_bytes",
        ),
        (vec![0x91; 17 * 1024 * 1024], "oversize"),
    ];
    let n = undecodable.len() as f64;
    for (payload, _) in undecodable.iter().cloned() {
        send(frame(seq, payload));
        seq += 1;
    }
    // Then a good batch, applied.
    send(frame(seq, stored(4)));
    wait("the good batch after the garbage", || {
        metrics.get("kvroute_bridge_events_total", "g", Some(0), "BlockStored") >= 2.0
            && relay.mirror_blocks() == 1
            && errors("oversize") == 1.0
    });
    assert_eq!(errors("frame_count"), 2.0);
    assert_eq!(errors("bad_seq_frame"), 1.0);
    for (_, reason) in &undecodable {
        assert_eq!(errors(reason), 1.0, "{reason}");
    }
    assert_eq!(
        metrics.get("kvroute_bridge_ranks_cleared_total", "g", Some(0), "") - cleared_before,
        n
    );
    // Frames without a usable seq left the numbering alone: no gap was seen.
    assert_eq!(gaps(), gaps_before);
    relay.shutdown();
}
