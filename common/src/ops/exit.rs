//! How every kvroute binary ends: one table of exit statuses ([`Status`]) and one error line
//! on stderr, `kvroute-<bin>: error: <message>: <cause>: <cause>` (no backtrace).
//!
//! A `main` is `exit::run::<Args>("kvroute-x", |args, origins| ...)`: it parses the command
//! line ([`crate::cli`]), runs the closure and turns its error into the line and the status.
//! The status comes from the error: a [`ConfigError`] (or anything marked with
//! [`with_status`]) is a bad configuration, [`Unreachable`] an unreachable NATS or etcd, and
//! so on; anything else is a runtime failure.

use std::process::ExitCode;

use crate::cli::{CliError, Origins};
use crate::config::{ConfigError, Unreachable};
pub use crate::error_chain::{describe, message};
use crate::jetstream::JetStreamError;
use crate::ops::http::ListenError;

/// The exit statuses of every kvroute binary (README.md, "Exit codes").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// 0: success (also `--help` and `--version`).
    Ok = 0,
    /// 1: a failure while running, or any error not below.
    Failed = 1,
    /// 2: bad usage or configuration: a flag, environment variable or file that cannot work,
    /// including a setting the environment refuses (an address in use, more replicas than
    /// the NATS cluster has servers).
    BadConfig = 2,
    /// 3: `kvroute-replay`: the run finished but failed its error threshold.
    Threshold = 3,
    /// 4: NATS or etcd unreachable at startup (past the connect deadline), or NATS without
    /// JetStream.
    Unavailable = 4,
}

impl From<Status> for ExitCode {
    fn from(status: Status) -> Self {
        ExitCode::from(status as u8)
    }
}

/// An error that ends the process with `status`: displays as the error it wraps.
#[derive(Debug)]
pub struct Fatal {
    pub status: Status,
    error: anyhow::Error,
}

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Fatal {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// Marks `error` to end the process with `status`.
pub fn with_status(status: Status, error: impl Into<anyhow::Error>) -> anyhow::Error {
    Fatal {
        status,
        error: error.into(),
    }
    .into()
}

/// The status `error` ends the process with: the first cause in its chain that has one.
pub fn status_of(error: &anyhow::Error) -> Status {
    for cause in error.chain() {
        if let Some(f) = cause.downcast_ref::<Fatal>() {
            return f.status;
        }
        if cause.is::<ConfigError>() || cause.is::<ListenError>() {
            return Status::BadConfig;
        }
        if cause.is::<Unreachable>() {
            return Status::Unavailable;
        }
        if let Some(e) = cause.downcast_ref::<JetStreamError>() {
            return match e {
                JetStreamError::Disabled { .. } => Status::Unavailable,
                JetStreamError::Refused { .. } => Status::BadConfig,
                JetStreamError::Failed { .. } => Status::Failed,
            };
        }
    }
    Status::Failed
}

/// Prints the error line `<bin>: error: <message>` on stderr.
pub fn report(bin: &str, message: &str) {
    eprintln!("{bin}: error: {message}");
}

/// The whole `main` of a binary: parses `T` from the command line and environment (bad
/// usage: the line and status 2; `--help`, `--version`: printed, status 0), runs `main`
/// with the arguments and where each came from, and ends with the status of its error.
pub fn run<T: clap::Parser>(
    bin: &str,
    main: impl FnOnce(T, Origins) -> anyhow::Result<()>,
) -> ExitCode {
    run_command(bin, T::command(), main)
}

/// [`run`] with `command` (`T`'s own, adjusted: a binary's name, extra help).
pub fn run_command<T: clap::FromArgMatches>(
    bin: &str,
    command: clap::Command,
    main: impl FnOnce(T, Origins) -> anyhow::Result<()>,
) -> ExitCode {
    let (args, origins) = match crate::cli::parse_command::<T>(command, std::env::args_os()) {
        Ok(parsed) => parsed,
        Err(CliError::Display(e)) => {
            let _ = e.print();
            return Status::Ok.into();
        }
        Err(CliError::Usage(message)) => {
            report(bin, &message);
            return Status::BadConfig.into();
        }
    };
    finish(bin, main(args, origins))
}

/// The status of `result`, reporting its error.
pub fn finish(bin: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => Status::Ok.into(),
        Err(e) => {
            report(bin, &message(&e));
            status_of(&e).into()
        }
    }
}

/// Runs `future` on a new multi-threaded runtime (what `#[tokio::main]` does).
pub fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(
    future: F,
) -> anyhow::Result<()> {
    block_on_value(future)
}

/// [`block_on`] for a future with a result.
pub fn block_on_value<T, F: std::future::Future<Output = anyhow::Result<T>>>(
    future: F,
) -> anyhow::Result<T> {
    let runtime = tokio::runtime::Runtime::new()
        .map_err(|e| anyhow::anyhow!("starting the async runtime: {e}"))?;
    runtime.block_on(future)
}

#[cfg(test)]
mod tests {
    use anyhow::Context as _;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading --policy-config x.yaml: {source}")]
    struct Repeats {
        source: std::io::Error,
    }

    #[test]
    fn causes_join_on_one_line_without_repeats() {
        let e = anyhow::Error::from(Repeats {
            source: std::io::Error::other("no such file"),
        })
        .context("starting");
        assert_eq!(
            message(&e),
            "starting: reading --policy-config x.yaml: no such file"
        );
        let e = anyhow::anyhow!("line one\n  line two");
        assert_eq!(message(&e), "line one line two");
    }

    #[test]
    fn the_status_comes_from_the_first_classified_cause() {
        let config = anyhow::Error::from(ConfigError::new("workers", "must be 1..=1024"));
        assert_eq!(status_of(&config), Status::BadConfig);
        assert_eq!(
            status_of(&config.context("starting the fleet")),
            Status::BadConfig
        );
        let unreachable = anyhow::Error::from(Unreachable {
            service: "etcd",
            urls: "http://127.0.0.1:1".into(),
            flag: "etcd-connect-timeout-ms",
            deadline_ms: 10,
            attempts: 1,
            last: "refused".into(),
        });
        assert_eq!(status_of(&unreachable), Status::Unavailable);
        let marked = with_status(Status::BadConfig, anyhow::anyhow!("unknown policy"));
        assert_eq!(status_of(&marked), Status::BadConfig);
        assert_eq!(message(&marked), "unknown policy");
        let plain: anyhow::Result<()> = Err(anyhow::anyhow!("boom"));
        assert_eq!(
            status_of(&plain.context("running").unwrap_err()),
            Status::Failed
        );
        assert_eq!(Status::Threshold as u8, 3);
    }
}
