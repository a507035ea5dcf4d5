//! A minimal MessagePack reader: exactly what the engines' formats need, in one pass, with no
//! allocation but the values kept, every length checked against the bytes left before it is
//! trusted, and nesting bounded.

use kvroute_engine_wire::extra_keys as canon;

use super::{RawHash, WireError, reduce_hash};

/// One element of a block's extra-keys tuple: its canonical bytes, and its text if a string.
pub(super) struct ExtraKey {
    pub(super) canon: Vec<u8>,
    pub(super) text: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

pub(super) enum Key<'a> {
    Str(&'a [u8]),
    Other,
}

/// Deepest nesting [`Reader::skip`] follows (extra keys are tuples of tuples at most).
pub(super) const MAX_DEPTH: u32 = 32;

pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(super) fn byte(&mut self) -> Result<u8, WireError> {
        let b = *self.buf.get(self.pos).ok_or(WireError::Truncated)?;
        self.pos += 1;
        Ok(b)
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    pub(super) fn be(&mut self, n: usize) -> Result<u64, WireError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| acc << 8 | u64::from(*b)))
    }

    pub(super) fn peek(&self) -> Result<Kind, WireError> {
        let b = *self.buf.get(self.pos).ok_or(WireError::Truncated)?;
        Ok(match b {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xca | 0xcb => Kind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xc1 => return Err(WireError::Invalid),
        })
    }

    pub(super) fn is_nil(&mut self) -> Result<bool, WireError> {
        if self.peek()? == Kind::Nil {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    pub(super) fn array_len(&mut self) -> Result<usize, WireError> {
        let b = self.byte()?;
        let n = match b {
            0x90..=0x9f => u64::from(b & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => return Err(WireError::BadEnvelope),
        };
        self.bounded_len(n, 1)
    }

    pub(super) fn map_len(&mut self) -> Result<usize, WireError> {
        let b = self.byte()?;
        let n = match b {
            0x80..=0x8f => u64::from(b & 0x0f),
            0xde => self.be(2)?,
            0xdf => self.be(4)?,
            _ => return Err(WireError::BadEnvelope),
        };
        self.bounded_len(n, 2)
    }

    /// A length that cannot be satisfied by the bytes left is a truncation, checked before any
    /// allocation sized by it.
    pub(super) fn bounded_len(&self, n: u64, min_bytes_each: u64) -> Result<usize, WireError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes_each) > left {
            return Err(WireError::Truncated);
        }
        Ok(n as usize)
    }

    pub(super) fn str_len(&mut self) -> Result<Option<usize>, WireError> {
        let b = self.byte()?;
        let n = match b {
            0xa0..=0xbf => u64::from(b & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => {
                self.pos -= 1;
                return Ok(None);
            }
        };
        Ok(Some(self.bounded_len(n, 1)?))
    }

    pub(super) fn str_bytes(&mut self) -> Result<&'a [u8], WireError> {
        match self.str_len()? {
            Some(n) => self.take(n),
            None => Err(WireError::BadEnvelope),
        }
    }

    pub(super) fn key(&mut self) -> Result<Key<'a>, WireError> {
        match self.str_len()? {
            Some(n) => Ok(Key::Str(self.take(n)?)),
            None => {
                self.skip()?;
                Ok(Key::Other)
            }
        }
    }

    pub(super) fn str_or_nil(&mut self) -> Result<Option<String>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        let s = self.str_bytes()?;
        Ok(Some(String::from_utf8_lossy(s).into_owned()))
    }

    /// Any integer as a raw hash (sign kept).
    pub(super) fn raw_int(&mut self) -> Result<RawHash<'a>, WireError> {
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => RawHash::Unsigned(u64::from(b)),
            0xe0..=0xff => RawHash::Signed(i64::from(b as i8)),
            0xcc => RawHash::Unsigned(self.be(1)?),
            0xcd => RawHash::Unsigned(self.be(2)?),
            0xce => RawHash::Unsigned(self.be(4)?),
            0xcf => RawHash::Unsigned(self.be(8)?),
            0xd0 => RawHash::Signed(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => RawHash::Signed(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => RawHash::Signed(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => RawHash::Signed(self.be(8)? as i64),
            _ => {
                self.pos -= 1;
                return Err(WireError::BadEnvelope);
            }
        })
    }

    pub(super) fn hash(&mut self) -> Result<u64, WireError> {
        match self.peek()? {
            Kind::Int => self.raw_int().map(reduce_hash),
            Kind::Bin => {
                let n = self.bin_len()?;
                Ok(reduce_hash(RawHash::Bytes(self.take(n)?)))
            }
            Kind::Str => {
                let s = self.str_bytes()?;
                Ok(reduce_hash(RawHash::Bytes(s)))
            }
            _ => Err(WireError::BadEnvelope),
        }
    }

    pub(super) fn hash_or_nil(&mut self) -> Result<Option<u64>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    pub(super) fn hash_list(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    pub(super) fn token_list(&mut self) -> Result<Vec<u32>, WireError> {
        if self.is_nil()? {
            return Ok(Vec::new());
        }
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            // Token ids are small non-negative integers: the fast path reads the common
            // encodings directly.
            let b = self.byte()?;
            let v = match b {
                0x00..=0x7f => u64::from(b),
                0xcc => self.be(1)?,
                0xcd => self.be(2)?,
                0xce => self.be(4)?,
                _ => {
                    self.pos -= 1;
                    match self.raw_int()? {
                        RawHash::Unsigned(v) => v,
                        _ => return Err(WireError::BadEnvelope),
                    }
                }
            };
            out.push(u32::try_from(v).map_err(|_| WireError::BadEnvelope)?);
        }
        Ok(out)
    }

    /// nil, or a list of token lists (`lookahead_token_ids`).
    pub(super) fn token_lists(&mut self) -> Result<Option<Vec<Vec<u32>>>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.token_list()?);
        }
        Ok(Some(out))
    }

    pub(super) fn uint_or_nil(&mut self) -> Result<Option<u64>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        match self.raw_int()? {
            RawHash::Unsigned(v) => Ok(Some(v)),
            RawHash::Signed(v) => u64::try_from(v)
                .map(Some)
                .map_err(|_| WireError::BadEnvelope),
            RawHash::Bytes(_) => Err(WireError::BadEnvelope),
        }
    }

    pub(super) fn int_or_nil(&mut self) -> Result<Option<i64>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        match self.raw_int()? {
            RawHash::Unsigned(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| WireError::BadEnvelope),
            RawHash::Signed(v) => Ok(Some(v)),
            RawHash::Bytes(_) => Err(WireError::BadEnvelope),
        }
    }

    pub(super) fn number_or_nil(&mut self) -> Result<Option<f64>, WireError> {
        match self.peek()? {
            Kind::Nil => {
                self.pos += 1;
                Ok(None)
            }
            Kind::Float => {
                let b = self.byte()?;
                Ok(Some(if b == 0xca {
                    f64::from(f32::from_bits(self.be(4)? as u32))
                } else {
                    f64::from_bits(self.be(8)?)
                }))
            }
            Kind::Int => Ok(Some(match self.raw_int()? {
                RawHash::Unsigned(v) => v as f64,
                RawHash::Signed(v) => v as f64,
                RawHash::Bytes(_) => 0.0,
            })),
            _ => Err(WireError::BadEnvelope),
        }
    }

    pub(super) fn bin_len(&mut self) -> Result<usize, WireError> {
        let b = self.byte()?;
        let n = match b {
            0xc4 => self.be(1)?,
            0xc5 => self.be(2)?,
            0xc6 => self.be(4)?,
            _ => return Err(WireError::BadEnvelope),
        };
        self.bounded_len(n, 1)
    }

    /// `extra_keys`: nil, or a list with one entry per block: nil or a tuple (array) of keys.
    pub(super) fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            if self.is_nil()? {
                out.push(None);
                continue;
            }
            let m = self.array_len()?;
            let mut keys = Vec::with_capacity(m);
            for _ in 0..m {
                let text = if self.peek()? == Kind::Str {
                    let save = self.pos;
                    let s = self.str_or_nil()?;
                    self.pos = save;
                    s
                } else {
                    None
                };
                let mut canon_bytes = Vec::new();
                self.canon(&mut canon_bytes, 0)?;
                keys.push(ExtraKey {
                    canon: canon_bytes,
                    text,
                });
            }
            out.push(Some(keys));
        }
        Ok(Some(out))
    }

    /// Appends the canonical encoding of the next value (PROTOCOL.md, "Extra keys"): a type
    /// byte, then nil: nothing; bool: 1 byte; integer: `i64` (0x02) or `u64` (0x03) LE;
    /// float: `f64` bits LE; str (0x05), bin (0x06): u32 LE length and the bytes; array (0x07):
    /// u32 LE count and the items; map (0x08): count and key, value pairs; ext (0x09): u32 LE
    /// length and the value's MessagePack bytes as they are (header, type and data). Two
    /// encoders' bytes for the same value therefore canonicalize alike.
    pub(super) fn canon(&mut self, out: &mut Vec<u8>, depth: u32) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        match self.peek()? {
            Kind::Nil => {
                self.pos += 1;
                out.push(canon::NIL);
            }
            Kind::Bool => {
                let b = self.byte()?;
                out.extend_from_slice(&[canon::BOOL, b & 1]);
            }
            Kind::Int => match self.raw_int()? {
                RawHash::Signed(v) if v < 0 => {
                    out.push(canon::NEGATIVE_INT);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                RawHash::Signed(v) => {
                    out.push(canon::INT);
                    out.extend_from_slice(&(v as u64).to_le_bytes());
                }
                RawHash::Unsigned(v) => {
                    out.push(canon::INT);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                RawHash::Bytes(_) => {}
            },
            Kind::Float => {
                let v = self.number_or_nil()?.unwrap_or(0.0);
                out.push(canon::FLOAT);
                out.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            Kind::Str => {
                let s = self.str_bytes()?;
                out.push(canon::STR);
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s);
            }
            Kind::Bin => {
                let n = self.bin_len()?;
                let s = self.take(n)?;
                out.push(canon::BIN);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                out.extend_from_slice(s);
            }
            Kind::Array => {
                let n = self.array_len()?;
                out.push(canon::ARRAY);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                for _ in 0..n {
                    self.canon(out, depth + 1)?;
                }
            }
            Kind::Map => {
                let n = self.map_len()?;
                out.push(canon::MAP);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                for _ in 0..2 * n {
                    self.canon(out, depth + 1)?;
                }
            }
            Kind::Ext => {
                let start = self.pos;
                self.skip()?;
                out.push(canon::EXT);
                out.extend_from_slice(&((self.pos - start) as u32).to_le_bytes());
                out.extend_from_slice(&self.buf[start..self.pos]);
            }
        }
        Ok(())
    }

    /// Skips the next value, however nested (bounded).
    pub(super) fn skip(&mut self) -> Result<(), WireError> {
        self.skip_depth(0)
    }

    pub(super) fn skip_depth(&mut self, depth: u32) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        let b = self.byte()?;
        let (skip, items) = match b {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(b & 0x0f)),
            0x90..=0x9f => (0, u64::from(b & 0x0f)),
            0xa0..=0xbf => (u64::from(b & 0x1f), 0),
            0xc4 | 0xd9 => (self.be(1)?, 0),
            0xc5 | 0xda => (self.be(2)?, 0),
            0xc6 | 0xdb => (self.be(4)?, 0),
            0xc7 => (self.be(1)? + 1, 0),
            0xc8 => (self.be(2)? + 1, 0),
            0xc9 => (self.be(4)? + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 => (4, 0),
            0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, self.be(2)?),
            0xdd => (0, self.be(4)?),
            0xde => (0, 2 * self.be(2)?),
            0xdf => (0, 2 * self.be(4)?),
            0xc1 => return Err(WireError::Invalid),
        };
        self.take(usize::try_from(skip).map_err(|_| WireError::Truncated)?)?;
        self.bounded_len(items, 1)?;
        for _ in 0..items {
            self.skip_depth(depth + 1)?;
        }
        Ok(())
    }
}
