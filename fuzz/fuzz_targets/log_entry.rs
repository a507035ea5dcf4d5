#![no_main]
//! One message of the events stream as an indexer replica reads it: the first byte picks the subject (the control subject, worker 7's events subject, or the input up to a newline); decode_entry gives a typed BadEntry or an entry true to its subject; applying it to a replica state never panics, and the state's snapshot restores to the same digest and bytes.
//! The check is `kvroute_fuzz::log_entry`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::log_entry(data));
