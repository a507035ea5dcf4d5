#![no_main]
//! The gateway's reading of a /v1/select body (parse_body: JSON, the known fields and their types, exactly one prompt field): a 400 ApiError or a body the rest of the handler takes.
//! The check is `kvroute_fuzz::gateway_select`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::gateway_select(data));
