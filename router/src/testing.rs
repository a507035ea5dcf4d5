//! Test fixtures shared by the unit tests: worker cards and small components.

use kvroute_common::WorkerId;
use kvroute_common::messages::{Decision, SchemaVersion, WorkerCard, WorkerRole};
use uuid::Uuid;

use crate::decide::load_view::LoadViewConfig;

/// An aggregated worker of model "m" with one rank, 1000 blocks of 16 tokens.
pub fn card(worker_id: WorkerId) -> WorkerCard {
    WorkerCard {
        v: Default::default(),
        worker_id,
        model: "m".to_owned(),
        role: WorkerRole::Aggregated,
        block_size: 16,
        total_kv_blocks: 1000,
        max_num_batched_tokens: 8192,
        dp_start_rank: 0,
        dp_size: 1,
        taints: Vec::new(),
        labels: Default::default(),
        request_subject: format!("worker.{worker_id}"),
        software_version: String::new(),
        http_url: None,
        kv_events: true,
        lora_adapters: None,
    }
}

/// Cards for workers `1..=n`.
pub fn cards(n: u64) -> Vec<WorkerCard> {
    (1..=n).map(card).collect()
}

/// A decision of model "m" (role aggregated) for `worker_id`'s rank 0.
pub fn decision(worker_id: u64, request_id: Uuid, blocks: u32, prefill: u64) -> Decision {
    Decision {
        v: SchemaVersion::CURRENT,
        decision_id: Uuid::new_v4(),
        request_id,
        router_id: "r".into(),
        model: "m".into(),
        role: Default::default(),
        worker_id,
        dp_rank: 0,
        session_id: None,
        request_blocks: blocks,
        overlap_blocks: 0,
        prefill_tokens: prefill,
        expected_output_tokens: None,
        block_size: 16,
        cost: Default::default(),
        policy: "default".into(),
        binding: None,
        ts: 0,
        attempt: 0,
        prefix_hashes: Vec::new(),
        decode: None,
        lora_name: None,
    }
}

/// A report of worker `worker_id`'s rank 0: idle, 1000 blocks, no adapter slots.
pub fn idle_report(worker_id: WorkerId) -> kvroute_common::messages::WorkerLoad {
    kvroute_common::messages::WorkerLoad {
        v: Default::default(),
        worker_id,
        dp_rank: 0,
        seq: 1,
        active_prefill_tokens: 0,
        active_decode_blocks: 0,
        active_requests: 0,
        waiting_requests: 0,
        kv_used_blocks: 0,
        total_kv_blocks: 1000,
        ts: 0,
        new_requests: None,
        adapters: None,
    }
}

/// A load view's settings for tests: 1 s reports, a 2 s confirm window, predictions kept 60 s,
/// no predicted overlap, no approximate caches, no load models.
pub fn view_config() -> LoadViewConfig {
    LoadViewConfig {
        report_interval_ms: 1_000,
        confirm_window_ms: 2_000,
        prediction_max_age_ms: 60_000,
        predicted_overlap_ttl_ms: 0,
        approx_cache_ttl_ms: 0,
        models: Default::default(),
    }
}
