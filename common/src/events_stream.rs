//! The events stream `KVROUTE_<ns>_EVENTS`: created idempotently by the first process that
//! needs it (indexer, or a worker fleet); later processes compare its settings with theirs and
//! report differences instead of overwriting them.

use std::time::Duration;

use crate::config::ConfigError;
use crate::jetstream::{JetStreamError, validate_replicas};
use crate::names::Names;
use crate::ops::exit::describe;
use async_nats::jetstream::{self, stream};

/// Where the events stream keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StreamStorage {
    File,
    Memory,
}

/// The events stream's settings. The first process that needs the stream creates it with
/// these; later processes compare and report mismatches instead of overwriting.
#[derive(Debug, Clone, clap::Args)]
pub struct StreamArgs {
    /// Replicas of the events stream (1 on a single NATS node, 3 in a cluster).
    #[arg(
        long = "stream-replicas",
        env = "KVROUTE_STREAM_REPLICAS",
        default_value_t = 1
    )]
    pub replicas: usize,
    /// Oldest message the stream keeps, in seconds (0 = no age limit).
    #[arg(
        long = "stream-max-age-secs",
        env = "KVROUTE_STREAM_MAX_AGE_SECS",
        default_value_t = 86_400
    )]
    pub max_age_secs: u64,
    /// Most bytes the stream keeps (-1 = no limit).
    #[arg(long = "stream-max-bytes", env = "KVROUTE_STREAM_MAX_BYTES",
        allow_negative_numbers = true, default_value_t = 1024 * 1024 * 1024)]
    pub max_bytes: i64,
    /// Stream storage: file or memory.
    #[arg(long = "stream-storage", env = "KVROUTE_STREAM_STORAGE", value_enum, default_value_t = StreamStorage::File)]
    pub storage: StreamStorage,
    /// Window in which a republished batch (same message id) is dropped as a duplicate, in seconds.
    #[arg(
        long = "stream-duplicate-window-secs",
        env = "KVROUTE_STREAM_DUPLICATE_WINDOW_SECS",
        default_value_t = 120
    )]
    pub duplicate_window_secs: u64,
}

impl Default for StreamArgs {
    /// The same values as the flags' defaults.
    fn default() -> Self {
        Self {
            replicas: 1,
            max_age_secs: 86_400,
            max_bytes: 1024 * 1024 * 1024,
            storage: StreamStorage::File,
            duplicate_window_secs: 120,
        }
    }
}

/// The settings kvroute wants for the events stream.
pub fn desired_config(names: &Names, args: &StreamArgs) -> stream::Config {
    stream::Config {
        name: names.events_stream(),
        subjects: names.events_stream_subjects(),
        num_replicas: args.replicas,
        max_age: Duration::from_secs(args.max_age_secs),
        max_bytes: args.max_bytes,
        storage: match args.storage {
            StreamStorage::File => stream::StorageType::File,
            StreamStorage::Memory => stream::StorageType::Memory,
        },
        duplicate_window: Duration::from_secs(args.duplicate_window_secs),
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// Differences between the stream's actual settings and ours, as `setting: theirs != ours`.
pub fn mismatches(actual: &stream::Config, wanted: &stream::Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |name: &str, a: String, w: String| {
        if a != w {
            out.push(format!("{name}: stream has {a}, this process wants {w}"));
        }
    };
    let mut a_subjects = actual.subjects.clone();
    let mut w_subjects = wanted.subjects.clone();
    a_subjects.sort();
    w_subjects.sort();
    check(
        "subjects",
        format!("{a_subjects:?}"),
        format!("{w_subjects:?}"),
    );
    check(
        "replicas",
        actual.num_replicas.to_string(),
        wanted.num_replicas.to_string(),
    );
    check(
        "max_age",
        format!("{:?}", actual.max_age),
        format!("{:?}", wanted.max_age),
    );
    check(
        "max_bytes",
        actual.max_bytes.to_string(),
        wanted.max_bytes.to_string(),
    );
    check(
        "storage",
        format!("{:?}", actual.storage),
        format!("{:?}", wanted.storage),
    );
    check(
        "duplicate_window",
        format!("{:?}", actual.duplicate_window),
        format!("{:?}", wanted.duplicate_window),
    );
    out
}

/// Gets the events stream, creating it if absent. Returns the stream and any mismatches
/// between its settings and ours (logged by the caller, never "fixed"). A refused creation
/// names the settings (as `--stream-*` flags) and keeps the server's cause.
pub async fn ensure_events_stream(
    js: &jetstream::Context,
    names: &Names,
    args: &StreamArgs,
) -> Result<(stream::Stream, Vec<String>), JetStreamError> {
    let wanted = desired_config(names, args);
    let what = format!("stream {}", wanted.name);
    let mut refused = None;
    for _ in 0..3 {
        match js.get_stream(&wanted.name).await {
            Ok(mut s) => {
                let info = s
                    .info()
                    .await
                    .map_err(|e| JetStreamError::failed(format!("reading {what}"), &e))?;
                let diff = mismatches(&info.config, &wanted);
                return Ok((s, diff));
            }
            Err(_) => match js.create_stream(wanted.clone()).await {
                Ok(s) => return Ok((s, Vec::new())),
                // Another process may have created it meanwhile: read it back.
                Err(e) => {
                    tracing::debug!(error = %e, "creating the events stream failed; reading it");
                    refused = Some(describe(&e));
                }
            },
        }
    }
    Err(JetStreamError::Refused {
        setting: args.flags(),
        what,
        cause: refused.unwrap_or_else(|| "unknown error".into()),
    })
}

impl StreamArgs {
    /// Checks the settings; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_replicas("stream-replicas", self.replicas)?;
        if self.max_bytes == 0 || self.max_bytes < -1 {
            return Err(ConfigError::new(
                "stream-max-bytes",
                "must be positive or -1",
            ));
        }
        if self.duplicate_window_secs == 0 {
            return Err(ConfigError::new(
                "stream-duplicate-window-secs",
                "must be positive",
            ));
        }
        if self.max_age_secs != 0 && self.max_age_secs < self.duplicate_window_secs {
            return Err(ConfigError::new(
                "stream-max-age-secs",
                "must be 0 or at least --stream-duplicate-window-secs",
            ));
        }
        Ok(())
    }

    /// The settings a refused creation may be about, as flags.
    pub fn flags(&self) -> String {
        format!(
            "--stream-replicas {} (with --stream-max-bytes {}, --stream-storage {})",
            self.replicas,
            self.max_bytes,
            match self.storage {
                StreamStorage::File => "file",
                StreamStorage::Memory => "memory",
            }
        )
    }
}
/// For worker-side processes (the mocker's fleets, the bridge): creates the events stream with
/// `args` (their `--stream-*` flags) if nobody has yet — they may start before any indexer —
/// and leaves an existing one as it is, warning about settings that differ. A refusal names
/// `bin`'s settings and the ways out.
pub async fn ensure_worker_events_stream(
    js: &jetstream::Context,
    names: &Names,
    args: &StreamArgs,
    bin: &str,
) -> Result<(), JetStreamError> {
    let (_, mismatched) = ensure_events_stream(js, names, args)
        .await
        .map_err(|e| match e {
            JetStreamError::Refused { what, cause, .. } => JetStreamError::Refused {
                setting: format!(
                    "{bin}'s {} (set --stream-*, start an indexer first, or pass --no-create-stream)",
                    args.flags()
                ),
                what,
                cause,
            },
            other => other,
        })?;
    for m in mismatched {
        tracing::warn!(
            stream = names.events_stream(),
            "events stream setting differs from {bin}'s --stream-* flags: {m}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_flag() {
        assert!(StreamArgs::default().validate().is_ok());
        let bad = |f: fn(&mut StreamArgs)| {
            let mut a = StreamArgs::default();
            f(&mut a);
            a.validate().unwrap_err().field
        };
        assert_eq!(bad(|a| a.replicas = 0), "stream-replicas");
        assert_eq!(bad(|a| a.replicas = 6), "stream-replicas");
        assert_eq!(bad(|a| a.max_bytes = 0), "stream-max-bytes");
        assert_eq!(bad(|a| a.max_bytes = -2), "stream-max-bytes");
        assert_eq!(
            bad(|a| a.duplicate_window_secs = 0),
            "stream-duplicate-window-secs"
        );
        assert_eq!(bad(|a| a.max_age_secs = 60), "stream-max-age-secs");
        let mut unlimited = StreamArgs {
            max_bytes: -1,
            max_age_secs: 0,
            ..StreamArgs::default()
        };
        assert!(unlimited.validate().is_ok());
        unlimited.storage = StreamStorage::Memory;
        assert!(unlimited.validate().is_ok());
    }
}
