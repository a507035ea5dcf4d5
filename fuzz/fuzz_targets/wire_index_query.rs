#![no_main]
//! IndexQuery (kvroute.<ns>.index.query): typed error or round trip.
//! The check is `kvroute_fuzz::wire_index_query`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_index_query(data));
