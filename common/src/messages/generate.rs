//! Serving a request: what a client sends to a worker's request subject (the card's
//! `request_subject`) after a selection, and the worker's answer when the request finishes.

use serde::{Deserialize, Serialize};

use super::SchemaVersion;
use crate::codec::WireMessage;
use crate::hashing::LocalBlockHash;
use crate::ids::{DecisionId, DpRank, RequestId, WorkerId};

/// "Run this prompt." The prompt is `token_ids`, or `block_hashes` (local hashes at
/// `block_size`, which must be the worker's) with the prompt's length in `prompt_tokens`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GenerateRequest {
    #[serde(default)]
    pub v: SchemaVersion,
    /// Usually the id the selection used, so lifecycle events and decisions line up.
    pub request_id: RequestId,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<LocalBlockHash>>,
    /// With `block_hashes`: the block size they were computed with.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// With `block_hashes`: the prompt's length in tokens (default: blocks × block size).
    #[serde(default)]
    pub prompt_tokens: Option<u32>,
    /// Tokens to generate (a simulated worker generates exactly this many; 0 counts as 1).
    pub max_tokens: u32,
    #[serde(default)]
    pub lora_name: Option<String>,
    /// The data-parallel rank to run on (default: the worker's first rank).
    #[serde(default)]
    pub dp_rank: Option<DpRank>,
    /// The selection that placed the request here (informational, for logs).
    #[serde(default)]
    pub decision_id: Option<DecisionId>,
}

impl WireMessage for GenerateRequest {
    const NAME: &'static str = "GenerateRequest";
    const MAX_BYTES: usize = 4 * 1024 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// The answer on the reply subject: `{"status": "ok", ...}` or `{"status": "error", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum GenerateResponse {
    Ok(GenerateReply),
    Error(GenerateError),
}

impl WireMessage for GenerateResponse {
    const NAME: &'static str = "GenerateResponse";
    const MAX_BYTES: usize = 64 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        match self {
            GenerateResponse::Ok(r) => r.v,
            GenerateResponse::Error(e) => e.v,
        }
    }
}

/// A finished request. Times are the engine's (simulated time for kvroute-mocker).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateReply {
    #[serde(default)]
    pub v: SchemaVersion,
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Time to first token, from arrival at the worker, in milliseconds.
    pub ttft_ms: f64,
    /// Arrival to last token, in milliseconds.
    pub latency_ms: f64,
    pub prompt_tokens: u64,
    /// Prompt tokens found in the prefix cache (not recomputed).
    pub cached_tokens: u64,
    pub output_tokens: u64,
}

/// A request the worker refused or could not finish.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateError {
    #[serde(default)]
    pub v: SchemaVersion,
    /// Absent when the request could not be decoded.
    #[serde(default)]
    pub request_id: Option<RequestId>,
    pub code: GenerateErrorCode,
    pub message: String,
}

impl GenerateError {
    pub fn new(
        request_id: Option<RequestId>,
        code: GenerateErrorCode,
        message: impl Into<String>,
    ) -> Self {
        Self {
            v: SchemaVersion::CURRENT,
            request_id,
            code,
            message: message.into(),
        }
    }

    /// The answer to a request that could not be decoded (no request id is known).
    pub fn undecodable(e: &crate::codec::DecodeError) -> Self {
        use crate::codec::DecodeError;
        let code = match e {
            DecodeError::TooLarge { .. } => GenerateErrorCode::TooLarge,
            DecodeError::UnsupportedVersion { .. } => GenerateErrorCode::UnsupportedVersion,
            DecodeError::Empty { .. } | DecodeError::Malformed { .. } => {
                GenerateErrorCode::BadRequest
            }
        };
        Self::new(None, code, e.to_string())
    }
}

/// Why a request failed. Stable on the wire (snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GenerateErrorCode {
    /// Undecodable, schema-violating or inconsistent (e.g. wrong block size, no prompt).
    BadRequest,
    /// Above the size limit, or needs more KV blocks than the worker has.
    TooLarge,
    /// A schema version newer than the worker understands.
    UnsupportedVersion,
    /// A request with this id is already running on the worker.
    Duplicate,
    /// The requested data-parallel rank is not served by this worker.
    UnknownDpRank,
    /// The worker dropped the request (cache reset, shutdown).
    Cancelled,
    /// The worker failed internally.
    Unavailable,
}

impl GenerateErrorCode {
    /// The wire name, for metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            GenerateErrorCode::BadRequest => "bad_request",
            GenerateErrorCode::TooLarge => "too_large",
            GenerateErrorCode::UnsupportedVersion => "unsupported_version",
            GenerateErrorCode::Duplicate => "duplicate",
            GenerateErrorCode::UnknownDpRank => "unknown_dp_rank",
            GenerateErrorCode::Cancelled => "cancelled",
            GenerateErrorCode::Unavailable => "unavailable",
        }
    }
}
