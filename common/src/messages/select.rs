//! Worker selection: the request a client sends on `kvroute.<ns>.select` and the answer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{SchemaVersion, StorageTier, WorkerRole};
use crate::codec::WireMessage;
use crate::hashing::LocalBlockHash;
use crate::ids::{DecisionId, DpRank, RequestId, SessionId, WorkerId};

/// "Which worker should serve this prompt?"
///
/// The prompt is given either as `token_ids` (the router hashes them with the model's block
/// size) or as `block_hashes` (local hashes of its full blocks, already computed by the
/// caller). Exactly one is required, and it must not be empty.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SelectRequest {
    #[serde(default)]
    pub v: SchemaVersion,
    /// Chosen by the client; the router assigns one when absent.
    #[serde(default)]
    pub request_id: Option<RequestId>,
    pub model: String,
    #[serde(default)]
    pub role: WorkerRole,
    /// On the wire a `bin` of little-endian `u32`s (what this encoder writes) or an array of
    /// integers; see [`super::token_ids`].
    #[serde(default, with = "super::token_ids")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<LocalBlockHash>>,
    /// With `block_hashes`: the block size they were computed with (must match the workers').
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub lora_name: Option<String>,
    #[serde(default)]
    pub session: Option<SessionContext>,
    /// Only these workers are eligible (empty or absent: all).
    #[serde(default)]
    pub allowed_workers: Option<Vec<WorkerId>>,
    /// Exactly this worker (and rank, when given), or an error.
    #[serde(default)]
    pub pin: Option<Pin>,
    #[serde(default)]
    pub dp_rank_range: Option<DpRankRange>,
    /// Taints the request tolerates; a worker is eligible only if it has no other taint.
    #[serde(default)]
    pub tolerated_taints: Vec<String>,
    /// Taints a worker must carry to be eligible.
    #[serde(default)]
    pub required_taints: Vec<String>,
    /// Taints that make a worker cheaper for this request (policies may use it).
    #[serde(default)]
    pub preferred_taints: Vec<String>,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    /// Strict priority: larger is more urgent.
    #[serde(default)]
    pub priority: Option<i32>,
    /// Milliseconds the request moves forward in its FCFS order in a router's admission
    /// queue (negative treated as 0; capped by the router's `--queue-max-priority-jump-ms`).
    #[serde(default)]
    pub priority_jump_ms: Option<i64>,
    /// Overrides the policy's temperature for this request (0 = deterministic).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Asks for this policy (a configured instance name or a registered type, e.g.
    /// `round-robin`) instead of the role's configured one: for benchmarks and A/B runs.
    /// Absent: the role's policy. A router that knows no such policy answers `bad_request`.
    #[serde(default)]
    pub policy: Option<String>,
    /// When the client stops waiting for this attempt (milliseconds since the Unix epoch). A
    /// router that picks the request up later drops it (no reply, no decision, no load
    /// charged): the client has retried elsewhere. Absent: no deadline.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// Which attempt of the request this is (0 = the first). Every attempt carries the same
    /// `request_id`, so routers answer a retry with the decision already made.
    #[serde(default)]
    pub attempt: u32,
    /// How long the request may wait in the router's admission queue when every eligible
    /// worker is busy (milliseconds from its first arrival; capped by the router's
    /// `--queue-max-timeout-ms`). Absent: the router's `--queue-timeout-ms`. The wait never
    /// outlasts `deadline_ms`.
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    /// How a request of role `aggregated` is served when its model has prefill and decode
    /// workers (absent: the router's configured mode). Ignored for other roles.
    #[serde(default)]
    pub disaggregation: Option<Disaggregation>,
    /// The decode hop's own rules when the request is disaggregated (`pin`, `allowed_workers`
    /// and `dp_rank_range` above rule the prefill hop). Absent: any decode worker.
    #[serde(default)]
    pub decode: Option<HopRules>,
}

/// How a request of a model with prefill and decode workers is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disaggregation {
    /// By one worker end to end: an aggregated one when the model has any, else a prefill one.
    Never,
    /// Prefill on a prefill worker, decode on a decode worker.
    #[default]
    Always,
    /// Disaggregated when the prompt's uncached part is long enough, or the chosen prefill
    /// worker is busy; otherwise by the prefill worker end to end.
    Conditional,
}

impl Disaggregation {
    pub const ALL: [Disaggregation; 3] = [
        Disaggregation::Never,
        Disaggregation::Always,
        Disaggregation::Conditional,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Disaggregation::Never => "never",
            Disaggregation::Always => "always",
            Disaggregation::Conditional => "conditional",
        }
    }
}

/// The eligibility rules of one hop of a disaggregated request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HopRules {
    #[serde(default)]
    pub pin: Option<Pin>,
    #[serde(default)]
    pub allowed_workers: Option<Vec<WorkerId>>,
    #[serde(default)]
    pub dp_rank_range: Option<DpRankRange>,
}

impl WireMessage for SelectRequest {
    const NAME: &'static str = "SelectRequest";
    const MAX_BYTES: usize = 4 * 1024 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// The session a request belongs to (multi-turn chats, agents).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SessionContext {
    pub id: SessionId,
    #[serde(default)]
    pub parent_id: Option<SessionId>,
    /// The last request of the session: its binding is removed after this selection.
    #[serde(default, rename = "final")]
    pub is_final: bool,
    #[serde(default)]
    pub trigger: SessionTrigger,
}

/// What started this turn of the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionTrigger {
    UserMessage,
    ToolResult,
    #[default]
    Other,
}

/// An exact placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
}

/// Inclusive bounds on the data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DpRankRange {
    pub min: DpRank,
    pub max: DpRank,
}

/// The answer on the reply subject: `{"status": "ok", ...}` or `{"status": "error", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
#[allow(
    clippy::large_enum_variant,
    reason = "one per selection, decoded and matched at once: boxing would cost an allocation per answer"
)]
pub enum SelectResponse {
    Ok(SelectReply),
    Error(SelectError),
}

impl WireMessage for SelectResponse {
    const NAME: &'static str = "SelectResponse";
    fn schema_version(&self) -> SchemaVersion {
        match self {
            SelectResponse::Ok(r) => r.v,
            SelectResponse::Error(e) => e.v,
        }
    }
}

/// A successful selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectReply {
    #[serde(default)]
    pub v: SchemaVersion,
    pub request_id: RequestId,
    pub decision_id: DecisionId,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Where to send the request (the worker card's request subject).
    #[serde(default)]
    pub request_subject: String,
    /// Leading blocks of the prompt the worker holds, per tier.
    #[serde(default)]
    pub overlap_blocks: BTreeMap<StorageTier, u32>,
    /// Full blocks in the prompt.
    #[serde(default)]
    pub request_blocks: u32,
    #[serde(default)]
    pub cost: CostBreakdown,
    /// The policy that chose (its configured instance name).
    #[serde(default)]
    pub policy: String,
    #[serde(default)]
    pub binding: Option<BindingState>,
    /// The router replica that answered.
    #[serde(default)]
    pub router_id: String,
    /// The chosen worker's role: `prefill` for a disaggregated request (its decode hop in
    /// `decode`) or one a prefill worker serves end to end.
    #[serde(default)]
    pub role: WorkerRole,
    /// A disaggregated request's decode worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<DecodeHop>,
}

/// The decode hop of a disaggregated request: where the request goes after its prefill (vLLM:
/// with the prefill answer's `kv_transfer_params`) or beside it (SGLang: both with the
/// prefill worker's bootstrap address and `bootstrap_room`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeHop {
    /// The hop's own decision id (its load is charged and released apart from the prefill's).
    pub decision_id: DecisionId,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// The decode worker card's request subject.
    #[serde(default)]
    pub request_subject: String,
    #[serde(default)]
    pub cost: CostBreakdown,
    #[serde(default)]
    pub policy: String,
    /// SGLang's bootstrap room for the pair: a random 63-bit integer whose remainder modulo the
    /// prefill worker's data-parallel size is the chosen prefill rank.
    pub bootstrap_room: u64,
}

/// The cost the policy assigned to the chosen worker, term by term.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CostBreakdown {
    #[serde(default)]
    pub total: f64,
    #[serde(default)]
    pub terms: BTreeMap<String, f64>,
}

/// What happened to the session's binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BindingState {
    New,
    Kept,
    Rebound,
    Released,
}

impl BindingState {
    pub const ALL: [BindingState; 4] = [
        BindingState::New,
        BindingState::Kept,
        BindingState::Rebound,
        BindingState::Released,
    ];

    /// The state as on the wire (also the metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            BindingState::New => "new",
            BindingState::Kept => "kept",
            BindingState::Rebound => "rebound",
            BindingState::Released => "released",
        }
    }
}

/// A selection that failed, with a machine-readable code.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectError {
    #[serde(default)]
    pub v: SchemaVersion,
    #[serde(default)]
    pub request_id: Option<RequestId>,
    pub code: ErrorCode,
    pub message: String,
    /// Per-worker reasons when every candidate was filtered out.
    #[serde(default)]
    pub reasons: BTreeMap<String, String>,
}

/// Why a selection failed. Stable on the wire (snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Undecodable, schema-violating or inconsistent request.
    BadRequest,
    /// Larger than the size limit.
    TooLarge,
    /// A schema version newer than the router understands.
    UnsupportedVersion,
    /// No registered worker serves this model and role.
    NoWorkers,
    /// Workers exist but eligibility rules or policy filters rejected all of them.
    AllFiltered,
    /// Every eligible worker is above the busy thresholds.
    AllOverloaded,
    /// The pinned worker (or rank) is not registered or not eligible.
    PinnedUnavailable,
    /// The policy misbehaved (non-finite cost, invalid pick).
    PolicyError,
    /// The router is not ready or failed internally.
    Unavailable,
    /// The request waited in the router's admission queue until its queue deadline and no
    /// eligible worker had room.
    QueueTimeout,
    /// Every eligible worker is busy and the partition's admission queue is full.
    QueueFull,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 11] = [
        ErrorCode::BadRequest,
        ErrorCode::TooLarge,
        ErrorCode::UnsupportedVersion,
        ErrorCode::NoWorkers,
        ErrorCode::AllFiltered,
        ErrorCode::AllOverloaded,
        ErrorCode::PinnedUnavailable,
        ErrorCode::PolicyError,
        ErrorCode::Unavailable,
        ErrorCode::QueueTimeout,
        ErrorCode::QueueFull,
    ];

    /// The code as on the wire (also the metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::NoWorkers => "no_workers",
            ErrorCode::AllFiltered => "all_filtered",
            ErrorCode::AllOverloaded => "all_overloaded",
            ErrorCode::PinnedUnavailable => "pinned_unavailable",
            ErrorCode::PolicyError => "policy_error",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::QueueTimeout => "queue_timeout",
            ErrorCode::QueueFull => "queue_full",
        }
    }

    /// Whether another router replica may answer differently: only `unavailable` (this
    /// replica is not ready, or failed internally). Every other code is the answer.
    pub fn is_retryable(self) -> bool {
        self == ErrorCode::Unavailable
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
