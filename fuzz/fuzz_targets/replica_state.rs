#![no_main]
//! ReplicaState::restore (an indexer replica's snapshot file, from the snapshot store): a typed RestoreError or a state whose own snapshot restores to the same digest and bytes.

use kvroute_common::{Names, Namespace};
use kvroute_indexer::replica::ReplicaState;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let names = Names::new(&Namespace::new("fuzz").expect("valid namespace"));
    let Ok(state) = ReplicaState::restore(&names, data) else {
        return;
    };
    let snapshot = state.snapshot();
    let again = ReplicaState::restore(&names, &snapshot).expect("own snapshot restores");
    assert_eq!(again.digest(), state.digest());
    assert_eq!(again.applied_seq(), state.applied_seq());
    assert_eq!(again.snapshot(), snapshot);
});
