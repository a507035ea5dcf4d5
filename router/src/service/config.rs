//! The router process's configuration: CLI flags with `KVROUTE_*` environment fallbacks (clap
//! reads them in the binary), validated once at startup; [`RouterConfig::validate`] names the
//! bad flag.

use std::net::SocketAddr;
use std::path::PathBuf;

use kvroute_common::cli::Origins;
use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs};
use kvroute_common::telemetry::TelemetryArgs;

use super::load_models::LoadModelArgs;
use crate::eligibility::{BusyThresholds, PrefillLimit};
use crate::queue::QueueConfig;
use crate::registry::{Override, PolicyOverrides};
use crate::select::SelectionSettings;
use crate::session::{AffinityMode, SessionConfig};

/// Where prefix overlap comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OverlapMode {
    /// Ask the indexer replicas on `kvroute.<ns>.index.query`, with a deadline.
    #[default]
    Remote,
    /// Keep an embedded index replica (snapshot + log, like an indexer).
    Local,
}

/// Session affinity mode (see `AffinityMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AffinityArg {
    /// The binding is the exact target while eligible.
    #[default]
    Hard,
    /// The binding is a hint the policy may override.
    Soft,
}

impl AffinityArg {
    /// The session table's settings for this mode and an idle TTL in seconds.
    pub fn sessions(self, idle_ttl_secs: u64) -> SessionConfig {
        SessionConfig {
            mode: match self {
                AffinityArg::Hard => AffinityMode::Hard,
                AffinityArg::Soft => AffinityMode::Soft,
            },
            idle_ttl_ms: idle_ttl_secs.saturating_mul(1000),
        }
    }
}

/// Everything `kvroute-router` needs.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvroute-router",
    version,
    about = "kvroute router: answers which worker should serve a request (NATS queue group on kvroute.<ns>.select)"
)]
pub struct RouterConfig {
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,

    /// This replica's id, reported in replies and decisions (default: router-<random>).
    #[arg(long = "router-id", env = "KVROUTE_ROUTER_ID")]
    pub router_id: Option<String>,
    /// Address of /metrics, /healthz, /readyz, /status (port 0: any free port).
    #[arg(
        long = "http-addr",
        env = "KVROUTE_HTTP_ADDR",
        default_value = "127.0.0.1:9200"
    )]
    pub http_addr: SocketAddr,

    /// Worker-selection YAML (a top-level `worker_selection:` key).
    #[arg(long = "policy-config", env = "KVROUTE_POLICY_CONFIG")]
    pub policy_config: Option<PathBuf>,
    /// Policy for every role (an instance name or a registered type); below the role flags,
    /// above the YAML.
    #[arg(
        long = "worker-selection-policy",
        env = "KVROUTE_WORKER_SELECTION_POLICY"
    )]
    pub worker_selection_policy: Option<String>,
    /// Policy for prefill workers; overrides every other selection for that role.
    #[arg(long = "prefill-policy", env = "KVROUTE_PREFILL_POLICY")]
    pub prefill_policy: Option<String>,
    /// Policy for decode workers; overrides every other selection for that role.
    #[arg(long = "decode-policy", env = "KVROUTE_DECODE_POLICY")]
    pub decode_policy: Option<String>,
    /// Seed of the policies' random generators (default: from the OS).
    #[arg(long = "seed", env = "KVROUTE_SEED")]
    pub seed: Option<u64>,

    /// Where overlap comes from: remote (indexer queries) or local (embedded replica).
    #[arg(long = "overlap-mode", env = "KVROUTE_OVERLAP_MODE", value_enum, default_value_t = OverlapMode::Remote)]
    pub overlap_mode: OverlapMode,
    /// Deadline of a remote overlap query, in milliseconds, shared by its attempts; past it,
    /// score on load alone.
    #[arg(
        long = "index-query-timeout-ms",
        env = "KVROUTE_INDEX_QUERY_TIMEOUT_MS",
        default_value_t = 50
    )]
    pub index_query_timeout_ms: u64,
    /// Attempts of a remote overlap query within its deadline (each waits an equal share); a
    /// retry goes to the indexer replica that answered last.
    #[arg(
        long = "index-query-attempts",
        env = "KVROUTE_INDEX_QUERY_ATTEMPTS",
        default_value_t = 2
    )]
    pub index_query_attempts: u32,
    /// Local mode: ready only when at most this many log messages are not yet applied.
    #[arg(
        long = "ready-max-lag",
        env = "KVROUTE_READY_MAX_LAG",
        default_value_t = 1000
    )]
    pub ready_max_lag: u64,

    /// Session affinity: hard (the binding is the target) or soft (a hint to the policy).
    #[arg(long = "session-affinity", env = "KVROUTE_SESSION_AFFINITY", value_enum, default_value_t = AffinityArg::Hard)]
    pub session_affinity: AffinityArg,
    /// A binding unused for this long is dropped (the bucket's max age), in seconds.
    #[arg(
        long = "session-idle-ttl-secs",
        env = "KVROUTE_SESSION_IDLE_TTL_SECS",
        default_value_t = 600
    )]
    pub session_idle_ttl_secs: u64,
    /// Replicas of the sessions bucket when this replica creates it (1 on one NATS node).
    #[arg(
        long = "session-bucket-replicas",
        env = "KVROUTE_SESSION_BUCKET_REPLICAS",
        default_value_t = 1
    )]
    pub session_bucket_replicas: usize,

    /// Workers' load report interval assumed until a rank's reports show it, in milliseconds:
    /// a report that does not name its new requests is taken to count the load predicted
    /// more than one interval before it. Each rank's real interval is learned from its reports.
    #[arg(
        long = "load-report-interval-ms",
        env = "KVROUTE_LOAD_REPORT_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub load_report_interval_ms: u64,
    /// Predicted load of a request that no report names goes after this long, in
    /// milliseconds, for workers whose reports name their new requests (at least two of the
    /// rank's report intervals): the time from a decision to the report counting it.
    #[arg(
        long = "prediction-confirm-ms",
        env = "KVROUTE_PREDICTION_CONFIRM_MS",
        default_value_t = 2000
    )]
    pub prediction_confirm_ms: u64,
    /// Predicted load of a request with no lifecycle event and no newer report is dropped
    /// after this long, in seconds.
    #[arg(
        long = "prediction-max-age-secs",
        env = "KVROUTE_PREDICTION_MAX_AGE_SECS",
        default_value_t = 600
    )]
    pub prediction_max_age_secs: u64,
    /// A decision's prompt counts as overlap on its rank for this long, in milliseconds, until
    /// the worker's own KV events show what it holds (predicted overlap; 0 turns it off).
    #[arg(
        long = "predicted-overlap-ttl-ms",
        env = "KVROUTE_PREDICTED_OVERLAP_TTL_MS",
        default_value_t = 2000
    )]
    pub predicted_overlap_ttl_ms: u64,
    /// For a worker whose card says it publishes no KV events (`kv_events: false`), a prefix
    /// decided for it counts as held in its approximate cache (bounded by its card's
    /// `total_kv_blocks`, least recently decided out first) for this long after its last
    /// decision, in milliseconds (approximate mode; 0 turns it off: such workers are then
    /// routed on load alone). The cache's bound does the real work; the TTL only limits how
    /// long a prediction can drift from the engine, and a conversation's next turn often comes
    /// minutes later (120 s kept 75 % of the event-driven hit rate on the conversation trace,
    /// 300 s or more all of it).
    #[arg(
        long = "approx-cache-ttl-ms",
        env = "KVROUTE_APPROX_CACHE_TTL_MS",
        default_value_t = 600_000
    )]
    pub approx_cache_ttl_ms: u64,
    /// The load view's optional models (output blocks, prefill decay).
    #[command(flatten)]
    pub load_models: LoadModelArgs,
    /// Decide every request here instead of forwarding it to its partition's owner (by
    /// default each (model, role) partition has one owning replica among the serving ones,
    /// registered in etcd, and the others forward its requests there).
    #[arg(long = "no-partition-owner", env = "KVROUTE_NO_PARTITION_OWNER")]
    pub no_partition_owner: bool,
    /// How long a forwarded request waits for its partition's owner before this replica
    /// decides it itself, in milliseconds (shortened to the request's deadline). Below the
    /// clients' first attempt timeout (250 ms), so a stalled owner costs a request this
    /// long, not a retry.
    #[arg(
        long = "forward-timeout-ms",
        env = "KVROUTE_FORWARD_TIMEOUT_MS",
        default_value_t = 150
    )]
    pub forward_timeout_ms: u64,
    /// TTL of this replica's registration in etcd while it serves, in seconds (at least 2):
    /// an owner that dies is replaced within it.
    #[arg(
        long = "router-lease-ttl-secs",
        env = "KVROUTE_ROUTER_LEASE_TTL_SECS",
        default_value_t = 2
    )]
    pub router_lease_ttl_secs: u64,

    /// A rank is busy (not eligible) above this fraction of its KV blocks in decode (off by default).
    #[arg(
        long = "busy-decode-blocks-fraction",
        env = "KVROUTE_BUSY_DECODE_BLOCKS_FRACTION"
    )]
    pub busy_decode_blocks_fraction: Option<f64>,
    /// A rank is busy above this many active prefill tokens (off by default).
    #[arg(long = "busy-prefill-tokens", env = "KVROUTE_BUSY_PREFILL_TOKENS")]
    pub busy_prefill_tokens: Option<u64>,
    /// Cost multiplier in (0, 1] of a worker carrying one of the request's preferred taints.
    #[arg(
        long = "preferred-taint-multiplier",
        env = "KVROUTE_PREFERRED_TAINT_MULTIPLIER",
        default_value_t = 0.8
    )]
    pub preferred_taint_multiplier: f64,
    /// Do not place LoRA adapters: a request naming an adapter may go to any eligible worker
    /// (by default only to the adapter's home workers, sized by its share of demand, and to
    /// workers where it is resident).
    #[arg(long = "no-adapter-placement", env = "KVROUTE_NO_ADAPTER_PLACEMENT")]
    pub no_adapter_placement: bool,
    /// Admission queue: cost units (requests, unless a classifier says otherwise) that may
    /// wait per (model, role) partition when every eligible worker is busy; a request that
    /// does not fit is answered `queue_full`. 0: no queue (`all_overloaded` at once).
    #[arg(
        long = "queue-max-len",
        env = "KVROUTE_QUEUE_MAX_LEN",
        default_value_t = QueueConfig::default().max_len
    )]
    pub queue_max_len: u32,
    /// How long a queued request without its own `queue_timeout_ms` waits before it is
    /// answered `queue_timeout`, in milliseconds (never past its attempt's deadline).
    #[arg(
        long = "queue-timeout-ms",
        env = "KVROUTE_QUEUE_TIMEOUT_MS",
        default_value_t = QueueConfig::default().default_timeout_ms
    )]
    pub queue_timeout_ms: u64,
    /// The longest `queue_timeout_ms` a request may ask for, in milliseconds.
    #[arg(
        long = "queue-max-timeout-ms",
        env = "KVROUTE_QUEUE_MAX_TIMEOUT_MS",
        default_value_t = QueueConfig::default().max_timeout_ms
    )]
    pub queue_max_timeout_ms: u64,
    /// The largest `priority_jump_ms` honoured, in milliseconds: a request is overtaken within
    /// its class and priority only by requests that arrived at most this much after it.
    #[arg(
        long = "queue-max-priority-jump-ms",
        env = "KVROUTE_QUEUE_MAX_PRIORITY_JUMP_MS",
        default_value_t = QueueConfig::default().max_priority_jump_ms
    )]
    pub queue_max_priority_jump_ms: u64,
    /// The starvation bound, in milliseconds: a request queued this long goes ahead of every
    /// class and priority (oldest first).
    #[arg(
        long = "queue-age-limit-ms",
        env = "KVROUTE_QUEUE_AGE_LIMIT_MS",
        default_value_t = QueueConfig::default().age_limit_ms
    )]
    pub queue_age_limit_ms: u64,
    /// Selections handled concurrently; more wait for a slot.
    #[arg(
        long = "max-in-flight",
        env = "KVROUTE_MAX_IN_FLIGHT",
        default_value_t = 1024
    )]
    pub max_in_flight: usize,
    /// Falling behind, in milliseconds: when the runtime's timers fire this late, or a
    /// selection has been in flight this long, the replica leaves the select queue group
    /// until both stay under half of it for as long again.
    #[arg(
        long = "max-lag-ms",
        env = "KVROUTE_MAX_LAG_MS",
        default_value_t = 1000
    )]
    pub max_lag_ms: u64,

    /// Where each flag's value came from (the binary records it after parsing), so errors
    /// name the environment variable of a value that came from one.
    #[arg(skip)]
    pub origins: Origins,
}

impl RouterConfig {
    /// Checks every setting; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.nats.validate()?;
        self.etcd.validate()?;
        if let Some(id) = &self.router_id
            && !kvroute_common::ids::is_subject_token(id, 128)
        {
            return Err(ConfigError::new(
                "router-id",
                "must be 1-128 characters of [A-Za-z0-9_-] (it is a NATS subject token)",
            ));
        }
        if let Some(path) = &self.policy_config {
            kvroute_common::config::check_file("policy-config", path)?;
        }
        kvroute_common::jetstream::validate_replicas(
            "session-bucket-replicas",
            self.session_bucket_replicas,
        )?;
        let positive = [
            ("index-query-timeout-ms", self.index_query_timeout_ms),
            ("index-query-attempts", u64::from(self.index_query_attempts)),
            ("max-lag-ms", self.max_lag_ms),
            ("session-idle-ttl-secs", self.session_idle_ttl_secs),
            ("load-report-interval-ms", self.load_report_interval_ms),
            ("prediction-confirm-ms", self.prediction_confirm_ms),
            ("prediction-max-age-secs", self.prediction_max_age_secs),
            ("max-in-flight", self.max_in_flight as u64),
            ("forward-timeout-ms", self.forward_timeout_ms),
            ("queue-timeout-ms", self.queue_timeout_ms),
            ("queue-max-timeout-ms", self.queue_max_timeout_ms),
            ("queue-age-limit-ms", self.queue_age_limit_ms),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(field, "must be above 0"));
            }
        }
        if u64::from(self.index_query_attempts) > self.index_query_timeout_ms {
            return Err(ConfigError::new(
                "index-query-attempts",
                "must be at most --index-query-timeout-ms (each attempt waits at least 1 ms)",
            ));
        }
        if self.router_lease_ttl_secs < 2 {
            return Err(ConfigError::new(
                "router-lease-ttl-secs",
                "must be at least 2 (etcd's shortest lease)",
            ));
        }
        if self.queue_timeout_ms > self.queue_max_timeout_ms {
            return Err(ConfigError::new(
                "queue-timeout-ms",
                format!(
                    "must be at most --queue-max-timeout-ms ({})",
                    self.queue_max_timeout_ms
                ),
            ));
        }
        self.load_models.models()?;
        if self.busy_prefill_tokens == Some(0) {
            return Err(ConfigError::new("busy-prefill-tokens", "must be above 0"));
        }
        if let Err(e) = self.selection_settings().validate() {
            let field = match e {
                crate::select::SelectionSettingsError::Busy(_) => "busy-decode-blocks-fraction",
                crate::select::SelectionSettingsError::TaintMultiplier { .. } => {
                    "preferred-taint-multiplier"
                }
            };
            return Err(ConfigError::new(field, e.to_string()));
        }
        Ok(())
    }

    /// The replica id: the flag, or `router-<random>`.
    pub fn router_id(&self) -> String {
        self.router_id.clone().unwrap_or_else(|| {
            let id = uuid::Uuid::new_v4().simple().to_string();
            format!("router-{}", &id[..8])
        })
    }

    /// How a remote overlap query is attempted within its deadline.
    pub fn index_query_policy(&self) -> kvroute_common::client::RetryPolicy {
        kvroute_common::client::RetryPolicy::split(
            std::time::Duration::from_millis(self.index_query_timeout_ms),
            self.index_query_attempts,
        )
    }

    /// When this replica counts as falling behind (and leaves the select queue group).
    pub fn watchdog(&self) -> kvroute_common::ops::WatchdogConfig {
        kvroute_common::ops::WatchdogConfig::new(std::time::Duration::from_millis(self.max_lag_ms))
    }

    /// The admission queue's limits.
    pub fn queue(&self) -> QueueConfig {
        QueueConfig {
            max_len: self.queue_max_len,
            default_timeout_ms: self.queue_timeout_ms,
            max_timeout_ms: self.queue_max_timeout_ms,
            max_priority_jump_ms: self.queue_max_priority_jump_ms,
            age_limit_ms: self.queue_age_limit_ms,
        }
    }

    /// Eligibility thresholds, the preferred-taint multiplier and adapter placement.
    pub fn selection_settings(&self) -> SelectionSettings {
        SelectionSettings {
            busy: BusyThresholds {
                decode_blocks_fraction: self.busy_decode_blocks_fraction,
                prefill_tokens: self.busy_prefill_tokens.map(PrefillLimit::Tokens),
            },
            preferred_taint_multiplier: self.preferred_taint_multiplier,
            adapter_placement: !self.no_adapter_placement,
        }
    }

    pub fn sessions(&self) -> SessionConfig {
        self.session_affinity.sessions(self.session_idle_ttl_secs)
    }

    /// The selections given outside the YAML, each with where it came from.
    pub fn policy_overrides(&self) -> PolicyOverrides {
        let selection = |flag: &str, value: &Option<String>| {
            value
                .as_ref()
                .map(|name| Override::new(name, self.origins.label(flag)))
        };
        PolicyOverrides {
            prefill: selection("prefill-policy", &self.prefill_policy),
            decode: selection("decode-policy", &self.decode_policy),
            all_roles: selection("worker-selection-policy", &self.worker_selection_policy),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> RouterConfig {
        RouterConfig::try_parse_from(std::iter::once("kvroute-router").chain(args.iter().copied()))
            .unwrap()
    }

    #[test]
    fn defaults_validate_and_bad_values_name_their_flag() {
        assert!(parse(&[]).validate().is_ok());
        let err = parse(&["--index-query-timeout-ms", "0"])
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "index-query-timeout-ms");
        let err = parse(&["--preferred-taint-multiplier", "1.5"])
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "preferred-taint-multiplier");
        let err = parse(&["--router-id", "a.b"]).validate().unwrap_err();
        assert_eq!(err.field, "router-id");
        let err = parse(&["--index-query-attempts", "0"])
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "index-query-attempts");
        let err = parse(&["--max-lag-ms", "0"]).validate().unwrap_err();
        assert_eq!(err.field, "max-lag-ms");
        let err = parse(&["--policy-config", "/nonexistent.yaml"])
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "policy-config");
        let err = parse(&["--busy-decode-blocks-fraction=-1"])
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("busy"), "{err}");
    }

    #[test]
    fn role_flags_and_the_all_roles_selection_become_overrides() {
        let c = parse(&["--prefill-policy", "p", "--worker-selection-policy", "all"]);
        let o = c.policy_overrides();
        assert_eq!(o.prefill, Some(Override::new("p", "--prefill-policy")));
        assert_eq!(o.decode, None);
        assert_eq!(
            o.all_roles,
            Some(Override::new("all", "--worker-selection-policy"))
        );
    }

    #[test]
    fn overrides_from_the_environment_name_their_variable() {
        use kvroute_common::cli::Origin;
        let mut c = parse(&["--decode-policy", "d", "--worker-selection-policy", "w"]);
        c.origins = Origins::from_pairs([
            ("decode-policy", Origin::Env("KVROUTE_DECODE_POLICY".into())),
            ("worker-selection-policy", Origin::CommandLine),
        ]);
        let o = c.policy_overrides();
        assert_eq!(o.decode, Some(Override::new("d", "KVROUTE_DECODE_POLICY")));
        assert_eq!(
            o.all_roles,
            Some(Override::new("w", "--worker-selection-policy"))
        );
    }

    #[test]
    fn both_replica_counts_are_range_checked() {
        for args in [
            &["--session-bucket-replicas", "9"][..],
            &["--session-bucket-replicas", "0"][..],
        ] {
            let err = parse(args).validate().unwrap_err();
            assert_eq!(err.field, "session-bucket-replicas", "{args:?}");
            assert!(err.message.contains("between 1 and 5"), "{err}");
        }
        assert!(
            parse(&["--session-bucket-replicas", "5"])
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn a_directory_for_the_policy_file_is_named_as_one() {
        let dir = std::env::temp_dir();
        let err = parse(&["--policy-config", dir.to_str().unwrap()])
            .validate()
            .unwrap_err();
        assert_eq!(err.field, "policy-config");
        assert!(err.message.ends_with("is a directory, not a file"), "{err}");
    }
}
