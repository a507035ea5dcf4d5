//! `kvroute-gateway`'s flags (each with a `KVROUTE_GATEWAY_*` or `KVROUTE_*` env fallback) and
//! their checks. A bad value stops startup with a message naming the flag.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvroute_common::client::SelectRetryArgs;
use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs, check_file};
use kvroute_common::telemetry::TelemetryArgs;

/// The most reservations one gateway holds at once (beyond it `select_and_reserve` answers 429).
pub const MAX_RESERVATIONS_LIMIT: usize = 1_000_000;

#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvroute-gateway",
    version,
    about = "kvroute's HTTP front door: the OpenAI API (completions, chat, models) routed to the \
             worker holding the prompt's prefix, and an HTTP selection API for other gateways"
)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub select: SelectRetryArgs,
    /// Address of the HTTP API (OpenAI endpoints, selection API, /health, /metrics).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_HTTP_ADDR",
        default_value = "127.0.0.1:8080"
    )]
    pub http_addr: SocketAddr,
    /// A model this gateway tokenizes: `NAME=DIR`, DIR holding `tokenizer.json` and
    /// `tokenizer_config.json` (its chat template). Repeat for more; NAME is the model name the
    /// workers register (`GET /v1/models` of the engine).
    #[arg(long = "model", env = "KVROUTE_GATEWAY_MODELS", value_delimiter = ',')]
    pub models: Vec<String>,
    /// A LoRA adapter the engines serve: `NAME=BASE`. A request whose `model` is NAME is routed
    /// among BASE's workers, tokenized as BASE, its blocks keyed apart by the adapter (the
    /// routers' `lora_name`), and sent to the engine as NAME. Repeat (or comma-separate) for
    /// more.
    #[arg(
        long = "lora-adapter",
        env = "KVROUTE_GATEWAY_LORA_ADAPTERS",
        value_delimiter = ','
    )]
    pub lora_adapters: Vec<String>,
    /// A directory of model folders, each named by its model and holding `tokenizer.json`.
    #[arg(long, env = "KVROUTE_GATEWAY_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// A file of API keys, one per line (`#` comments and blank lines ignored): requests must
    /// carry `Authorization: Bearer <key>` with one of them. Absent: no authentication.
    #[arg(long, env = "KVROUTE_GATEWAY_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// The largest request body accepted, in bytes (beyond: 413).
    #[arg(long, env = "KVROUTE_GATEWAY_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// The longest prompt accepted, in tokens (beyond: 400, as engines refuse a prompt longer
    /// than their context).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_MAX_PROMPT_TOKENS",
        default_value_t = 131_072
    )]
    pub max_prompt_tokens: usize,
    /// Prompts tokenized at once (default: the machine's cores). Text prompts beyond wait in
    /// the queue.
    #[arg(long, env = "KVROUTE_GATEWAY_MAX_CONCURRENT_TOKENIZATIONS")]
    pub max_concurrent_tokenizations: Option<usize>,
    /// Text prompts that may wait for a tokenizing turn; beyond, 503 `tokenizer_busy` with
    /// `Retry-After`.
    #[arg(long, env = "KVROUTE_GATEWAY_TOKENIZE_QUEUE", default_value_t = 64)]
    pub tokenize_queue: usize,
    /// Memory per model for the token ids of long text pieces between the tokenizer's special
    /// tokens (a chat's messages), so a conversation's next turn tokenizes only its new
    /// messages; 0 turns it off. The ids are the same either way.
    #[arg(long, env = "KVROUTE_GATEWAY_TOKENIZE_CACHE_MIB", default_value_t = 64)]
    pub tokenize_cache_mib: usize,
    /// Client connections open at once. Past it a new connection closes the oldest one that has
    /// no request in flight; when every connection is busy, a reserve of 16 more answers only
    /// /health, /healthz, /readyz and /metrics, and beyond that new connections are closed. The
    /// process's file limit must allow about twice this (a connection to an engine per request).
    #[arg(long, env = "KVROUTE_GATEWAY_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Milliseconds a client has to send a request's line and headers, counted from its first
    /// byte (or from the connection's start for its first request); past it the connection closes.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_HEADER_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub header_read_timeout_ms: u64,
    /// Milliseconds a client has to send a request's whole body once its headers arrived
    /// (beyond: 408).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_BODY_READ_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub body_read_timeout_ms: u64,
    /// Milliseconds a kept-alive connection may stay without a request before it is closed.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_IDLE_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub idle_timeout_ms: u64,
    /// Milliseconds a client may leave its answer unread (the socket takes no byte of it)
    /// before its connection is closed (and its request's engine connection with it).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_WRITE_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub write_timeout_ms: u64,
    /// The largest request line plus headers, in bytes (beyond: 431). Heads above about 400 KB
    /// are refused by the HTTP layer itself (431 without a body).
    #[arg(long, env = "KVROUTE_GATEWAY_MAX_HEADER_BYTES", default_value_t = 32 * 1024)]
    pub max_header_bytes: usize,
    /// Milliseconds requests in flight may take to finish after SIGTERM before their
    /// connections are closed (the lifecycle events' flush has 2 s more at most).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_SHUTDOWN_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub shutdown_timeout_ms: u64,
    /// Milliseconds to connect to a worker's HTTP API before trying another worker.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_CONNECT_TIMEOUT_MS",
        default_value_t = 1000
    )]
    pub connect_timeout_ms: u64,
    /// Milliseconds to wait for the worker's response headers (its queue and, when not
    /// streaming, the whole generation) before answering 504.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_RESPONSE_TIMEOUT_MS",
        default_value_t = 600_000
    )]
    pub response_timeout_ms: u64,
    /// Milliseconds the worker may go silent once its response headers arrived: between two
    /// chunks of a stream, or in the middle of a whole answer's body. Past it a stream ends
    /// with an error event, and an answer not yet sent to the client is a 504.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_UPSTREAM_IDLE_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub upstream_idle_timeout_ms: u64,
    /// Send completions prompts to the engine as the gateway's token ids instead of text, so
    /// the engine caches exactly the tokens kvroute routed on.
    #[arg(long, env = "KVROUTE_GATEWAY_FORWARD_TOKEN_IDS")]
    pub forward_token_ids: bool,
    /// Milliseconds a reservation (`/v1/select_and_reserve`) holds its worker's load unless
    /// released first.
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_RESERVATION_TTL_MS",
        default_value_t = 60_000
    )]
    pub reservation_ttl_ms: u64,
    /// The most reservations held at once (beyond: 429).
    #[arg(
        long,
        env = "KVROUTE_GATEWAY_MAX_RESERVATIONS",
        default_value_t = 100_000
    )]
    pub max_reservations: usize,
    /// Seconds in the `Retry-After` header of a 429 / 503 answer.
    #[arg(long, env = "KVROUTE_GATEWAY_RETRY_AFTER_SECS", default_value_t = 1)]
    pub retry_after_secs: u64,
    /// Do not log one structured line per request (target `kvroute_gateway::access`).
    #[arg(long, env = "KVROUTE_GATEWAY_NO_ACCESS_LOG")]
    pub no_access_log: bool,
}

/// The most client connections accepted by `--max-connections`.
pub const MAX_CONNECTIONS_LIMIT: usize = 1_000_000;
/// The largest `--max-header-bytes`: below what the HTTP layer itself buffers (about 400 KB),
/// so that every refusal of a head this size is the gateway's JSON 431.
pub const MAX_HEADER_BYTES_LIMIT: usize = 256 * 1024;

/// The largest segment cache accepted, per model (MiB).
const MAX_TOKENIZE_CACHE_MIB: usize = 64 * 1024;
/// The longest tokenize queue accepted.
pub const MAX_QUEUE: usize = 100_000;

/// One configured model: its name and folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    pub name: String,
    pub dir: PathBuf,
}

impl GatewayArgs {
    /// Checks every setting; errors name the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.nats.validate()?;
        self.etcd.validate()?;
        self.select.validate()?;
        self.model_specs()?;
        if let Some(dir) = &self.models_dir
            && !dir.is_dir()
        {
            return Err(ConfigError::new(
                "models-dir",
                format!("{} is not a directory", dir.display()),
            ));
        }
        if let Some(path) = &self.api_keys_file {
            check_file("api-keys-file", path)?;
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::new("max-body-bytes", "must be at least 1024"));
        }
        if self.max_prompt_tokens == 0 {
            return Err(ConfigError::new("max-prompt-tokens", "must be positive"));
        }
        if self.max_concurrent_tokenizations == Some(0) {
            return Err(ConfigError::new(
                "max-concurrent-tokenizations",
                "must be positive",
            ));
        }
        if self.tokenize_cache_mib > MAX_TOKENIZE_CACHE_MIB {
            return Err(ConfigError::new(
                "tokenize-cache-mib",
                format!("must be at most {MAX_TOKENIZE_CACHE_MIB}"),
            ));
        }
        if self.tokenize_queue > MAX_QUEUE {
            return Err(ConfigError::new(
                "tokenize-queue",
                format!("must be at most {MAX_QUEUE}"),
            ));
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS_LIMIT {
            return Err(ConfigError::new(
                "max-connections",
                format!("must be in 1..={MAX_CONNECTIONS_LIMIT}"),
            ));
        }
        for (field, value) in [
            ("header-read-timeout-ms", self.header_read_timeout_ms),
            ("body-read-timeout-ms", self.body_read_timeout_ms),
            ("idle-timeout-ms", self.idle_timeout_ms),
            ("write-timeout-ms", self.write_timeout_ms),
            ("shutdown-timeout-ms", self.shutdown_timeout_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::new(field, "must be positive"));
            }
        }
        if !(1024..=MAX_HEADER_BYTES_LIMIT).contains(&self.max_header_bytes) {
            return Err(ConfigError::new(
                "max-header-bytes",
                format!("must be in 1024..={MAX_HEADER_BYTES_LIMIT}"),
            ));
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::new("connect-timeout-ms", "must be positive"));
        }
        if self.response_timeout_ms == 0 {
            return Err(ConfigError::new("response-timeout-ms", "must be positive"));
        }
        if self.upstream_idle_timeout_ms == 0 {
            return Err(ConfigError::new(
                "upstream-idle-timeout-ms",
                "must be positive",
            ));
        }
        if self.reservation_ttl_ms == 0 {
            return Err(ConfigError::new("reservation-ttl-ms", "must be positive"));
        }
        if self.max_reservations == 0 || self.max_reservations > MAX_RESERVATIONS_LIMIT {
            return Err(ConfigError::new(
                "max-reservations",
                format!("must be in 1..={MAX_RESERVATIONS_LIMIT}"),
            ));
        }
        self.adapter_bases()?;
        Ok(())
    }

    /// The `--lora-adapter NAME=BASE` values: each adapter's base model.
    pub fn adapter_bases(&self) -> Result<HashMap<String, String>, ConfigError> {
        let mut bases = HashMap::new();
        let models = self.model_specs()?;
        for raw in &self.lora_adapters {
            let fail =
                |why: String| Err(ConfigError::new("lora-adapter", format!("{raw:?}: {why}")));
            let Some((name, base)) = raw.split_once('=') else {
                return fail("expected NAME=BASE".into());
            };
            let (name, base) = (name.trim(), base.trim());
            if name.is_empty() || base.is_empty() {
                return fail("expected NAME=BASE with both parts".into());
            }
            if name == base || models.iter().any(|m| m.name == name) {
                return fail(format!("{name:?} is a base model's name"));
            }
            if bases.insert(name.to_owned(), base.to_owned()).is_some() {
                return fail(format!("adapter {name:?} is given twice"));
            }
        }
        if let Some((name, base)) = bases.iter().find(|(_, base)| bases.contains_key(*base)) {
            return Err(ConfigError::new(
                "lora-adapter",
                format!("adapter {name:?} names adapter {base:?} as its base model"),
            ));
        }
        Ok(bases)
    }

    /// The `--model NAME=DIR` values, parsed.
    pub fn model_specs(&self) -> Result<Vec<ModelSpec>, ConfigError> {
        let mut specs: Vec<ModelSpec> = Vec::new();
        for raw in &self.models {
            let Some((name, dir)) = raw.split_once('=') else {
                return Err(ConfigError::new(
                    "model",
                    format!("{raw:?}: expected NAME=DIR"),
                ));
            };
            let name = name.trim();
            if name.is_empty() || dir.is_empty() {
                return Err(ConfigError::new(
                    "model",
                    format!("{raw:?}: expected NAME=DIR with both parts"),
                ));
            }
            if specs.iter().any(|s| s.name == name) {
                return Err(ConfigError::new(
                    "model",
                    format!("model {name:?} is given twice"),
                ));
            }
            specs.push(ModelSpec {
                name: name.to_owned(),
                dir: PathBuf::from(dir),
            });
        }
        Ok(specs)
    }

    /// `--max-concurrent-tokenizations`, else the machine's cores.
    pub fn concurrent_tokenizations(&self) -> usize {
        self.max_concurrent_tokenizations.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        })
    }

    pub fn serve_limits(&self) -> crate::serve::Limits {
        crate::serve::Limits {
            max_connections: self.max_connections,
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            write_timeout: Duration::from_millis(self.write_timeout_ms),
        }
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    pub fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.response_timeout_ms)
    }

    pub fn upstream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream_idle_timeout_ms)
    }
}

/// The API keys of `--api-keys-file`: one per line, `#` comments and blank lines ignored.
pub fn parse_api_keys(text: &str) -> Result<Vec<String>, ConfigError> {
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if keys.is_empty() {
        return Err(ConfigError::new(
            "api-keys-file",
            "holds no key (one per line; # starts a comment)",
        ));
    }
    if let Some(bad) = keys.iter().find(|k| k.chars().any(char::is_whitespace)) {
        return Err(ConfigError::new(
            "api-keys-file",
            format!(
                "a key contains whitespace (line starting {:?})",
                bad.chars().take(4).collect::<String>()
            ),
        ));
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> GatewayArgs {
        let mut argv = vec!["kvroute-gateway"];
        argv.extend_from_slice(extra);
        GatewayArgs::try_parse_from(argv).expect("parses")
    }

    #[test]
    fn models_are_name_equals_dir() {
        let a = args(&["--model", "m=/tmp/m", "--model", "n=/x"]);
        let specs = a.model_specs().expect("valid");
        assert_eq!(specs[0].name, "m");
        assert_eq!(specs[1].dir, PathBuf::from("/x"));
        for bad in ["m", "=/x", "m="] {
            let e = args(&["--model", bad]).model_specs().unwrap_err();
            assert_eq!(e.field, "model", "{bad}");
        }
        let e = args(&["--model", "m=/a", "--model", "m=/b"])
            .model_specs()
            .unwrap_err();
        assert!(e.message.contains("twice"), "{}", e.message);
    }

    #[test]
    fn lora_adapters_are_name_equals_base() {
        let a = args(&["--lora-adapter", "sql=m", "--lora-adapter", " chat = m "]);
        let bases = a.adapter_bases().expect("valid");
        assert_eq!((bases["sql"].as_str(), bases["chat"].as_str()), ("m", "m"));
        for bad in ["sql", "=m", "sql=", "m=m", "a=m,a=n", "a=b,b=m"] {
            let e = args(&["--lora-adapter", bad]).validate().unwrap_err();
            assert_eq!(e.field, "lora-adapter", "{bad}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let model = format!("m={}", dir.path().display());
        let e = args(&["--model", &model, "--lora-adapter", "m=base"])
            .validate()
            .unwrap_err();
        assert!(e.message.contains("base model's name"), "{}", e.message);
    }

    #[test]
    fn a_gateway_without_models_routes_token_ids_only() {
        args(&[])
            .validate()
            .expect("valid: token-id prompts need no tokenizer");
        let e = args(&["--models-dir", "/nonexistent"])
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "models-dir");
    }

    #[test]
    fn limits_are_checked_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = format!("m={}", dir.path().display());
        for (flag, value) in [
            ("--max-body-bytes", "10"),
            ("--max-prompt-tokens", "0"),
            ("--max-concurrent-tokenizations", "0"),
            ("--tokenize-queue", "100001"),
            ("--max-connections", "0"),
            ("--header-read-timeout-ms", "0"),
            ("--body-read-timeout-ms", "0"),
            ("--idle-timeout-ms", "0"),
            ("--write-timeout-ms", "0"),
            ("--shutdown-timeout-ms", "0"),
            ("--max-header-bytes", "100"),
            ("--connect-timeout-ms", "0"),
            ("--response-timeout-ms", "0"),
            ("--upstream-idle-timeout-ms", "0"),
            ("--reservation-ttl-ms", "0"),
            ("--max-reservations", "0"),
        ] {
            let e = args(&["--model", &m, flag, value]).validate().unwrap_err();
            assert_eq!(format!("--{}", e.field), flag);
        }
        let e = args(&["--model", &m, "--api-keys-file", "/nonexistent/keys"])
            .validate()
            .unwrap_err();
        assert_eq!(e.field, "api-keys-file");
    }

    #[test]
    fn api_keys_skip_comments_and_blanks() {
        let keys = parse_api_keys("# team a\nsk-1\n\n  sk-2  \n").expect("valid");
        assert_eq!(keys, ["sk-1", "sk-2"]);
        assert!(parse_api_keys("# nothing\n").is_err());
        assert!(parse_api_keys("a b\n").is_err());
    }
}
