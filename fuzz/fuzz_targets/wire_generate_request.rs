#![no_main]
//! GenerateRequest (a worker's request subject): typed error or round trip.
//! The check is `kvroute_fuzz::wire_generate_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_generate_request(data));
