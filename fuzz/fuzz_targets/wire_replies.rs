#![no_main]
//! The answers and records clients and routers decode (IndexQueryResponse, SelectResponse, GenerateResponse, SessionBindingRecord, ReplicaStatus), chosen by the first byte: typed error or round trip.

use kvroute_common::messages::{
    GenerateResponse, IndexQueryResponse, ReplicaStatus, SelectResponse, SessionBindingRecord,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, data)) = data.split_first() else {
        return;
    };
    match which % 5 {
        0 => drop(kvroute_fuzz::round_trip::<IndexQueryResponse>(data)),
        1 => drop(kvroute_fuzz::round_trip::<SelectResponse>(data)),
        2 => drop(kvroute_fuzz::round_trip::<GenerateResponse>(data)),
        3 => drop(kvroute_fuzz::round_trip::<SessionBindingRecord>(data)),
        _ => drop(kvroute_fuzz::round_trip::<ReplicaStatus>(data)),
    }
});
