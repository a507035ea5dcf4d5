#![no_main]
//! ControlRecord (the events stream's control subject): typed error or round trip.

use kvroute_common::messages::ControlRecord;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_fuzz::round_trip::<ControlRecord>(data);
});
