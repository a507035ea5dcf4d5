//! One-pass deserialization of [`KvEventData`] (the tag may come anywhere in the map; unknown
//! fields are ignored; missing optional fields default), equivalent to the derived internally
//! tagged form but without buffering.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::{KvEventData, StorageTier, StoredBlock};
use crate::hashing::SequenceHash;

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Type,
    ParentHash,
    Blocks,
    BlockHashes,
    Tier,
    #[serde(other)]
    Other,
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = KvEventData;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a KV event: a map with a `type` of stored, removed or cleared")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEventData, A::Error> {
        let mut kind: Option<Kind> = None;
        let mut parent_hash: Option<Option<SequenceHash>> = None;
        let mut blocks: Option<Vec<StoredBlock>> = None;
        let mut block_hashes: Option<Vec<SequenceHash>> = None;
        let mut tier: Option<StorageTier> = None;
        while let Some(field) = map.next_key::<Field>()? {
            match field {
                Field::Type => kind = Some(map.next_value()?),
                Field::ParentHash => parent_hash = Some(map.next_value()?),
                Field::Blocks => blocks = Some(map.next_value()?),
                Field::BlockHashes => block_hashes = Some(map.next_value()?),
                Field::Tier => tier = Some(map.next_value()?),
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match kind.ok_or_else(|| de::Error::missing_field("type"))? {
            Kind::Stored => Ok(KvEventData::Stored {
                parent_hash: parent_hash.flatten(),
                blocks: blocks.ok_or_else(|| de::Error::missing_field("blocks"))?,
                tier: tier.unwrap_or_default(),
            }),
            Kind::Removed => Ok(KvEventData::Removed {
                block_hashes: block_hashes
                    .ok_or_else(|| de::Error::missing_field("block_hashes"))?,
                tier: tier.unwrap_or_default(),
            }),
            Kind::Cleared => Ok(KvEventData::Cleared),
        }
    }
}

impl<'de> Deserialize<'de> for KvEventData {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(EventVisitor)
    }
}
