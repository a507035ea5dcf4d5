#![no_main]
//! The bridge's reading of vLLM's `/metrics` page: loads, cache facts and LoRA adapter slots,
//! never a panic, the slots' lists bounded, distinct and disjoint.
//! The check is `kvroute_fuzz::engine_metrics`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::engine_metrics(data));
