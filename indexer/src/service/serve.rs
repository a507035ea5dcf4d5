//! What the indexer answers: overlap queries (queue group, once ready), the digest subject
//! (every replica answers), and the HTTP endpoints.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_common::codec::{DecodeError, decode, encode};
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::ids::WorkerId;
use kvroute_common::messages::{
    IndexError, IndexErrorCode, IndexQuery, IndexQueryResponse, IndexReply, ReplicaStatus,
    SchemaVersion, WorkerCard,
};
use kvroute_common::names::Names;
use kvroute_common::ops::{HttpHandler, HttpResponse};
use tokio::sync::{mpsc, oneshot};

use super::metrics::IndexerMetrics;
use crate::index::SharedIndex;

/// State the serving tasks read; the main loop writes it.
#[derive(Debug)]
pub struct Shared {
    pub replica_id: String,
    pub names: Names,
    pub index: RwLock<SharedIndex>,
    pub cards: RwLock<HashMap<WorkerId, WorkerCard>>,
    pub applied_seq: AtomicU64,
    pub ready: AtomicBool,
    pub leader: AtomicBool,
    pub metrics: IndexerMetrics,
    /// Asks the main loop for a consistent (sequence, digest) pair.
    pub status_requests: mpsc::Sender<oneshot::Sender<ReplicaStatus>>,
}

impl Shared {
    pub async fn status(&self) -> Option<ReplicaStatus> {
        let (tx, rx) = oneshot::channel();
        self.status_requests.send(tx).await.ok()?;
        rx.await.ok()
    }
}

fn error(code: IndexErrorCode, message: impl Into<String>) -> IndexQueryResponse {
    IndexQueryResponse::Error(IndexError {
        v: SchemaVersion::CURRENT,
        code,
        message: message.into(),
    })
}

/// Answers one overlap query.
pub fn answer(shared: &Shared, payload: &[u8]) -> IndexQueryResponse {
    let query: IndexQuery = match decode(payload) {
        Ok(q) => q,
        Err(e) => {
            let code = match e {
                DecodeError::TooLarge { .. } => IndexErrorCode::TooLarge,
                DecodeError::UnsupportedVersion { .. } => IndexErrorCode::UnsupportedVersion,
                _ => IndexErrorCode::BadRequest,
            };
            return error(code, e.to_string());
        }
    };
    let cards = shared.cards.read().expect("cards lock");
    let hashes = match (&query.block_hashes, &query.token_ids) {
        (Some(h), _) => h.clone(),
        (None, Some(tokens)) => {
            let block_size = query.block_size.or_else(|| {
                cards
                    .values()
                    .find(|c| c.model == query.model)
                    .map(|c| c.block_size)
            });
            match block_size {
                Some(bs) if bs > 0 => local_block_hashes(
                    tokens,
                    bs as usize,
                    seed_for_lora(query.lora_name.as_deref()),
                ),
                _ => {
                    return error(
                        IndexErrorCode::BadRequest,
                        "token_ids need block_size (or a model with registered workers)",
                    );
                }
            }
        }
        (None, None) => {
            return error(
                IndexErrorCode::BadRequest,
                "one of token_ids, block_hashes is required",
            );
        }
    };
    let index = shared.index.read().expect("index lock").clone();
    let applied_seq = shared.applied_seq.load(Ordering::Acquire);
    let mut scores = index.find_matches(&hashes);
    if !query.model.is_empty() {
        scores.matches.retain(|m| {
            cards
                .get(&m.worker_id)
                .is_some_and(|c| c.model == query.model)
        });
    }
    IndexQueryResponse::Ok(IndexReply {
        v: SchemaVersion::CURRENT,
        matches: scores.matches,
        query_blocks: scores.query_blocks,
        applied_seq,
        replica_id: shared.replica_id.clone(),
    })
}

/// Serves overlap queries in the indexers' queue group until the subscription ends.
pub async fn serve_queries(nats: async_nats::Client, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut sub = nats
        .queue_subscribe(
            shared.names.index_query(),
            shared.names.indexer_queue_group(),
        )
        .await?;
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let started = Instant::now();
            let response = answer(&shared, &msg.payload);
            let label = match &response {
                IndexQueryResponse::Ok(_) => "ok",
                IndexQueryResponse::Error(e) => match e.code {
                    IndexErrorCode::BadRequest => "bad_request",
                    IndexErrorCode::TooLarge => "too_large",
                    IndexErrorCode::UnsupportedVersion => "unsupported_version",
                    IndexErrorCode::NotReady => "not_ready",
                },
            };
            shared.metrics.queries.inc(label);
            if let (Some(reply), Ok(bytes)) = (msg.reply, encode(&response)) {
                let _ = nats.publish(reply, bytes).await;
            }
            shared
                .metrics
                .query_latency
                .observe(started.elapsed().as_secs_f64());
        }
    });
    Ok(())
}

/// Every replica answers `kvroute.<ns>.index.digest` with its [`ReplicaStatus`].
pub async fn serve_digest(nats: async_nats::Client, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut sub = nats.subscribe(shared.names.index_digest()).await?;
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let (Some(reply), Some(status)) = (msg.reply, shared.status().await)
                && let Ok(bytes) = encode(&status)
            {
                let _ = nats.publish(reply, bytes).await;
            }
        }
    });
    Ok(())
}

/// `/metrics`, `/healthz`, `/readyz`, `/status`.
#[derive(Debug)]
pub struct Http(pub Arc<Shared>);

impl HttpHandler for Http {
    fn get(&self, path: &str) -> BoxFuture<'static, HttpResponse> {
        let shared = self.0.clone();
        let path = path.split('?').next().unwrap_or("").to_owned();
        Box::pin(async move {
            match path.as_str() {
                "/metrics" => HttpResponse::prometheus(shared.metrics.registry.render()),
                "/healthz" => HttpResponse::text(200, "ok\n"),
                "/readyz" => {
                    if shared.ready.load(Ordering::Acquire) {
                        HttpResponse::text(200, "ready\n")
                    } else {
                        HttpResponse::text(503, "catching up\n")
                    }
                }
                "/status" => match shared.status().await {
                    Some(s) => {
                        HttpResponse::json(200, serde_json::to_string(&s).unwrap_or_default())
                    }
                    None => HttpResponse::text(503, "shutting down\n"),
                },
                _ => HttpResponse::text(404, "not found\n"),
            }
        })
    }
}
