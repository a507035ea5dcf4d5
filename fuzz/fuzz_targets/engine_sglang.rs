#![no_main]
//! The bridge's decoder of SGLang's ZeroMQ KV-event payloads (MessagePack batches): a typed WireError, or a batch whose every event is well-formed (extra keys empty or one per block); the bridge's frame checks never panic.
//! The check is `kvroute_fuzz::engine_sglang`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::engine_sglang(data));
