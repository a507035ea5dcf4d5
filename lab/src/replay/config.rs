//! The replay tool's settings: the trace and its time scaling, the routing modes to compare,
//! where selections come from, and the outputs. Parsed by `kvroute-replay`, checked once by
//! [`ReplayArgs::validate`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_common::client::SelectRetryArgs;
use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs};
use kvroute_common::telemetry::TelemetryArgs;

use super::chart::DEFAULT_FONT;

/// A routing mode to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Mode {
    /// The router's configured (KV-aware) policy.
    Kv,
    /// `kvroute-sim` only: the configured policy over workers that publish no KV events
    /// (approximate mode: the routers predict their caches from the decisions).
    KvApprox,
    RoundRobin,
    Random,
    LeastBusy,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Kv, Mode::RoundRobin, Mode::Random, Mode::LeastBusy];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Kv => "kv",
            Mode::KvApprox => "kv-approx",
            Mode::RoundRobin => "round-robin",
            Mode::Random => "random",
            Mode::LeastBusy => "least-busy",
        }
    }

    /// The `policy` a selection request asks the router for (`None`: the configured one).
    pub fn router_policy(self) -> Option<&'static str> {
        match self {
            Mode::Kv | Mode::KvApprox => None,
            other => Some(other.as_str()),
        }
    }

    /// The policy this mode runs for `model` (an aggregated partition): the configured
    /// selection for `kv`, the named built-in otherwise.
    pub fn build_policy(
        self,
        policies: &kvroute_router::registry::ResolvedPolicies,
        model: &str,
    ) -> anyhow::Result<kvroute_router::pipeline::WorkerSelectionPolicy> {
        self.build_policy_for(
            policies,
            kvroute_common::messages::WorkerRole::Aggregated,
            model,
        )
    }

    /// The policy this mode runs for `model`'s partition of `role`: the role's configured
    /// selection for `kv`, the named built-in otherwise.
    pub fn build_policy_for(
        self,
        policies: &kvroute_router::registry::ResolvedPolicies,
        role: kvroute_common::messages::WorkerRole,
        model: &str,
    ) -> anyhow::Result<kvroute_router::pipeline::WorkerSelectionPolicy> {
        Ok(match self.router_policy() {
            None => policies.build(role, model)?,
            Some(name) => policies
                .build_named(name, role, model)
                .ok_or_else(|| anyhow::anyhow!("no policy named {name:?} is registered"))??,
        })
    }
}

impl Mode {
    /// Whether the mode's workers publish KV events (all but `kv-approx`'s).
    pub fn kv_events(self) -> bool {
        self != Mode::KvApprox
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who picks the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SelectorKind {
    /// kvroute routers on `kvroute.<ns>.select` (any number of replicas).
    #[default]
    Router,
    /// An in-process approximation of each mode (no router needed; `kv` assumes each worker
    /// caches what was sent to it, LRU-bounded by its card's capacity).
    Local,
    /// A kvroute-gateway's OpenAI API at `--gateway-url`: the gateway selects through the
    /// routers and forwards (on a prefill/decode fleet it runs the hand-off); every request is
    /// streamed, and the client measures TTFT and inter-token latency. The `kv` mode only (the
    /// routers' configured policy), on the fleet as it is (no cache reset): its workers are
    /// engines behind kvroute-bridge.
    Gateway,
}

/// Replays a Mooncake trace through kvroute's routers onto a (mocker) fleet, once per routing
/// mode, and reports cache hits against the oracles, latency, throughput, load spread and
/// errors.
///
/// SIGTERM or Ctrl-C stops a run early: nothing more is sent, the requests sent are waited for,
/// and the report covers what ran (the rest counted as not sent; later modes do not run). A
/// second signal ends the process at once (status 130).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "kvroute-replay", version)]
pub struct ReplayArgs {
    /// Mooncake JSONL trace (relative paths are from the working directory).
    #[arg(
        long,
        env = "KVROUTE_REPLAY_TRACE",
        default_value = "../shared/traces/conversation_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Replay only the first N requests of the trace (0 = all).
    #[arg(long, env = "KVROUTE_REPLAY_LIMIT", default_value_t = 1000)]
    pub limit: usize,
    /// Factor on the trace's arrival times, giving simulated arrival times (0.5 = twice the
    /// request rate).
    #[arg(
        long,
        env = "KVROUTE_REPLAY_TIME_SCALE",
        default_value_t = 1.0,
        conflicts_with = "target_duration_secs"
    )]
    pub time_scale: f64,
    /// Instead of --time-scale: scale arrivals so the last one comes this many simulated
    /// seconds after the first.
    #[arg(long, env = "KVROUTE_REPLAY_TARGET_DURATION_SECS")]
    pub target_duration_secs: Option<f64>,
    /// Routing modes to measure, comma-separated, in order.
    #[arg(
        long,
        env = "KVROUTE_REPLAY_MODES",
        value_enum,
        value_delimiter = ',',
        default_value = "kv,round-robin,random,least-busy"
    )]
    pub modes: Vec<Mode>,
    /// Where selections come from.
    #[arg(long, env = "KVROUTE_REPLAY_SELECTOR", value_enum, default_value_t = SelectorKind::Router)]
    pub selector: SelectorKind,
    /// With `--selector gateway`: the gateway's base URL (`http://host:port`).
    #[arg(long, env = "KVROUTE_REPLAY_GATEWAY_URL")]
    pub gateway_url: Option<String>,
    /// With `--selector gateway`: an API key the gateway accepts (when it asks for one).
    #[arg(long, env = "KVROUTE_REPLAY_GATEWAY_API_KEY", hide_env_values = true)]
    pub gateway_api_key: Option<String>,
    /// Model name to request (the workers' cards must serve it).
    #[arg(long, env = "KVROUTE_REPLAY_MODEL", default_value = "mock-model")]
    pub model: String,
    /// Simulated seconds per wall second of the fleet; default: the workers' card label
    /// `kvroute.mocker/speedup`, else 1.
    #[arg(long, env = "KVROUTE_REPLAY_SPEEDUP")]
    pub speedup: Option<f64>,
    #[command(flatten)]
    pub select: SelectRetryArgs,
    /// Wall-clock seconds to wait for a worker to finish a request.
    #[arg(
        long,
        env = "KVROUTE_REPLAY_REQUEST_TIMEOUT_SECS",
        default_value_t = 120.0
    )]
    pub request_timeout_secs: f64,
    /// Wall-clock seconds to wait for workers to register before the first mode.
    #[arg(long, env = "KVROUTE_REPLAY_WAIT_WORKERS_SECS", default_value_t = 30.0)]
    pub wait_workers_secs: f64,
    /// Do not reset the workers' caches before each mode (they must be kvroute-mocker
    /// workers to reset; without reset, later modes inherit warm caches).
    #[arg(long, env = "KVROUTE_REPLAY_NO_RESET")]
    pub no_reset: bool,
    /// Do not send a trace row's `session_id` as the request's session (to compare routing
    /// with and without session affinity; the report still measures stickiness).
    #[arg(long, env = "KVROUTE_REPLAY_NO_SESSIONS")]
    pub no_sessions: bool,
    /// Wall-clock milliseconds to wait after the resets, so indexers and routers see them.
    #[arg(long, env = "KVROUTE_REPLAY_SETTLE_MS", default_value_t = 500)]
    pub settle_ms: u64,
    /// Seed of the local selector's random choices.
    #[arg(long, env = "KVROUTE_REPLAY_SEED", default_value_t = 42)]
    pub seed: u64,
    /// The run fails (exit code 3, after the report is printed and written) when, in any mode,
    /// more than this fraction of the requests failed: selection failures (`select_*`: an
    /// error reply, or no router answering) plus worker failures (`worker_*`: an error reply,
    /// no worker listening, a timeout). A healthy fleet completes every request; 0.01 lets a
    /// long run lose a rare request while a run whose numbers stand on a visibly incomplete
    /// set of requests fails. 1 never fails.
    #[arg(
        long,
        env = "KVROUTE_REPLAY_MAX_ERROR_FRACTION",
        default_value_t = DEFAULT_MAX_ERROR_FRACTION
    )]
    pub max_error_fraction: f64,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// `--max-error-fraction`'s default.
pub const DEFAULT_MAX_ERROR_FRACTION: f64 = 0.01;

/// The checks `kvroute-replay` and `kvroute-sim` share: the trace file exists, the time scale
/// is a positive number, and the modes are a non-empty list without repeats.
pub fn validate_run(trace: &Path, time_scale: f64, modes: &[Mode]) -> Result<(), ConfigError> {
    kvroute_common::config::check_file("trace", trace)?;
    positive("time-scale", time_scale)?;
    if modes.is_empty() {
        return Err(ConfigError::new("modes", "name at least one mode"));
    }
    let mut seen = modes.to_vec();
    seen.sort();
    seen.dedup();
    if seen.len() != modes.len() {
        return Err(ConfigError::new("modes", "a mode is listed twice"));
    }
    Ok(())
}

fn positive(field: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("must be a positive number, got {value}"),
        ))
    }
}

impl ReplayArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_run(&self.trace, self.time_scale, &self.modes)?;
        if self.modes.contains(&Mode::KvApprox) {
            return Err(ConfigError::new(
                "modes",
                "kv-approx is kvroute-sim's; against live routers run kvroute-mocker --no-kv-events and the kv mode",
            ));
        }
        if let Some(d) = self.target_duration_secs {
            positive("target-duration-secs", d)?;
        }
        match (self.selector, &self.gateway_url) {
            (SelectorKind::Gateway, None) => {
                return Err(ConfigError::new(
                    "gateway-url",
                    "--selector gateway needs the gateway's base URL",
                ));
            }
            (SelectorKind::Gateway, Some(url))
                if !(url.starts_with("http://") || url.starts_with("https://")) =>
            {
                return Err(ConfigError::new(
                    "gateway-url",
                    format!("must be an http:// or https:// URL, got {url:?}"),
                ));
            }
            (SelectorKind::Gateway, Some(_)) if self.modes != [Mode::Kv] => {
                return Err(ConfigError::new(
                    "modes",
                    "--selector gateway runs the kv mode only (the routers' configured policy)",
                ));
            }
            (SelectorKind::Router | SelectorKind::Local, Some(_)) => {
                return Err(ConfigError::new(
                    "gateway-url",
                    "only with --selector gateway",
                ));
            }
            _ => {}
        }
        if self.model.trim().is_empty() {
            return Err(ConfigError::new("model", "must not be empty"));
        }
        if let Some(s) = self.speedup {
            positive("speedup", s)?;
        }
        self.select.validate()?;
        positive("request-timeout-secs", self.request_timeout_secs)?;
        positive("wait-workers-secs", self.wait_workers_secs)?;
        if !(0.0..=1.0).contains(&self.max_error_fraction) {
            return Err(ConfigError::new(
                "max-error-fraction",
                format!("must be in [0, 1], got {}", self.max_error_fraction),
            ));
        }
        self.output.validate()?;
        self.nats.validate()?;
        self.etcd.validate()
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.request_timeout_secs)
    }
}

/// Where a run's report goes: the table (or JSON only) on stdout, a JSON file, a PNG chart.
/// Shared by `kvroute-replay` and `kvroute-sim`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OutputArgs {
    /// Write the JSON report here.
    #[arg(long, env = "KVROUTE_REPLAY_JSON_OUT")]
    pub json_out: Option<PathBuf>,
    /// Draw the PNG chart (TTFT percentiles and hit rate per mode) here.
    #[arg(long, env = "KVROUTE_REPLAY_CHART_OUT")]
    pub chart_out: Option<PathBuf>,
    /// TrueType font for the chart's text.
    #[arg(long, env = "KVROUTE_REPLAY_FONT", default_value = DEFAULT_FONT)]
    pub font: PathBuf,
    /// No progress bar; print only the summary.
    #[arg(long, short)]
    pub quiet: bool,
    /// Print only the JSON report on stdout (no progress bar, no table).
    #[arg(long)]
    pub json: bool,
}

impl OutputArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.chart_out.is_some() {
            kvroute_common::config::check_file("font", &self.font).map_err(|mut e| {
                e.message.push_str(" (needed by --chart-out)");
                e
            })?;
        }
        Ok(())
    }

    /// Whether a progress bar and tables go to the terminal.
    pub fn interactive(&self) -> bool {
        !self.quiet && !self.json
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> ReplayArgs {
        let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let mut all = vec!["kvroute-replay", "--trace", trace];
        all.extend_from_slice(args);
        ReplayArgs::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_are_valid_and_modes_parse() {
        let a = parse(&[]);
        a.validate().unwrap();
        assert_eq!(a.modes, Mode::ALL.to_vec());
        let a = parse(&["--modes", "least-busy,kv", "--selector", "local"]);
        assert_eq!(a.modes, vec![Mode::LeastBusy, Mode::Kv]);
        assert_eq!(a.selector, SelectorKind::Local);
        assert_eq!(Mode::Kv.router_policy(), None);
        assert_eq!(Mode::RoundRobin.router_policy(), Some("round-robin"));
    }

    #[test]
    fn validation_names_the_flag() {
        let field = |args: &[&str]| parse(args).validate().unwrap_err().field;
        assert_eq!(field(&["--time-scale", "0"]), "time-scale");
        assert_eq!(
            field(&["--target-duration-secs=-1"]),
            "target-duration-secs"
        );
        assert_eq!(field(&["--modes", "kv,kv"]), "modes");
        assert_eq!(field(&["--modes", "kv,kv-approx"]), "modes");
        assert_eq!(
            field(&["--selector", "gateway", "--modes", "kv"]),
            "gateway-url"
        );
        let gateway = ["--selector", "gateway", "--gateway-url"];
        assert_eq!(
            field(&[&gateway[..], &["localhost:8080", "--modes", "kv"]].concat()),
            "gateway-url"
        );
        assert_eq!(
            field(&[&gateway[..], &["http://127.0.0.1:8080"]].concat()),
            "modes",
            "the default modes are more than kv"
        );
        parse(&[&gateway[..], &["http://127.0.0.1:8080", "--modes", "kv"]].concat())
            .validate()
            .unwrap();
        assert_eq!(field(&["--gateway-url", "http://x"]), "gateway-url");
        assert_eq!(field(&["--speedup", "0"]), "speedup");
        assert_eq!(
            field(&["--max-error-fraction", "1.5"]),
            "max-error-fraction"
        );
        assert_eq!(field(&["--max-error-fraction=-0.1"]), "max-error-fraction");
        assert_eq!(parse(&[]).max_error_fraction, DEFAULT_MAX_ERROR_FRACTION);
        let mut missing = parse(&[]);
        missing.trace = "/nonexistent.jsonl".into();
        assert_eq!(missing.validate().unwrap_err().field, "trace");
        assert_eq!(
            field(&["--chart-out", "x.png", "--font", "/nonexistent.ttf"]),
            "font"
        );
        assert!(
            ReplayArgs::try_parse_from([
                "kvroute-replay",
                "--time-scale",
                "2",
                "--target-duration-secs",
                "3"
            ])
            .is_err(),
            "the two scalings conflict"
        );
    }
}
