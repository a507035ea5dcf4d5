//! The edge where answers go out: the reply on the requester's inbox and the `Decision` every
//! router replica applies to its load view.

use kvroute_common::DecisionId;
use kvroute_common::RequestId;
use kvroute_common::codec::encode;
use kvroute_common::messages::{
    Decision, ErrorCode, SchemaVersion, SelectError, SelectReply, SelectRequest, SelectResponse,
    StorageTier, now_ms,
};

use super::intake::Prompt;
use crate::select::Selection;

/// An error reply without per-worker reasons.
pub fn error(code: ErrorCode, message: String, request_id: Option<RequestId>) -> SelectResponse {
    SelectResponse::Error(SelectError {
        v: SchemaVersion::CURRENT,
        request_id,
        code,
        message,
        reasons: Default::default(),
    })
}

/// Publishes `response` to `inbox`. A reply that cannot be sent is logged (the requester
/// times out; nothing else can be done from here).
pub async fn send(
    nats: &async_nats::Client,
    inbox: async_nats::Subject,
    response: &SelectResponse,
) {
    let bytes = match encode(response) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "encoding a select reply failed");
            return;
        }
    };
    if let Err(e) = nats.publish(inbox, bytes).await {
        tracing::warn!(error = %e, "publishing a select reply failed");
    }
}

/// The decision record of a successful selection.
pub fn decision(
    request: &SelectRequest,
    request_id: RequestId,
    decision_id: DecisionId,
    selection: &Selection,
    prompt: &Prompt,
    block_size: u32,
    router_id: &str,
) -> Decision {
    let overlap = selection.overlap.map_or(0, |o| o.device);
    let cached_tokens = u64::from(overlap) * u64::from(block_size);
    Decision {
        v: SchemaVersion::CURRENT,
        decision_id,
        request_id,
        router_id: router_id.to_owned(),
        model: request.model.clone(),
        role: request.role,
        worker_id: selection.worker.worker_id,
        dp_rank: selection.worker.dp_rank,
        session_id: request.session.as_ref().map(|s| s.id.clone()),
        request_blocks: prompt.blocks(),
        overlap_blocks: overlap,
        prefill_tokens: prompt.tokens.saturating_sub(cached_tokens),
        expected_output_tokens: request.expected_output_tokens,
        cost: selection.cost.clone(),
        policy: selection.policy.clone(),
        binding: selection.binding,
        ts: now_ms(),
        attempt: request.attempt,
    }
}

/// The reply that announces decision `d` (this replica's or another's): what a retry of its
/// request gets, so every attempt of one request is answered with one decision.
pub fn from_decision(d: &Decision, request_subject: String) -> SelectReply {
    let mut overlap_blocks = std::collections::BTreeMap::new();
    if d.overlap_blocks > 0 {
        overlap_blocks.insert(StorageTier::Device, d.overlap_blocks);
    }
    SelectReply {
        v: SchemaVersion::CURRENT,
        request_id: d.request_id,
        decision_id: d.decision_id,
        worker_id: d.worker_id,
        dp_rank: d.dp_rank,
        request_subject,
        overlap_blocks,
        request_blocks: d.request_blocks,
        cost: d.cost.clone(),
        policy: d.policy.clone(),
        binding: d.binding,
        router_id: d.router_id.clone(),
    }
}

/// Publishes a decision on `kvroute.<ns>.decisions`.
pub async fn publish_decision(nats: &async_nats::Client, subject: &str, decision: &Decision) {
    match encode(decision) {
        Ok(bytes) => {
            if let Err(e) = nats.publish(subject.to_owned(), bytes).await {
                tracing::warn!(error = %e, "publishing a decision failed");
            }
        }
        Err(e) => tracing::error!(error = %e, "encoding a decision failed"),
    }
}
