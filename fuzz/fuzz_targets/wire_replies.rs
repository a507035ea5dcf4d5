#![no_main]
//! The answers and records clients and routers decode (IndexQueryResponse, SelectResponse, GenerateResponse, SessionBindingRecord, ReplicaStatus), chosen by the first byte: typed error or round trip.
//! The check is `kvroute_fuzz::wire_replies`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::wire_replies(data));
