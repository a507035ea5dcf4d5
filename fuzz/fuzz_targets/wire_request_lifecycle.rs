#![no_main]
//! RequestLifecycle (kvroute.<ns>.lifecycle.<worker>): typed error or round trip.

use kvroute_common::messages::RequestLifecycle;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<RequestLifecycle>(data);
});
