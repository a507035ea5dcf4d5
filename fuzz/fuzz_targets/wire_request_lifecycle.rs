#![no_main]
//! RequestLifecycle (kvroute.<ns>.lifecycle.<worker>): typed error or round trip.
//! The check is `kvroute_fuzz::wire_request_lifecycle`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_request_lifecycle(data));
