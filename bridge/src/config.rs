//! What the bridge serves: one engine from flags (the sidecar case) or a list of engines from a
//! YAML file (`--engines-file`), plus the bridge-wide settings. Checked once by
//! [`BridgeArgs::engines`]; every error names the flag or the file's field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs, check_file};
use kvroute_common::events_stream::StreamArgs;
use kvroute_common::messages::WorkerRole;
use kvroute_common::telemetry::TelemetryArgs;
use kvroute_common::{DpRank, WorkerId};
pub use kvroute_engine_wire::EngineKind;
use serde::Deserialize;

/// One engine the bridge serves: where it is, and what it cannot tell about itself.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    /// A short name for logs and metric labels (default: `<engine>-<worker id>`).
    #[serde(default)]
    pub name: String,
    pub engine: EngineKind,
    /// The engine's HTTP base URL (`http://host:port`), for health, load, its model, and
    /// forwarding requests.
    pub engine_url: String,
    /// The engine's KV-event PUB endpoint for rank 0 (`tcp://host:port`; rank r uses port + r,
    /// `ipc://` / `inproc://` endpoints the suffix `_dp<r>`). Required unless `kv_events` is
    /// false.
    #[serde(default)]
    pub zmq_endpoint: String,
    /// Whether the engine publishes KV events (default true). False: an engine with no event
    /// socket — no ZMQ subscription; its card says `kv_events: false`, and routers predict
    /// its cache from their decisions (approximate mode).
    #[serde(default = "yes")]
    pub kv_events: bool,
    /// The engine's replay ROUTER endpoint for rank 0 (same per-rank rule); without it a gap
    /// clears the rank.
    #[serde(default)]
    pub zmq_replay_endpoint: Option<String>,
    /// The topic the engine publishes under (its `topic` setting; empty: all).
    #[serde(default)]
    pub zmq_topic: String,
    /// kvroute's id for the engine (default: derived from `engine_url` and `zmq_endpoint`, so
    /// the same engine keeps its id across bridge restarts).
    #[serde(default)]
    pub worker_id: Option<WorkerId>,
    /// Data-parallel ranks (default: what the engine reports, else 1).
    #[serde(default)]
    pub dp_size: Option<u32>,
    #[serde(default)]
    pub dp_start_rank: DpRank,
    /// The model name to register (default: the engine's first `/v1/models` entry).
    #[serde(default)]
    pub model: Option<String>,
    /// Tokens per KV block (default: what the engine reports).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Device KV blocks per rank (default: what the engine reports).
    #[serde(default)]
    pub total_kv_blocks: Option<u64>,
    /// The engine's per-step token budget (default: what the engine reports, else 0: unknown).
    #[serde(default)]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    pub role: WorkerRole,
    #[serde(default)]
    pub taints: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn yes() -> bool {
    true
}

impl EngineSpec {
    /// The worker id: configured, or derived from the engine's addresses (never 0).
    pub fn worker_id(&self) -> WorkerId {
        self.worker_id.unwrap_or_else(|| {
            let key = format!("{}\n{}", self.engine_url, self.zmq_endpoint);
            // 48 bits, like the mocker's random ids: readable in logs, far from collisions
            // for any fleet one bridge serves.
            (xxhash_rust::xxh3::xxh3_64(key.as_bytes()) >> 16).max(1)
        })
    }

    /// The name used in logs and metric labels.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!("{}-{}", self.engine, self.worker_id())
        } else {
            self.name.clone()
        }
    }

    /// The PUB endpoint of `rank`'s publisher (the engines' own offset rule).
    pub fn zmq_endpoint_for(&self, rank: DpRank) -> Result<String, String> {
        rank_endpoint(&self.zmq_endpoint, rank)
    }

    pub fn zmq_replay_endpoint_for(&self, rank: DpRank) -> Option<Result<String, String>> {
        self.zmq_replay_endpoint
            .as_deref()
            .map(|e| rank_endpoint(e, rank))
    }

    /// Checks the spec; `field` prefixes the error (a flag, or `engines[2]` of the file).
    pub fn validate(&self, field: &'static str) -> Result<(), ConfigError> {
        let bad = |what: &str, msg: String| ConfigError::new(field, format!("{what}: {msg}"));
        let url = self.engine_url.trim();
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() < 10 {
            return Err(bad(
                "engine-url",
                format!("must be an http:// URL, got {:?}", self.engine_url),
            ));
        }
        if !self.kv_events {
            if !self.zmq_endpoint.is_empty() || self.zmq_replay_endpoint.is_some() {
                return Err(bad(
                    "zmq-endpoint",
                    "an engine without KV events has no event endpoints: drop them, or its \
                     no-kv-events setting"
                        .into(),
                ));
            }
        } else {
            self.zmq_endpoint_for(0)
                .map_err(|e| bad("zmq-endpoint", e))?;
        }
        if self.zmq_endpoint.trim().starts_with("inproc://") {
            return Err(bad(
                "zmq-endpoint",
                "inproc:// endpoints exist only inside the engine's process: configure the \
                 engine's endpoint as tcp:// or ipc://"
                    .into(),
            ));
        }
        if let Some(Err(e)) = self.zmq_replay_endpoint_for(0) {
            return Err(bad("zmq-replay-endpoint", e));
        }
        if self.dp_size == Some(0) {
            return Err(bad("dp-size", "must be at least 1".into()));
        }
        if self.block_size == Some(0) {
            return Err(bad("block-size", "must be at least 1".into()));
        }
        if self.worker_id == Some(0) {
            return Err(bad("worker-id", "must not be 0".into()));
        }
        if self.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(bad("model", "must not be empty".into()));
        }
        Ok(())
    }
}

/// The endpoint of data-parallel rank `rank`, from rank 0's: TCP ports are offset by the rank,
/// `ipc://` and `inproc://` paths get the suffix `_dp<rank>` (what vLLM and SGLang bind).
pub fn rank_endpoint(endpoint: &str, rank: DpRank) -> Result<String, String> {
    let endpoint = endpoint.trim();
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("{endpoint:?} has no port"))?;
        if host.is_empty() || host == "*" {
            return Err(format!(
                "{endpoint:?}: name the engine's host (the engine binds `*`, the bridge connects)"
            ));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{endpoint:?}: bad port {port:?}"))?;
        if port == 0 {
            return Err(format!("{endpoint:?}: port 0 is not an address"));
        }
        let port = u32::from(port) + rank;
        if port > u32::from(u16::MAX) {
            return Err(format!(
                "{endpoint:?}: rank {rank}'s port {port} exceeds 65535"
            ));
        }
        return Ok(format!("tcp://{host}:{port}"));
    }
    if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
        return Ok(if rank == 0 {
            endpoint.to_string()
        } else {
            format!("{endpoint}_dp{rank}")
        });
    }
    Err(format!(
        "{endpoint:?}: use tcp://host:port, ipc://path or inproc://name"
    ))
}

/// The file behind `--engines-file`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnginesFile {
    pub engines: Vec<EngineSpec>,
}

/// The one engine given by flags (`kvroute-bridge --engine vllm --engine-url ...`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EngineFlags {
    /// The engine's kind (its wire formats and HTTP API).
    #[arg(long, env = "KVROUTE_BRIDGE_ENGINE")]
    pub engine: Option<EngineKind>,
    /// The engine's HTTP base URL, e.g. http://127.0.0.1:8000.
    #[arg(long, env = "KVROUTE_BRIDGE_ENGINE_URL")]
    pub engine_url: Option<String>,
    /// The engine's KV-event PUB endpoint for rank 0, e.g. tcp://127.0.0.1:5557 (the engine's
    /// `endpoint` with its host).
    #[arg(long, env = "KVROUTE_BRIDGE_ZMQ_ENDPOINT")]
    pub zmq_endpoint: Option<String>,
    /// The engine's replay endpoint for rank 0, e.g. tcp://127.0.0.1:5558 (its
    /// `replay_endpoint`); without it, a gap clears the rank.
    #[arg(long, env = "KVROUTE_BRIDGE_ZMQ_REPLAY_ENDPOINT")]
    pub zmq_replay_endpoint: Option<String>,
    /// The engine's event topic (its `topic` setting).
    #[arg(long, env = "KVROUTE_BRIDGE_ZMQ_TOPIC", default_value = "")]
    pub zmq_topic: String,
    /// The engine has no KV-event socket (engines without events, llama.cpp, TGI, managed
    /// endpoints): no --zmq-endpoint, no ZMQ subscription; its card says `kv_events: false`,
    /// and routers predict its cache from their own decisions (approximate mode).
    #[arg(long, env = "KVROUTE_BRIDGE_NO_KV_EVENTS")]
    pub no_kv_events: bool,
    /// kvroute's id for the engine (default: derived from its URL and endpoint).
    #[arg(long, env = "KVROUTE_BRIDGE_WORKER_ID")]
    pub worker_id: Option<WorkerId>,
    /// Data-parallel ranks (default: what the engine reports, else 1).
    #[arg(long, env = "KVROUTE_BRIDGE_DP_SIZE")]
    pub dp_size: Option<u32>,
    /// The model name to register (default: the engine's first /v1/models entry).
    #[arg(long, env = "KVROUTE_BRIDGE_MODEL")]
    pub model: Option<String>,
    /// Tokens per KV block (default: what the engine reports).
    #[arg(long, env = "KVROUTE_BRIDGE_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Device KV blocks per rank (default: what the engine reports).
    #[arg(long, env = "KVROUTE_BRIDGE_TOTAL_KV_BLOCKS")]
    pub total_kv_blocks: Option<u64>,
    /// The engine's per-step token budget (default: what the engine reports, else unknown).
    #[arg(long, env = "KVROUTE_BRIDGE_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<u64>,
    /// The worker's role in (dis)aggregated serving.
    #[arg(long, env = "KVROUTE_BRIDGE_ROLE", default_value = "aggregated")]
    pub role: WorkerRole,
}

/// `kvroute-bridge`'s flags.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvroute-bridge",
    version,
    about = "Feeds kvroute from real vLLM / SGLang engines: their ZMQ KV events, load, \
             registration and requests, with no change to the engine"
)]
pub struct BridgeArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub one: EngineFlags,
    /// A YAML file listing engines (`engines: [{engine, engine_url, zmq_endpoint, ...}]`),
    /// instead of --engine and its flags.
    #[arg(long, env = "KVROUTE_BRIDGE_ENGINES_FILE", conflicts_with = "engine")]
    pub engines_file: Option<PathBuf>,
    /// How often to poll each engine's load, in milliseconds.
    #[arg(long, env = "KVROUTE_BRIDGE_LOAD_INTERVAL_MS", default_value_t = 100)]
    pub load_interval_ms: u64,
    /// How often to probe each engine's /health, in milliseconds.
    #[arg(long, env = "KVROUTE_BRIDGE_HEALTH_INTERVAL_MS", default_value_t = 500)]
    pub health_interval_ms: u64,
    /// How often to read a registered vLLM engine's LoRA adapters (`/v1/models`), in
    /// milliseconds: adapters loaded or unloaded at runtime reach its card within this.
    #[arg(
        long,
        env = "KVROUTE_BRIDGE_ADAPTERS_INTERVAL_MS",
        default_value_t = 5000
    )]
    pub adapters_interval_ms: u64,
    /// Consecutive failed health probes after which the engine is deregistered.
    #[arg(long, env = "KVROUTE_BRIDGE_HEALTH_FAILURES", default_value_t = 3)]
    pub health_failures: u32,
    /// Timeout of one HTTP call to an engine (health, load, model info), in milliseconds.
    /// SGLang's /health runs a one-token generation after a 1 s pause: its probes get 1.5 s
    /// more.
    #[arg(long, env = "KVROUTE_BRIDGE_ENGINE_TIMEOUT_MS", default_value_t = 1000)]
    pub engine_timeout_ms: u64,
    /// TTL of each engine's etcd lease, in seconds (minimum 2).
    #[arg(long, env = "KVROUTE_BRIDGE_LEASE_TTL_SECS", default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// Most blocks the mirror of one engine rank holds; beyond it the block stored longest ago
    /// is evicted from the mirror and announced to kvroute as removed (counted as
    /// `ignored{reason="mirror_full"}`), so kvroute never routes on blocks a resync could not
    /// recreate. An engine's cache is far smaller; this bounds a misbehaving one.
    #[arg(
        long,
        env = "KVROUTE_BRIDGE_MIRROR_MAX_BLOCKS",
        default_value_t = 4_000_000
    )]
    pub mirror_max_blocks: usize,
    /// Address for /metrics, /healthz and /readyz (e.g. 127.0.0.1:9400).
    #[arg(long, env = "KVROUTE_BRIDGE_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Do not create the events stream when it is missing (leave that to the indexers).
    #[arg(long, env = "KVROUTE_BRIDGE_NO_CREATE_STREAM")]
    pub no_create_stream: bool,
    /// The events stream's settings, used when this process creates it (the indexers' flags).
    #[command(flatten)]
    pub stream: StreamArgs,
    /// Ignore (and count, `ignored{reason="external"|"remote"}`) the engines' external media
    /// and remote-locality blocks instead of publishing them in the shared tier: for an event
    /// log whose indexers (or local-mode routers) predate the shared tier, which refuse a
    /// batch naming it. Upgrade those first, then drop this flag.
    #[arg(long, env = "KVROUTE_BRIDGE_NO_SHARED_TIER")]
    pub no_shared_tier: bool,
}

impl BridgeArgs {
    /// Checks every setting and returns the engines to serve; errors name the flag or field.
    pub fn engines(&self) -> Result<Vec<EngineSpec>, ConfigError> {
        self.nats.validate()?;
        self.etcd.validate()?;
        self.stream.validate()?;
        if self.load_interval_ms == 0 {
            return Err(ConfigError::new("load-interval-ms", "must be positive"));
        }
        if self.health_interval_ms == 0 {
            return Err(ConfigError::new("health-interval-ms", "must be positive"));
        }
        if self.adapters_interval_ms == 0 {
            return Err(ConfigError::new("adapters-interval-ms", "must be positive"));
        }
        if self.health_failures == 0 {
            return Err(ConfigError::new("health-failures", "must be at least 1"));
        }
        if self.engine_timeout_ms == 0 {
            return Err(ConfigError::new("engine-timeout-ms", "must be positive"));
        }
        if self.lease_ttl_secs < 2 {
            return Err(ConfigError::new(
                "lease-ttl-secs",
                "must be at least 2 (etcd's minimum)",
            ));
        }
        if self.mirror_max_blocks == 0 {
            return Err(ConfigError::new("mirror-max-blocks", "must be positive"));
        }
        let engines = match &self.engines_file {
            Some(path) => read_engines_file(path)?,
            None => vec![self.one_engine()?],
        };
        let mut ids = BTreeMap::new();
        for (i, spec) in engines.iter().enumerate() {
            if let Some(other) = ids.insert(spec.worker_id(), i) {
                return Err(ConfigError::new(
                    if self.engines_file.is_some() {
                        "engines-file"
                    } else {
                        "worker-id"
                    },
                    format!(
                        "engines[{other}] and engines[{i}] have the same worker id {}",
                        spec.worker_id()
                    ),
                ));
            }
        }
        Ok(engines)
    }

    fn one_engine(&self) -> Result<EngineSpec, ConfigError> {
        let f = &self.one;
        let engine = f.engine.ok_or_else(|| {
            ConfigError::new(
                "engine",
                "name the engine (vllm or sglang), or give --engines-file",
            )
        })?;
        let engine_url = f
            .engine_url
            .clone()
            .ok_or_else(|| ConfigError::new("engine-url", "required with --engine"))?;
        let zmq_endpoint = match (&f.zmq_endpoint, f.no_kv_events) {
            (Some(e), _) => e.clone(),
            (None, true) => String::new(),
            (None, false) => {
                return Err(ConfigError::new(
                    "zmq-endpoint",
                    "required with --engine (or --no-kv-events for an engine without events)",
                ));
            }
        };
        let spec = EngineSpec {
            name: String::new(),
            engine,
            engine_url,
            zmq_endpoint,
            zmq_replay_endpoint: f.zmq_replay_endpoint.clone(),
            zmq_topic: f.zmq_topic.clone(),
            kv_events: !f.no_kv_events,
            worker_id: f.worker_id,
            dp_size: f.dp_size,
            dp_start_rank: 0,
            model: f.model.clone(),
            block_size: f.block_size,
            total_kv_blocks: f.total_kv_blocks,
            max_num_batched_tokens: f.max_num_batched_tokens,
            role: f.role,
            taints: Vec::new(),
            labels: BTreeMap::new(),
        };
        // Name the flag itself: the spec's checks say which part is wrong.
        spec.validate("engine").map_err(|e| {
            let (flag, rest) = e
                .message
                .split_once(": ")
                .map(|(f, r)| (f.to_string(), r.to_string()))
                .unwrap_or_default();
            ConfigError::new(leak_flag(&flag), rest)
        })?;
        Ok(spec)
    }

    pub fn load_interval(&self) -> Duration {
        Duration::from_millis(self.load_interval_ms)
    }
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    pub fn engine_timeout(&self) -> Duration {
        Duration::from_millis(self.engine_timeout_ms)
    }
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }
}

/// The flag names [`EngineSpec::validate`] reports, as `'static` for [`ConfigError`].
fn leak_flag(flag: &str) -> &'static str {
    match flag {
        "engine-url" => "engine-url",
        "zmq-endpoint" => "zmq-endpoint",
        "zmq-replay-endpoint" => "zmq-replay-endpoint",
        "dp-size" => "dp-size",
        "block-size" => "block-size",
        "worker-id" => "worker-id",
        "model" => "model",
        _ => "engine",
    }
}

fn read_engines_file(path: &std::path::Path) -> Result<Vec<EngineSpec>, ConfigError> {
    check_file("engines-file", path)?;
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::new(
            "engines-file",
            format!(
                "{}: {}",
                path.display(),
                kvroute_common::config::io_reason(&e)
            ),
        )
    })?;
    let file: EnginesFile = serde_norway::from_str(&text)
        .map_err(|e| ConfigError::new("engines-file", format!("{}: {e}", path.display())))?;
    if file.engines.is_empty() {
        return Err(ConfigError::new(
            "engines-file",
            format!("{}: `engines` lists no engine", path.display()),
        ));
    }
    for (i, spec) in file.engines.iter().enumerate() {
        spec.validate("engines-file").map_err(|e| {
            ConfigError::new(
                "engines-file",
                format!("{}: engines[{i}].{}", path.display(), e.message),
            )
        })?;
    }
    Ok(file.engines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_endpoints_follow_the_engines_offset_rule() {
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:5557", 0).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:5557", 3).unwrap(),
            "tcp://127.0.0.1:5560"
        );
        assert_eq!(
            rank_endpoint("tcp://[::1]:5557", 1).unwrap(),
            "tcp://[::1]:5558"
        );
        assert_eq!(rank_endpoint("ipc:///tmp/kv", 0).unwrap(), "ipc:///tmp/kv");
        assert_eq!(
            rank_endpoint("ipc:///tmp/kv", 2).unwrap(),
            "ipc:///tmp/kv_dp2"
        );
        assert_eq!(rank_endpoint("inproc://kv", 1).unwrap(), "inproc://kv_dp1");
        assert!(
            rank_endpoint("tcp://*:5557", 0)
                .unwrap_err()
                .contains("host")
        );
        assert!(
            rank_endpoint("tcp://h:65535", 1)
                .unwrap_err()
                .contains("65535")
        );
        assert!(rank_endpoint("tcp://h:0", 0).is_err());
        assert!(rank_endpoint("udp://h:1", 0).is_err());
    }

    fn spec() -> EngineSpec {
        serde_norway::from_str(
            "engine: vllm\nengine_url: http://127.0.0.1:8000\nzmq_endpoint: tcp://127.0.0.1:5557\n",
        )
        .unwrap()
    }

    #[test]
    fn derived_worker_ids_are_stable_and_distinct() {
        let a = spec();
        let mut b = spec();
        b.zmq_endpoint = "tcp://127.0.0.1:6557".into();
        assert_eq!(a.worker_id(), spec().worker_id());
        assert_ne!(a.worker_id(), b.worker_id());
        assert!(a.worker_id() < 1 << 48 && a.worker_id() > 0);
    }

    #[test]
    fn an_engine_without_kv_events_needs_no_endpoint_and_takes_none() {
        use clap::Parser;
        let args = |extra: &[&str]| {
            let mut argv = vec![
                "kvroute-bridge",
                "--engine",
                "vllm",
                "--engine-url",
                "http://127.0.0.1:8000",
            ];
            argv.extend(extra);
            BridgeArgs::try_parse_from(argv).unwrap().engines()
        };
        let specs = args(&["--no-kv-events"]).unwrap();
        assert!(!specs[0].kv_events);
        assert!(specs[0].zmq_endpoint.is_empty());
        assert_eq!(args(&[]).unwrap_err().field, "zmq-endpoint");
        let e = args(&["--no-kv-events", "--zmq-endpoint", "tcp://h:1"]).unwrap_err();
        assert_eq!(e.field, "zmq-endpoint");
        assert!(spec().kv_events);
    }

    #[test]
    fn each_engine_registers_its_disaggregation_role() {
        use clap::Parser;
        assert_eq!(spec().role, WorkerRole::Aggregated);
        let prefill: EngineSpec = serde_norway::from_str(
            "engine: vllm\nengine_url: http://a:1\nzmq_endpoint: tcp://a:5557\nrole: prefill\n",
        )
        .unwrap();
        assert_eq!(prefill.role, WorkerRole::Prefill);
        let argv = [
            "kvroute-bridge",
            "--engine",
            "sglang",
            "--engine-url",
            "http://127.0.0.1:8000",
            "--zmq-endpoint",
            "tcp://127.0.0.1:5557",
            "--role",
            "decode",
        ];
        let specs = BridgeArgs::try_parse_from(argv).unwrap().engines().unwrap();
        assert_eq!(specs[0].role, WorkerRole::Decode);
        assert!(
            serde_norway::from_str::<EngineSpec>(
                "engine: vllm\nengine_url: http://a:1\nzmq_endpoint: tcp://a:5557\nrole: both\n"
            )
            .is_err()
        );
    }

    #[test]
    fn engines_file_errors_name_the_entry_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engines.yaml");
        std::fs::write(
            &path,
            "engines:\n  - engine: vllm\n    engine_url: http://a:1\n    zmq_endpoint: tcp://a:5557\n  - engine: sglang\n    engine_url: ftp://b\n    zmq_endpoint: tcp://b:5557\n",
        )
        .unwrap();
        let e = read_engines_file(&path).unwrap_err();
        assert_eq!(e.field, "engines-file");
        assert!(e.message.contains("engines[1].engine-url"), "{}", e.message);
        std::fs::write(&path, "engines:\n  - engine: tgi\n").unwrap();
        let e = read_engines_file(&path).unwrap_err();
        assert!(e.message.contains("unknown variant"), "{}", e.message);
        std::fs::write(&path, "engines:\n  - engine: vllm\n    engine_url: http://a:1\n    zmq_endpoint: tcp://a:1\n    colour: red\n").unwrap();
        let e = read_engines_file(&path).unwrap_err();
        assert!(e.message.contains("colour"), "{}", e.message);
    }
}
