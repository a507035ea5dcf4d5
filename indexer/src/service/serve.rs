//! What the indexer answers: overlap queries (the queue group and this replica's direct
//! subject, held only while the replica is ready and keeping up; a query that reaches it
//! otherwise is answered `not_ready`, one past its deadline is dropped), the digest subject
//! (every replica answers), and the HTTP endpoints.

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: times each query"
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use futures::StreamExt;
use futures::future::BoxFuture;
use kvroute_common::codec::{DecodeError, decode, encode};
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::ids::WorkerId;
use kvroute_common::messages::now_ms;
use kvroute_common::messages::{
    IndexError, IndexErrorCode, IndexQuery, IndexQueryResponse, IndexReply, ReplicaStatus,
    SchemaVersion, WorkerCard,
};
use kvroute_common::names::Names;
use kvroute_common::ops::{HttpHandler, HttpResponse, InFlight, Membership, serve_membership};
use tokio::sync::{mpsc, oneshot, watch};

use super::metrics::IndexerMetrics;
use crate::index::SharedIndex;

/// State the serving tasks read; the main loop writes it.
#[derive(Debug)]
pub struct ServeState {
    pub replica_id: String,
    pub names: Names,
    pub index: RwLock<SharedIndex>,
    pub cards: RwLock<HashMap<WorkerId, WorkerCard>>,
    pub applied_seq: AtomicU64,
    pub ready: Readiness,
    /// In the query queue group (ready and keeping up).
    pub serving: AtomicBool,
    /// The leader term this replica acts in (0: not leading). Appends check it before
    /// every attempt, so a deposed leader's retries stop.
    pub leader_term: AtomicU64,
    pub metrics: IndexerMetrics,
    /// Asks the main loop for a consistent (sequence, digest) pair.
    pub status_requests: mpsc::Sender<oneshot::Sender<ReplicaStatus>>,
}

impl ServeState {
    pub async fn status(&self) -> Option<ReplicaStatus> {
        let (tx, rx) = oneshot::channel();
        self.status_requests.send(tx).await.ok()?;
        rx.await.ok()
    }
}

/// Whether the replica is ready (`/readyz`), with a generation that changes on every
/// transition, so a query can tell that readiness held for the whole of its answer (a
/// bootstrap swaps the state only after readiness went false).
#[derive(Debug, Default)]
pub struct Readiness(AtomicU64);

impl Readiness {
    /// Sets readiness; returns whether it changed.
    pub fn set(&self, ready: bool) -> bool {
        let current = self.0.load(Ordering::Acquire);
        if (current & 1 == 1) == ready {
            return false;
        }
        let next = ((current >> 1) + 1) << 1 | u64::from(ready);
        self.0.store(next, Ordering::Release);
        true
    }

    pub fn is_ready(&self) -> bool {
        self.token() & 1 == 1
    }

    /// Generation and readiness in one value: equal tokens before and after an answer mean
    /// readiness did not change in between.
    fn token(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// What becomes of one query.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Reply(IndexQueryResponse),
    /// Past its deadline: nobody waits for the answer.
    Expired,
}

fn error(
    shared: &ServeState,
    code: IndexErrorCode,
    message: impl Into<String>,
) -> IndexQueryResponse {
    IndexQueryResponse::Error(IndexError {
        v: SchemaVersion::CURRENT,
        code,
        message: message.into(),
        replica_id: shared.replica_id.clone(),
    })
}

/// Answers one overlap query: `not_ready` unless the replica was ready from before reading
/// its state until after (a cold or rebuilding state is never reported as the truth).
pub fn answer(shared: &ServeState, payload: &[u8]) -> Answer {
    let query: IndexQuery = match decode(payload) {
        Ok(q) => q,
        Err(e) => {
            let code = match e {
                DecodeError::TooLarge { .. } => IndexErrorCode::TooLarge,
                DecodeError::UnsupportedVersion { .. } => IndexErrorCode::UnsupportedVersion,
                _ => IndexErrorCode::BadRequest,
            };
            return Answer::Reply(error(shared, code, e.to_string()));
        }
    };
    if query.deadline_ms.is_some_and(|d| now_ms() > d) {
        return Answer::Expired;
    }
    let not_ready = || {
        Answer::Reply(error(
            shared,
            IndexErrorCode::NotReady,
            format!("indexer replica {} is not ready", shared.replica_id),
        ))
    };
    let before = shared.ready.token();
    if before & 1 == 0 {
        return not_ready();
    }
    let response = match_query(shared, &query);
    if shared.ready.token() != before {
        return not_ready();
    }
    Answer::Reply(response)
}

fn match_query(shared: &ServeState, query: &IndexQuery) -> IndexQueryResponse {
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
                        shared,
                        IndexErrorCode::BadRequest,
                        "token_ids need block_size (or a model with registered workers)",
                    );
                }
            }
        }
        (None, None) => {
            return error(
                shared,
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

/// Answers one query message and counts it by result.
async fn handle_query(
    nats: &async_nats::Client,
    shared: &ServeState,
    in_flight: &Arc<InFlight>,
    msg: async_nats::Message,
) {
    let started = Instant::now();
    let _in_flight = in_flight.enter();
    let label = match answer(shared, &msg.payload) {
        Answer::Expired => super::metrics::labels::QUERY_EXPIRED,
        Answer::Reply(response) => {
            if let (Some(reply), Ok(bytes)) = (msg.reply, encode(&response)) {
                let _ = nats.publish(reply, bytes).await;
            }
            match &response {
                IndexQueryResponse::Ok(_) => super::metrics::labels::QUERY_OK,
                IndexQueryResponse::Error(e) => e.code.as_str(),
            }
        }
    };
    shared.metrics.queries.inc(label);
    shared
        .metrics
        .query_latency
        .observe(started.elapsed().as_secs_f64());
}

/// Serves overlap queries whenever `serve` is true (ready and not lagging): in the indexers'
/// queue group and on this replica's direct subject. When `serve` turns false it leaves both
/// and answers what was already delivered (`not_ready` when no longer ready).
pub fn serve_queries(
    nats: async_nats::Client,
    shared: Arc<ServeState>,
    serve: watch::Receiver<bool>,
    in_flight: Arc<InFlight>,
) -> tokio::task::JoinHandle<()> {
    let membership = Membership {
        subject: shared.names.index_query(),
        queue_group: shared.names.indexer_queue_group(),
        direct_subject: shared.names.indexer_query(&shared.replica_id),
        what: "query",
    };
    tokio::spawn(async move {
        let on_state = |serving: bool| {
            shared.serving.store(serving, Ordering::Release);
            shared.metrics.serving.set(i64::from(serving));
        };
        let handle = |msg| handle_query(&nats, &shared, &in_flight, msg);
        serve_membership(&nats, &membership, serve, on_state, handle).await;
    })
}

/// Every replica answers `kvroute.<ns>.index.digest` with its [`ReplicaStatus`].
pub async fn serve_digest(nats: async_nats::Client, shared: Arc<ServeState>) -> anyhow::Result<()> {
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
pub struct Http(pub Arc<ServeState>);

impl HttpHandler for Http {
    fn get(&self, path: &str) -> BoxFuture<'static, HttpResponse> {
        let shared = self.0.clone();
        let path = path.split('?').next().unwrap_or("").to_owned();
        Box::pin(async move {
            match path.as_str() {
                "/metrics" => HttpResponse::prometheus(shared.metrics.registry.render()),
                "/healthz" => HttpResponse::text(200, "ok\n"),
                "/readyz" => {
                    if !shared.ready.is_ready() {
                        HttpResponse::text(503, "catching up\n")
                    } else if !shared.serving.load(Ordering::Acquire) {
                        HttpResponse::text(
                            503,
                            "caught up, not in the query queue group yet (or behind)\n",
                        )
                    } else {
                        HttpResponse::text(200, "ready\n")
                    }
                }
                // The digest as a hex string: JSON readers round numbers above 2^53.
                "/status" => match shared.status().await {
                    Some(s) => HttpResponse::json(200, s.to_json().to_string()),
                    None => HttpResponse::text(503, "shutting down\n"),
                },
                _ => HttpResponse::text(404, "not found\n"),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::Namespace;
    use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

    use super::*;
    use crate::index::IndexConfig;

    fn shared() -> ServeState {
        shared_with(mpsc::channel(1).0)
    }

    fn shared_with(status_requests: mpsc::Sender<oneshot::Sender<ReplicaStatus>>) -> ServeState {
        let index = SharedIndex::new(IndexConfig::default());
        {
            let stored = KvEventData::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock {
                    block_hash: 7,
                    tokens_hash: 7,
                }],
                tier: StorageTier::Device,
            };
            index.apply(1, 0, &stored).unwrap();
        }
        ServeState {
            replica_id: "ix-1".into(),
            names: Names::new(&Namespace::default()),
            index: RwLock::new(index),
            cards: Default::default(),
            applied_seq: AtomicU64::new(1),
            ready: Readiness::default(),
            serving: AtomicBool::new(false),
            leader_term: AtomicU64::new(0),
            metrics: IndexerMetrics::new(),
            status_requests,
        }
    }

    fn query(deadline_ms: Option<u64>) -> Vec<u8> {
        encode(&IndexQuery {
            block_hashes: Some(vec![7]),
            deadline_ms,
            ..Default::default()
        })
        .unwrap()
        .to_vec()
    }

    fn code(answer: Answer) -> Option<IndexErrorCode> {
        match answer {
            Answer::Reply(IndexQueryResponse::Error(e)) => Some(e.code),
            Answer::Reply(IndexQueryResponse::Ok(_)) => None,
            Answer::Expired => panic!("expired"),
        }
    }

    #[test]
    fn readiness_changes_its_token_on_every_transition_only() {
        let r = Readiness::default();
        assert!(!r.is_ready());
        let t0 = r.token();
        assert!(!r.set(false));
        assert_eq!(r.token(), t0);
        assert!(r.set(true));
        let t1 = r.token();
        assert!(r.is_ready() && t1 != t0);
        assert!(!r.set(true));
        assert!(r.set(false) && r.set(true));
        assert!(
            r.is_ready() && r.token() != t1,
            "ready again is a new generation"
        );
    }

    #[test]
    fn a_replica_that_is_not_ready_answers_not_ready_and_a_late_query_is_dropped() {
        let s = shared();
        assert_eq!(
            code(answer(&s, &query(None))),
            Some(IndexErrorCode::NotReady)
        );
        s.ready.set(true);
        match answer(&s, &query(None)) {
            Answer::Reply(IndexQueryResponse::Ok(r)) => {
                assert_eq!(r.matches.len(), 1);
                assert_eq!(r.replica_id, "ix-1");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(answer(&s, &query(Some(now_ms() - 1))), Answer::Expired);
        assert_eq!(code(answer(&s, &query(Some(now_ms() + 60_000)))), None);
        s.ready.set(false);
        assert_eq!(
            code(answer(&s, &query(None))),
            Some(IndexErrorCode::NotReady)
        );
    }

    #[tokio::test]
    async fn status_shows_a_digest_above_2_pow_53_exactly() {
        let (tx, mut rx) = mpsc::channel::<oneshot::Sender<ReplicaStatus>>(1);
        let digest = (1u64 << 53) + 1;
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                let _ = reply.send(ReplicaStatus {
                    replica_id: "ix-1".into(),
                    applied_seq: 9,
                    digest,
                    ..ReplicaStatus::default()
                });
            }
        });
        let http = Http(Arc::new(shared_with(tx)));
        let page = http.get("/status").await;
        assert_eq!(page.status, 200, "{}", page.body);
        let json: serde_json::Value = serde_json::from_str(&page.body).unwrap();
        // A double cannot hold 2^53 + 1: a JSON number here would read back as 2^53.
        assert_eq!(json["digest"], "0x0020000000000001", "{}", page.body);
        assert_eq!(json["applied_seq"], 9);
        assert_eq!(ReplicaStatus::from_json(&json).unwrap().digest, digest);
    }
}
