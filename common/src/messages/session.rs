//! The value stored under a session's key in the sessions bucket `KVROUTE_<ns>_SESSIONS`.

use serde::{Deserialize, Serialize};

use super::SchemaVersion;
use crate::codec::WireMessage;
use crate::ids::{DpRank, WorkerId};

/// Where a session runs and when it last did. Written by router replicas with
/// create-if-absent and compare-and-swap on the key's revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionBindingRecord {
    #[serde(default)]
    pub v: SchemaVersion,
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Milliseconds since the Unix epoch of the last selection that made or kept the binding.
    #[serde(default)]
    pub last_used_ms: u64,
}

impl WireMessage for SessionBindingRecord {
    const NAME: &'static str = "SessionBindingRecord";
    const MAX_BYTES: usize = 4 * 1024;
    fn schema_version(&self) -> SchemaVersion {
        self.v
    }
}
