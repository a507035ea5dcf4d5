#![no_main]
//! Decision (kvroute.<ns>.decisions): typed error or round trip.
//! The check is `kvroute_fuzz::wire_decision`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_decision(data));
