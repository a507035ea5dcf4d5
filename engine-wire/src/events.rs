//! The engines' KV-event batches (PROTOCOL.md, "Engine events"): a ZMQ message is `[topic, seq
//! (8-byte big-endian), payload]`; the payload is MessagePack of a batch, `[ts, events,
//! dp_rank]` (positional) or a map with the [`batch`] keys. An event is a map tagged by
//! [`TYPE`] or a positional array whose first slot is the tag and whose other slots follow
//! [`slots`].
//!
//! Versions: vLLM 0.32 and 0.34 (0.34's `BlockStored` adds `lookahead_token_ids`), SGLang
//! 0.5.23. The names and orders are the engines' (vllm/distributed/kv_events.py,
//! sglang/srt/disaggregation/kv_events.py).

use crate::EngineKind;

/// The keys of a batch written as a map.
pub mod batch {
    pub const TS: &str = "ts";
    pub const EVENTS: &str = "events";
    /// vLLM's rank key.
    pub const VLLM_RANK: &str = "data_parallel_rank";
    /// SGLang's rank key.
    pub const SGLANG_RANK: &str = "attn_dp_rank";
    /// The generic rank key some publishers write.
    pub const RANK: &str = "dp_rank";
}

/// The key of an event map's tag.
pub const TYPE: &str = "type";

/// An event's tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventTag {
    Stored,
    Removed,
    Cleared,
}

impl EventTag {
    pub const ALL: [EventTag; 3] = [EventTag::Stored, EventTag::Removed, EventTag::Cleared];

    /// The tag as the engines write it.
    pub const fn name(self) -> &'static str {
        match self {
            EventTag::Stored => "BlockStored",
            EventTag::Removed => "BlockRemoved",
            EventTag::Cleared => "AllBlocksCleared",
        }
    }

    /// The tag a name means (`None`: an event type kvroute does not know).
    pub fn from_name(name: &[u8]) -> Option<Self> {
        match name {
            b"BlockStored" => Some(EventTag::Stored),
            b"BlockRemoved" => Some(EventTag::Removed),
            b"AllBlocksCleared" => Some(EventTag::Cleared),
            _ => None,
        }
    }
}

/// An event field either engine writes (kvroute reads some; the others are named so that the
/// positional form's slots can be).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    KvCacheSpecSlidingWindow,
    Locality,
    Ownership,
    SessionId,
    /// vLLM 0.34: per block, the tokens after it that its hash also covers.
    LookaheadTokenIds,
    /// SGLang's cache salt.
    CacheSalt,
}

impl Field {
    pub const ALL: [Field; 16] = [
        Field::BlockHashes,
        Field::ParentBlockHash,
        Field::TokenIds,
        Field::BlockSize,
        Field::LoraId,
        Field::Medium,
        Field::LoraName,
        Field::ExtraKeys,
        Field::GroupIdx,
        Field::KvCacheSpecKind,
        Field::KvCacheSpecSlidingWindow,
        Field::Locality,
        Field::Ownership,
        Field::SessionId,
        Field::LookaheadTokenIds,
        Field::CacheSalt,
    ];

    /// The field's name as the engines write it.
    pub const fn name(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::ParentBlockHash => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::LoraId => "lora_id",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::KvCacheSpecKind => "kv_cache_spec_kind",
            Field::KvCacheSpecSlidingWindow => "kv_cache_spec_sliding_window",
            Field::Locality => "locality",
            Field::Ownership => "ownership",
            Field::SessionId => "session_id",
            Field::LookaheadTokenIds => "lookahead_token_ids",
            Field::CacheSalt => "cache_salt",
        }
    }

    /// The field a name means (`None`: a field kvroute does not know).
    pub fn from_name(name: &[u8]) -> Option<Self> {
        Some(match name {
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::ParentBlockHash,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::KvCacheSpecKind,
            b"kv_cache_spec_sliding_window" => Field::KvCacheSpecSlidingWindow,
            b"locality" => Field::Locality,
            b"ownership" => Field::Ownership,
            b"session_id" => Field::SessionId,
            b"lookahead_token_ids" => Field::LookaheadTokenIds,
            b"cache_salt" => Field::CacheSalt,
            _ => return None,
        })
    }
}

const VLLM_STORED: &[Field] = &[
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
    Field::Locality,
    Field::Ownership,
    Field::SessionId,
    // vLLM 0.34.
    Field::LookaheadTokenIds,
];
const SGLANG_STORED: &[Field] = &[
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::CacheSalt,
    Field::SessionId,
    Field::LoraName,
];
const VLLM_REMOVED: &[Field] = &[
    Field::BlockHashes,
    Field::Medium,
    Field::GroupIdx,
    Field::Locality,
    Field::Ownership,
];
const SGLANG_REMOVED: &[Field] = &[Field::BlockHashes, Field::Medium];

/// The slots of engine `kind`'s positional form of a `tag` event, after the tag: its struct's
/// fields in declaration order. Writers leave trailing slots out; readers ignore extra ones.
pub fn slots(kind: EngineKind, tag: EventTag) -> &'static [Field] {
    match (tag, kind) {
        (EventTag::Stored, EngineKind::Vllm) => VLLM_STORED,
        (EventTag::Stored, EngineKind::Sglang) => SGLANG_STORED,
        (EventTag::Removed, EngineKind::Vllm) => VLLM_REMOVED,
        (EventTag::Removed, EngineKind::Sglang) => SGLANG_REMOVED,
        (EventTag::Cleared, _) => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back() {
        for tag in EventTag::ALL {
            assert_eq!(EventTag::from_name(tag.name().as_bytes()), Some(tag));
        }
        for field in Field::ALL {
            assert_eq!(Field::from_name(field.name().as_bytes()), Some(field));
        }
        assert_eq!(EventTag::from_name(b"BlockMoved"), None);
        assert_eq!(Field::from_name(b"Medium"), None);
    }

    #[test]
    fn slots_name_each_field_once_and_lead_with_the_hashes() {
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            for tag in [EventTag::Stored, EventTag::Removed] {
                let s = slots(kind, tag);
                assert_eq!(s[0], Field::BlockHashes);
                for (i, f) in s.iter().enumerate() {
                    assert!(!s[..i].contains(f), "{kind} {tag:?}: {f:?} twice");
                }
            }
        }
    }
}
