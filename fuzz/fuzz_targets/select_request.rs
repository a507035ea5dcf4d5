#![no_main]
//! SelectRequest as the router's intake reads it (decode, then the checks that need no worker state): a typed rejection or a request that passes the checks and round-trips.

use kvroute_common::messages::SelectRequest;
use kvroute_router::service::intake::{MAX_SESSION_ID_BYTES, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = kvroute_fuzz::round_trip::<SelectRequest>(data);
    match parse(data) {
        Ok(request) => {
            assert_eq!(
                format!("{request:?}"),
                format!("{:?}", decoded.expect("parsed, so decoded"))
            );
            assert!(!request.model.is_empty());
            assert!(request.token_ids.is_some() != request.block_hashes.is_some());
            assert!(request.token_ids.as_ref().is_none_or(|t| !t.is_empty()));
            assert!(request.block_hashes.as_ref().is_none_or(|h| !h.is_empty()));
            if let Some(s) = &request.session {
                assert!(!s.id.is_empty() && s.id.len() <= MAX_SESSION_ID_BYTES);
            }
        }
        Err(rejected) => assert!(!rejected.message.is_empty()),
    }
});
