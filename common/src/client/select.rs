//! The selection client every kvroute tool uses (the replay tool, tests; PROTOCOL.md tells
//! other clients to do the same): one `request_id` for every attempt, each attempt stamped
//! with its number and deadline, retried on silence, on "nobody listening" and on
//! `unavailable`, a retry going to the router that answered last.

use std::time::Duration;

use super::group::{GroupClient, GroupError, Judged};
use super::retry::RetryPolicy;
use crate::codec::{decode, encode};
use crate::config::ConfigError;
use crate::messages::{SelectError, SelectReply, SelectRequest, SelectResponse};
use crate::names::Names;

/// The retry settings of a selection client (flags with `KVROUTE_*` env fallbacks).
#[derive(Debug, Clone, clap::Args)]
pub struct SelectRetryArgs {
    /// Attempts per selection (1 = no retry); every attempt carries the same request id.
    #[arg(
        long = "select-attempts",
        env = "KVROUTE_SELECT_ATTEMPTS",
        default_value_t = RetryPolicy::SELECT.attempts
    )]
    pub attempts: u32,
    /// Wall-clock milliseconds the first attempt waits for a router; each retry waits twice
    /// as long as the one before, up to 8 times this.
    #[arg(
        long = "select-attempt-timeout-ms",
        env = "KVROUTE_SELECT_ATTEMPT_TIMEOUT_MS",
        default_value_t = RetryPolicy::SELECT.first_timeout.as_millis() as u64
    )]
    pub attempt_timeout_ms: u64,
    /// How long a selection may wait in a router's admission queue when every eligible worker
    /// is busy (sent as the request's `queue_timeout_ms`; each attempt waits this much longer).
    /// 0 (the default): the request waits at most its attempt's timeout (the router answers
    /// `queue_timeout` just before the attempt's deadline). A longer wait lengthens every
    /// attempt, so a router that dies or stalls with the request costs that much more before
    /// the retry: raise it where a served request is worth that.
    #[arg(
        long = "select-queue-timeout-ms",
        env = "KVROUTE_SELECT_QUEUE_TIMEOUT_MS",
        default_value_t = SelectRetryArgs::DEFAULT_QUEUE_TIMEOUT_MS
    )]
    pub queue_timeout_ms: u64,
}

impl Default for SelectRetryArgs {
    fn default() -> Self {
        Self {
            attempts: RetryPolicy::SELECT.attempts,
            attempt_timeout_ms: RetryPolicy::SELECT.first_timeout.as_millis() as u64,
            queue_timeout_ms: Self::DEFAULT_QUEUE_TIMEOUT_MS,
        }
    }
}

impl SelectRetryArgs {
    pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 0;

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.attempts == 0 {
            return Err(ConfigError::new("select-attempts", "must be at least 1"));
        }
        if self.attempt_timeout_ms == 0 {
            return Err(ConfigError::new(
                "select-attempt-timeout-ms",
                "must be above 0",
            ));
        }
        Ok(())
    }

    pub fn policy(&self) -> RetryPolicy {
        let first = Duration::from_millis(self.attempt_timeout_ms);
        RetryPolicy {
            attempts: self.attempts,
            first_timeout: first,
            max_timeout: first.saturating_mul(8),
            no_responders_backoff: RetryPolicy::SELECT.no_responders_backoff,
            queue_wait: Duration::from_millis(self.queue_timeout_ms),
        }
    }
}

/// Why a select call (every attempt of it) produced no worker: refused by a router, no router, out
/// of time, or the transport. [`SelectCallFailure::kind`] is a stable label. (The router's own
/// reasons for refusing are `kvroute_router::select::SelectFailure`.)
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectCallFailure {
    /// A router answered with an error code (`no_workers`, `all_overloaded`, ...; or
    /// `unavailable` from every router tried).
    #[error("router refused: {}: {}", .0.code, .0.message)]
    Refused(SelectError),
    /// Nobody listens on the select subject.
    #[error("no router is listening")]
    NoRouter,
    #[error("no answer after {attempts} attempts ({waited:?})")]
    Timeout { attempts: u32, waited: Duration },
    /// The answer could not be decoded, or the request could not be encoded or sent.
    #[error("{0}")]
    Transport(String),
}

impl SelectCallFailure {
    /// `select_<code>`, `select_no_router`, `select_timeout` or `select_transport`.
    pub fn kind(&self) -> String {
        match self {
            SelectCallFailure::Refused(e) => format!("select_{}", e.code.as_str()),
            SelectCallFailure::NoRouter => "select_no_router".into(),
            SelectCallFailure::Timeout { .. } => "select_timeout".into(),
            SelectCallFailure::Transport(_) => "select_transport".into(),
        }
    }
}

/// A successful selection and the attempts it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    pub reply: SelectReply,
    /// 1 = answered by the first attempt.
    pub attempts: u32,
}

/// Selections on `kvroute.<ns>.select` with retries (shared by every request task).
#[derive(Debug)]
pub struct SelectClient {
    group: GroupClient,
}

impl SelectClient {
    pub fn new(nats: async_nats::Client, names: &Names, policy: RetryPolicy) -> Self {
        Self {
            group: GroupClient::new(nats, names, names.select(), Names::router_select, policy),
        }
    }

    pub fn policy(&self) -> &RetryPolicy {
        self.group.policy()
    }

    /// Selects a worker for `request`. A request without `request_id` gets one here, so every
    /// attempt names the same request and routers answer a retry with the same decision.
    pub async fn select(&self, mut request: SelectRequest) -> Result<Selected, SelectCallFailure> {
        request.request_id.get_or_insert_with(uuid::Uuid::new_v4);
        let queue_wait = self.group.policy().queue_wait;
        if !queue_wait.is_zero() {
            request
                .queue_timeout_ms
                .get_or_insert(u64::try_from(queue_wait.as_millis()).unwrap_or(u64::MAX));
        }
        let payload = |attempt: u32, deadline_ms: u64| {
            request.attempt = attempt;
            request.deadline_ms = Some(deadline_ms);
            encode(&request).map_err(|e| e.to_string())
        };
        let judge = |bytes: &[u8]| match decode::<SelectResponse>(bytes) {
            Ok(SelectResponse::Ok(reply)) => {
                let router = (!reply.router_id.is_empty()).then(|| reply.router_id.clone());
                (Judged::Answer(Ok(reply)), router)
            }
            Ok(SelectResponse::Error(e)) if e.code.is_retryable() => {
                (Judged::Retry(Err(SelectCallFailure::Refused(e))), None)
            }
            Ok(SelectResponse::Error(e)) => {
                (Judged::Answer(Err(SelectCallFailure::Refused(e))), None)
            }
            Err(e) => (
                Judged::Answer(Err(SelectCallFailure::Transport(e.to_string()))),
                None,
            ),
        };
        match self.group.request(payload, judge).await {
            Ok(answered) => answered.value.map(|reply| Selected {
                reply,
                attempts: answered.attempts,
            }),
            Err(GroupError::NoResponders { .. }) => Err(SelectCallFailure::NoRouter),
            Err(GroupError::TimedOut { attempts, waited }) => {
                Err(SelectCallFailure::Timeout { attempts, waited })
            }
            Err(GroupError::Transport(e)) => Err(SelectCallFailure::Transport(e)),
        }
    }
}
