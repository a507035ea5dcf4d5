//! Offline simulation (`kvroute-sim`): a trace through a simulated fleet and router replicas
//! on simulated time, in one process — the same engine as `kvroute-mocker`, the indexer's
//! radix index, and the router's core, policies and load view, joined by modelled delays
//! instead of NATS and etcd. Minutes of trace take seconds, and a run is reproducible, so
//! policy parameters can be compared quickly before a replay through the real system.

pub mod config;
mod main;
pub mod world;

use std::time::Instant;

use kvroute_common::trace::read_trace;
use kvroute_router::registry::{
    DisaggregationConfig, PolicyOverrides, ResolvedPolicies, RouterPluginRegistry,
    RouterPluginsConfig, WorkerSelectionConfig,
};

pub use config::SimArgs;
pub use main::main_with;
pub use world::{SIM_MODEL, SimSettings, sim_cards, simulate};

use crate::replay::oracle::{oracle_with_hits, ttft_floor};
use crate::replay::session_oracle;
use crate::replay::{Plan, Progress, RunReport};

/// What `--policy-config` configures for the simulation: the worker selection and the
/// disaggregation rule.
#[derive(Debug, Clone)]
pub struct SimPolicies {
    pub policies: ResolvedPolicies,
    /// The file's `disaggregation` (the default without one), its mode replaced by
    /// `--disaggregation` when given.
    pub disaggregation: DisaggregationConfig,
}

/// The policies of `--policy-config` (the built-in ones without it), resolved against
/// `registry` as a router resolves them; an error names the flag and the file. A file that
/// configures a `request_classifier` is refused: the simulation has no admission queue to run
/// its lifecycle.
pub fn load_policies(
    args: &SimArgs,
    registry: &RouterPluginRegistry,
    bin: &str,
) -> anyhow::Result<SimPolicies> {
    let (selection, mut disaggregation) = match &args.policy_config {
        None => (
            WorkerSelectionConfig::default(),
            DisaggregationConfig::default(),
        ),
        Some(path) => {
            let in_file = |e: &dyn std::fmt::Display| {
                anyhow::anyhow!("--policy-config {}: {e}", path.display())
            };
            let file = RouterPluginsConfig::from_file(path).map_err(|e| in_file(&e))?;
            file.disaggregation.validate().map_err(|e| in_file(&e))?;
            let disaggregation = file.disaggregation;
            let selection = file.without_classifier(bin).map_err(|e| in_file(&e))?;
            (selection, disaggregation)
        }
    };
    if let Some(mode) = args.disaggregation {
        disaggregation.mode = mode.into();
    }
    let policies = registry
        .resolve(&selection, &PolicyOverrides::default())
        .map_err(|e| match &args.policy_config {
            Some(path) => anyhow::anyhow!("--policy-config {}: {e}", path.display()),
            None => e.into(),
        })?;
    Ok(SimPolicies {
        policies,
        disaggregation,
    })
}

/// [`run_with`] the built-in policies.
pub fn run(args: &SimArgs) -> anyhow::Result<RunReport> {
    run_with(args, &RouterPluginRegistry::with_builtins())
}

/// Simulates every mode of `args`, with the policy types of `registry` (a deployment's own
/// catalog, as `kvroute-router-custom` links it), and returns the report (prints nothing on
/// stdout).
pub fn run_with(args: &SimArgs, registry: &RouterPluginRegistry) -> anyhow::Result<RunReport> {
    args.validate()?;
    let started = Instant::now();
    let plan = Plan::new(read_trace(&args.trace)?, args.limit, args.time_scale, None);
    anyhow::ensure!(
        !plan.is_empty(),
        "the trace {} is empty",
        args.trace.display()
    );
    let policies = load_policies(args, registry, "kvroute-sim")?;
    let engine = args.engine.engine_config();
    // The caches prompts are computed in (a decode worker's holds transferred blocks only).
    let computing = args.aggregated_workers() + args.prefill_workers;
    let capacity = engine.num_blocks * u64::from(computing);
    let (oracle, hits) = oracle_with_hits(&plan.requests, engine.block_size, capacity);
    let floor = ttft_floor(&plan.requests, &hits, &engine);
    let session_oracle = plan
        .sessions
        .as_ref()
        .map(|k| session_oracle(k, &plan.requests, &hits, engine.block_size));
    let mut modes = Vec::new();
    let mut simulated = 0.0;
    for &mode in &args.modes {
        let settings = SimSettings {
            mode,
            engine: engine.clone(),
            workers: args.aggregated_workers(),
            prefill_workers: args.prefill_workers,
            decode_workers: args.decode_workers,
            disaggregation: policies.disaggregation,
            kv_transfer_per_block: SimArgs::millis(args.kv_transfer_ms_per_block),
            routers: args.routers,
            event_delay: SimArgs::millis(args.event_delay_ms),
            signal_delay: SimArgs::millis(args.signal_delay_ms),
            load_interval: SimArgs::millis(args.load_interval_ms),
            load_reports: !args.no_load_reports,
            report_covers: SimArgs::millis(args.report_covers_ms),
            prediction_confirm: SimArgs::millis(args.prediction_confirm_ms),
            prediction_max_age: SimArgs::millis(args.prediction_max_age_secs * 1e3),
            predicted_overlap_ttl: SimArgs::millis(args.predicted_overlap_ttl_ms),
            approx_cache_ttl: SimArgs::millis(args.approx_cache_ttl_ms),
            no_kv_events_workers: args.no_kv_events_workers,
            seed: args.seed,
            send_sessions: !args.no_sessions,
            adapter_placement: !args.no_adapter_placement,
            running_adapters_only: args.running_adapters_only,
            sessions: args.sessions(),
            cpu_workers: args.cpu_workers,
            cpu_slowdown: args.cpu_slowdown,
            shared_cache_blocks: args.shared_cache_blocks,
            load_models: args.load_models()?,
        };
        let progress = Progress::new(mode.as_str(), plan.len() as u64, args.output.interactive());
        let report = simulate(&plan, &settings, &policies.policies, |t| progress.update(t))?;
        progress.finish();
        simulated += report.duration_s;
        modes.push(report);
    }
    Ok(RunReport {
        trace: args.trace.display().to_string(),
        requests: plan.len() as u64,
        workers: args.fleet_size(),
        block_size: engine.block_size,
        blocks_per_worker: engine.num_blocks,
        // Simulated seconds per wall second of the whole run.
        speedup: simulated / started.elapsed().as_secs_f64().max(1e-9),
        oracle,
        ttft_floor_ms: Some(floor),
        session_oracle,
        selection_measured: crate::replay::report::SelectionMeasured::InProcess,
        modes,
    })
}

#[cfg(test)]
mod tests;
