#![no_main]
//! ControlRecord (the events stream's control subject): typed error or round trip.
//! The check is `kvroute_fuzz::wire_control_record`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_control_record(data));
