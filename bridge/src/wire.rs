//! The engines' KV-event wire format, decoded tolerantly (PROTOCOL.md, "Engine events").
//!
//! A ZMQ message is `[topic, seq (8-byte big-endian), payload]`; the payload is MessagePack of
//! a batch: `[ts, events, dp_rank]` as a positional array (the norm; extra trailing slots and a
//! missing rank are fine) or a map (`ts`, `events`, and `data_parallel_rank` for vLLM or
//! `attn_dp_rank` for SGLang). An event is a tagged map (`type`: `BlockStored` |
//! `BlockRemoved` | `AllBlocksCleared`; any field order; unknown fields ignored) or a tagged
//! positional array (older versions: the tag first, then every slot of that engine's struct in
//! declaration order, nil when unset; extra slots ignored).
//!
//! Decoding is a single pass over the bytes with no intermediate value tree (the relay decodes
//! every block of the fleet). An event that cannot be understood is skipped and counted by its
//! reason; only a batch whose envelope is broken is refused as a whole.

use crate::config::EngineKind;

/// A decoded batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineBatch {
    /// The engine's timestamp (seconds since the epoch; 0 when absent).
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    /// The rank the engine stamped, when it did.
    pub dp_rank: Option<u32>,
    /// Events skipped as undecodable, with their reason.
    pub skipped: Vec<&'static str>,
}

/// One engine event, engine-neutral.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed(Removed),
    AllCleared,
}

/// `BlockStored`, the fields kvroute uses (everything else is ignored).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    /// The engine's block hashes, reduced to u64 ([`reduce_hash`]).
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    /// Every stored block's tokens, concatenated (empty for token-less offload stores).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    pub medium: Option<String>,
    /// Per block: the extra keys beyond the LoRA name, canonically encoded ([`canon`]);
    /// empty when there are none. Either empty or one entry per block.
    pub extra_keys: Vec<Vec<u8>>,
    /// SGLang's cache salt (folded like an extra key).
    pub cache_salt: Option<String>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub locality: Option<String>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Removed {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
}

/// Why a payload or an event could not be decoded (stable: metric label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("truncated MessagePack")]
    Truncated,
    #[error("invalid MessagePack")]
    Invalid,
    #[error("the batch is not [ts, events, rank] or a map with events")]
    BadEnvelope,
    #[error("trailing bytes after the batch")]
    Trailing,
    #[error("nested too deeply")]
    TooDeep,
}

impl WireError {
    pub fn reason(self) -> &'static str {
        match self {
            WireError::Truncated => "truncated",
            WireError::Invalid => "invalid_msgpack",
            WireError::BadEnvelope => "bad_envelope",
            WireError::Trailing => "trailing_bytes",
            WireError::TooDeep => "too_deep",
        }
    }
}

/// How an engine hash becomes kvroute's u64: unsigned integers as they are (vLLM), signed
/// integers by their two's-complement bits (SGLang: `-1` → `0xffff_ffff_ffff_ffff`), bytes
/// (vLLM with integer hashes off) and strings by XXH3-64 of their bytes with seed 0.
pub fn reduce_hash(raw: RawHash<'_>) -> u64 {
    match raw {
        RawHash::Unsigned(v) => v,
        RawHash::Signed(v) => v as u64,
        RawHash::Bytes(b) => xxhash_rust::xxh3::xxh3_64(b),
    }
}

/// A hash as it was on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawHash<'a> {
    Unsigned(u64),
    Signed(i64),
    Bytes(&'a [u8]),
}

/// Decodes one payload of engine `kind`.
pub fn decode_batch(kind: EngineKind, payload: &[u8]) -> Result<EngineBatch, WireError> {
    let mut r = Reader::new(payload);
    let mut batch = EngineBatch::default();
    match r.peek()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n < 2 {
                return Err(WireError::BadEnvelope);
            }
            batch.ts = r.number_or_nil()?.unwrap_or(0.0);
            read_events(kind, &mut r, &mut batch)?;
            if n >= 3 {
                batch.dp_rank = r.uint_or_nil()?.and_then(|v| u32::try_from(v).ok());
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Kind::Map => {
            let n = r.map_len()?;
            let mut saw_events = false;
            for _ in 0..n {
                match r.key()? {
                    Key::Str(b"ts") => batch.ts = r.number_or_nil()?.unwrap_or(0.0),
                    Key::Str(b"events") => {
                        read_events(kind, &mut r, &mut batch)?;
                        saw_events = true;
                    }
                    Key::Str(b"data_parallel_rank" | b"attn_dp_rank" | b"dp_rank") => {
                        batch.dp_rank = r.uint_or_nil()?.and_then(|v| u32::try_from(v).ok());
                    }
                    _ => r.skip()?,
                }
            }
            if !saw_events {
                return Err(WireError::BadEnvelope);
            }
        }
        _ => return Err(WireError::BadEnvelope),
    }
    if r.pos != payload.len() {
        return Err(WireError::Trailing);
    }
    Ok(batch)
}

fn read_events(
    kind: EngineKind,
    r: &mut Reader<'_>,
    batch: &mut EngineBatch,
) -> Result<(), WireError> {
    if r.peek()? != Kind::Array {
        return Err(WireError::BadEnvelope);
    }
    let n = r.array_len()?;
    batch.events.reserve(n.min(4096));
    for _ in 0..n {
        let start = r.pos;
        match read_event(kind, r) {
            Ok(Some(e)) => batch.events.push(e),
            Ok(None) => batch.skipped.push("unknown_event_type"),
            Err(EventError::Wire(e)) => return Err(e),
            Err(EventError::Shape(reason)) => {
                // Skip the whole event value, whatever was read of it.
                r.pos = start;
                r.skip()?;
                batch.skipped.push(reason);
            }
        }
    }
    Ok(())
}

enum EventError {
    /// The bytes themselves are broken: the batch cannot be read further.
    Wire(WireError),
    /// A well-formed value of the wrong shape: only this event is skipped.
    Shape(&'static str),
}

impl From<WireError> for EventError {
    fn from(e: WireError) -> Self {
        EventError::Wire(e)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

fn tag_of(s: &[u8]) -> Option<Tag> {
    match s {
        b"BlockStored" => Some(Tag::Stored),
        b"BlockRemoved" => Some(Tag::Removed),
        b"AllBlocksCleared" => Some(Tag::Cleared),
        _ => None,
    }
}

/// Field names of the positional (array) form, per engine, after the tag.
const VLLM_STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
];
const SGLANG_STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "cache_salt",
    "session_id",
    "lora_name",
];
const VLLM_REMOVED: &[&str] = &[
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];
const SGLANG_REMOVED: &[&str] = &["block_hashes", "medium"];

fn read_event(kind: EngineKind, r: &mut Reader<'_>) -> Result<Option<EngineEvent>, EventError> {
    match r.peek()? {
        Kind::Map => {
            // The tag may come anywhere: remember where the map starts, find `type`, then read
            // the fields knowing the variant.
            let start = r.pos;
            let n = r.map_len()?;
            let mut tag = None;
            for _ in 0..n {
                match r.key()? {
                    Key::Str(b"type") => {
                        let s = r
                            .str_bytes()
                            .map_err(|_| EventError::Shape("bad_type_tag"))?;
                        tag = Some(tag_of(s));
                    }
                    _ => r.skip()?,
                }
            }
            let Some(tag) = tag else {
                return Err(EventError::Shape("missing_type_tag"));
            };
            let Some(tag) = tag else { return Ok(None) };
            let end = r.pos;
            r.pos = start;
            let n = r.map_len()?;
            let mut fields = Fields::default();
            for _ in 0..n {
                let key = r.key()?;
                match key {
                    Key::Str(name) => fields.read(tag, name, r)?,
                    Key::Other => r.skip()?,
                }
            }
            debug_assert_eq!(r.pos, end);
            fields.finish(tag).map(Some)
        }
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return Err(EventError::Shape("empty_event"));
            }
            let s = r
                .str_bytes()
                .map_err(|_| EventError::Shape("bad_type_tag"))?;
            let Some(tag) = tag_of(s) else {
                for _ in 1..n {
                    r.skip()?;
                }
                return Ok(None);
            };
            let names: &[&str] = match (tag, kind) {
                (Tag::Stored, EngineKind::Vllm) => VLLM_STORED,
                (Tag::Stored, EngineKind::Sglang) => SGLANG_STORED,
                (Tag::Removed, EngineKind::Vllm) => VLLM_REMOVED,
                (Tag::Removed, EngineKind::Sglang) => SGLANG_REMOVED,
                (Tag::Cleared, _) => &[],
            };
            let mut fields = Fields::default();
            for i in 1..n {
                match names.get(i - 1) {
                    Some(name) => fields.read(tag, name.as_bytes(), r)?,
                    None => r.skip()?,
                }
            }
            fields.finish(tag).map(Some)
        }
        _ => Err(EventError::Shape("event_not_map_or_array")),
    }
}

/// What one event said, before it is checked.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    medium: Option<String>,
    extra_keys: Vec<Vec<u8>>,
    cache_salt: Option<String>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
    locality: Option<String>,
    /// `extra_keys` entries kept raw until `lora_name` is known (it may come later in a map).
    raw_extra: Option<Vec<Option<Vec<ExtraKey>>>>,
}

/// One element of a block's extra-keys tuple: its canonical bytes, and its text if a string.
struct ExtraKey {
    canon: Vec<u8>,
    text: Option<String>,
}

impl Fields {
    fn read(&mut self, tag: Tag, name: &[u8], r: &mut Reader<'_>) -> Result<(), EventError> {
        let shape = |reason| move |_| EventError::Shape(reason);
        match (tag, name) {
            (Tag::Stored | Tag::Removed, b"block_hashes") => {
                self.block_hashes = Some(r.hash_list().map_err(shape("bad_block_hashes"))?);
            }
            (Tag::Stored, b"parent_block_hash") => {
                self.parent = r.hash_or_nil().map_err(shape("bad_parent_block_hash"))?;
            }
            (Tag::Stored, b"token_ids") => {
                self.token_ids = r.token_list().map_err(shape("bad_token_ids"))?;
            }
            (Tag::Stored, b"block_size") => {
                let v = r
                    .uint_or_nil()
                    .map_err(shape("bad_block_size"))?
                    .unwrap_or(0);
                self.block_size =
                    u32::try_from(v).map_err(|_| EventError::Shape("bad_block_size"))?;
            }
            (Tag::Stored, b"lora_id") => {
                self.lora_id = r.int_or_nil().map_err(shape("bad_lora_id"))?
            }
            (Tag::Stored, b"lora_name") => {
                self.lora_name = r.str_or_nil().map_err(shape("bad_lora_name"))?
            }
            (Tag::Stored, b"cache_salt") => {
                self.cache_salt = r.str_or_nil().map_err(shape("bad_cache_salt"))?
            }
            (Tag::Stored, b"kv_cache_spec_kind") => {
                self.kv_cache_spec_kind =
                    r.str_or_nil().map_err(shape("bad_kv_cache_spec_kind"))?;
            }
            (Tag::Stored, b"extra_keys") => {
                self.raw_extra = r.extra_keys().map_err(shape("bad_extra_keys"))?;
            }
            (Tag::Stored | Tag::Removed, b"medium") => {
                self.medium = r.str_or_nil().map_err(shape("bad_medium"))?
            }
            (Tag::Stored | Tag::Removed, b"group_idx") => {
                self.group_idx = r.int_or_nil().map_err(shape("bad_group_idx"))?;
            }
            (Tag::Stored | Tag::Removed, b"locality") => {
                self.locality = r.str_or_nil().map_err(shape("bad_locality"))?;
            }
            _ => r.skip()?,
        }
        Ok(())
    }

    fn finish(mut self, tag: Tag) -> Result<EngineEvent, EventError> {
        match tag {
            Tag::Cleared => Ok(EngineEvent::AllCleared),
            Tag::Removed => Ok(EngineEvent::Removed(Removed {
                block_hashes: self
                    .block_hashes
                    .ok_or(EventError::Shape("missing_block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
            })),
            Tag::Stored => {
                let block_hashes = self
                    .block_hashes
                    .ok_or(EventError::Shape("missing_block_hashes"))?;
                if let Some(raw) = self.raw_extra.take() {
                    if !raw.is_empty() && raw.len() != block_hashes.len() {
                        return Err(EventError::Shape("extra_keys_length"));
                    }
                    let lora = self.lora_name.as_deref();
                    let mut any = false;
                    let folded: Vec<Vec<u8>> = raw
                        .into_iter()
                        .map(|keys| {
                            let mut out = Vec::new();
                            for (i, key) in keys.into_iter().flatten().enumerate() {
                                // The LoRA name leads the tuple when the event has one; it is
                                // already the hash seed.
                                if i == 0 && lora.is_some() && key.text.as_deref() == lora {
                                    continue;
                                }
                                out.extend_from_slice(&key.canon);
                            }
                            any |= !out.is_empty();
                            out
                        })
                        .collect();
                    if any {
                        self.extra_keys = folded;
                    }
                }
                Ok(EngineEvent::Stored(Stored {
                    block_hashes,
                    parent_block_hash: self.parent,
                    token_ids: self.token_ids,
                    block_size: self.block_size,
                    lora_id: self.lora_id,
                    lora_name: self.lora_name.filter(|n| !n.is_empty()),
                    medium: self.medium,
                    extra_keys: self.extra_keys,
                    cache_salt: self.cache_salt.filter(|s| !s.is_empty()),
                    group_idx: self.group_idx,
                    kv_cache_spec_kind: self.kv_cache_spec_kind,
                    locality: self.locality,
                }))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A minimal MessagePack reader: exactly what the formats above need, no allocation but the
// values kept.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
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

enum Key<'a> {
    Str(&'a [u8]),
    Other,
}

/// Deepest nesting [`Reader::skip`] follows (extra keys are tuples of tuples at most).
const MAX_DEPTH: u32 = 32;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn byte(&mut self) -> Result<u8, WireError> {
        let b = *self.buf.get(self.pos).ok_or(WireError::Truncated)?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, WireError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| acc << 8 | u64::from(*b)))
    }

    fn peek(&self) -> Result<Kind, WireError> {
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

    fn is_nil(&mut self) -> Result<bool, WireError> {
        if self.peek()? == Kind::Nil {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn array_len(&mut self) -> Result<usize, WireError> {
        let b = self.byte()?;
        let n = match b {
            0x90..=0x9f => u64::from(b & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => return Err(WireError::BadEnvelope),
        };
        self.bounded_len(n, 1)
    }

    fn map_len(&mut self) -> Result<usize, WireError> {
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
    fn bounded_len(&self, n: u64, min_bytes_each: u64) -> Result<usize, WireError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes_each) > left {
            return Err(WireError::Truncated);
        }
        Ok(n as usize)
    }

    fn str_len(&mut self) -> Result<Option<usize>, WireError> {
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

    fn str_bytes(&mut self) -> Result<&'a [u8], WireError> {
        match self.str_len()? {
            Some(n) => self.take(n),
            None => Err(WireError::BadEnvelope),
        }
    }

    fn key(&mut self) -> Result<Key<'a>, WireError> {
        match self.str_len()? {
            Some(n) => Ok(Key::Str(self.take(n)?)),
            None => {
                self.skip()?;
                Ok(Key::Other)
            }
        }
    }

    fn str_or_nil(&mut self) -> Result<Option<String>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        let s = self.str_bytes()?;
        Ok(Some(String::from_utf8_lossy(s).into_owned()))
    }

    /// Any integer as a raw hash (sign kept).
    fn raw_int(&mut self) -> Result<RawHash<'a>, WireError> {
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

    fn hash(&mut self) -> Result<u64, WireError> {
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

    fn hash_or_nil(&mut self) -> Result<Option<u64>, WireError> {
        if self.is_nil()? {
            return Ok(None);
        }
        self.hash().map(Some)
    }

    fn hash_list(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn token_list(&mut self) -> Result<Vec<u32>, WireError> {
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

    fn uint_or_nil(&mut self) -> Result<Option<u64>, WireError> {
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

    fn int_or_nil(&mut self) -> Result<Option<i64>, WireError> {
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

    fn number_or_nil(&mut self) -> Result<Option<f64>, WireError> {
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

    fn bin_len(&mut self) -> Result<usize, WireError> {
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
    fn extra_keys(&mut self) -> Result<Option<Vec<Option<Vec<ExtraKey>>>>, WireError> {
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
    /// u32 LE count and the items; map (0x08): count and key, value pairs; ext (0x09): type,
    /// length, data. Two encoders' bytes for the same value therefore canonicalize alike.
    fn canon(&mut self, out: &mut Vec<u8>, depth: u32) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        match self.peek()? {
            Kind::Nil => {
                self.pos += 1;
                out.push(0x00);
            }
            Kind::Bool => {
                let b = self.byte()?;
                out.extend_from_slice(&[0x01, b & 1]);
            }
            Kind::Int => match self.raw_int()? {
                RawHash::Signed(v) if v < 0 => {
                    out.push(0x02);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                RawHash::Signed(v) => {
                    out.push(0x03);
                    out.extend_from_slice(&(v as u64).to_le_bytes());
                }
                RawHash::Unsigned(v) => {
                    out.push(0x03);
                    out.extend_from_slice(&v.to_le_bytes());
                }
                RawHash::Bytes(_) => {}
            },
            Kind::Float => {
                let v = self.number_or_nil()?.unwrap_or(0.0);
                out.push(0x04);
                out.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            Kind::Str => {
                let s = self.str_bytes()?;
                out.push(0x05);
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s);
            }
            Kind::Bin => {
                let n = self.bin_len()?;
                let s = self.take(n)?;
                out.push(0x06);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                out.extend_from_slice(s);
            }
            Kind::Array => {
                let n = self.array_len()?;
                out.push(0x07);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                for _ in 0..n {
                    self.canon(out, depth + 1)?;
                }
            }
            Kind::Map => {
                let n = self.map_len()?;
                out.push(0x08);
                out.extend_from_slice(&(n as u32).to_le_bytes());
                for _ in 0..2 * n {
                    self.canon(out, depth + 1)?;
                }
            }
            Kind::Ext => {
                let start = self.pos;
                self.skip()?;
                out.push(0x09);
                out.extend_from_slice(&((self.pos - start) as u32).to_le_bytes());
                out.extend_from_slice(&self.buf[start..self.pos]);
            }
        }
        Ok(())
    }

    /// Skips the next value, however nested (bounded).
    fn skip(&mut self) -> Result<(), WireError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<(), WireError> {
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

#[cfg(test)]
mod tests;
