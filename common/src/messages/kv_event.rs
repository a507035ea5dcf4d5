//! KV-cache events: what a worker stored or evicted. The indexer's only input.

use serde::{Deserialize, Serialize};

use super::{SchemaVersion, TimestampMs};
use crate::codec::WireMessage;
use crate::hashing::{LocalBlockHash, SequenceHash};
use crate::ids::{DpRank, WorkerId};

/// A batch of events from one (worker, dp rank), published on `kvroute.<ns>.kv.events.<worker>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvEventBatch {
    #[serde(default)]
    pub v: SchemaVersion,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    pub events: Vec<KvEvent>,
    /// When the batch was published (ms since the Unix epoch); informational.
    #[serde(default)]
    pub ts: TimestampMs,
}

impl WireMessage for KvEventBatch {
    const NAME: &'static str = "KvEventBatch";
    const SUPPORTED_VERSION: SchemaVersion = SHARED_TIER_VERSION;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// One event. `event_id` increases by exactly one per (worker, dp rank); a jump is a gap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvEvent {
    pub event_id: u64,
    pub data: KvEventData,
}

/// What happened. Internally tagged: `{"type": "stored", ...}`.
///
/// Deserialization is hand-written (`de_event.rs`): serde's derive for internally tagged enums
/// buffers every field before choosing the variant, which made decoding the indexer's most
/// expensive step; the hand-written visitor reads the fields in one pass, in any order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEventData {
    /// Blocks stored as a chain under `parent_hash` (absent: the chain starts the prompt).
    Stored {
        #[serde(default)]
        parent_hash: Option<SequenceHash>,
        blocks: Vec<StoredBlock>,
        #[serde(default)]
        tier: StorageTier,
    },
    /// Blocks evicted, named by their `block_hash` (sequence hash).
    Removed {
        block_hashes: Vec<SequenceHash>,
        #[serde(default)]
        tier: StorageTier,
    },
    /// Every block of this (worker, dp rank) is gone.
    Cleared,
}

impl KvEventData {
    /// Blocks the event names (stored or removed; 0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match self {
            KvEventData::Stored { blocks, .. } => blocks.len(),
            KvEventData::Removed { block_hashes, .. } => block_hashes.len(),
            KvEventData::Cleared => 0,
        }
    }
}

/// One stored block: the engine's opaque sequence hash and the block's local (tokens) hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    pub block_hash: SequenceHash,
    pub tokens_hash: LocalBlockHash,
}

/// Where a block lives. Routing prefers device blocks; host and disk blocks are cheaper to
/// load than to recompute. `Shared` is a tier outside the worker (LMCache, a remote store)
/// that any worker of the model can load from: the worker announcing it wrote the block there.
///
/// Tiers are ordered best first (`Device < Host < Disk < Shared`); the index credits each
/// leading block in the best tier holding it. A batch carrying a `Shared` event is stamped
/// `v` = [`SHARED_TIER_VERSION`], so that readers older than the tier refuse it as
/// `unsupported_version` instead of as malformed.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    #[default]
    Device,
    Host,
    Disk,
    Shared,
}

/// The `KvEventBatch` schema version that introduced [`StorageTier::Shared`]: a batch naming
/// that tier carries it; every other batch keeps `v` = 1, which older readers accept.
pub const SHARED_TIER_VERSION: SchemaVersion = SchemaVersion(2);

impl StorageTier {
    /// Every tier, best first.
    pub const ALL: [StorageTier; 4] = [
        StorageTier::Device,
        StorageTier::Host,
        StorageTier::Disk,
        StorageTier::Shared,
    ];

    pub fn index(self) -> usize {
        self as usize
    }
}

impl KvEventData {
    /// The tier the event names (`Cleared` names none).
    pub fn tier(&self) -> Option<StorageTier> {
        match self {
            KvEventData::Stored { tier, .. } | KvEventData::Removed { tier, .. } => Some(*tier),
            KvEventData::Cleared => None,
        }
    }
}

impl KvEventBatch {
    /// The lowest schema version whose readers understand these events: 1, or
    /// [`SHARED_TIER_VERSION`] when an event names the shared tier. Writers stamp `v` with it.
    pub fn required_version(events: &[KvEvent]) -> SchemaVersion {
        if events
            .iter()
            .any(|e| e.data.tier() == Some(StorageTier::Shared))
        {
            SHARED_TIER_VERSION
        } else {
            SchemaVersion::CURRENT
        }
    }
}

/// A record the indexer leader appends to the event log on `kvroute.<ns>.kv.control`, so that
/// every replica acts on it at the same position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRecord {
    #[serde(default)]
    pub v: SchemaVersion,
    pub action: ControlAction,
    /// The replica that appended it (informational).
    #[serde(default)]
    pub replica_id: String,
    /// The leader term that appended it: the create revision of the indexer leader key
    /// (0: written before terms existed). Readers ignore a record whose term is below the
    /// newest term already seen in the log.
    #[serde(default)]
    pub term: u64,
    /// The appending leader's wall clock when it appended the record, in ms since the Unix
    /// epoch (0: unknown). Part of the log, so every replica reads the same value.
    #[serde(default)]
    pub at_ms: u64,
}

impl WireMessage for ControlRecord {
    const NAME: &'static str = "ControlRecord";
    const MAX_BYTES: usize = 64 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// What the control record does. Internally tagged: `{"type": "worker_removed", ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ControlAction {
    /// The worker left (lease expired, deregistered, or never registered): drop everything it
    /// held, and ignore its events until it starts a new incarnation (event 0 = `Cleared`).
    WorkerRemoved { worker_id: WorkerId },
}
