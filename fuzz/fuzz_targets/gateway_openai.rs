#![no_main]
//! The gateway's reading of OpenAI /v1/completions and /v1/chat/completions bodies (the first byte picks the API and whether kvroute's session headers are set from the input): a 400 ApiError or a parsed request true to the body.
//! The check is `kvroute_fuzz::gateway_openai`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::gateway_openai(data));
