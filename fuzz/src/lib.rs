//! What the fuzz targets share: the round-trip check of the wire codec.

use std::fmt::Debug;

use kvroute_common::codec::{EncodeError, WireMessage, decode, encode};

/// Decodes `data` as a `T`; when that succeeds, checks the codec's promise that the value
/// encodes and decodes back to itself: the second decoding succeeds, is equal (compared by
/// `Debug`, which also compares NaN costs), and encodes to the same bytes. A failure is a typed
/// [`kvroute_common::DecodeError`], which the caller may inspect.
pub fn round_trip<T: WireMessage + Debug>(data: &[u8]) -> Option<T> {
    let msg = decode::<T>(data).ok()?;
    let bytes = match encode(&msg) {
        Ok(bytes) => bytes,
        // A compact input (e.g. tokens as a bin, ids in few bytes) may re-encode larger than
        // the limit: the limit is the reader's, not a promise of the value.
        Err(EncodeError::TooLarge { .. }) => return Some(msg),
        Err(e) => panic!("{} decoded but does not encode: {e}\n{msg:?}", T::NAME),
    };
    let again: T = decode(&bytes)
        .unwrap_or_else(|e| panic!("{} re-encoded does not decode: {e}\n{msg:?}", T::NAME));
    assert_eq!(
        format!("{msg:?}"),
        format!("{again:?}"),
        "{} changed through encode and decode",
        T::NAME
    );
    let bytes_again = encode(&again).expect("encoded once");
    assert_eq!(
        bytes,
        bytes_again,
        "{} encodes differently the second time",
        T::NAME
    );
    Some(msg)
}

/// The engine targets' check of one input, for either engine's decoder: a typed `WireError`,
/// or a batch whose every event is well-formed (extra keys empty or one per block); the
/// bridge's frame checks never panic.
pub fn check_engine_batch(kind: kvroute_bridge::EngineKind, data: &[u8]) {
    use kvroute_bridge::wire::{EngineEvent, decode_batch};
    use kvroute_bridge::zmq_io::{frames_error, seq_of};
    match decode_batch(kind, data) {
        Ok(batch) => {
            for event in &batch.events {
                if let EngineEvent::Stored(s) = event {
                    assert!(s.extra_keys.is_empty() || s.extra_keys.len() == s.block_hashes.len());
                }
            }
            assert!(batch.skipped.iter().all(|r| !r.is_empty()));
        }
        Err(e) => assert!(!e.reason().is_empty()),
    }
    // A live message: [topic, seq, payload], split from the input at its first two bytes.
    if let [a, b, rest @ ..] = data {
        let (a, b) = (usize::from(*a).min(rest.len()), usize::from(*b));
        let (topic, rest) = rest.split_at(a);
        let (seq, payload) = rest.split_at(b.min(rest.len()));
        let frames = vec![topic.to_vec(), seq.to_vec(), payload.to_vec()];
        if frames_error(&frames).is_none() {
            let _ = seq_of(&frames[1]);
        }
    }
}
