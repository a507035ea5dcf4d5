//! Every wire message the decision core builds: the decision record, the reply (new, or
//! announcing a decision already made) and error replies. The service only encodes and sends
//! them.

use kvroute_common::messages::{
    Decision, DecodeHop, ErrorCode, SchemaVersion, SelectError, SelectReply, SelectResponse,
    StorageTier, WorkerRole,
};
use kvroute_common::{DecisionId, RequestId};

use super::DecideInput;
use crate::select::Chosen;

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

/// The decision record of `selection`, made for `input` at `now_ms`.
pub fn decision(input: &DecideInput<'_>, selection: &Chosen, now_ms: u64) -> Decision {
    let request = input.request;
    let prompt = input.prompt;
    let overlap = selection.overlap.map_or(0, |o| o.device);
    let cached_tokens = u64::from(overlap) * u64::from(input.partition.block_size);
    Decision {
        v: SchemaVersion::CURRENT,
        decision_id: input.decision_id,
        request_id: input.request_id,
        router_id: input.router_id.to_owned(),
        model: request.model.clone(),
        role: request.role,
        worker_id: selection.worker.worker_id,
        dp_rank: selection.worker.dp_rank,
        session_id: request.session.as_ref().map(|s| s.id.clone()),
        request_blocks: prompt.blocks(),
        overlap_blocks: overlap,
        // A decode worker prefills nothing: the prompt's blocks arrive by transfer.
        prefill_tokens: match request.role {
            WorkerRole::Decode => 0,
            _ => prompt.tokens.saturating_sub(cached_tokens),
        },
        expected_output_tokens: request.expected_output_tokens,
        block_size: input.partition.block_size,
        cost: selection.cost.clone(),
        policy: selection.policy.clone(),
        binding: selection.binding,
        ts: now_ms,
        attempt: request.attempt,
        prefix_hashes: Vec::new(),
        decode: None,
        lora_name: request.lora_name.clone().filter(|name| !name.is_empty()),
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
        role: d.role,
        decode: d.decode.clone(),
    }
}

/// The decode hop of a paired decision `d` as a decision of its own (role `decode`, no
/// prefill of its own: the blocks arrive by transfer), which load views charge to the decode
/// worker apart from the prefill.
pub fn decode_half(d: &Decision) -> Option<Decision> {
    let hop = d.decode.as_ref()?;
    Some(Decision {
        decision_id: hop.decision_id,
        role: WorkerRole::Decode,
        worker_id: hop.worker_id,
        dp_rank: hop.dp_rank,
        overlap_blocks: 0,
        prefill_tokens: 0,
        cost: hop.cost.clone(),
        policy: hop.policy.clone(),
        binding: None,
        decode: None,
        ..d.clone()
    })
}

/// The decode hop `decode` (a decision of its partition) as the paired decision carries it.
pub fn hop(decode: &Decision, request_subject: String, bootstrap_room: u64) -> DecodeHop {
    DecodeHop {
        decision_id: decode.decision_id,
        worker_id: decode.worker_id,
        dp_rank: decode.dp_rank,
        request_subject,
        cost: decode.cost.clone(),
        policy: decode.policy.clone(),
        bootstrap_room,
    }
}

/// The reply for a new selection.
pub fn reply(
    selection: &Chosen,
    request_id: RequestId,
    decision_id: DecisionId,
    request_blocks: u32,
    router_id: &str,
    role: WorkerRole,
) -> SelectReply {
    SelectReply {
        v: SchemaVersion::CURRENT,
        request_id,
        decision_id,
        worker_id: selection.worker.worker_id,
        dp_rank: selection.worker.dp_rank,
        request_subject: selection.request_subject.clone(),
        overlap_blocks: selection.overlap.map(|o| o.by_tier()).unwrap_or_default(),
        request_blocks,
        cost: selection.cost.clone(),
        policy: selection.policy.clone(),
        binding: selection.binding,
        router_id: router_id.to_owned(),
        role,
        decode: None,
    }
}
