//! The fleet's settings: how many workers, what they serve, the engine model and the time
//! compression. Parsed from flags by the binary (with `KVROUTE_MOCKER_*` fallbacks), checked
//! once by [`FleetConfig::validate`].

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_common::WorkerId;
use kvroute_common::config::ConfigError;
use kvroute_common::events_stream::StreamArgs;

use crate::engine::EngineConfig;
use crate::engine_face::EngineFaceArgs;

/// The simulated engine's flags (defaults: [`EngineConfig::default`], a mid-size model on one GPU).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_MOCKER_BLOCK_SIZE", default_value_t = 64)]
    pub block_size: u32,
    /// KV blocks per worker (device cache capacity).
    #[arg(long, env = "KVROUTE_MOCKER_NUM_BLOCKS", default_value_t = 8192)]
    pub num_blocks: u64,
    /// Most requests in a worker's running batch; more wait in its queue.
    #[arg(long, env = "KVROUTE_MOCKER_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Most tokens computed in one engine step (decodes plus prefill chunks).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_MAX_NUM_BATCHED_TOKENS",
        default_value_t = 8192
    )]
    pub max_num_batched_tokens: u32,
    /// Fixed cost of every engine step, in microseconds (simulated).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_STEP_OVERHEAD_US",
        default_value_t = 10_000
    )]
    pub step_overhead_us: u64,
    /// Cost of each prompt token prefilled, in nanoseconds (simulated).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_PREFILL_NS_PER_TOKEN",
        default_value_t = 40_000
    )]
    pub prefill_ns_per_token: u64,
    /// Cost of each request decoding one token in a step, in nanoseconds (simulated).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_DECODE_NS_PER_SEQ",
        default_value_t = 100_000
    )]
    pub decode_ns_per_seq: u64,
    /// Cost of each context token attended by a decoding request in a step, in nanoseconds.
    #[arg(
        long,
        env = "KVROUTE_MOCKER_DECODE_NS_PER_CONTEXT_TOKEN",
        default_value_t = 20
    )]
    pub decode_ns_per_context_token: u64,
    /// Cost of each prompt token loaded from the shared tier instead of prefilled, in
    /// nanoseconds (simulated; only with a shared tier).
    #[arg(
        long,
        env = "KVROUTE_MOCKER_SHARED_LOAD_NS_PER_TOKEN",
        default_value_t = 10_000
    )]
    pub shared_load_ns_per_token: u64,
    /// LoRA adapters a worker holds at once (vLLM's `--max-loras`): a request naming another
    /// waits until one is idle, and loading it costs --lora-load-us. 0: adapters are not
    /// modelled.
    #[arg(long, env = "KVROUTE_MOCKER_MAX_LORAS", default_value_t = 0)]
    pub max_loras: u32,
    /// Cost of loading a LoRA adapter into a slot, in microseconds (simulated), added to the
    /// step that first runs it.
    #[arg(long, env = "KVROUTE_MOCKER_LORA_LOAD_US", default_value_t = 50_000)]
    pub lora_load_us: u64,
}

impl EngineArgs {
    /// Checks the engine's settings; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.engine_config().validate().map_err(|e| {
            ConfigError::new(
                engine_flag(e.field),
                format!("{} (got {})", e.reason, self.engine_value(e.field)),
            )
        })
    }

    fn engine_value(&self, field: &str) -> String {
        let e = self;
        match field {
            "block_size" => e.block_size.to_string(),
            "num_blocks" => e.num_blocks.to_string(),
            "max_num_seqs" => e.max_num_seqs.to_string(),
            "max_num_batched_tokens" => e.max_num_batched_tokens.to_string(),
            "step_overhead_us" => e.step_overhead_us.to_string(),
            _ => "?".into(),
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            step_overhead_us: self.step_overhead_us,
            prefill_ns_per_token: self.prefill_ns_per_token,
            decode_ns_per_seq: self.decode_ns_per_seq,
            decode_ns_per_context_token: self.decode_ns_per_context_token,
            shared_load_ns_per_token: self.shared_load_ns_per_token,
            max_loras: self.max_loras,
            lora_load_us: self.lora_load_us,
        }
    }
}

impl Default for EngineArgs {
    fn default() -> Self {
        let c = EngineConfig::default();
        Self {
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            step_overhead_us: c.step_overhead_us,
            prefill_ns_per_token: c.prefill_ns_per_token,
            decode_ns_per_seq: c.decode_ns_per_seq,
            decode_ns_per_context_token: c.decode_ns_per_context_token,
            shared_load_ns_per_token: c.shared_load_ns_per_token,
            max_loras: c.max_loras,
            lora_load_us: c.lora_load_us,
        }
    }
}

/// Everything about the fleet except how to reach NATS and etcd.
#[derive(Debug, Clone, clap::Args)]
pub struct FleetConfig {
    /// Simulated workers in this process (each its own worker id, lease and card).
    #[arg(long, env = "KVROUTE_MOCKER_WORKERS", default_value_t = 2)]
    pub workers: u32,
    /// Worker id of the first worker; the others follow consecutively.
    #[arg(long, env = "KVROUTE_MOCKER_WORKER_ID_START", default_value_t = 1)]
    pub worker_id_start: WorkerId,
    /// Instead of --worker-id-start, start at a random multiple of 65536 below 2^48, so
    /// replicas of one container configuration (`docker-compose up --scale`) get distinct ids.
    #[arg(long, env = "KVROUTE_MOCKER_RANDOM_WORKER_IDS")]
    pub random_worker_ids: bool,
    /// Model name the workers serve (in their cards).
    #[arg(long, env = "KVROUTE_MOCKER_MODEL", default_value = "mock-model")]
    pub model: String,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Simulated seconds per wall-clock second (e.g. 10 runs the engines ten times faster).
    #[arg(long, env = "KVROUTE_MOCKER_SPEEDUP", default_value_t = 1.0)]
    pub speedup: f64,
    /// A label on every worker's card, `KEY=VALUE` (repeat the flag for more; the variable
    /// takes a comma-separated list), e.g. `kvroute.io/device=cpu` for a fleet of CPU workers.
    #[arg(long = "label", env = "KVROUTE_MOCKER_LABELS", value_delimiter = ',')]
    pub labels: Vec<String>,
    /// Blocks of a shared KV tier per worker (0: none). The process's workers share one store
    /// (an LMCache-like tier): each writes the prompts it computes through to it and announces
    /// them in the shared tier, and each loads the store's blocks beyond its device prefix at
    /// `--shared-load-ns-per-token` instead of prefilling them. Workers of other processes do
    /// not see it.
    #[arg(long, env = "KVROUTE_MOCKER_SHARED_CACHE_BLOCKS", default_value_t = 0)]
    pub shared_cache_blocks: u64,
    /// TTL of each worker's etcd lease, in seconds (minimum 2); a crashed worker disappears
    /// after at most this long.
    #[arg(long, env = "KVROUTE_MOCKER_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// Interval of periodic load reports, in wall-clock milliseconds (reports also go out
    /// when a worker's request counts change).
    #[arg(long, env = "KVROUTE_MOCKER_LOAD_INTERVAL_MS", default_value_t = 200)]
    pub load_interval_ms: u64,
    /// Publish no load reports, like an engine that reports nothing (behind kvroute-gateway):
    /// routers then go by their own predictions and the lifecycle events (to try the load
    /// view's models, `--track-output-blocks` and `--prefill-load-model decay`).
    #[arg(long, env = "KVROUTE_MOCKER_NO_LOAD_REPORTS")]
    pub no_load_reports: bool,
    /// Publish no KV events, like an engine without an event socket: the workers' cards say
    /// `kv_events: false`, and routers predict their caches from their own decisions
    /// (approximate mode).
    #[arg(long, env = "KVROUTE_MOCKER_NO_KV_EVENTS")]
    pub no_kv_events: bool,
    /// Address for /metrics, /healthz and /readyz (e.g. 127.0.0.1:9300; the indexer's default
    /// is 9100 and the router's 9200); off when absent: no HTTP endpoint at all.
    #[arg(long, env = "KVROUTE_MOCKER_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Do not create the events stream when it is missing (leave that to the indexers).
    #[arg(long, env = "KVROUTE_MOCKER_NO_CREATE_STREAM")]
    pub no_create_stream: bool,
    /// The events stream's settings, used when this process creates it (the indexers' flags).
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub face: EngineFaceArgs,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            workers: 2,
            worker_id_start: 1,
            random_worker_ids: false,
            model: "mock-model".into(),
            engine: EngineArgs::default(),
            speedup: 1.0,
            labels: Vec::new(),
            shared_cache_blocks: 0,
            lease_ttl_secs: 10,
            load_interval_ms: 200,
            no_load_reports: false,
            no_kv_events: false,
            http_addr: None,
            no_create_stream: false,
            stream: StreamArgs::default(),
            face: EngineFaceArgs::default(),
        }
    }
}

/// Most workers one process runs (each has its own tasks and NATS subscriptions).
pub const MAX_WORKERS: u32 = 1024;

impl FleetConfig {
    /// The `--label` flags as (key, value) pairs (validated).
    pub fn label_pairs(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.labels.iter().filter_map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
    }

    /// Checks every setting; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.workers == 0 || self.workers > MAX_WORKERS {
            return Err(ConfigError::new(
                "workers",
                format!("must be 1..={MAX_WORKERS}"),
            ));
        }
        if self
            .worker_id_start
            .checked_add(u64::from(self.workers))
            .is_none()
        {
            return Err(ConfigError::new(
                "worker-id-start",
                "worker ids overflow u64",
            ));
        }
        if self.model.trim().is_empty() {
            return Err(ConfigError::new("model", "must not be empty"));
        }
        if let Some(bad) = self
            .labels
            .iter()
            .find(|l| l.split_once('=').is_none_or(|(k, _)| k.trim().is_empty()))
        {
            return Err(ConfigError::new(
                "label",
                format!("must be KEY=VALUE, got {bad:?}"),
            ));
        }
        self.engine.validate()?;
        self.stream.validate()?;
        if !(self.speedup.is_finite() && self.speedup > 0.0 && self.speedup <= 1e6) {
            return Err(ConfigError::new(
                "speedup",
                format!("must be a number in (0, 1e6], got {}", self.speedup),
            ));
        }
        if self.lease_ttl_secs < 2 {
            return Err(ConfigError::new(
                "lease-ttl-secs",
                "must be at least 2 (etcd's minimum)",
            ));
        }
        if self.load_interval_ms == 0 {
            return Err(ConfigError::new("load-interval-ms", "must be positive"));
        }
        self.face.validate(self.workers)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    pub fn load_interval(&self) -> Duration {
        Duration::from_millis(self.load_interval_ms)
    }

    /// The first worker id under `--random-worker-ids`, from `random` (any u64): a multiple of
    /// 65536 in [65536, 2^48), so fleets (at most [`MAX_WORKERS`] workers) never overlap unless
    /// two draws are equal.
    pub fn random_worker_id_start(random: u64) -> WorkerId {
        ((random % ((1 << 32) - 1)) + 1) << 16
    }

    /// The worker ids this fleet runs.
    pub fn worker_ids(&self) -> impl Iterator<Item = WorkerId> + use<> {
        let start = self.worker_id_start;
        (0..u64::from(self.workers)).map(move |i| start + i)
    }
}

/// The flag of an [`EngineConfig`] field.
fn engine_flag(field: &str) -> &'static str {
    match field {
        "block_size" => "block-size",
        "num_blocks" => "num-blocks",
        "max_num_seqs" => "max-num-seqs",
        "max_num_batched_tokens" => "max-num-batched-tokens",
        "step_overhead_us" => "step-overhead-us",
        "prefill_ns_per_token" => "prefill-ns-per-token",
        "decode_ns_per_seq" => "decode-ns-per-seq",
        _ => "decode-ns-per-context-token",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_flag() {
        assert!(FleetConfig::default().validate().is_ok());
        let bad = |edit: fn(&mut FleetConfig)| {
            let mut c = FleetConfig::default();
            edit(&mut c);
            c.validate().unwrap_err()
        };
        assert_eq!(bad(|c| c.workers = 0).field, "workers");
        assert_eq!(bad(|c| c.speedup = 0.0).field, "speedup");
        assert_eq!(bad(|c| c.speedup = f64::NAN).field, "speedup");
        assert_eq!(bad(|c| c.lease_ttl_secs = 1).field, "lease-ttl-secs");
        assert_eq!(bad(|c| c.engine.block_size = 0).field, "block-size");
        assert_eq!(bad(|c| c.model = " ".into()).field, "model");
        assert_eq!(
            bad(|c| c.worker_id_start = u64::MAX).field,
            "worker-id-start"
        );
        let err = bad(|c| c.engine.max_num_batched_tokens = 4);
        assert_eq!(err.field, "max-num-batched-tokens");
        assert!(
            err.to_string().contains("--max-num-batched-tokens"),
            "{err}"
        );
        assert!(err.to_string().contains("got 4"), "{err}");
    }

    #[test]
    fn random_worker_id_starts_leave_room_for_a_whole_fleet() {
        for r in [0, 1, u64::MAX, (1 << 32) - 2, 12_345_678_901] {
            let start = FleetConfig::random_worker_id_start(r);
            assert!((1 << 16..1 << 48).contains(&start), "{r}: {start}");
            assert_eq!(start % (1 << 16), 0);
            assert!(u64::from(MAX_WORKERS) < 1 << 16);
        }
    }

    #[test]
    fn worker_ids_are_consecutive() {
        let c = FleetConfig {
            workers: 3,
            worker_id_start: 10,
            ..FleetConfig::default()
        };
        assert_eq!(c.worker_ids().collect::<Vec<_>>(), vec![10, 11, 12]);
    }
}
