//! `kvroute-gateway`'s flags (each with a `KVROUTE_GATEWAY_*` or `KVROUTE_*` env fallback) and
//! their checks. A bad value stops startup with a message naming the flag.

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
        Ok(())
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
