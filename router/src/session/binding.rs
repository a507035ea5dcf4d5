//! What a session binding is, how it is stored, and the session settings.

use kvroute_common::{DpRank, WorkerId};
use serde::{Deserialize, Serialize};

use crate::worker::WorkerRank;

/// How a session's binding constrains selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityMode {
    /// The binding is the exact target; if it is no longer eligible, the session is rebound.
    #[default]
    Hard,
    /// The binding is offered to the policy as `affinity_target()`; the policy may choose
    /// another worker, and the binding follows the choice.
    Soft,
}

/// Session settings, validated at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    pub mode: AffinityMode,
    /// A binding unused for longer than this (milliseconds) is treated as absent. Default 10 min.
    pub idle_ttl_ms: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            mode: AffinityMode::Hard,
            idle_ttl_ms: 600_000,
        }
    }
}

/// A session setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("session idle TTL must be above 0 ms")]
pub struct InvalidSessionConfig;

impl SessionConfig {
    pub fn validate(&self) -> Result<(), InvalidSessionConfig> {
        if self.idle_ttl_ms == 0 {
            return Err(InvalidSessionConfig);
        }
        Ok(())
    }
}

/// The stored value under a session's key: where the session runs and when it last did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionBinding {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
    /// Milliseconds since the Unix epoch of the last selection that kept or made the binding.
    #[serde(default)]
    pub last_used_ms: u64,
}

impl SessionBinding {
    pub fn new(worker: WorkerRank, now_ms: u64) -> Self {
        Self {
            worker_id: worker.worker_id,
            dp_rank: worker.dp_rank,
            last_used_ms: now_ms,
        }
    }

    pub fn worker(&self) -> WorkerRank {
        WorkerRank::new(self.worker_id, self.dp_rank)
    }

    /// Idle for longer than `ttl_ms` at `now_ms`.
    pub fn is_expired(&self, now_ms: u64, ttl_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_used_ms) > ttl_ms
    }
}

/// A store revision; compare-and-swap writes name the revision they replace.
pub type Revision = u64;

/// A binding as read from the store, with its revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Versioned {
    pub binding: SessionBinding,
    pub revision: Revision,
}
