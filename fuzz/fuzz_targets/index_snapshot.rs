#![no_main]
//! The radix index's snapshot restore. The input is tried as it is and with its XXH3-64 appended (the format's checksum), so mutations reach the body: a typed SnapshotError or an index that answers queries, survives removing its workers, and whose own snapshot restores to the same digest and bytes.

use kvroute_indexer::SharedIndex;
use libfuzzer_sys::fuzz_target;
use xxhash_rust::xxh3::xxh3_64;

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&xxh3_64(data).to_le_bytes());
    check(&sealed);
});

fn check(bytes: &[u8]) {
    let Ok(index) = SharedIndex::restore(bytes) else {
        return;
    };
    let snapshot = index.snapshot();
    let again = SharedIndex::restore(&snapshot).expect("own snapshot restores");
    assert_eq!(again.digest(), index.digest());
    assert_eq!(again.snapshot(), snapshot);
    // The restored index is usable: a query over hashes found in the input, then every worker
    // leaves and the index is empty.
    let hashes: Vec<u64> = bytes
        .chunks_exact(8)
        .take(64)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let _ = index.find_matches(&hashes);
    for (worker, _) in index.workers() {
        index.remove_worker(worker);
    }
    assert!(index.is_empty(), "no worker left, yet entries remain");
}
