//! What a worker says about itself: its card (in etcd) and its load (on NATS).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{SchemaVersion, TimestampMs};
use crate::codec::WireMessage;
use crate::ids::{DpRank, RequestId, WorkerId};

/// The role a worker plays in (dis)aggregated serving.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefill and decode on the same worker.
    #[default]
    Aggregated,
    Prefill,
    Decode,
    Encode,
}

impl WorkerRole {
    pub const ALL: [WorkerRole; 4] = [
        WorkerRole::Aggregated,
        WorkerRole::Prefill,
        WorkerRole::Decode,
        WorkerRole::Encode,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Aggregated => "aggregated",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Encode => "encode",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WorkerRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?}: use aggregated, prefill, decode or encode"))
    }
}

/// A worker's registration, the value under `/kvroute/<ns>/workers/<worker>` in etcd.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerCard {
    #[serde(default)]
    pub v: SchemaVersion,
    pub worker_id: WorkerId,
    pub model: String,
    #[serde(default)]
    pub role: WorkerRole,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks the worker's cache holds on device.
    pub total_kv_blocks: u64,
    /// The engine's per-step token budget (prefill chunking); 0 when unknown.
    #[serde(default)]
    pub max_num_batched_tokens: u64,
    #[serde(default)]
    pub dp_start_rank: DpRank,
    /// Data-parallel ranks `dp_start_rank .. dp_start_rank + dp_size`; at least 1.
    #[serde(default = "one")]
    pub dp_size: u32,
    /// Taints: properties a request must ask for (or tolerate) to be placed here.
    #[serde(default)]
    pub taints: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The NATS subject on which the worker takes requests.
    pub request_subject: String,
    #[serde(default)]
    pub software_version: String,
    /// The engine's own HTTP base URL (`http://host:port`, its OpenAI-compatible API), for
    /// gateways that send the request to the engine directly; absent for workers that take
    /// requests only on NATS (kvroute-mocker). Set by kvroute-bridge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_url: Option<String>,
    /// Whether the worker publishes KV events. A worker that does not (an engine without an
    /// event socket) is routed in approximate mode: every router predicts its cache from the
    /// published decisions. Absent (an older card) means true; written only when false.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub kv_events: bool,
    /// The LoRA adapters the engine can serve (vLLM: the `/v1/models` entries whose `parent`
    /// is the card's model). A request naming an adapter goes only to workers whose list holds
    /// it. Absent: not known, and any adapter may be asked of the worker (an engine that loads
    /// adapters by itself, or whose list cannot be read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_adapters: Option<Vec<String>>,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// A card field whose value no worker can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CardField {
    Model,
    BlockSize,
    TotalKvBlocks,
    RequestSubject,
    LoraAdapters,
}

/// A card that decodes but cannot describe a worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("WorkerCard: invalid {field:?}: {detail}")]
pub struct InvalidCard {
    pub field: CardField,
    pub detail: &'static str,
}

impl WorkerCard {
    /// Checks what routing relies on: a model to match, a block size to hash prompts with,
    /// a cache to score against, and a subject to send requests to.
    pub fn validate(&self) -> Result<(), InvalidCard> {
        let fail = |field, detail| Err(InvalidCard { field, detail });
        if self.model.trim().is_empty() {
            return fail(CardField::Model, "empty");
        }
        if self.block_size == 0 {
            return fail(CardField::BlockSize, "0 tokens per block");
        }
        if self.total_kv_blocks == 0 {
            return fail(CardField::TotalKvBlocks, "0 blocks");
        }
        if self.request_subject.is_empty()
            || self
                .request_subject
                .split('.')
                .any(|t| t.is_empty() || t.contains(char::is_whitespace))
        {
            return fail(CardField::RequestSubject, "not a NATS subject");
        }
        if let Some(adapters) = &self.lora_adapters {
            if adapters.len() > Self::MAX_LORA_ADAPTERS {
                return fail(CardField::LoraAdapters, "more than 256 adapters");
            }
            if adapters
                .iter()
                .any(|a| a.is_empty() || a.len() > Self::MAX_LORA_NAME_BYTES)
            {
                return fail(
                    CardField::LoraAdapters,
                    "an empty adapter name or one over 128 bytes",
                );
            }
        }
        Ok(())
    }

    /// The most adapters one card lists.
    pub const MAX_LORA_ADAPTERS: usize = 256;
    /// The longest adapter name a card lists, in bytes.
    pub const MAX_LORA_NAME_BYTES: usize = 128;

    /// Whether the worker can serve adapter `name` (an unknown list: yes).
    pub fn serves_adapter(&self, name: &str) -> bool {
        self.lora_adapters
            .as_ref()
            .is_none_or(|list| list.iter().any(|a| a == name))
    }

    /// The data-parallel ranks this worker serves.
    pub fn dp_ranks(&self) -> impl Iterator<Item = DpRank> + '_ {
        self.dp_start_rank..self.dp_start_rank.saturating_add(self.dp_size.max(1))
    }
}

impl WireMessage for WorkerCard {
    const NAME: &'static str = "WorkerCard";
    const MAX_BYTES: usize = 64 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// A load report, published on `kvroute.<ns>.load.<worker>` periodically and on change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    #[serde(default)]
    pub v: SchemaVersion,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Increases by one per report of this (worker, dp rank); lets readers drop stale reports.
    #[serde(default)]
    pub seq: u64,
    /// Prompt tokens admitted but not yet prefilled.
    #[serde(default)]
    pub active_prefill_tokens: u64,
    /// KV blocks held by running (decoding) requests.
    #[serde(default)]
    pub active_decode_blocks: u64,
    #[serde(default)]
    pub active_requests: u64,
    #[serde(default)]
    pub waiting_requests: u64,
    /// KV blocks in use (running requests and cached prefixes).
    #[serde(default)]
    pub kv_used_blocks: u64,
    #[serde(default)]
    pub total_kv_blocks: u64,
    /// When the worker took the report (its clock); readers learn the report interval from
    /// consecutive reports' `ts`.
    #[serde(default)]
    pub ts: TimestampMs,
    /// The requests this report counts for the first time: those the rank took since its
    /// previous report (at most [`WorkerLoad::MAX_NEW_REQUESTS`]). `None` when the worker does
    /// not name them (or took more): readers then assume the report counts every request decided
    /// more than one report interval ago.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_requests: Option<Vec<RequestId>>,
    /// The rank's LoRA adapter slots; `None` when the worker does not report them (it serves
    /// no adapters, or its engine does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdapterSlots>,
}

impl WorkerLoad {
    /// The most request ids one report names (38 bytes each in MessagePack: uuid strings).
    pub const MAX_NEW_REQUESTS: usize = 256;
}

/// A rank's LoRA adapter slots, as its engine reports them (vLLM:
/// `vllm:lora_requests_info`'s `running_lora_adapters`, `waiting_lora_adapters` and
/// `max_lora`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterSlots {
    /// Adapters resident in the rank's slots (at least those its running requests use).
    #[serde(default)]
    pub loaded: Vec<String>,
    /// Adapters that waiting requests name and no slot holds yet.
    #[serde(default)]
    pub waiting: Vec<String>,
    /// Adapters the rank can hold at once; 0: not known.
    #[serde(default)]
    pub max_loaded: u32,
}

impl AdapterSlots {
    /// The most adapter names one report lists, per list (longer lists are cut by senders).
    pub const MAX_NAMES: usize = 64;

    /// Whether `name` is resident.
    pub fn holds(&self, name: &str) -> bool {
        self.loaded.iter().any(|a| a == name)
    }

    /// Whether a slot is free: fewer resident than `max_loaded` (unknown capacity: yes).
    pub fn has_free_slot(&self) -> bool {
        self.max_loaded == 0 || self.loaded.len() < self.max_loaded as usize
    }
}

impl WireMessage for WorkerLoad {
    const NAME: &'static str = "WorkerLoad";
    const MAX_BYTES: usize = 16 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}
