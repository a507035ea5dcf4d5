#![no_main]
//! WorkerLoad (kvroute.<ns>.load.<worker>): typed error or round trip.
//! The check is `kvroute_fuzz::wire_worker_load`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_worker_load(data));
