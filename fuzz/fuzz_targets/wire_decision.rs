#![no_main]
//! Decision (kvroute.<ns>.decisions): typed error or round trip.

use kvroute_common::messages::Decision;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<Decision>(data);
});
