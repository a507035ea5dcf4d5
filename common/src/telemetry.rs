//! Logging setup for binaries: `RUST_LOG` filters (services default to `info`, one-shot tools
//! such as the replay and the simulator to `warn`: their results go to stdout; async-nats's own
//! connection lines are left out, kvroute logs connection events itself), `--log-format
//! text|json`, colour only on a terminal and never with `NO_COLOR` set.

use std::io::IsTerminal as _;

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

/// The default filter of services (without `RUST_LOG`).
pub const SERVICE_FILTER: &str = "info,async_nats=warn";
/// The default filter of one-shot tools, which print their results on stdout.
pub const TOOL_FILTER: &str = "warn";

/// Installs the global subscriber of a service ([`SERVICE_FILTER`] without `RUST_LOG`).
pub fn init(args: &TelemetryArgs) {
    init_with(args, SERVICE_FILTER);
}

/// Installs the global subscriber of a one-shot tool ([`TOOL_FILTER`] without `RUST_LOG`).
pub fn init_tool(args: &TelemetryArgs) {
    init_with(args, TOOL_FILTER);
}

/// Installs the global subscriber, filtering by `RUST_LOG`, else by `default_filter`. Called
/// once, from `main`. Logs go to stderr; like `RUST_LOG`, `NO_COLOR` is read here, at the
/// binary's edge.
pub fn init_with(args: &TelemetryArgs, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let ansi = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let result = match args.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    // A second init (tests, embedded use) keeps the first subscriber.
    drop(result);
}

/// Whether log lines are coloured: only on a terminal, and not when `NO_COLOR` is set to
/// anything but the empty string (<https://no-color.org>).
pub fn colour(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".as_ref())));
        assert!(!colour(true, Some("1".as_ref())));
        assert!(!colour(false, None));
    }
}
