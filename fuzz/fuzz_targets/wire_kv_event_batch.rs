#![no_main]
//! KvEventBatch (kvroute.<ns>.kv.events.<worker>): typed error or round trip.
//! The check is `kvroute_fuzz::wire_kv_event_batch`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_kv_event_batch(data));
