#![no_main]
//! KvEventBatch (kvroute.<ns>.kv.events.<worker>): typed error or round trip.

use kvroute_common::messages::KvEventBatch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(batch) = kvroute_fuzz::round_trip::<KvEventBatch>(data) {
        // What the writer stamps is readable by this build.
        assert!(
            KvEventBatch::required_version(&batch.events)
                <= kvroute_common::messages::SchemaVersion(2)
        );
    }
});
