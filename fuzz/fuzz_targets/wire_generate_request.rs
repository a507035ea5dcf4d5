#![no_main]
//! GenerateRequest (a worker's request subject): typed error or round trip.

use kvroute_common::messages::GenerateRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<GenerateRequest>(data);
});
