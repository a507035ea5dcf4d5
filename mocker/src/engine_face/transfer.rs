//! The modelled KV transfer between a prefill and a decode worker. A prefill worker holds each
//! hand-off's KV in its [`Outbox`] and serves it on its side channel (vLLM's NIXL side
//! channel, SGLang's bootstrap port; a mocker-private `POST /kvroute/kv/pull`); a decode
//! worker pulls it ([`Transfers::pull`]), waits `--kv-transfer-ms-per-block` per block, and
//! fails a `--kv-transfer-failure-rate` share of transfers. A prefill worker that is gone, a
//! hand-off it does not hold (expired, taken, forged) or another engine's id fail the pull.
//!
//! Deliberately simple: the prefill's blocks are unpinned when its answer ends (vLLM keeps
//! them pinned until read), and an SGLang prefill does not wait for its decode to connect.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::config::DisaggregationRole;

/// Most hand-offs a prefill worker holds; beyond, the oldest is dropped.
pub(crate) const MAX_HELD: usize = 65_536;

/// A decode worker's request for a hand-off's KV.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PullRequest {
    /// vLLM: `remote_request_id`; SGLang: `room:<bootstrap_room>`.
    pub key: String,
    /// vLLM: `remote_engine_id`, checked against the prefill worker's (its NIXL handshake).
    pub engine_id: Option<String>,
    /// vLLM: `remote_block_ids`, checked against those the prefill announced.
    pub block_ids: Option<Vec<u64>>,
    /// How long to wait for a hand-off not yet announced (SGLang: the prefill request may
    /// arrive after the decode's), ms.
    pub wait_ms: u64,
}

/// The KV handed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pulled {
    pub prompt_tokens: u64,
    pub blocks: u64,
}

/// Why a pull got nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum PullRefusal {
    #[error("engine id mismatch: this prefill engine is {ours}, the request names {theirs}")]
    EngineMismatch { ours: String, theirs: String },
    #[error("no KV held for {key} (never announced, expired or already taken)")]
    Unknown { key: String },
    #[error("{key} timed out after {waited:.1}s waiting for its prefill")]
    TimedOut { key: String, waited: f64 },
    #[error("remote_block_ids do not match the blocks held for {key}")]
    BlocksMismatch { key: String },
    #[error("the prefill of {key} did not complete")]
    PrefillFailed { key: String },
}

#[derive(Debug)]
enum HeldState {
    Computing,
    Ready(Pulled),
    Failed,
}

#[derive(Debug)]
struct Held {
    state: HeldState,
    block_ids: Vec<u64>,
    since: Instant,
}

/// A prefill worker's hand-offs, by key, until a decode worker takes them or they expire.
#[derive(Debug)]
pub(crate) struct Outbox {
    engine_id: String,
    hold: Duration,
    held: Mutex<HashMap<String, Held>>,
    changed: Notify,
}

impl Outbox {
    pub fn new(engine_id: String, hold: Duration) -> Self {
        Self {
            engine_id,
            hold,
            held: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A prefill of `key` started.
    pub fn announce(&self, key: &str, block_ids: Vec<u64>) {
        let now = Instant::now();
        let mut held = self.lock();
        held.retain(|_, h| now.duration_since(h.since) < self.hold);
        if held.len() >= MAX_HELD
            && let Some(oldest) = held
                .iter()
                .min_by_key(|(_, h)| h.since)
                .map(|(k, _)| k.clone())
        {
            held.remove(&oldest);
        }
        held.insert(
            key.to_owned(),
            Held {
                state: HeldState::Computing,
                block_ids,
                since: now,
            },
        );
        drop(held);
        self.changed.notify_waiters();
    }

    /// The prefill of `key` ended: its KV is ready (`Some`), or it never came (`None`).
    pub fn settle(&self, key: &str, ready: Option<Pulled>) {
        if let Some(h) = self.lock().get_mut(key) {
            h.state = ready.map_or(HeldState::Failed, HeldState::Ready);
        }
        self.changed.notify_waiters();
    }

    /// Hands `req`'s KV over (once), waiting up to `req.wait_ms` for an unannounced key and
    /// up to the hold time for a prefill still computing.
    pub async fn take(&self, req: &PullRequest) -> Result<Pulled, PullRefusal> {
        if let Some(theirs) = &req.engine_id
            && *theirs != self.engine_id
        {
            return Err(PullRefusal::EngineMismatch {
                ours: self.engine_id.clone(),
                theirs: theirs.clone(),
            });
        }
        let key = req.key.clone();
        let start = Instant::now();
        let unannounced_deadline = start + Duration::from_millis(req.wait_ms);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let deadline = {
                let mut held = self.lock();
                let now = Instant::now();
                match held.get(&key) {
                    Some(h) if now.duration_since(h.since) >= self.hold => {
                        held.remove(&key);
                        return Err(PullRefusal::Unknown { key });
                    }
                    None if req.wait_ms == 0 => return Err(PullRefusal::Unknown { key }),
                    None => unannounced_deadline,
                    Some(h) => {
                        if let Some(ids) = &req.block_ids
                            && *ids != h.block_ids
                        {
                            return Err(PullRefusal::BlocksMismatch { key });
                        }
                        match h.state {
                            HeldState::Computing => h.since + self.hold,
                            HeldState::Ready(pulled) => {
                                held.remove(&key);
                                return Ok(pulled);
                            }
                            HeldState::Failed => {
                                held.remove(&key);
                                return Err(PullRefusal::PrefillFailed { key });
                            }
                        }
                    }
                }
            };
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(PullRefusal::TimedOut {
                    key,
                    waited: start.elapsed().as_secs_f64(),
                });
            }
        }
    }

    /// Hand-offs held now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The prefill worker's side channel: `POST /kvroute/kv/pull` (a [`PullRequest`]) answers
/// a [`Pulled`], or 404 / 409 / 504 with `{"error": reason}`.
pub(crate) fn side_channel(outbox: std::sync::Arc<Outbox>) -> Router {
    Router::new()
        .route("/kvroute/kv/pull", post(serve_pull))
        .with_state(outbox)
}

async fn serve_pull(
    State(outbox): State<std::sync::Arc<Outbox>>,
    Json(req): Json<PullRequest>,
) -> Result<Json<Pulled>, (StatusCode, Json<serde_json::Value>)> {
    outbox.take(&req).await.map(Json).map_err(|e| {
        let status = match e {
            PullRefusal::EngineMismatch { .. } | PullRefusal::BlocksMismatch { .. } => {
                StatusCode::CONFLICT
            }
            PullRefusal::TimedOut { .. } => StatusCode::GATEWAY_TIMEOUT,
            PullRefusal::Unknown { .. } | PullRefusal::PrefillFailed { .. } => {
                StatusCode::NOT_FOUND
            }
        };
        (status, Json(serde_json::json!({"error": e.to_string()})))
    })
}

/// Why a decode worker's transfer failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TransferError {
    #[error("the prefill worker at {url} is unreachable: {error}")]
    Unreachable { url: String, error: String },
    #[error("the prefill worker at {url} refused the transfer ({status}): {reason}")]
    Refused {
        url: String,
        status: u16,
        reason: String,
    },
    #[error("the transfer of {blocks} blocks failed (--kv-transfer-failure-rate)")]
    Injected { blocks: u64 },
}

/// Disaggregation counters of one worker.
#[derive(Debug, Default)]
pub(crate) struct DisaggCounters {
    /// Requests refused for missing or malformed disaggregation fields.
    pub refused: AtomicU64,
    /// Decode requests whose KV transfer failed.
    pub transfer_failed: AtomicU64,
    /// Decodes whose prefill never came (SGLang: a room that timed out, a prefill gone).
    pub bootstrap_failed: AtomicU64,
    /// Blocks pulled by decodes.
    pub blocks_pulled: AtomicU64,
}

/// One worker's part in disaggregated serving.
#[derive(Debug)]
pub(crate) struct Transfers {
    pub role: DisaggregationRole,
    /// A prefill worker's hand-offs (and its engine id).
    pub outbox: std::sync::Arc<Outbox>,
    /// Where a prefill worker's side channel listens, as announced (`remote_host` /
    /// `remote_port`; SGLang's bootstrap port).
    pub side_channel: Option<(String, u16)>,
    pub ms_per_block: f64,
    pub failure_rate: f64,
    /// How long an SGLang decode waits for its room.
    pub room_wait: Duration,
    /// Simulated seconds per wall second.
    pub speedup: f64,
    pub counters: DisaggCounters,
    pub client: reqwest::Client,
}

impl Transfers {
    /// Pulls the KV `req` names from the side channel at `url` and waits out its transfer.
    pub async fn pull(&self, url: &str, req: &PullRequest) -> Result<Pulled, TransferError> {
        let wait = Duration::from_millis(req.wait_ms) + self.room_wait + Duration::from_secs(5);
        let resp = self
            .client
            .post(format!("{url}/kvroute/kv/pull"))
            .json(req)
            .timeout(wait)
            .send()
            .await
            .map_err(|e| TransferError::Unreachable {
                url: url.to_owned(),
                error: kvroute_common::error_chain::describe(&e),
            })?;
        let status = resp.status();
        if !status.is_success() {
            let body: serde_json::Value = resp.json().await.unwrap_or_default();
            return Err(TransferError::Refused {
                url: url.to_owned(),
                status: status.as_u16(),
                reason: body["error"].as_str().unwrap_or("no reason").to_owned(),
            });
        }
        let pulled: Pulled = resp.json().await.map_err(|e| TransferError::Unreachable {
            url: url.to_owned(),
            error: kvroute_common::error_chain::describe(&e),
        })?;
        tokio::time::sleep(self.transfer_time(pulled.blocks)).await;
        if self.failure_rate > 0.0 && rand::random::<f64>() < self.failure_rate {
            return Err(TransferError::Injected {
                blocks: pulled.blocks,
            });
        }
        self.counters
            .blocks_pulled
            .fetch_add(pulled.blocks, Ordering::Relaxed);
        Ok(pulled)
    }

    /// The wall time `blocks` take to move.
    pub fn transfer_time(&self, blocks: u64) -> Duration {
        Duration::from_secs_f64(blocks as f64 * self.ms_per_block / 1000.0 / self.speedup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, wait_ms: u64) -> PullRequest {
        PullRequest {
            key: key.into(),
            engine_id: None,
            block_ids: None,
            wait_ms,
        }
    }

    const READY: Pulled = Pulled {
        prompt_tokens: 9,
        blocks: 3,
    };

    #[tokio::test(start_paused = true)]
    async fn a_handoff_is_taken_once_after_its_prefill() {
        let out = std::sync::Arc::new(Outbox::new("e1".into(), Duration::from_secs(60)));
        out.announce("r", vec![0, 1, 2]);
        let waiter = {
            let out = out.clone();
            tokio::spawn(async move { out.take(&req("r", 0)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        out.settle("r", Some(READY));
        assert_eq!(waiter.await.unwrap(), Ok(READY));
        assert!(matches!(
            out.take(&req("r", 0)).await,
            Err(PullRefusal::Unknown { .. })
        ));
        assert_eq!(out.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn forged_or_late_pulls_are_refused() {
        let out = Outbox::new("e1".into(), Duration::from_secs(60));
        out.announce("r", vec![0, 1, 2]);
        out.settle("r", Some(READY));
        let forged = PullRequest {
            engine_id: Some("other".into()),
            ..req("r", 0)
        };
        assert!(matches!(
            out.take(&forged).await,
            Err(PullRefusal::EngineMismatch { .. })
        ));
        let wrong_blocks = PullRequest {
            block_ids: Some(vec![7]),
            ..req("r", 0)
        };
        assert!(matches!(
            out.take(&wrong_blocks).await,
            Err(PullRefusal::BlocksMismatch { .. })
        ));
        // A room that never comes times out after the decode's wait.
        let started = Instant::now();
        assert!(matches!(
            out.take(&req("room:1", 500)).await,
            Err(PullRefusal::TimedOut { .. })
        ));
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        // Held KV expires.
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert!(matches!(
            out.take(&req("r", 0)).await,
            Err(PullRefusal::Unknown { .. })
        ));
        out.announce("f", vec![]);
        out.settle("f", None);
        assert!(matches!(
            out.take(&req("f", 0)).await,
            Err(PullRefusal::PrefillFailed { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_room_announced_later_is_waited_for() {
        let out = std::sync::Arc::new(Outbox::new("e1".into(), Duration::from_secs(60)));
        let waiter = {
            let out = out.clone();
            tokio::spawn(async move { out.take(&req("room:5", 10_000)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        out.announce("room:5", vec![]);
        tokio::time::sleep(Duration::from_millis(100)).await;
        out.settle("room:5", Some(READY));
        assert_eq!(waiter.await.unwrap(), Ok(READY));
    }
}
