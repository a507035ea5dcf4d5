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
