//! The canonical encoding of a block's extra keys (PROTOCOL.md, "Extra keys"): a type byte,
//! then the value. A block's keys, so encoded and concatenated, fold into its tokens hash; a
//! cache salt and lookahead tokens fold the same way, as one more key each.

/// Type bytes.
pub const NIL: u8 = 0x00;
/// + 1 byte (0 or 1).
pub const BOOL: u8 = 0x01;
/// A negative integer: + i64 LE.
pub const NEGATIVE_INT: u8 = 0x02;
/// Any other integer: + u64 LE.
pub const INT: u8 = 0x03;
/// + f64 bits LE.
pub const FLOAT: u8 = 0x04;
/// + u32 LE length + the bytes.
pub const STR: u8 = 0x05;
/// + u32 LE length + the bytes.
pub const BIN: u8 = 0x06;
/// + u32 LE count + the items.
pub const ARRAY: u8 = 0x07;
/// + u32 LE count + keys and values alternating.
pub const MAP: u8 = 0x08;
/// + u32 LE length + its MessagePack bytes.
pub const EXT: u8 = 0x09;

/// A cache salt (SGLang's `cache_salt`) as an extra key: the string key `05 ‖ LE32(len) ‖
/// bytes`, so a salt folds like the same string among the extra keys.
pub fn salt_key(salt: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + salt.len());
    out.push(STR);
    out.extend_from_slice(&(salt.len() as u32).to_le_bytes());
    out.extend_from_slice(salt.as_bytes());
    out
}

/// A block's lookahead tokens (vLLM 0.34's `lookahead_token_ids`) as an extra key: an array
/// of integers, `07 ‖ LE32(count) ‖ (03 ‖ LE64(token))…`.
pub fn lookahead_key(tokens: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + 9 * tokens.len());
    out.push(ARRAY);
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for &t in tokens {
        out.push(INT);
        out.extend_from_slice(&u64::from(t).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_bytes() {
        assert_eq!(salt_key("ab"), [0x05, 2, 0, 0, 0, b'a', b'b']);
        assert_eq!(
            lookahead_key(&[7]),
            [0x07, 1, 0, 0, 0, 0x03, 7, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(lookahead_key(&[]), [0x07, 0, 0, 0, 0]);
    }
}
