//! kvroute's KV events written as vLLM's or SGLang's publisher writes them: the MessagePack
//! payload of one ZMQ message, `[ts, events, dp_rank]` (both engines' `EventBatch` is
//! `array_like`, and their `ZmqEventPublisher.publish` always stamps the rank).
//!
//! Events follow msgspec's rules for the engines' structs (vllm/distributed/kv_events.py and
//! sglang/srt/disaggregation/kv_events.py): tagged maps with `type` first, then the fields in
//! declaration order; fields without a default always present (nil when unset), fields with a
//! `None` default omitted when unset. What the engines' caches put in them:
//! - vLLM 0.32 (`BlockPool`): one `BlockStored` per newly cached run, with `extra_keys` (one nil
//!   per block for a plain prompt) and `group_idx` 0; one `BlockRemoved` per evicted block;
//!   block hashes are u64.
//! - SGLang 0.5 (`KVCacheEventRecorder`): stores and removes coalesced into one event per run,
//!   `lora_id` nil, `medium` set; block hashes are signed 64-bit.
//!
//! [`EventFormat::Arrays`] writes the older tagged positional form instead: the tag, then each
//! field in its slot of the engine's order (`kvroute_engine_wire::events::slots`), nil in the
//! slots before it that are unset: vLLM `[block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, lora_name]`, SGLang every slot of its struct.
//!
//! The names, slot orders and media are the bridge's own (`kvroute_engine_wire`), so what this
//! writes is what the bridge reads (bridge/tests/engine_wire.rs).

use kvroute_common::hashing::SequenceHash;
use kvroute_common::messages::{KvEventData, StorageTier};
use kvroute_engine_wire::events::{EventTag, Field, TYPE, slots};
use kvroute_engine_wire::media::{self, REMOTE};
use rmpv::Value;

use super::config::{EngineKind, EventFormat};

/// A stored block whose tokens the writer was not given (a bug in the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no tokens known for stored block {block_hash:#018x}")]
pub struct MissingTokens {
    pub block_hash: SequenceHash,
}

/// Writes one engine's events for one block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventWriter {
    pub engine: EngineKind,
    pub format: EventFormat,
    pub block_size: u32,
}

impl EventWriter {
    /// The engine events saying what `event` says. `tokens(block_hash)` gives a stored block's
    /// `block_size` token ids and the LoRA adapter it was computed under (a stored run is one
    /// request's: its first block's adapter is the event's `lora_name`).
    pub fn events<'t>(
        &self,
        event: &KvEventData,
        tokens: impl Fn(SequenceHash) -> Option<(&'t [u32], Option<&'t str>)>,
    ) -> Result<Vec<Value>, MissingTokens> {
        Ok(match event {
            KvEventData::Stored {
                parent_hash,
                blocks,
                tier,
            } => {
                let mut token_ids = Vec::with_capacity(blocks.len() * self.block_size as usize);
                let mut lora = None;
                for (i, b) in blocks.iter().enumerate() {
                    let (t, adapter) = tokens(b.block_hash).ok_or(MissingTokens {
                        block_hash: b.block_hash,
                    })?;
                    if i == 0 {
                        lora = adapter;
                    }
                    token_ids.extend(t.iter().map(|&t| Value::from(t)));
                }
                let hashes = blocks.iter().map(|b| self.hash(b.block_hash)).collect();
                let parent = parent_hash.map(|h| self.hash(h));
                vec![self.stored(hashes, parent, token_ids, *tier, lora)]
            }
            KvEventData::Removed { block_hashes, tier } => match self.engine {
                // vLLM's block pool reports each evicted block on its own.
                EngineKind::Vllm => block_hashes
                    .iter()
                    .map(|&h| self.removed(vec![self.hash(h)], *tier))
                    .collect(),
                EngineKind::Sglang => {
                    vec![self.removed(block_hashes.iter().map(|&h| self.hash(h)).collect(), *tier)]
                }
            },
            KvEventData::Cleared => vec![self.tagged(EventTag::Cleared, Vec::new())],
        })
    }

    /// The payload of one ZMQ message: `[ts, events, dp_rank]`.
    pub fn batch(&self, ts: f64, events: Vec<Value>, dp_rank: u32) -> Vec<u8> {
        let batch = Value::Array(vec![
            Value::F64(ts),
            Value::Array(events),
            Value::from(dp_rank),
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
        out
    }

    /// The engine's form of a block hash: vLLM's are unsigned, SGLang's signed 64-bit.
    pub fn hash(&self, h: SequenceHash) -> Value {
        match self.engine {
            EngineKind::Vllm => Value::from(h),
            EngineKind::Sglang => Value::from(h as i64),
        }
    }

    /// The engine's `medium` string for a tier. vLLM has no shared medium: its network-backed
    /// offload tiers say `STORAGE` with `locality: "REMOTE"` ([`Self::remote`]).
    pub fn medium(&self, tier: StorageTier) -> &'static str {
        media::medium_of(self.engine, tier)
    }

    /// Whether an event of `tier` carries vLLM's `locality: "REMOTE"`.
    fn remote(&self, tier: StorageTier) -> bool {
        media::remote_locality(self.engine, tier)
    }

    fn stored(
        &self,
        hashes: Vec<Value>,
        parent: Option<Value>,
        token_ids: Vec<Value>,
        tier: StorageTier,
        lora: Option<&str>,
    ) -> Value {
        let blocks = hashes.len();
        let lora_name = lora.map_or(Value::Nil, Value::from);
        let mut fields = vec![
            (Field::BlockHashes, Value::Array(hashes)),
            (Field::ParentBlockHash, parent.unwrap_or(Value::Nil)),
            (Field::TokenIds, Value::Array(token_ids)),
            (Field::BlockSize, Value::from(self.block_size)),
            (Field::LoraId, Value::Nil),
            (Field::Medium, Value::from(self.medium(tier))),
        ];
        match (self.engine, self.format) {
            (EngineKind::Vllm, EventFormat::Maps) => fields.extend([
                (Field::LoraName, lora_name),
                (Field::ExtraKeys, Value::Array(vec![Value::Nil; blocks])),
                (Field::GroupIdx, Value::from(0)),
            ]),
            (EngineKind::Vllm, EventFormat::Arrays) => fields.push((Field::LoraName, lora_name)),
            // cache_salt, session_id and lora_name default to None: omitted from maps when
            // unset.
            (EngineKind::Sglang, EventFormat::Maps) => {
                if !lora_name.is_nil() {
                    fields.push((Field::LoraName, lora_name));
                }
            }
            (EngineKind::Sglang, EventFormat::Arrays) => fields.extend([
                (Field::CacheSalt, Value::Nil),
                (Field::SessionId, Value::Nil),
                (Field::LoraName, lora_name),
            ]),
        }
        if self.remote(tier) {
            fields.push((Field::Locality, Value::from(REMOTE)));
        }
        self.tagged(EventTag::Stored, fields)
    }

    fn removed(&self, hashes: Vec<Value>, tier: StorageTier) -> Value {
        let mut fields = vec![
            (Field::BlockHashes, Value::Array(hashes)),
            (Field::Medium, Value::from(self.medium(tier))),
        ];
        if (self.engine, self.format) == (EngineKind::Vllm, EventFormat::Maps) {
            fields.push((Field::GroupIdx, Value::from(0)));
        }
        if self.remote(tier) {
            fields.push((Field::Locality, Value::from(REMOTE)));
        }
        self.tagged(EventTag::Removed, fields)
    }

    /// The event: a map of `fields` in their order after the tag, or the tag then each field
    /// in its slot of the engine's order, nil in the unset slots before the last one written.
    fn tagged(&self, tag: EventTag, fields: Vec<(Field, Value)>) -> Value {
        match self.format {
            EventFormat::Maps => {
                let mut map = vec![(Value::from(TYPE), Value::from(tag.name()))];
                map.extend(fields.into_iter().map(|(k, v)| (Value::from(k.name()), v)));
                Value::Map(map)
            }
            EventFormat::Arrays => {
                let order = slots(self.engine, tag);
                let slot_of = |field: Field| {
                    order
                        .iter()
                        .position(|&f| f == field)
                        .expect("the engine's struct has every field written")
                };
                let len = fields.iter().map(|&(f, _)| slot_of(f) + 1).max();
                let mut values = vec![Value::Nil; len.unwrap_or(0)];
                for (field, value) in fields {
                    values[slot_of(field)] = value;
                }
                let mut out = vec![Value::from(tag.name())];
                out.extend(values);
                Value::Array(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_common::messages::StoredBlock;

    fn writer(engine: EngineKind, format: EventFormat) -> EventWriter {
        EventWriter {
            engine,
            format,
            block_size: 2,
        }
    }

    fn stored() -> KvEventData {
        KvEventData::Stored {
            parent_hash: None,
            blocks: vec![
                StoredBlock {
                    block_hash: 1,
                    tokens_hash: 11,
                },
                StoredBlock {
                    block_hash: u64::MAX,
                    tokens_hash: 12,
                },
            ],
            tier: StorageTier::Device,
        }
    }

    fn tokens(h: SequenceHash) -> Option<(&'static [u32], Option<&'static str>)> {
        match h {
            1 => Some((&[5, 6], None)),
            u64::MAX => Some((&[7, 8], None)),
            _ => None,
        }
    }

    fn keys(v: &Value) -> Vec<&str> {
        v.as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap())
            .collect()
    }

    fn field<'v>(v: &'v Value, name: &str) -> &'v Value {
        &v.as_map()
            .unwrap()
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .unwrap()
            .1
    }

    #[test]
    fn vllm_maps_carry_required_nils_and_its_cache_fields() {
        let w = writer(EngineKind::Vllm, EventFormat::Maps);
        let e = &w.events(&stored(), tokens).unwrap()[0];
        assert_eq!(
            keys(e),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx"
            ]
        );
        assert_eq!(field(e, "type").as_str(), Some("BlockStored"));
        assert!(field(e, "parent_block_hash").is_nil() && field(e, "lora_id").is_nil());
        assert_eq!(
            field(e, "block_hashes").as_array().unwrap()[1].as_u64(),
            Some(u64::MAX)
        );
        let ids: Vec<u64> = field(e, "token_ids")
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(ids, [5, 6, 7, 8]);
        assert_eq!(field(e, "extra_keys"), &Value::Array(vec![Value::Nil; 2]));
        let removed = w
            .events(
                &KvEventData::Removed {
                    block_hashes: vec![1, 2],
                    tier: StorageTier::Host,
                },
                tokens,
            )
            .unwrap();
        assert_eq!(removed.len(), 2, "one BlockRemoved per block");
        assert_eq!(
            keys(&removed[1]),
            ["type", "block_hashes", "medium", "group_idx"]
        );
        assert_eq!(field(&removed[1], "medium").as_str(), Some("CPU"));
        let cleared = w.events(&KvEventData::Cleared, tokens).unwrap();
        assert_eq!(keys(&cleared[0]), ["type"]);
    }

    #[test]
    fn sglang_maps_omit_unset_optionals_and_sign_hashes() {
        let w = writer(EngineKind::Sglang, EventFormat::Maps);
        let e = &w.events(&stored(), tokens).unwrap()[0];
        assert_eq!(
            keys(e),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium"
            ]
        );
        assert_eq!(
            field(e, "block_hashes").as_array().unwrap()[1].as_i64(),
            Some(-1)
        );
        let removed = w
            .events(
                &KvEventData::Removed {
                    block_hashes: vec![1, 2],
                    tier: StorageTier::Disk,
                },
                tokens,
            )
            .unwrap();
        assert_eq!(removed.len(), 1, "one BlockRemoved per run");
        assert_eq!(field(&removed[0], "medium").as_str(), Some("DISK"));
    }

    #[test]
    fn arrays_put_the_tag_first_and_every_slot() {
        let v = writer(EngineKind::Vllm, EventFormat::Arrays);
        let e = v.events(&stored(), tokens).unwrap().remove(0);
        let slots = e.as_array().unwrap();
        assert_eq!(slots.len(), 8);
        assert_eq!(slots[0].as_str(), Some("BlockStored"));
        assert_eq!(slots[4].as_u64(), Some(2));
        assert_eq!(slots[6].as_str(), Some("GPU"));
        assert!(slots[7].is_nil());
        let s = writer(EngineKind::Sglang, EventFormat::Arrays);
        let e = s.events(&stored(), tokens).unwrap().remove(0);
        assert_eq!(e.as_array().unwrap().len(), 10);
        let r = s
            .events(
                &KvEventData::Removed {
                    block_hashes: vec![3],
                    tier: StorageTier::Device,
                },
                tokens,
            )
            .unwrap()
            .remove(0);
        assert_eq!(
            r,
            Value::Array(vec![
                "BlockRemoved".into(),
                Value::Array(vec![3.into()]),
                "GPU".into()
            ])
        );
    }

    #[test]
    fn batches_are_positional_with_the_rank() {
        let w = writer(EngineKind::Vllm, EventFormat::Maps);
        let bytes = w.batch(1.5, vec![Value::from(1)], 3);
        let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        assert_eq!(
            v,
            Value::Array(vec![
                Value::F64(1.5),
                Value::Array(vec![1.into()]),
                3.into()
            ])
        );
        assert_eq!(
            bytes[1], 0xcb,
            "ts is a float64, as msgspec writes Python floats"
        );
    }

    #[test]
    fn a_block_without_tokens_is_an_error() {
        let w = writer(EngineKind::Vllm, EventFormat::Maps);
        assert_eq!(
            w.events(&stored(), |_| None).unwrap_err(),
            MissingTokens { block_hash: 1 }
        );
    }
}
