#![no_main]
//! SelectRequest as the router's intake reads it (decode, then the checks that need no worker state): a typed rejection or a request that passes the checks and round-trips.
//! The check is `kvroute_fuzz::select_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::select_request(data));
