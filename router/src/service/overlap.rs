//! Where a prompt's prefix overlap comes from: the indexer replicas (`remote`: one query on
//! `kvroute.<ns>.index.query` with a deadline) or an embedded follower replica (`local`).
//! A remote query that times out, finds no responder or gets an error yields no overlap and a
//! fallback reason: the request is scored on load alone.

use std::time::Duration;

use async_nats::RequestErrorKind;
use kvroute_common::codec::{decode, encode};
use kvroute_common::hashing::LocalBlockHash;
use kvroute_common::messages::{IndexQuery, IndexQueryResponse, SchemaVersion, WorkerMatch};
use kvroute_common::names::Names;
use kvroute_indexer::service::LocalReplica;

/// Why a remote query gave no overlap (the label of `overlap_fallbacks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    Timeout,
    NoResponders,
    /// The indexer answered with an error (e.g. not ready).
    IndexerError,
    /// The request or the reply could not be encoded / decoded, or NATS failed.
    Failed,
}

impl Fallback {
    pub fn reason(self) -> &'static str {
        match self {
            Fallback::Timeout => "timeout",
            Fallback::NoResponders => "no_responders",
            Fallback::IndexerError => "indexer_error",
            Fallback::Failed => "failed",
        }
    }
}

/// The overlap source chosen by `--overlap-mode`.
#[derive(Debug, Clone)]
pub enum OverlapSource {
    Remote {
        nats: async_nats::Client,
        subject: String,
        timeout: Duration,
    },
    Local(LocalReplica),
}

impl OverlapSource {
    pub fn remote(nats: async_nats::Client, names: &Names, timeout: Duration) -> Self {
        OverlapSource::Remote {
            nats,
            subject: names.index_query(),
            timeout,
        }
    }

    /// Ready to answer: always for remote (failures fall back), caught up for local.
    pub fn is_ready(&self) -> bool {
        match self {
            OverlapSource::Remote { .. } => true,
            OverlapSource::Local(replica) => replica.is_ready(),
        }
    }

    /// Leading blocks of `hashes` held per (worker, rank) with at least one.
    pub async fn matches(
        &self,
        model: &str,
        hashes: &[LocalBlockHash],
    ) -> Result<Vec<WorkerMatch>, Fallback> {
        match self {
            OverlapSource::Local(replica) => Ok(replica.find_matches(hashes).matches),
            OverlapSource::Remote {
                nats,
                subject,
                timeout,
            } => {
                let query = IndexQuery {
                    v: SchemaVersion::CURRENT,
                    model: model.to_owned(),
                    token_ids: None,
                    block_hashes: Some(hashes.to_vec()),
                    block_size: None,
                    lora_name: None,
                };
                let payload = encode(&query).map_err(|_| Fallback::Failed)?;
                let request = async_nats::Request::new()
                    .payload(payload)
                    .timeout(Some(*timeout));
                let reply =
                    nats.send_request(subject.clone(), request)
                        .await
                        .map_err(|e| match e.kind() {
                            RequestErrorKind::TimedOut => Fallback::Timeout,
                            RequestErrorKind::NoResponders => Fallback::NoResponders,
                            _ => Fallback::Failed,
                        })?;
                match decode::<IndexQueryResponse>(&reply.payload) {
                    Ok(IndexQueryResponse::Ok(r)) => Ok(r.matches),
                    Ok(IndexQueryResponse::Error(_)) => Err(Fallback::IndexerError),
                    Err(_) => Err(Fallback::Failed),
                }
            }
        }
    }
}
