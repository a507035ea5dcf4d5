//! Where a prompt's prefix overlap comes from: the indexer replicas (`remote`: a query on
//! `kvroute.<ns>.index.query` with a deadline shared by its attempts — a retry goes to the
//! replica that answered last unless that one failed or answered `not_ready`, and then to the
//! group, which a replica that is not ready has left) or an
//! embedded follower replica (`local`). A remote query that gets no usable answer in time
//! yields no overlap and a fallback reason: the request is scored on load alone.

use kvroute_common::client::{GroupClient, GroupError, Judged, RetryPolicy};
use kvroute_common::codec::{decode, encode};
use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::messages::{
    IndexErrorCode, IndexQuery, IndexQueryResponse, SchemaVersion, WorkerMatch,
};
use kvroute_common::names::Names;
use kvroute_indexer::service::IndexFollower;

use super::Router;
use crate::decide::prompt::Prompt;
use crate::signals::SignalSnapshot;

/// Why a remote query gave no overlap (the label of `overlap_fallbacks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    Timeout,
    NoResponders,
    /// Every replica asked answered `not_ready`.
    NotReady,
    /// The indexer answered with another error.
    IndexerError,
    /// The request or the reply could not be encoded / decoded, or NATS failed.
    Failed,
}

impl Fallback {
    pub const ALL: [Fallback; 5] = [
        Fallback::Timeout,
        Fallback::NoResponders,
        Fallback::NotReady,
        Fallback::IndexerError,
        Fallback::Failed,
    ];

    pub fn reason(self) -> &'static str {
        match self {
            Fallback::Timeout => "timeout",
            Fallback::NoResponders => "no_responders",
            Fallback::NotReady => "not_ready",
            Fallback::IndexerError => "indexer_error",
            Fallback::Failed => "failed",
        }
    }
}

/// The overlap of a prompt and how many attempts it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Overlaps {
    pub matches: Vec<WorkerMatch>,
    /// Remote queries sent (1 = no retry; local lookups count 1).
    pub attempts: u32,
}

/// The overlap source chosen by `--overlap-mode`.
#[derive(Debug)]
pub enum OverlapSource {
    Remote(Box<GroupClient>),
    Local(IndexFollower),
}

impl OverlapSource {
    pub fn remote(nats: async_nats::Client, names: &Names, policy: RetryPolicy) -> Self {
        OverlapSource::Remote(Box::new(GroupClient::new(
            nats,
            names,
            names.index_query(),
            Names::indexer_query,
            policy,
        )))
    }

    /// Ready to answer: always for remote (failures fall back), caught up for local.
    pub fn is_ready(&self) -> bool {
        match self {
            OverlapSource::Remote(_) => true,
            OverlapSource::Local(replica) => replica.is_ready(),
        }
    }

    /// Leading blocks of `hashes` held per (worker, rank) with at least one.
    pub async fn matches(
        &self,
        model: &str,
        hashes: &[LocalBlockHash],
    ) -> Result<Overlaps, Fallback> {
        let group = match self {
            OverlapSource::Local(replica) => {
                return Ok(Overlaps {
                    matches: replica.find_matches(hashes).matches,
                    attempts: 1,
                });
            }
            OverlapSource::Remote(group) => group,
        };
        let mut query = IndexQuery {
            v: SchemaVersion::CURRENT,
            model: model.to_owned(),
            token_ids: None,
            block_hashes: Some(hashes.to_vec()),
            block_size: None,
            lora_name: None,
            deadline_ms: None,
        };
        let payload = |_attempt: u32, deadline_ms: u64| {
            query.deadline_ms = Some(deadline_ms);
            encode(&query).map_err(|e| e.to_string())
        };
        let judge = |bytes: &[u8]| match decode::<IndexQueryResponse>(bytes) {
            Ok(IndexQueryResponse::Ok(r)) => {
                let replica = (!r.replica_id.is_empty()).then(|| r.replica_id.clone());
                (Judged::Answer(Ok(r.matches)), replica)
            }
            Ok(IndexQueryResponse::Error(e)) if e.code == IndexErrorCode::NotReady => {
                // Named, it is asked no further within this query (and stops being the
                // replica a retry goes to).
                let replica = (!e.replica_id.is_empty()).then_some(e.replica_id);
                (Judged::Retry(Err(Fallback::NotReady)), replica)
            }
            Ok(IndexQueryResponse::Error(_)) => (Judged::Answer(Err(Fallback::IndexerError)), None),
            Err(_) => (Judged::Answer(Err(Fallback::Failed)), None),
        };
        match group.request(payload, judge).await {
            Ok(answered) => answered.value.map(|matches| Overlaps {
                matches,
                attempts: answered.attempts,
            }),
            Err(GroupError::NoResponders { .. }) => Err(Fallback::NoResponders),
            Err(GroupError::TimedOut { .. }) => Err(Fallback::Timeout),
            Err(GroupError::Transport(_)) => Err(Fallback::Failed),
        }
    }
}

#[allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: times the query for its histogram"
)]
impl Router {
    /// The prompt's overlap per rank (the policy reads `CACHE`); none for a prompt without a
    /// block.
    pub(super) async fn overlap_signals(&self, model: &str, prompt: &Prompt) -> SignalSnapshot {
        let mut signals = SignalSnapshot::new();
        if !prompt.hashes.is_empty() {
            let started = std::time::Instant::now();
            match self.overlap.matches(model, &prompt.hashes).await {
                Ok(found) => {
                    if found.attempts > 1 {
                        self.metrics
                            .overlap_retries
                            .add(u64::from(found.attempts - 1));
                    }
                    signals = SignalSnapshot::from_matches(&found.matches);
                }
                Err(fallback) => {
                    self.metrics.overlap_fallbacks.inc(fallback.reason());
                    tracing::debug!(
                        reason = fallback.reason(),
                        "no overlap available; scoring on load alone"
                    );
                }
            }
            self.metrics
                .overlap_latency
                .observe(started.elapsed().as_secs_f64());
        }
        signals
    }
}
