//! Connection settings shared by every binary: NATS and etcd, from CLI flags with `KVROUTE_*`
//! environment fallbacks, validated once at startup ([`ConfigError`] names the bad flag).
//! Connecting ([`connect`]) retries until a startup deadline, the same way for both.

mod access;
mod connect;

use std::path::{Path, PathBuf};

use crate::ids::Namespace;

pub use access::{AccessFlags, Credentials, Etcd, Nats, Service, TlsFiles};
pub use connect::{DEFAULT_CONNECT_TIMEOUT_MS, Unreachable};

/// A setting that cannot work; `field` is the flag's name, `env` the environment variable
/// the value came from (when it did; see [`crate::cli::Origins::attribute`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {}: {message}", self.source_label())]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
    pub env: Option<String>,
}

impl ConfigError {
    pub fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
            env: None,
        }
    }

    fn source_label(&self) -> String {
        match &self.env {
            Some(env) => format!("{env} (for --{})", self.field),
            None => format!("--{}", self.field),
        }
    }
}

/// Checks that `path` (the value of `--field`) is a file that can be opened: the error says
/// whether it is missing, a directory, or unreadable.
pub fn check_file(field: &'static str, path: &Path) -> Result<(), ConfigError> {
    let problem = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => "is a directory, not a file".to_owned(),
        Ok(_) => match std::fs::File::open(path) {
            Ok(_) => return Ok(()),
            Err(e) => format!("cannot be read: {}", io_reason(&e)),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist".to_owned(),
        Err(e) => format!("cannot be read: {}", io_reason(&e)),
    };
    Err(ConfigError::new(
        field,
        format!("{} {problem}", path.display()),
    ))
}

/// An I/O error in words, without the `(os error N)` suffix.
pub fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(i) => text[..i].to_lowercase(),
        None => text,
    }
}

fn file_must_exist(field: &'static str, path: &Option<PathBuf>) -> Result<(), ConfigError> {
    match path {
        Some(p) => check_file(field, p),
        None => Ok(()),
    }
}

fn pair_must_match(a: (&'static str, bool), b: (&'static str, bool)) -> Result<(), ConfigError> {
    match (a.1, b.1) {
        (true, false) => Err(ConfigError::new(b.0, format!("required with --{}", a.0))),
        (false, true) => Err(ConfigError::new(a.0, format!("required with --{}", b.0))),
        _ => Ok(()),
    }
}

/// The deployment's namespace.
#[derive(Debug, Clone, clap::Args)]
pub struct NamespaceArgs {
    /// Namespace that scopes every subject, stream, bucket and etcd key (1-64 of [A-Za-z0-9_-]).
    #[arg(long, env = "KVROUTE_NAMESPACE", default_value = "default")]
    pub namespace: Namespace,
}

/// How to reach NATS. (Arg ids are the flag names, so the struct flattens next to
/// [`EtcdArgs`], whose fields have the same names.)
#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URLs, comma-separated (nats://, tls://, or host:port).
    #[arg(
        id = "nats-url",
        long = "nats-url",
        env = "KVROUTE_NATS_URL",
        value_delimiter = ',',
        default_value = "nats://127.0.0.1:4222"
    )]
    pub urls: Vec<String>,
    /// `--nats-user`, `--nats-password`.
    #[command(flatten)]
    pub credentials: Credentials<Nats>,
    /// NATS authentication token.
    #[arg(
        id = "nats-token",
        long = "nats-token",
        env = "KVROUTE_NATS_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// NATS credentials file (JWT + NKey seed).
    #[arg(id = "nats-creds", long = "nats-creds", env = "KVROUTE_NATS_CREDS")]
    pub creds_file: Option<PathBuf>,
    /// `--nats-tls-ca`, `--nats-tls-cert`, `--nats-tls-key`.
    #[command(flatten)]
    pub tls: TlsFiles<Nats>,
    /// Prefix of this connection's reply subjects (`<prefix>.<unique>`); a deployment with
    /// per-identity permissions gives each identity its own (`_INBOX.<user>`), so no other
    /// identity can subscribe to its replies.
    #[arg(
        id = "nats-inbox-prefix",
        long = "nats-inbox-prefix",
        env = "KVROUTE_NATS_INBOX_PREFIX",
        default_value = "_INBOX"
    )]
    pub inbox_prefix: String,
    /// Startup deadline, in milliseconds: the first connection is retried (with backoff, each
    /// failure logged) for this long, then the process exits with status 4.
    #[arg(
        id = "nats-connect-timeout-ms",
        long = "nats-connect-timeout-ms",
        env = "KVROUTE_NATS_CONNECT_TIMEOUT_MS",
        default_value_t = DEFAULT_CONNECT_TIMEOUT_MS
    )]
    pub connect_timeout_ms: u64,
    /// How often to ping the server, in milliseconds; after 2 unanswered pings the client
    /// reconnects (elsewhere, with several URLs). Match the servers' `ping_interval`.
    #[arg(
        id = "nats-ping-interval-ms",
        long = "nats-ping-interval-ms",
        env = "KVROUTE_NATS_PING_INTERVAL_MS",
        default_value_t = DEFAULT_PING_INTERVAL_MS
    )]
    pub ping_interval_ms: u64,
}

/// The client ping interval kvroute's processes use by default: the same as the NATS servers
/// of compose.yaml and the test harness (`ping_interval: 2s`, `ping_max: 2`), so a dead peer
/// is noticed within seconds on both sides.
pub const DEFAULT_PING_INTERVAL_MS: u64 = 2000;

impl NatsArgs {
    /// Settings for a server at `url` with no authentication.
    pub fn plain(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            credentials: Credentials::default(),
            token: None,
            creds_file: None,
            tls: TlsFiles::default(),
            inbox_prefix: "_INBOX".to_owned(),
            connect_timeout_ms: 5000,
            ping_interval_ms: DEFAULT_PING_INTERVAL_MS,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.urls.is_empty() || self.urls.iter().any(|u| u.trim().is_empty()) {
            return Err(ConfigError::new(
                "nats-url",
                "at least one non-empty URL is required",
            ));
        }
        for url in &self.urls {
            validate_url("nats-url", url, &["nats", "tls", "ws", "wss"])?;
        }
        self.credentials.validate()?;
        let methods = [
            self.credentials.user.is_some(),
            self.token.is_some(),
            self.creds_file.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err(ConfigError::new(
                "nats-token",
                "use one of --nats-user/--nats-password, --nats-token, --nats-creds",
            ));
        }
        file_must_exist("nats-creds", &self.creds_file)?;
        self.tls.validate()?;
        validate_inbox_prefix(&self.inbox_prefix)?;
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::new(
                "nats-connect-timeout-ms",
                "must be positive",
            ));
        }
        if self.ping_interval_ms == 0 {
            return Err(ConfigError::new(
                "nats-ping-interval-ms",
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// How to reach etcd.
#[derive(Debug, Clone, clap::Args)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated (http://host:port or https://host:port).
    #[arg(
        id = "etcd-endpoints",
        long = "etcd-endpoints",
        env = "KVROUTE_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub endpoints: Vec<String>,
    /// `--etcd-user`, `--etcd-password`.
    #[command(flatten)]
    pub credentials: Credentials<Etcd>,
    /// `--etcd-tls-ca`, `--etcd-tls-cert`, `--etcd-tls-key`.
    #[command(flatten)]
    pub tls: TlsFiles<Etcd>,
    /// Startup deadline, in milliseconds: the first connection is retried (with backoff, each
    /// failure logged) for this long, then the process exits with status 4.
    #[arg(
        id = "etcd-connect-timeout-ms",
        long = "etcd-connect-timeout-ms",
        env = "KVROUTE_ETCD_CONNECT_TIMEOUT_MS",
        default_value_t = DEFAULT_CONNECT_TIMEOUT_MS
    )]
    pub connect_timeout_ms: u64,
}

impl EtcdArgs {
    /// Settings for an endpoint with no authentication.
    pub fn plain(endpoint: impl Into<String>) -> Self {
        Self {
            endpoints: vec![endpoint.into()],
            credentials: Credentials::default(),
            tls: TlsFiles::default(),
            connect_timeout_ms: 5000,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() || self.endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(ConfigError::new(
                "etcd-endpoints",
                "at least one non-empty endpoint is required",
            ));
        }
        for e in &self.endpoints {
            validate_url("etcd-endpoints", e, &["http", "https"])?;
        }
        self.credentials.validate()?;
        self.tls.validate()?;
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::new(
                "etcd-connect-timeout-ms",
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// An inbox prefix is one or more dot-separated tokens without wildcards or spaces.
fn validate_inbox_prefix(prefix: &str) -> Result<(), ConfigError> {
    let bad = prefix
        .split('.')
        .any(|t| t.is_empty() || t.contains(['*', '>', ' ', '\t']));
    if bad {
        return Err(ConfigError::new(
            "nats-inbox-prefix",
            format!("{prefix:?}: must be dot-separated tokens without wildcards or spaces"),
        ));
    }
    Ok(())
}

/// Accepts `scheme://host:port` with a listed scheme, or a bare `host:port`.
fn validate_url(field: &'static str, url: &str, schemes: &[&str]) -> Result<(), ConfigError> {
    let rest = match url.split_once("://") {
        Some((scheme, rest)) => {
            if !schemes.contains(&scheme) {
                return Err(ConfigError::new(
                    field,
                    format!("{url:?}: scheme must be one of {}", schemes.join(", ")),
                ));
            }
            rest
        }
        None => url,
    };
    let hostport = rest
        .rsplit('@')
        .next()
        .unwrap_or(rest)
        .trim_end_matches('/');
    let ok = match hostport.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => !hostport.is_empty(),
    };
    if ok {
        Ok(())
    } else {
        Err(ConfigError::new(field, format!("{url:?} is not host:port")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_and_etcd_flatten_into_one_command() {
        use clap::{CommandFactory, Parser};
        #[derive(Debug, Parser)]
        struct Both {
            #[command(flatten)]
            nats: NatsArgs,
            #[command(flatten)]
            etcd: EtcdArgs,
        }
        Both::command().debug_assert();
        let both = Both::try_parse_from([
            "x",
            "--nats-user=u",
            "--nats-password=p",
            "--etcd-user=e",
            "--etcd-password=q",
            "--nats-connect-timeout-ms=7",
        ])
        .unwrap();
        assert_eq!(both.nats.credentials.user.as_deref(), Some("u"));
        assert_eq!(both.etcd.credentials.user.as_deref(), Some("e"));
        assert_eq!(both.nats.connect_timeout_ms, 7);
        assert_eq!(both.etcd.connect_timeout_ms, DEFAULT_CONNECT_TIMEOUT_MS);
    }

    #[test]
    fn validation_names_the_field() {
        let mut n = NatsArgs::plain("nats://127.0.0.1:4222");
        assert!(n.validate().is_ok());
        n.urls = vec!["http://x:1".into()];
        assert_eq!(n.validate().unwrap_err().field, "nats-url");
        n.urls = vec!["nats://x:notaport".into()];
        assert_eq!(n.validate().unwrap_err().field, "nats-url");
        n.urls = vec!["127.0.0.1:4222".into()];
        n.credentials.user = Some("u".into());
        assert_eq!(n.validate().unwrap_err().field, "nats-password");
        n.credentials.password = Some("p".into());
        n.token = Some("t".into());
        assert_eq!(n.validate().unwrap_err().field, "nats-token");
        n.credentials = Credentials::default();
        n.token = None;
        n.inbox_prefix = "_INBOX.*".into();
        assert_eq!(n.validate().unwrap_err().field, "nats-inbox-prefix");
        n.inbox_prefix = "_INBOX.worker-1".into();
        assert!(n.validate().is_ok());
        n.tls = TlsFiles::with_ca("/nonexistent/ca.pem");
        assert_eq!(n.validate().unwrap_err().field, "nats-tls-ca");
        n.tls.ca = None;
        n.tls.key = Some("/nonexistent/key.pem".into());
        assert_eq!(n.validate().unwrap_err().field, "nats-tls-key");

        let mut e = EtcdArgs::plain("http://127.0.0.1:2379");
        assert!(e.validate().is_ok());
        e.endpoints = vec!["nats://x:1".into()];
        let err = e.validate().unwrap_err();
        assert_eq!(err.field, "etcd-endpoints");
        assert!(err.to_string().contains("--etcd-endpoints"), "{err}");
        e.endpoints = vec!["http://x:1".into()];
        e.credentials.password = Some("p".into());
        assert_eq!(e.validate().unwrap_err().field, "etcd-user");
        e.credentials.password = None;
        e.tls = TlsFiles::with_ca("/nonexistent/ca.pem");
        assert_eq!(e.validate().unwrap_err().field, "etcd-tls-ca");
        e.tls = TlsFiles::default();
        e.connect_timeout_ms = 0;
        assert_eq!(e.validate().unwrap_err().field, "etcd-connect-timeout-ms");
    }
}

#[cfg(test)]
mod clap_tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct All {
        #[command(flatten)]
        ns: NamespaceArgs,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        etcd: EtcdArgs,
    }

    #[test]
    fn shared_flag_groups_keep_their_names_and_variables() {
        use clap::CommandFactory;
        let cmd = All::command();
        for service in ["NATS", "ETCD"] {
            for flag in ["USER", "PASSWORD", "TLS_CA", "TLS_CERT", "TLS_KEY"] {
                let env = format!("KVROUTE_{service}_{flag}");
                let id = format!("{service}-{flag}").to_lowercase().replace('_', "-");
                let arg = cmd
                    .get_arguments()
                    .find(|a| a.get_id() == id.as_str())
                    .unwrap_or_else(|| panic!("no --{id}"));
                assert_eq!(arg.get_long(), Some(id.as_str()));
                assert_eq!(arg.get_env().and_then(|e| e.to_str()), Some(env.as_str()));
            }
        }
        let a = All::try_parse_from([
            "x",
            "--nats-tls-ca=/n",
            "--etcd-tls-cert=/c",
            "--etcd-tls-key=/k",
            "--etcd-password=p",
        ])
        .unwrap();
        assert_eq!(a.nats.tls.ca.as_deref(), Some(Path::new("/n")));
        assert!(a.etcd.tls.ca.is_none());
        assert_eq!(
            a.etcd.tls.identity().map(|(c, _)| c.as_path()),
            Some(Path::new("/c"))
        );
        assert_eq!(a.etcd.credentials.password.as_deref(), Some("p"));
        assert_eq!(a.nats.inbox_prefix, "_INBOX");
    }

    #[test]
    fn flag_sets_combine_into_one_command() {
        use clap::CommandFactory;
        All::command().debug_assert();
        let a = All::try_parse_from(["x", "--nats-user", "u", "--etcd-user", "e"]).unwrap();
        assert_eq!(a.nats.credentials.user.as_deref(), Some("u"));
        assert_eq!(a.etcd.credentials.user.as_deref(), Some("e"));
    }
}
