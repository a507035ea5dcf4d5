//! Overlap queries to the indexer replicas on `kvroute.<ns>.index.query`.

use serde::{Deserialize, Serialize};

use super::SchemaVersion;
use crate::codec::WireMessage;
use crate::hashing::LocalBlockHash;
use crate::ids::{DpRank, WorkerId};

/// "How many leading blocks of this prompt does each worker hold?"
/// Give `token_ids` (hashed with `block_size`) or `block_hashes` (local hashes).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct IndexQuery {
    #[serde(default)]
    pub v: SchemaVersion,
    /// Only workers registered for this model are reported (empty: every worker).
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub block_hashes: Option<Vec<LocalBlockHash>>,
    /// Required with `token_ids`.
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub lora_name: Option<String>,
    /// When the asker stops waiting (milliseconds since the Unix epoch): a replica that picks
    /// the query up later drops it unanswered. Absent: no deadline.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
}

impl WireMessage for IndexQuery {
    const NAME: &'static str = "IndexQuery";
    const MAX_BYTES: usize = 4 * 1024 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// The answer: `{"status": "ok", ...}` or `{"status": "error", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum IndexQueryResponse {
    Ok(IndexReply),
    Error(IndexError),
}

impl WireMessage for IndexQueryResponse {
    const NAME: &'static str = "IndexQueryResponse";
    fn schema_version(&self) -> SchemaVersion {
        match self {
            IndexQueryResponse::Ok(r) => r.v,
            IndexQueryResponse::Error(e) => e.v,
        }
    }
}

/// Matches per (worker, dp rank) with at least one leading block, and the replica's position.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct IndexReply {
    #[serde(default)]
    pub v: SchemaVersion,
    pub matches: Vec<WorkerMatch>,
    /// Full blocks in the query.
    #[serde(default)]
    pub query_blocks: u32,
    /// The last stream sequence the answering replica had applied.
    #[serde(default)]
    pub applied_seq: u64,
    #[serde(default)]
    pub replica_id: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Leading blocks held by one (worker, dp rank), per tier, and the worker's total blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkerMatch {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    #[serde(default)]
    pub device: u32,
    #[serde(default)]
    pub host: u32,
    #[serde(default)]
    pub disk: u32,
    /// Leading blocks of the query held in the shared tier (LMCache, a remote store), which
    /// any worker can load: each block of the prefix announced in the shared tier by some
    /// (worker, dp rank), not necessarily this one. The same in every row of an answer; not
    /// disjoint from the row's own tiers. Omitted when 0 (readers older than the field ignore
    /// it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared: u32,
    /// Blocks this (worker, dp rank) holds in all (for tie-breaks).
    #[serde(default)]
    pub total_blocks: u64,
}

/// A query that could not be answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexError {
    #[serde(default)]
    pub v: SchemaVersion,
    pub code: IndexErrorCode,
    pub message: String,
    /// The replica that answered (empty when unknown, and from older replicas), so that a
    /// client retrying after `not_ready` asks another replica instead of this one again.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub replica_id: String,
}

/// Why a query failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexErrorCode {
    BadRequest,
    TooLarge,
    UnsupportedVersion,
    /// The replica is not ready (bootstrapping, resyncing, or behind the log): ask another.
    NotReady,
}

impl IndexErrorCode {
    /// Every code (the metrics export each from startup; add a new code here too).
    pub const ALL: [IndexErrorCode; 4] = [
        IndexErrorCode::BadRequest,
        IndexErrorCode::TooLarge,
        IndexErrorCode::UnsupportedVersion,
        IndexErrorCode::NotReady,
    ];

    /// The code as on the wire (also the metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            IndexErrorCode::BadRequest => "bad_request",
            IndexErrorCode::TooLarge => "too_large",
            IndexErrorCode::UnsupportedVersion => "unsupported_version",
            IndexErrorCode::NotReady => "not_ready",
        }
    }
}

/// A replica's position and state digest: the answer on `kvroute.<ns>.index.digest` (every
/// replica answers) and the indexer's `/status` page (as JSON, [`ReplicaStatus::to_json`]: the
/// digest as a hex string there). Replicas that applied the same log prefix report the same
/// `(applied_seq, digest)`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReplicaStatus {
    #[serde(default)]
    pub v: SchemaVersion,
    pub replica_id: String,
    pub applied_seq: u64,
    pub digest: u64,
    #[serde(default)]
    pub ready: bool,
    #[serde(default)]
    pub leader: bool,
    /// (block, worker, rank) entries in the index.
    #[serde(default)]
    pub entries: u64,
    /// The stream's last sequence when last checked.
    #[serde(default)]
    pub stream_last_seq: u64,
}

impl WireMessage for ReplicaStatus {
    const NAME: &'static str = "ReplicaStatus";
    const MAX_BYTES: usize = 16 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}

/// A digest as JSON shows it: `0x` and 16 lower-case hex digits. JSON numbers above 2^53 are
/// rounded by most readers (jq, JavaScript), so JSON outputs carry u64 digests as strings;
/// MessagePack carries them as u64.
pub fn digest_hex(digest: u64) -> String {
    format!("{digest:#018x}")
}

/// Reads [`digest_hex`]'s form back (`0x` and 1-16 hex digits).
pub fn parse_digest_hex(s: &str) -> Option<u64> {
    let digits = s.strip_prefix("0x")?;
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

impl ReplicaStatus {
    /// The JSON form (the indexer's `/status`): the MessagePack fields, with `digest` as a
    /// [`digest_hex`] string.
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("a ReplicaStatus always serializes");
        value["digest"] = serde_json::Value::String(digest_hex(self.digest));
        value
    }

    /// Reads [`ReplicaStatus::to_json`]'s form.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        let digest = value["digest"]
            .as_str()
            .and_then(parse_digest_hex)
            .ok_or_else(|| format!("digest: not a \"0x\" hex string: {}", value["digest"]))?;
        let mut value = value.clone();
        value["digest"] = serde_json::Value::from(digest);
        serde_json::from_value(value).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    #[test]
    fn a_digest_above_2_pow_53_round_trips_through_json_exactly() {
        let status = ReplicaStatus {
            v: SchemaVersion::CURRENT,
            replica_id: "ix-1".into(),
            applied_seq: 42,
            digest: (1 << 53) + 1,
            ready: true,
            ..ReplicaStatus::default()
        };
        let text = status.to_json().to_string();
        assert!(text.contains(r#""digest":"0x0020000000000001""#), "{text}");
        // What a reader that takes numbers as doubles (jq) sees stays exact: no number.
        let read: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(read["digest"].is_string(), "{text}");
        assert_eq!(ReplicaStatus::from_json(&read).unwrap(), status);
        for digest in [0, 1, u64::MAX, 0xdead_beef_0000_0001] {
            assert_eq!(parse_digest_hex(&digest_hex(digest)), Some(digest));
            assert_eq!(digest_hex(digest).len(), 18);
        }
        for bad in ["", "0x", "123", "0x1g", "0x00000000000000001"] {
            assert_eq!(parse_digest_hex(bad), None, "{bad}");
        }
        // MessagePack keeps the u64.
        let back: ReplicaStatus = decode(&encode(&status).unwrap()).unwrap();
        assert_eq!(back.digest, (1 << 53) + 1);
    }
}
