#![no_main]
//! IndexQuery (kvroute.<ns>.index.query): typed error or round trip.

use kvroute_common::messages::IndexQuery;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<IndexQuery>(data);
});
