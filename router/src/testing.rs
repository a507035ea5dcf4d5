//! Test fixtures shared by the unit tests: worker cards and small components.

use kvroute_common::WorkerId;
use kvroute_common::messages::{WorkerCard, WorkerRole};

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
    }
}

/// Cards for workers `1..=n`.
pub fn cards(n: u64) -> Vec<WorkerCard> {
    (1..=n).map(card).collect()
}
