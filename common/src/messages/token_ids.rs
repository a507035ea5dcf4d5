//! `token_ids` on the wire, in either of two forms (PROTOCOL.md, "SelectRequest"):
//! - a MessagePack `bin` of little-endian `u32`s, 4 bytes per token: what kvroute's own
//!   encoder writes, decoded with one pass over the bytes instead of one integer decode per
//!   token (an 8,192-token prompt was the largest single cost of a selection);
//! - an array of unsigned integers: what any MessagePack library writes for a list, accepted
//!   as before.
//!
//! Use as `#[serde(default, with = "token_ids")]` on an `Option<Vec<u32>>`.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;

/// Tokens decoded up front from an array's length hint at most (a hint is not a promise).
const MAX_PREALLOCATED: usize = 1 << 20;

/// Writes the tokens as one `bin` of little-endian `u32`s (`nil` when absent).
pub fn serialize<S: Serializer>(
    tokens: &Option<Vec<u32>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match tokens {
        None => serializer.serialize_none(),
        Some(tokens) => serializer.serialize_bytes(&to_le_bytes(tokens)),
    }
}

/// Reads `nil`, a `bin` of little-endian `u32`s or an array of unsigned integers.
pub fn deserialize<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<u32>>, D::Error> {
    deserializer.deserialize_option(OptionVisitor)
}

/// The `bin` form's bytes.
pub fn to_le_bytes(tokens: &[u32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    bytes
}

/// Tokens from the `bin` form's bytes; `None` when the length is not a multiple of 4.
pub fn from_le_bytes(bytes: &[u8]) -> Option<Vec<u32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut tokens = Vec::with_capacity(bytes.len() / 4);
    tokens.extend(
        bytes
            .chunks_exact(4)
            .map(|chunk| <[u8; 4]>::try_from(chunk).map_or(0, u32::from_le_bytes)),
    );
    Some(tokens)
}

struct OptionVisitor;

impl<'de> Visitor<'de> for OptionVisitor {
    type Value = Option<Vec<u32>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("nil, a bin of little-endian u32 token ids or an array of token ids")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(TokensVisitor).map(Some)
    }
}

struct TokensVisitor;

impl TokensVisitor {
    fn bytes<E: de::Error>(bytes: &[u8]) -> Result<Vec<u32>, E> {
        from_le_bytes(bytes)
            .ok_or_else(|| E::invalid_length(bytes.len(), &"a bin of 4 bytes per token id"))
    }
}

impl<'de> Visitor<'de> for TokensVisitor {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a bin of little-endian u32 token ids or an array of token ids")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        Self::bytes(v)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Self::Value, E> {
        Self::bytes(v)
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Self::Value, E> {
        Self::bytes(&v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut tokens = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_PREALLOCATED));
        while let Some(token) = seq.next_element::<u32>()? {
            tokens.push(token);
        }
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde::{Deserialize, Serialize};

    use crate::codec::{DecodeError, WireMessage, decode, encode};
    use crate::messages::SchemaVersion;

    /// A message with only the field, in both forms.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Bin {
        #[serde(default, with = "super")]
        token_ids: Option<Vec<u32>>,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Array {
        token_ids: Option<Vec<u32>>,
    }

    impl WireMessage for Bin {
        const NAME: &'static str = "Bin";
        fn schema_version(&self) -> SchemaVersion {
            SchemaVersion::CURRENT
        }
    }

    impl WireMessage for Array {
        const NAME: &'static str = "Array";
        fn schema_version(&self) -> SchemaVersion {
            SchemaVersion::CURRENT
        }
    }

    /// `{"token_ids": <raw MessagePack value>}`.
    fn with_raw(value: &[u8]) -> Vec<u8> {
        let mut bytes = vec![0x81, 0xa9];
        bytes.extend_from_slice(b"token_ids");
        bytes.extend_from_slice(value);
        bytes
    }

    #[test]
    fn writes_a_bin_of_little_endian_u32s() {
        let bytes = encode(&Bin {
            token_ids: Some(vec![1, 0x0102_0304]),
        })
        .unwrap();
        assert_eq!(
            bytes.as_ref(),
            with_raw(&[0xc4, 8, 1, 0, 0, 0, 4, 3, 2, 1]).as_slice()
        );
    }

    #[test]
    fn reads_both_forms_and_nil() {
        let bin: Bin = decode(&with_raw(&[0xc4, 4, 7, 0, 0, 0])).unwrap();
        assert_eq!(bin.token_ids, Some(vec![7]));
        // An array of a fixint, a uint16 and a uint32.
        let array: Bin = decode(&with_raw(&[
            0x93, 0x05, 0xcd, 0x01, 0x00, 0xce, 0x00, 0x01, 0x00, 0x00,
        ]))
        .unwrap();
        assert_eq!(array.token_ids, Some(vec![5, 256, 65536]));
        let nil: Bin = decode(&with_raw(&[0xc0])).unwrap();
        assert_eq!(nil.token_ids, None);
        let missing: Bin = decode(&[0x80]).unwrap();
        assert_eq!(missing.token_ids, None);
        let empty: Bin = decode(&with_raw(&[0xc4, 0])).unwrap();
        assert_eq!(empty.token_ids, Some(vec![]));
    }

    #[test]
    fn malformed_token_ids_are_typed_errors() {
        let malformed = |value: &[u8]| {
            let e = decode::<Bin>(&with_raw(value)).unwrap_err();
            assert!(matches!(e, DecodeError::Malformed { .. }), "{e:?}");
            e.to_string()
        };
        assert!(malformed(&[0xc4, 3, 1, 2, 3]).contains("4 bytes per token id"));
        // Negative, too large, a string, a truncated bin, a truncated array.
        malformed(&[0x91, 0xff]);
        malformed(&[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0]);
        malformed(&[0xa1, b'x']);
        malformed(&[0xc4, 8, 1, 0, 0, 0]);
        malformed(&[0x92, 0x01]);
        malformed(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    }

    proptest! {
        /// Whatever the form on the wire, the same tokens come out.
        #[test]
        fn both_forms_decode_equal(tokens in proptest::collection::vec(any::<u32>(), 0..2000)) {
            let array = encode(&Array { token_ids: Some(tokens.clone()) }).unwrap();
            let bin = encode(&Bin { token_ids: Some(tokens.clone()) }).unwrap();
            prop_assert_eq!(decode::<Bin>(&array).unwrap().token_ids, Some(tokens.clone()));
            prop_assert_eq!(decode::<Bin>(&bin).unwrap().token_ids, Some(tokens));
        }

        /// Arbitrary bytes in the field never panic.
        #[test]
        fn arbitrary_values_never_panic(value in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode::<Bin>(&with_raw(&value));
        }
    }
}
