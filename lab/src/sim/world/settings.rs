//! What one mode's simulation is given besides the plan and the policies, and the simulated
//! fleet's cards.

use std::time::Duration;

use kvroute_common::messages::{SchemaVersion, WorkerCard, WorkerRole};
use kvroute_mocker::engine::EngineConfig;
use kvroute_router::decide::load_view::models::LoadModels;
use kvroute_router::registry::DisaggregationConfig;
use kvroute_router::session::SessionConfig;

use super::SIM_MODEL;
use crate::replay::Mode;

/// Everything one mode's simulation needs besides the plan and the policies.
#[derive(Debug, Clone)]
pub struct SimSettings {
    pub mode: Mode,
    pub engine: EngineConfig,
    /// Aggregated workers (ids 1..=workers).
    pub workers: u32,
    /// Prefill workers (the next ids) and decode workers (the last ones): with both above 0,
    /// requests are served as the router serves a model with prefill and decode workers.
    pub prefill_workers: u32,
    pub decode_workers: u32,
    /// The routers' `disaggregation` (the mode and the conditional rule's thresholds).
    pub disaggregation: DisaggregationConfig,
    /// The KV transfer from a prefill to a decode worker, per engine block of the prompt.
    pub kv_transfer_per_block: Duration,
    /// Router replicas; arrivals go to them in turn.
    pub routers: u32,
    /// From a worker's KV event to the index.
    pub event_delay: Duration,
    /// From a decision, lifecycle event or load report to the (other) router replicas.
    pub signal_delay: Duration,
    /// Between two load reports of a worker.
    pub load_interval: Duration,
    /// Whether workers send load reports at all.
    pub load_reports: bool,
    /// The load view's report interval assumed until reports show it.
    pub report_covers: Duration,
    /// The load view's confirm window (reports here name their new requests).
    pub prediction_confirm: Duration,
    /// The load view's cap on a prediction's age.
    pub prediction_max_age: Duration,
    /// The routers' predicted-overlap TTL (zero: off).
    pub predicted_overlap_ttl: Duration,
    /// The routers' approximate-cache TTL for workers without KV events (zero: off).
    pub approx_cache_ttl: Duration,
    /// The first `no_kv_events_workers` workers publish no KV events in every mode (a mixed
    /// fleet); in `kv-approx` none does.
    pub no_kv_events_workers: u32,
    pub seed: u64,
    /// Send a row's `session_id` as the request's `SessionContext`.
    pub send_sessions: bool,
    /// The routers' adapter placement (`SelectionSettings::adapter_placement`).
    pub adapter_placement: bool,
    /// Workers list only running requests' adapters as loaded, as vLLM's gauge does.
    pub running_adapters_only: bool,
    /// The routers' session settings (`--session-affinity`, `--session-idle-ttl-secs`).
    pub sessions: SessionConfig,
    /// The last `cpu_workers` aggregated workers are CPU workers (card label
    /// `kvroute.io/device: cpu`), their engines `cpu_slowdown` times slower.
    pub cpu_workers: u32,
    pub cpu_slowdown: f64,
    /// Blocks of the shared tier per worker (0: no shared tier).
    pub shared_cache_blocks: u64,
    /// The routers' load models (`--track-output-blocks`, `--prefill-load-model`).
    pub load_models: LoadModels,
}

impl SimSettings {
    /// Every worker: aggregated, prefill and decode.
    pub fn fleet(&self) -> u32 {
        self.workers + self.prefill_workers + self.decode_workers
    }

    /// Worker `i`'s (0-based) role.
    pub(super) fn role_of(&self, i: u32) -> WorkerRole {
        if i < self.workers {
            WorkerRole::Aggregated
        } else if i < self.workers + self.prefill_workers {
            WorkerRole::Prefill
        } else {
            WorkerRole::Decode
        }
    }

    /// Worker `i`'s (0-based) engine and whether it is a CPU worker.
    pub(super) fn engine_of(&self, i: u32) -> (EngineConfig, bool) {
        let cpu_from = self.workers - self.cpu_workers.min(self.workers);
        if !(cpu_from..self.workers).contains(&i) {
            return (self.engine.clone(), false);
        }
        (slowed(&self.engine, self.cpu_slowdown), true)
    }
}

/// `engine` with every step cost `factor` times larger (a CPU worker).
pub fn slowed(engine: &EngineConfig, factor: f64) -> EngineConfig {
    let f = |v: u64| (v as f64 * factor).round() as u64;
    EngineConfig {
        step_overhead_us: f(engine.step_overhead_us),
        prefill_ns_per_token: f(engine.prefill_ns_per_token),
        decode_ns_per_seq: f(engine.decode_ns_per_seq),
        decode_ns_per_context_token: f(engine.decode_ns_per_context_token),
        shared_load_ns_per_token: f(engine.shared_load_ns_per_token),
        ..engine.clone()
    }
}

/// The cards of a simulated fleet (worker ids 1..=n).
pub fn sim_cards(engine: &EngineConfig, workers: u32) -> Vec<WorkerCard> {
    (1..=u64::from(workers))
        .map(|worker_id| WorkerCard {
            v: SchemaVersion::CURRENT,
            worker_id,
            model: SIM_MODEL.to_owned(),
            role: WorkerRole::Aggregated,
            block_size: engine.block_size,
            total_kv_blocks: engine.num_blocks,
            max_num_batched_tokens: u64::from(engine.max_num_batched_tokens),
            dp_start_rank: 0,
            dp_size: 1,
            taints: Vec::new(),
            labels: Default::default(),
            request_subject: format!("sim.worker.{worker_id}"),
            software_version: format!("kvroute-sim {}", env!("CARGO_PKG_VERSION")),
            http_url: None,
            kv_events: true,
            lora_adapters: None,
        })
        .collect()
}
