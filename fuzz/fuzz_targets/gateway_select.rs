#![no_main]
//! The gateway's reading of a /v1/select body (parse_body: JSON, the known fields and their types, exactly one prompt field): a 400 ApiError or a body the rest of the handler takes.

use kvroute_gateway::select_api::parse_body;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = parse_body(data) {
        assert!(e.status.is_client_error(), "{e:?}");
    }
});
