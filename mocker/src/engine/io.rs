//! What goes into a simulated engine (requests) and what comes out (lifecycle outputs, KV
//! events, load figures).

use std::time::Duration;

use kvroute_common::hashing::BlockHashes;
use kvroute_common::messages::{KvEventData, LifecycleKind, WorkerLoad};
use kvroute_common::{DpRank, RequestId, WorkerId};

/// A request as the engine sees it: sizes and the prompt's block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    pub request_id: RequestId,
    pub prompt_tokens: u32,
    /// Tokens to generate; 0 is treated as 1 (prefill always yields a first token).
    pub output_tokens: u32,
    /// The prompt's full blocks at the engine's block size.
    pub hashes: BlockHashes,
    /// Report every decoded token in [`Ready::tokens`] (for a streamed answer); otherwise only
    /// the first and the last token are reported, as lifecycle outputs.
    pub report_tokens: bool,
    /// Leading blocks of the prompt the fleet's shared tier holds (the caller looks them up
    /// when it submits): those beyond the device cache's prefix are loaded, at
    /// `shared_load_ns_per_token`, instead of prefilled. 0 without a shared tier.
    pub shared_blocks: u32,
    /// Leading prompt tokens whose KV a prefill worker computed and this (decode) worker
    /// received before submitting (disaggregated serving): neither computed nor charged to
    /// any step — the caller has already waited out the transfer. The last prompt token is
    /// still computed, as the engines recompute it to sample the next one. 0 when aggregated.
    pub transferred_tokens: u32,
    /// The LoRA adapter the request runs under (its blocks are hashed with the adapter's
    /// seed); with `max_loras` it needs one of the engine's adapter slots.
    pub lora_name: Option<String>,
}

impl SimRequest {
    pub fn from_tokens(
        request_id: RequestId,
        tokens: &[u32],
        output_tokens: u32,
        block_size: u32,
        lora_name: Option<&str>,
    ) -> Self {
        Self {
            request_id,
            prompt_tokens: tokens.len() as u32,
            output_tokens,
            hashes: BlockHashes::of_tokens(tokens, block_size as usize, lora_name),
            report_tokens: false,
            shared_blocks: 0,
            transferred_tokens: 0,
            lora_name: lora_name.map(str::to_owned),
        }
    }
}

/// A request reaching a step of its life, at simulated time `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineOutput {
    /// The prompt is computed and the first token produced.
    PrefillDone {
        request_id: RequestId,
        at: Duration,
        /// Prompt tokens found in the cache or loaded from the shared tier (not recomputed).
        cached_tokens: u64,
        /// Time to first token, from submission.
        ttft: Duration,
    },
    /// The last token is produced and the request's blocks are released.
    Finished {
        request_id: RequestId,
        at: Duration,
        output_tokens: u64,
        ttft: Duration,
        /// End-to-end latency, from submission.
        latency: Duration,
    },
}

impl EngineOutput {
    pub fn request_id(&self) -> RequestId {
        match *self {
            EngineOutput::PrefillDone { request_id, .. }
            | EngineOutput::Finished { request_id, .. } => request_id,
        }
    }

    pub fn at(&self) -> Duration {
        match *self {
            EngineOutput::PrefillDone { at, .. } | EngineOutput::Finished { at, .. } => at,
        }
    }

    /// The wire form's `kind` (for a `RequestLifecycle`).
    pub fn lifecycle_kind(&self) -> LifecycleKind {
        match *self {
            EngineOutput::PrefillDone { cached_tokens, .. } => {
                LifecycleKind::PrefillDone { cached_tokens }
            }
            EngineOutput::Finished { output_tokens, .. } => {
                LifecycleKind::Finished { output_tokens }
            }
        }
    }
}

/// What [`super::Engine::advance_to`] produced: lifecycle outputs in time order, the KV
/// events to publish, in order, the decoded tokens of requests that report them, and output
/// blocks crossed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ready {
    pub outputs: Vec<EngineOutput>,
    pub kv_events: Vec<KvEventData>,
    /// In time order; only for requests submitted with `report_tokens`, and only the tokens
    /// between the first (`PrefillDone`) and the last (`Finished`).
    pub tokens: Vec<TokenOutput>,
    /// With [`super::Engine::with_shared_writes`]: the block hashes of every prompt whose
    /// prefill completed, for the caller to write through to its shared tier.
    pub prefilled: Vec<BlockHashes>,
    /// In time order: a request's generated tokens reached a multiple of the block size (a
    /// new output block), before its last token — at most one per block of output, for the
    /// `progress` lifecycle event.
    pub progress: Vec<TokenOutput>,
}

/// A decode step produced one more token of a request, at simulated time `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenOutput {
    pub request_id: RequestId,
    pub at: Duration,
    /// Tokens generated so far, this one included.
    pub generated: u64,
}

/// What [`super::Engine::abort`] took out of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aborted {
    /// It was in the running batch (else it was still waiting).
    pub was_running: bool,
    /// Tokens it had generated (0 before its prefill was done).
    pub output_tokens: u64,
}

/// Load figures of one engine, as a `WorkerLoad` carries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    /// Prompt tokens still to prefill: running requests' remainders, plus waiting requests'
    /// prompts less the prefix the cache holds now.
    pub active_prefill_tokens: u64,
    /// Blocks held by running requests that are decoding.
    pub active_decode_blocks: u64,
    /// Requests in the running batch.
    pub active_requests: u64,
    /// Requests queued, not yet admitted.
    pub waiting_requests: u64,
    /// Blocks in use (running requests and cached prefixes).
    pub kv_used_blocks: u64,
    pub total_kv_blocks: u64,
}

impl EngineLoad {
    pub fn to_worker_load(
        self,
        worker_id: WorkerId,
        dp_rank: DpRank,
        seq: u64,
        ts: u64,
        new_requests: Vec<RequestId>,
    ) -> WorkerLoad {
        WorkerLoad {
            v: Default::default(),
            worker_id,
            dp_rank,
            seq,
            active_prefill_tokens: self.active_prefill_tokens,
            active_decode_blocks: self.active_decode_blocks,
            active_requests: self.active_requests,
            waiting_requests: self.waiting_requests,
            kv_used_blocks: self.kv_used_blocks,
            total_kv_blocks: self.total_kv_blocks,
            ts,
            // More than one report may name: left to the readers' interval rule.
            new_requests: (new_requests.len() <= WorkerLoad::MAX_NEW_REQUESTS)
                .then_some(new_requests),
            // The engine's adapter slots are not load figures: see `Engine::adapter_slots`.
            adapters: None,
        }
    }
}
