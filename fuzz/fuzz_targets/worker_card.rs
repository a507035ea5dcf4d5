#![no_main]
//! A worker card as discovery reads it from etcd (key and value; the first input byte picks a well-formed key for worker 7 or the input up to a newline as the key): decode_card gives a typed Invalid event or a card whose id matches its key and that round-trips.
//! The check is `kvroute_fuzz::worker_card`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::worker_card(data));
