#![no_main]
//! A worker card as discovery reads it from etcd (key and value; the first input byte picks a well-formed key for worker 7 or the input up to a newline as the key): decode_card gives a typed Invalid event or a card whose id matches its key and that round-trips.

use kvroute_common::discovery::{WorkerEvent, decode_card};
use kvroute_common::messages::WorkerCard;
use kvroute_common::{Names, Namespace};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let names = Names::new(&Namespace::new("fuzz").expect("valid namespace"));
    let (key, value) = if mode % 2 == 0 {
        (names.worker_key(7).into_bytes(), rest)
    } else {
        let cut = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
        (
            rest[..cut].to_vec(),
            rest.get(cut + 1..).unwrap_or_default(),
        )
    };
    match decode_card(&names, &key, value) {
        Ok(card) => {
            // The key is exactly the card's key: one worker, one key.
            assert_eq!(key, names.worker_key(card.worker_id).into_bytes());
            kvroute_fuzz::round_trip::<WorkerCard>(value).expect("decoded once");
        }
        Err(event) => assert!(matches!(*event, WorkerEvent::Invalid { .. })),
    }
});
