#![no_main]
//! ReplicaState::restore (an indexer replica's snapshot file, from the snapshot store): a typed RestoreError or a state whose own snapshot restores to the same digest and bytes.
//! The check is `kvroute_fuzz::replica_state`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::replica_state(data));
