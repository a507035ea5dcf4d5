//! Logging setup for binaries: `RUST_LOG` filters (default `info`), `--log-format text|json`.

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Telemetry flags shared by every binary.
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Log format: text (human) or json (one object per line).
    #[arg(long = "log-format", env = "KVROUTE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Installs the global subscriber. Called once, from `main`. Logs go to stderr.
pub fn init(args: &TelemetryArgs) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match args.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    // A second init (tests, embedded use) keeps the first subscriber.
    drop(result);
}
