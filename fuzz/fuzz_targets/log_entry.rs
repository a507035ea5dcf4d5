#![no_main]
//! One message of the events stream as an indexer replica reads it: the first byte picks the subject (the control subject, worker 7's events subject, or the input up to a newline); decode_entry gives a typed BadEntry or an entry true to its subject; applying it to a replica state never panics, and the state's snapshot restores to the same digest and bytes.

use kvroute_common::{Names, Namespace};
use kvroute_indexer::IndexConfig;
use kvroute_indexer::replica::{LogEntry, ReplicaState, decode_entry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let names = Names::new(&Namespace::new("fuzz").expect("valid namespace"));
    let (subject, payload) = match mode % 3 {
        0 => (names.kv_control(), rest),
        1 => (names.kv_events(7), rest),
        _ => {
            let cut = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            let payload = rest.get(cut + 1..).unwrap_or_default();
            (String::from_utf8_lossy(&rest[..cut]).into_owned(), payload)
        }
    };
    match decode_entry(&names, &subject, payload) {
        Ok(LogEntry::Events(batch)) => assert_eq!(subject, names.kv_events(batch.worker_id)),
        Ok(LogEntry::Control(_)) => assert_eq!(subject, names.kv_control()),
        Err(bad) => assert!(!bad.reason().is_empty()),
    }
    let mut state = ReplicaState::new(&names, IndexConfig::default());
    let report = state.apply(1, &subject, payload);
    assert_eq!(state.applied_seq(), 1);
    if report.bad.is_some() {
        assert_eq!(report.events_applied, 0);
    }
    let snapshot = state.snapshot();
    let restored = ReplicaState::restore(&names, &snapshot).expect("own snapshot restores");
    assert_eq!(restored.digest(), state.digest());
    assert_eq!(restored.snapshot(), snapshot);
});
