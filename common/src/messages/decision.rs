//! What routers tell each other: decisions made, and how requests progress on workers.

use serde::{Deserialize, Serialize};

use super::{BindingState, CostBreakdown, DecodeHop, SchemaVersion, TimestampMs, WorkerRole};
use crate::codec::WireMessage;
use crate::ids::{DecisionId, DpRank, RequestId, SessionId, WorkerId};

/// A routing decision, published on `kvroute.<ns>.decisions` by the replica that made it.
/// Every router replica applies every decision to its predicted-load view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    #[serde(default)]
    pub v: SchemaVersion,
    pub decision_id: DecisionId,
    pub request_id: RequestId,
    pub router_id: String,
    pub model: String,
    #[serde(default)]
    pub role: WorkerRole,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    #[serde(default)]
    pub session_id: Option<SessionId>,
    /// Full blocks in the prompt.
    pub request_blocks: u32,
    /// Of those, blocks the worker already held on device.
    pub overlap_blocks: u32,
    /// Prompt tokens the worker still has to prefill (estimate).
    pub prefill_tokens: u64,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    /// Tokens per KV block of the chosen rank's partition (0 from a router that predates it):
    /// what a load view counts output blocks in.
    #[serde(default)]
    pub block_size: u32,
    #[serde(default)]
    pub cost: CostBreakdown,
    #[serde(default)]
    pub policy: String,
    #[serde(default)]
    pub binding: Option<BindingState>,
    #[serde(default)]
    pub ts: TimestampMs,
    /// The request's attempt that this decision answered. When two replicas decided the same
    /// request (a retry raced a late answer), every replica keeps the decision of the later
    /// attempt — the one the client waited for — and charges only it.
    #[serde(default)]
    pub attempt: u32,
    /// Chain hashes of the prompt's prefixes at a fixed schedule of depths (PROTOCOL.md,
    /// "Predicted overlap"): every replica records them as blocks the chosen rank is about
    /// to hold. Empty from a router that predicts no overlap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefix_hashes: Vec<u64>,
    /// A disaggregated request's decode hop (this decision is then its prefill hop, role
    /// `prefill`): every replica charges the decode worker too, under the hop's decision id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<DecodeHop>,
    /// The LoRA adapter the request names: every replica counts it as about to be resident
    /// on the chosen rank (and the decode hop's) until a report of the rank says otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
}

impl WireMessage for Decision {
    const NAME: &'static str = "Decision";
    const MAX_BYTES: usize = 64 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// A request's progress on a worker, published on `kvroute.<ns>.lifecycle.<worker>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestLifecycle {
    #[serde(default)]
    pub v: SchemaVersion,
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    pub kind: LifecycleKind,
    #[serde(default)]
    pub ts: TimestampMs,
}

/// Which step the request reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LifecycleKind {
    /// The prompt is in the cache; the request now decodes.
    PrefillDone {
        #[serde(default)]
        cached_tokens: u64,
    },
    /// The request has generated `output_tokens` tokens so far (the first included). Sent as
    /// generation crosses a block boundary, at most once per block of output; lets a load
    /// view count the KV blocks the output takes (`--track-output-blocks`).
    Progress { output_tokens: u64 },
    /// The request left the worker (completed, cancelled or failed).
    Finished {
        #[serde(default)]
        output_tokens: u64,
    },
}

impl WireMessage for RequestLifecycle {
    const NAME: &'static str = "RequestLifecycle";
    const MAX_BYTES: usize = 16 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}
