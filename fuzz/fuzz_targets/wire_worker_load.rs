#![no_main]
//! WorkerLoad (kvroute.<ns>.load.<worker>): typed error or round trip.

use kvroute_common::messages::WorkerLoad;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<WorkerLoad>(data);
});
