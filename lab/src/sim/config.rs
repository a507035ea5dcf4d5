//! `kvroute-sim`'s settings: the trace and its time scaling, the fleet (the mocker's engine
//! flags), the router replicas and their policy YAML, the signal delays, and the outputs.

use std::path::PathBuf;
use std::time::Duration;

use clap::Command;
use kvroute_common::config::ConfigError;
use kvroute_common::messages::Disaggregation;
use kvroute_common::telemetry::TelemetryArgs;
use kvroute_mocker::fleet::{EngineArgs, MAX_WORKERS};
use kvroute_router::decide::load_view::models::LoadModels;
use kvroute_router::service::config::AffinityArg;
use kvroute_router::service::load_models::{LoadModelArgs, PrefillModelArg};
use kvroute_router::session::SessionConfig;

use crate::replay::config::validate_run;
use crate::replay::{Mode, OutputArgs};

/// Simulates a Mooncake trace offline — the mocker's engines, the indexer's radix index and
/// the router's policies and load view, in one process on simulated time, without NATS or
/// etcd — once per routing mode, and reports what `kvroute-replay` reports. Environment
/// fallbacks are `KVROUTE_SIM_*` only (kvroute-mocker's and kvroute-replay's variables do not
/// apply).
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Mooncake JSONL trace (relative paths are from the working directory).
    #[arg(
        long,
        env = "KVROUTE_SIM_TRACE",
        default_value = "../shared/traces/conversation_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Simulate only the first N requests of the trace (0 = all).
    #[arg(long, env = "KVROUTE_SIM_LIMIT", default_value_t = 0)]
    pub limit: usize,
    /// Factor on the trace's arrival times (0.5 = twice the request rate).
    #[arg(long, env = "KVROUTE_SIM_TIME_SCALE", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Routing modes to simulate, comma-separated, in order (`kv-approx`: the `kv` policy over
    /// workers that publish no KV events, predicted by the routers' approximate caches).
    #[arg(
        long,
        env = "KVROUTE_SIM_MODES",
        value_enum,
        value_delimiter = ',',
        default_value = "kv,round-robin,random,least-busy"
    )]
    pub modes: Vec<Mode>,
    /// Aggregated workers (worker ids 1..=N). Default 8, or 0 with --prefill-workers and
    /// --decode-workers.
    #[arg(long, env = "KVROUTE_SIM_WORKERS")]
    pub workers: Option<u32>,
    /// Prefill workers (the ids after the aggregated ones): with --decode-workers, a
    /// disaggregated fleet, served as the router serves one (see --disaggregation).
    #[arg(long, env = "KVROUTE_SIM_PREFILL_WORKERS", default_value_t = 0)]
    pub prefill_workers: u32,
    /// Decode workers (the last ids): they receive a paired request's prompt KV by transfer
    /// and compute its last token and the output.
    #[arg(long, env = "KVROUTE_SIM_DECODE_WORKERS", default_value_t = 0)]
    pub decode_workers: u32,
    /// How requests are served on a fleet with prefill and decode workers, as the router's
    /// `disaggregation.mode`: never, always, or conditional (by the policy file's
    /// `disaggregation` thresholds). Default: the policy file's mode, else always.
    #[arg(long, env = "KVROUTE_SIM_DISAGGREGATION", value_enum)]
    pub disaggregation: Option<DisaggregationArg>,
    /// Simulated milliseconds to move one engine block of KV from a prefill to a decode worker
    /// (every block of the prompt moves). Default 0.4, kvroute-mocker's
    /// --kv-transfer-ms-per-block: a 64-token block of an 8B model, 8 MiB, at about 25 GB/s.
    #[arg(
        long,
        env = "KVROUTE_SIM_KV_TRANSFER_MS_PER_BLOCK",
        default_value_t = 0.4
    )]
    pub kv_transfer_ms_per_block: f64,
    /// The last N workers are CPU workers: their cards carry `kvroute.io/device: cpu` and their
    /// engines' step costs are `--cpu-slowdown` times the others'.
    #[arg(long, env = "KVROUTE_SIM_CPU_WORKERS", default_value_t = 0)]
    pub cpu_workers: u32,
    /// How many times slower a CPU worker's engine is (step overhead, prefill, decode, shared
    /// loads), ≥ 1.
    #[arg(long, env = "KVROUTE_SIM_CPU_SLOWDOWN", default_value_t = 4.0)]
    pub cpu_slowdown: f64,
    /// Blocks of a shared KV tier per worker (0: none): every engine writes the prompts it
    /// computes through to one store that every engine loads from, and announces what it
    /// wrote in the shared tier (see `kvroute_mocker::shared_store`).
    #[arg(long, env = "KVROUTE_SIM_SHARED_CACHE_BLOCKS", default_value_t = 0)]
    pub shared_cache_blocks: u64,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Router replicas, each with its own load view and policy state; arrivals go to them in
    /// turn.
    #[arg(long, env = "KVROUTE_SIM_ROUTERS", default_value_t = 1)]
    pub routers: u32,
    /// Worker-selection YAML, as `kvroute-router --policy-config` takes it (the `kv` mode
    /// runs its aggregated selection).
    #[arg(long = "policy-config", env = "KVROUTE_SIM_POLICY_CONFIG")]
    pub policy_config: Option<PathBuf>,
    /// Simulated milliseconds from a worker's KV event to the index.
    #[arg(long, env = "KVROUTE_SIM_EVENT_DELAY_MS", default_value_t = 5.0)]
    pub event_delay_ms: f64,
    /// Simulated milliseconds from a decision, lifecycle event or load report to the router
    /// replicas.
    #[arg(long, env = "KVROUTE_SIM_SIGNAL_DELAY_MS", default_value_t = 5.0)]
    pub signal_delay_ms: f64,
    /// Simulated milliseconds between two load reports of a worker.
    #[arg(long, env = "KVROUTE_SIM_LOAD_INTERVAL_MS", default_value_t = 200.0)]
    pub load_interval_ms: f64,
    /// Workers send no load reports (as `kvroute-mocker --no-load-reports`): the routers' load
    /// views go by their predictions and the lifecycle events alone.
    #[arg(long, env = "KVROUTE_SIM_NO_LOAD_REPORTS")]
    pub no_load_reports: bool,
    /// The routers' `--load-report-interval-ms`: the report interval assumed until a worker's
    /// reports show it (simulated milliseconds).
    #[arg(long, env = "KVROUTE_SIM_REPORT_COVERS_MS", default_value_t = 1000.0)]
    pub report_covers_ms: f64,
    /// The routers' `--prediction-confirm-ms` (simulated milliseconds).
    #[arg(
        long,
        env = "KVROUTE_SIM_PREDICTION_CONFIRM_MS",
        default_value_t = 2000.0
    )]
    pub prediction_confirm_ms: f64,
    /// The routers' `--prediction-max-age-secs` (simulated seconds).
    #[arg(
        long,
        env = "KVROUTE_SIM_PREDICTION_MAX_AGE_SECS",
        default_value_t = 600.0
    )]
    pub prediction_max_age_secs: f64,
    /// The routers' `--predicted-overlap-ttl-ms` (simulated milliseconds; 0 turns predicted
    /// overlap off).
    #[arg(
        long,
        env = "KVROUTE_SIM_PREDICTED_OVERLAP_TTL_MS",
        default_value_t = 2000.0
    )]
    pub predicted_overlap_ttl_ms: f64,
    /// The routers' `--approx-cache-ttl-ms`: how long a prefix decided for a worker without KV
    /// events counts as held in its approximate cache (simulated milliseconds; 0 turns
    /// approximate mode off).
    #[arg(
        long,
        env = "KVROUTE_SIM_APPROX_CACHE_TTL_MS",
        default_value_t = 600_000.0
    )]
    pub approx_cache_ttl_ms: f64,
    /// The first N workers publish no KV events in every mode (a mixed fleet; the `kv-approx`
    /// mode runs the whole fleet without them).
    #[arg(long, env = "KVROUTE_SIM_NO_KV_EVENTS_WORKERS", default_value_t = 0)]
    pub no_kv_events_workers: u32,
    /// The routers' `--track-output-blocks`: count predicted requests' output blocks from the
    /// simulated workers' `progress` events.
    #[arg(long = "track-output-blocks", env = "KVROUTE_SIM_TRACK_OUTPUT_BLOCKS")]
    pub track_output_blocks: bool,
    /// The routers' `--prefill-load-model`: `full`, or `decay` (each rank's oldest predicted
    /// prefill decays over its predicted duration).
    #[arg(
        long = "prefill-load-model",
        env = "KVROUTE_SIM_PREFILL_LOAD_MODEL",
        value_enum,
        default_value_t = PrefillModelArg::Full
    )]
    pub prefill_load_model: PrefillModelArg,
    /// The routers' `--prefill-tokens-per-sec` (per simulated second; by default fitted).
    #[arg(
        long = "prefill-tokens-per-sec",
        env = "KVROUTE_SIM_PREFILL_TOKENS_PER_SEC"
    )]
    pub prefill_tokens_per_sec: Option<u64>,
    /// Do not send a trace row's `session_id` as the request's session (to compare routing
    /// with and without session affinity; the report still measures stickiness).
    #[arg(long, env = "KVROUTE_SIM_NO_SESSIONS")]
    pub no_sessions: bool,
    /// The routers' `--no-adapter-placement`: a request naming a LoRA adapter may go to any
    /// eligible worker, not only to the adapter's home and where it is resident.
    #[arg(long, env = "KVROUTE_SIM_NO_ADAPTER_PLACEMENT")]
    pub no_adapter_placement: bool,
    /// Workers report their adapter slots as vLLM's `lora_requests_info` does: only the
    /// adapters of running requests as loaded (an idle adapter still in its slot is not
    /// listed). By default they report every resident adapter.
    #[arg(long, env = "KVROUTE_SIM_RUNNING_ADAPTERS_ONLY")]
    pub running_adapters_only: bool,
    /// The routers' `--session-affinity`: hard (a session's binding is its target while
    /// eligible) or soft (a hint to the policy).
    #[arg(long, env = "KVROUTE_SIM_SESSION_AFFINITY", value_enum, default_value_t = AffinityArg::Hard)]
    pub session_affinity: AffinityArg,
    /// The routers' `--session-idle-ttl-secs`: a binding unused this long (simulated seconds)
    /// is dropped.
    #[arg(long, env = "KVROUTE_SIM_SESSION_IDLE_TTL_SECS", default_value_t = 600)]
    pub session_idle_ttl_secs: u64,
    /// Seed of the policies' random choices (each replica derives its own stream).
    #[arg(long, env = "KVROUTE_SIM_SEED", default_value_t = 42)]
    pub seed: u64,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// `--disaggregation`: the router's `disaggregation.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DisaggregationArg {
    Never,
    Always,
    Conditional,
}

impl From<DisaggregationArg> for Disaggregation {
    fn from(arg: DisaggregationArg) -> Self {
        match arg {
            DisaggregationArg::Never => Disaggregation::Never,
            DisaggregationArg::Always => Disaggregation::Always,
            DisaggregationArg::Conditional => Disaggregation::Conditional,
        }
    }
}

/// The sim's command: its flags include kvroute-mocker's engine flags and kvroute-replay's
/// output flags, whose `KVROUTE_MOCKER_*` / `KVROUTE_REPLAY_*` fallbacks are renamed to
/// `KVROUTE_SIM_*`, so a shell set up for those tools does not change the simulation.
impl clap::CommandFactory for SimArgs {
    fn command() -> Command {
        own_env_names(<Self as clap::Args>::augment_args(base_command()))
    }

    fn command_for_update() -> Command {
        own_env_names(<Self as clap::Args>::augment_args_for_update(base_command()))
    }
}

impl clap::Parser for SimArgs {}

fn base_command() -> Command {
    Command::new("kvroute-sim").version(env!("CARGO_PKG_VERSION"))
}

/// The other tools' environment prefixes, renamed to `KVROUTE_SIM_` in the sim's flags.
const FOREIGN_ENV_PREFIXES: [&str; 2] = ["KVROUTE_MOCKER_", "KVROUTE_REPLAY_"];

/// Renames the flattened flags' `KVROUTE_MOCKER_X` / `KVROUTE_REPLAY_X` fallbacks to
/// `KVROUTE_SIM_X` (shared ones such as `KVROUTE_LOG_FORMAT` stay).
fn own_env_names(command: Command) -> Command {
    command.mut_args(|arg| {
        let renamed = arg.get_env().and_then(|env| env.to_str()).and_then(|env| {
            FOREIGN_ENV_PREFIXES
                .iter()
                .find_map(|prefix| env.strip_prefix(prefix))
                .map(|rest| format!("KVROUTE_SIM_{rest}"))
        });
        match renamed {
            // clap keeps `'static` names: a few bytes per flag, once per parse.
            Some(name) => arg.env(&*Box::leak(name.into_boxed_str())),
            None => arg,
        }
    })
}

impl SimArgs {
    /// Checks every setting; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_run(&self.trace, self.time_scale, &self.modes)?;
        let disaggregated = self.prefill_workers > 0 || self.decode_workers > 0;
        if disaggregated && (self.prefill_workers == 0 || self.decode_workers == 0) {
            let field = match self.prefill_workers {
                0 => "prefill-workers",
                _ => "decode-workers",
            };
            return Err(ConfigError::new(
                field,
                "--prefill-workers and --decode-workers go together (both above 0)",
            ));
        }
        let total = u64::from(self.aggregated_workers())
            + u64::from(self.prefill_workers)
            + u64::from(self.decode_workers);
        if total > u64::from(MAX_WORKERS) {
            return Err(ConfigError::new(
                "workers",
                format!("at most {MAX_WORKERS} workers in all, got {total}"),
            ));
        }
        if self.aggregated_workers() == 0 && !disaggregated {
            return Err(ConfigError::new(
                "workers",
                "must be above 0 without --prefill-workers and --decode-workers",
            ));
        }
        if !(self.kv_transfer_ms_per_block.is_finite() && self.kv_transfer_ms_per_block >= 0.0) {
            return Err(ConfigError::new(
                "kv-transfer-ms-per-block",
                format!("must be 0 or more, got {}", self.kv_transfer_ms_per_block),
            ));
        }
        if self.routers == 0 || self.routers > 64 {
            return Err(ConfigError::new("routers", "must be 1..=64"));
        }
        if self.cpu_workers > self.aggregated_workers() {
            return Err(ConfigError::new(
                "cpu-workers",
                format!("must be at most --workers ({})", self.aggregated_workers()),
            ));
        }
        if self.no_kv_events_workers > self.fleet_size() {
            return Err(ConfigError::new(
                "no-kv-events-workers",
                format!("must be at most the fleet's {} workers", self.fleet_size()),
            ));
        }
        if !(self.cpu_slowdown.is_finite() && self.cpu_slowdown >= 1.0) {
            return Err(ConfigError::new("cpu-slowdown", "must be a number ≥ 1"));
        }
        self.engine.validate()?;
        if let Some(path) = &self.policy_config {
            kvroute_common::config::check_file("policy-config", path)?;
        }
        let times = [
            ("event-delay-ms", self.event_delay_ms, false),
            ("signal-delay-ms", self.signal_delay_ms, false),
            ("load-interval-ms", self.load_interval_ms, true),
            ("report-covers-ms", self.report_covers_ms, false),
            ("prediction-confirm-ms", self.prediction_confirm_ms, false),
            (
                "predicted-overlap-ttl-ms",
                self.predicted_overlap_ttl_ms,
                false,
            ),
            ("approx-cache-ttl-ms", self.approx_cache_ttl_ms, false),
            (
                "prediction-max-age-secs",
                self.prediction_max_age_secs,
                true,
            ),
        ];
        self.load_models()?;
        if self.session_idle_ttl_secs == 0 {
            return Err(ConfigError::new("session-idle-ttl-secs", "must be above 0"));
        }
        for (field, value, positive) in times {
            let ok = (0.0..1e9).contains(&value) && (!positive || value > 0.0);
            if !ok {
                let range = if positive { "> 0" } else { "≥ 0" };
                return Err(ConfigError::new(
                    field,
                    format!("must be a finite number {range}, got {value}"),
                ));
            }
        }
        self.output.validate()
    }

    /// Aggregated workers: `--workers`, by default 8, or 0 on a disaggregated fleet.
    pub fn aggregated_workers(&self) -> u32 {
        let disaggregated = self.prefill_workers > 0 && self.decode_workers > 0;
        self.workers.unwrap_or(if disaggregated { 0 } else { 8 })
    }

    /// Every worker: aggregated, prefill and decode.
    pub fn fleet_size(&self) -> u32 {
        self.aggregated_workers()
            .saturating_add(self.prefill_workers)
            .saturating_add(self.decode_workers)
    }

    /// The routers' load models (validated as the router validates its flags).
    pub fn load_models(&self) -> Result<LoadModels, ConfigError> {
        LoadModelArgs {
            track_output_blocks: self.track_output_blocks,
            prefill_load_model: self.prefill_load_model,
            prefill_tokens_per_sec: self.prefill_tokens_per_sec,
        }
        .models()
    }

    /// The routers' session settings.
    pub fn sessions(&self) -> SessionConfig {
        self.session_affinity.sessions(self.session_idle_ttl_secs)
    }

    pub fn millis(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> SimArgs {
        let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let mut all = vec!["kvroute-sim", "--trace", trace];
        all.extend_from_slice(args);
        SimArgs::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_are_valid() {
        let a = parse(&[]);
        a.validate().unwrap();
        assert_eq!((a.aggregated_workers(), a.routers, a.limit), (8, 1, 0));
        let d = parse(&["--prefill-workers", "4", "--decode-workers", "4"]);
        d.validate().unwrap();
        assert_eq!((d.aggregated_workers(), d.fleet_size()), (0, 8));
        assert_eq!(d.kv_transfer_ms_per_block, 0.4);
        assert_eq!(a.modes, Mode::ALL.to_vec());
    }

    #[test]
    fn the_sim_reads_only_its_own_environment_names() {
        use clap::CommandFactory;
        let names: Vec<String> = SimArgs::command()
            .get_arguments()
            .filter_map(|a| Some(a.get_env()?.to_str()?.to_owned()))
            .collect();
        assert!(
            names.contains(&"KVROUTE_SIM_NUM_BLOCKS".to_owned()),
            "{names:?}"
        );
        assert!(
            names.contains(&"KVROUTE_SIM_JSON_OUT".to_owned()),
            "{names:?}"
        );
        for name in &names {
            assert!(
                name.starts_with("KVROUTE_SIM_") || name == "KVROUTE_LOG_FORMAT",
                "{name}"
            );
        }
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
    }

    /// Runs in a child process of this test binary with the variables set (setting them here
    /// would reach the other tests' parses, which run on other threads).
    #[test]
    fn the_mockers_and_replays_variables_do_not_change_the_sim() {
        const CHILD: &str = "KVROUTE_SIM_CONFIG_TEST_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let a = parse(&[]);
            let defaults = kvroute_mocker::fleet::EngineArgs::default();
            assert_eq!(a.engine.num_blocks, defaults.num_blocks);
            assert_eq!(a.output.json_out, None);
            assert_eq!(a.engine.block_size, 32, "its own name is read");
            return;
        }
        let name = "sim::config::tests::the_mockers_and_replays_variables_do_not_change_the_sim";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--test-threads", "1"])
            .env(CHILD, "1")
            .env("KVROUTE_MOCKER_NUM_BLOCKS", "77")
            .env("KVROUTE_REPLAY_JSON_OUT", "/tmp/from-replay.json")
            .env("KVROUTE_SIM_BLOCK_SIZE", "32")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn validation_names_the_flag() {
        let field = |args: &[&str]| parse(args).validate().unwrap_err().field;
        assert_eq!(field(&["--time-scale", "0"]), "time-scale");
        assert_eq!(field(&["--modes", "kv,kv"]), "modes");
        assert_eq!(field(&["--workers", "0"]), "workers");
        assert_eq!(field(&["--prefill-workers", "4"]), "decode-workers");
        assert_eq!(field(&["--decode-workers", "4"]), "prefill-workers");
        assert_eq!(
            field(&["--kv-transfer-ms-per-block=-1"]),
            "kv-transfer-ms-per-block"
        );
        assert_eq!(field(&["--routers", "0"]), "routers");
        assert_eq!(field(&["--num-blocks", "0"]), "num-blocks");
        assert_eq!(field(&["--load-interval-ms", "0"]), "load-interval-ms");
        assert_eq!(field(&["--event-delay-ms=-1"]), "event-delay-ms");
        assert_eq!(
            field(&["--prefill-tokens-per-sec", "1000"]),
            "prefill-tokens-per-sec"
        );
        assert_eq!(
            field(&["--session-idle-ttl-secs", "0"]),
            "session-idle-ttl-secs"
        );
        assert_eq!(
            field(&["--policy-config", "/nonexistent.yaml"]),
            "policy-config"
        );
    }
}
