#![no_main]
//! The bridge's decoder of vLLM's ZeroMQ KV-event payloads (MessagePack batches): a typed WireError, or a batch whose every event is well-formed (extra keys empty or one per block); the bridge's frame checks never panic.

use kvroute_bridge::EngineKind;
use kvroute_bridge::wire::{EngineEvent, decode_batch};
use kvroute_bridge::zmq_io::{frames_error, seq_of};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode_batch(EngineKind::Vllm, data) {
        Ok(batch) => {
            for event in &batch.events {
                if let EngineEvent::Stored(s) = event {
                    assert!(s.extra_keys.is_empty() || s.extra_keys.len() == s.block_hashes.len());
                }
            }
            assert!(batch.skipped.iter().all(|r| !r.is_empty()));
        }
        Err(e) => assert!(!e.reason().is_empty()),
    }
    // A live message: [topic, seq, payload], split from the input at its first two bytes.
    if let [a, b, rest @ ..] = data {
        let (a, b) = (usize::from(*a).min(rest.len()), usize::from(*b));
        let (topic, rest) = rest.split_at(a);
        let (seq, payload) = rest.split_at(b.min(rest.len()));
        let frames = vec![topic.to_vec(), seq.to_vec(), payload.to_vec()];
        if frames_error(&frames).is_none() {
            let _ = seq_of(&frames[1]);
        }
    }
});
