#![no_main]
//! The radix index's snapshot restore. The input is tried as it is and with its XXH3-64 appended (the format's checksum), so mutations reach the body: a typed SnapshotError or an index that answers queries, survives removing its workers, and whose own snapshot restores to the same digest and bytes.
//! The check is `kvroute_fuzz::index_snapshot`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::index_snapshot(data));
