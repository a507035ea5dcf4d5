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
//!
//! Versions: vLLM 0.32 and 0.34 (0.34's `BlockStored` adds `lookahead_token_ids`: with hash
//! lookahead on, each block's hash also covers that many tokens after the block, one list per
//! block), SGLang 0.5.23. The field names and slot orders are the engines' vocabulary
//! (`kvroute_engine_wire::events`, shared with the mocker's impersonated engines).

use kvroute_engine_wire::EngineKind;
use kvroute_engine_wire::events::{EventTag as Tag, Field, TYPE, batch as batch_keys, slots};

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
    /// vLLM 0.34: per block, the tokens after it that its hash also covers (empty when the
    /// engine hashes without lookahead). Either empty or one entry per block.
    pub lookahead_token_ids: Vec<Vec<u32>>,
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
                    Key::Str(k) if k == batch_keys::TS.as_bytes() => {
                        batch.ts = r.number_or_nil()?.unwrap_or(0.0)
                    }
                    Key::Str(k) if k == batch_keys::EVENTS.as_bytes() => {
                        read_events(kind, &mut r, &mut batch)?;
                        saw_events = true;
                    }
                    Key::Str(k)
                        if [
                            batch_keys::VLLM_RANK,
                            batch_keys::SGLANG_RANK,
                            batch_keys::RANK,
                        ]
                        .iter()
                        .any(|name| k == name.as_bytes()) =>
                    {
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

fn read_event(kind: EngineKind, r: &mut Reader<'_>) -> Result<Option<EngineEvent>, EventError> {
    match r.peek()? {
        Kind::Map => {
            let start = r.pos;
            let n = r.map_len()?;
            // The engines' encoder (msgspec) writes the tag first: then one pass reads it all.
            if n > 0 {
                let after_len = r.pos;
                if matches!(r.key()?, Key::Str(k) if k == TYPE.as_bytes()) {
                    let s = r
                        .str_bytes()
                        .map_err(|_| EventError::Shape("bad_type_tag"))?;
                    let Some(tag) = Tag::from_name(s) else {
                        for _ in 1..n {
                            r.skip()?;
                            r.skip()?;
                        }
                        return Ok(None);
                    };
                    let mut fields = Fields::default();
                    for _ in 1..n {
                        match r.key()? {
                            Key::Str(name) => fields.read(tag, Field::from_name(name), r)?,
                            Key::Other => r.skip()?,
                        }
                    }
                    return fields.finish(tag).map(Some);
                }
                r.pos = after_len;
            }
            // Elsewhere the tag may come anywhere: find `type`, then read the fields knowing
            // the variant.
            r.pos = start;
            let n = r.map_len()?;
            let mut tag = None;
            for _ in 0..n {
                match r.key()? {
                    Key::Str(k) if k == TYPE.as_bytes() => {
                        let s = r
                            .str_bytes()
                            .map_err(|_| EventError::Shape("bad_type_tag"))?;
                        tag = Some(Tag::from_name(s));
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
                    Key::Str(name) => fields.read(tag, Field::from_name(name), r)?,
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
            let Some(tag) = Tag::from_name(s) else {
                for _ in 1..n {
                    r.skip()?;
                }
                return Ok(None);
            };
            let names = slots(kind, tag);
            let mut fields = Fields::default();
            for i in 1..n {
                match names.get(i - 1) {
                    Some(&field) => fields.read(tag, Some(field), r)?,
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
    lookahead: Option<Vec<Vec<u32>>>,
}

impl Fields {
    /// Reads the value of `field` (`None`: a field kvroute does not know, skipped).
    fn read(
        &mut self,
        tag: Tag,
        field: Option<Field>,
        r: &mut Reader<'_>,
    ) -> Result<(), EventError> {
        let shape = |reason| move |_| EventError::Shape(reason);
        let Some(field) = field else {
            return r.skip().map_err(EventError::Wire);
        };
        match (tag, field) {
            (Tag::Stored | Tag::Removed, Field::BlockHashes) => {
                self.block_hashes = Some(r.hash_list().map_err(shape("bad_block_hashes"))?);
            }
            (Tag::Stored, Field::ParentBlockHash) => {
                self.parent = r.hash_or_nil().map_err(shape("bad_parent_block_hash"))?;
            }
            (Tag::Stored, Field::TokenIds) => {
                self.token_ids = r.token_list().map_err(shape("bad_token_ids"))?;
            }
            (Tag::Stored, Field::BlockSize) => {
                let v = r
                    .uint_or_nil()
                    .map_err(shape("bad_block_size"))?
                    .unwrap_or(0);
                self.block_size =
                    u32::try_from(v).map_err(|_| EventError::Shape("bad_block_size"))?;
            }
            (Tag::Stored, Field::LoraId) => {
                self.lora_id = r.int_or_nil().map_err(shape("bad_lora_id"))?
            }
            (Tag::Stored, Field::LoraName) => {
                self.lora_name = r.str_or_nil().map_err(shape("bad_lora_name"))?
            }
            (Tag::Stored, Field::CacheSalt) => {
                self.cache_salt = r.str_or_nil().map_err(shape("bad_cache_salt"))?
            }
            (Tag::Stored, Field::KvCacheSpecKind) => {
                self.kv_cache_spec_kind =
                    r.str_or_nil().map_err(shape("bad_kv_cache_spec_kind"))?;
            }
            (Tag::Stored, Field::ExtraKeys) => {
                self.raw_extra = r.extra_keys().map_err(shape("bad_extra_keys"))?;
            }
            (Tag::Stored, Field::LookaheadTokenIds) => {
                self.lookahead = r.token_lists().map_err(shape("bad_lookahead_token_ids"))?;
            }
            (Tag::Stored | Tag::Removed, Field::Medium) => {
                self.medium = r.str_or_nil().map_err(shape("bad_medium"))?
            }
            (Tag::Stored | Tag::Removed, Field::GroupIdx) => {
                self.group_idx = r.int_or_nil().map_err(shape("bad_group_idx"))?;
            }
            (Tag::Stored | Tag::Removed, Field::Locality) => {
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
                let lookahead = self.lookahead.take().unwrap_or_default();
                if !lookahead.is_empty() && lookahead.len() != block_hashes.len() {
                    return Err(EventError::Shape("lookahead_length"));
                }
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
                    lookahead_token_ids: lookahead,
                }))
            }
        }
    }
}

mod reader;

use reader::{ExtraKey, Key, Kind, Reader};

#[cfg(test)]
mod tests;
