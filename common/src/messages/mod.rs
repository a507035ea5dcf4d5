//! Every message kvroute puts on the wire, defined once. PROTOCOL.md documents each field.
//!
//! All messages are MessagePack maps with named fields (see [`crate::codec`]); every top-level
//! message carries the schema version `v`. Optional fields default when missing and unknown
//! fields are ignored, so older and newer peers can talk.

mod de_event;
mod decision;
mod generate;
mod index;
mod kv_event;
mod select;
mod session;
pub mod token_ids;
mod worker;

pub use decision::{Decision, LifecycleKind, RequestLifecycle};
pub use generate::{
    GenerateError, GenerateErrorCode, GenerateReply, GenerateRequest, GenerateResponse,
};
pub use index::{
    IndexError, IndexErrorCode, IndexQuery, IndexQueryResponse, IndexReply, ReplicaStatus,
    WorkerMatch, digest_hex, parse_digest_hex,
};
pub use kv_event::{
    ControlAction, ControlRecord, KvEvent, KvEventBatch, KvEventData, SHARED_TIER_VERSION,
    StorageTier, StoredBlock,
};
pub use select::{
    BindingState, CostBreakdown, DecodeHop, Disaggregation, DpRankRange, ErrorCode, HopRules, Pin,
    SelectError, SelectReply, SelectRequest, SelectResponse, SessionContext, SessionTrigger,
};
pub use session::SessionBindingRecord;
pub use worker::{AdapterSlots, CardField, InvalidCard, WorkerCard, WorkerLoad, WorkerRole};

use serde::{Deserialize, Serialize};

/// The schema version carried in every top-level message as field `v`.
///
/// Additive changes (new optional fields) keep the version; a reader refuses a message whose
/// version is above the type's `WireMessage::SUPPORTED_VERSION` ([`SchemaVersion::CURRENT`]
/// unless the type says otherwise) with a typed error. A missing `v` means 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SchemaVersion(pub u16);

impl SchemaVersion {
    pub const CURRENT: SchemaVersion = SchemaVersion(1);
}

impl Default for SchemaVersion {
    fn default() -> Self {
        Self(1)
    }
}

/// Milliseconds since the Unix epoch, as carried in `ts` fields.
pub type TimestampMs = u64;

/// The wall clock in milliseconds since the Unix epoch, for `ts` fields (informational only:
/// no kvroute logic depends on it).
pub fn now_ms() -> TimestampMs {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
