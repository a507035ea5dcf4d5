//! The indexer process's configuration: CLI flags with `KVROUTE_*` environment fallbacks,
//! validated once at startup ([`IndexerConfig::validate`] names the bad flag).

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_common::config::{ConfigError, EtcdArgs, NamespaceArgs, NatsArgs};
use kvroute_common::events_stream::StreamArgs;
use kvroute_common::telemetry::TelemetryArgs;

use crate::index::IndexConfig;

/// Everything `kvroute-indexer` needs.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvroute-indexer",
    version,
    about = "kvroute indexer: replicated radix index of which worker holds which KV-cache prefix"
)]
pub struct IndexerConfig {
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub stream: StreamArgs,

    /// This replica's id (unique among indexers; default: indexer-<random>).
    #[arg(long = "replica-id", env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Address of the HTTP endpoints /metrics, /healthz, /readyz, /status (port 0: any free port).
    #[arg(
        long = "http-addr",
        env = "KVROUTE_HTTP_ADDR",
        default_value = "127.0.0.1:9100"
    )]
    pub http_addr: SocketAddr,
    /// The leader writes a snapshot after this many applied log messages (0 = never by count).
    #[arg(
        long = "snapshot-every-messages",
        env = "KVROUTE_SNAPSHOT_EVERY_MESSAGES",
        default_value_t = 10_000
    )]
    pub snapshot_every_messages: u64,
    /// The leader writes a snapshot at least this often when the state changed, in seconds (0 = never by time).
    #[arg(
        long = "snapshot-interval-secs",
        env = "KVROUTE_SNAPSHOT_INTERVAL_SECS",
        default_value_t = 30
    )]
    pub snapshot_interval_secs: u64,
    /// Snapshots kept in the object store (older ones are deleted).
    #[arg(
        long = "snapshot-keep",
        env = "KVROUTE_SNAPSHOT_KEEP",
        default_value_t = 3
    )]
    pub snapshot_keep: usize,
    /// Purge log messages older than the oldest kept snapshot (true/false).
    #[arg(long = "purge-log", env = "KVROUTE_PURGE_LOG", default_value_t = true, action = clap::ArgAction::Set)]
    pub purge_log: bool,
    /// Ready only when at most this many log messages are not yet applied.
    #[arg(
        long = "ready-max-lag",
        env = "KVROUTE_READY_MAX_LAG",
        default_value_t = 1000
    )]
    pub ready_max_lag: u64,
    /// Falling behind on queries, in milliseconds: when the runtime's timers fire this late,
    /// or a query has been in flight this long, the replica leaves the query queue group until
    /// both stay under half of it for as long again.
    #[arg(
        long = "max-lag-ms",
        env = "KVROUTE_MAX_LAG_MS",
        default_value_t = 1000
    )]
    pub max_lag_ms: u64,
    /// TTL of the snapshot leader's lease, in seconds (minimum 2): a new leader takes over within it.
    #[arg(
        long = "leader-ttl-secs",
        env = "KVROUTE_LEADER_TTL_SECS",
        default_value_t = 5
    )]
    pub leader_ttl_secs: u64,
    /// A worker with events in the log but no registration for this long is removed, in seconds.
    #[arg(
        long = "unregistered-grace-secs",
        env = "KVROUTE_UNREGISTERED_GRACE_SECS",
        default_value_t = 15
    )]
    pub unregistered_grace_secs: u64,
    /// Maximum resident (block, worker) entries in the index (absent: no cap). A serving
    /// replica holds its index twice (readers never wait for the writer): budget about
    /// 2 × 70 bytes per entry (`kvroute_indexer_index_bytes` counts both copies).
    #[arg(long = "max-entries", env = "KVROUTE_MAX_ENTRIES")]
    pub max_entries: Option<usize>,
}

impl IndexerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.nats.validate()?;
        self.etcd.validate()?;
        self.stream.validate()?;
        if let Some(id) = &self.replica_id
            && !kvroute_common::ids::is_subject_token(id, 64)
        {
            return Err(ConfigError::new(
                "replica-id",
                "must be 1 to 64 characters of [A-Za-z0-9_-] (it is a NATS subject token)",
            ));
        }
        if self.max_lag_ms == 0 {
            return Err(ConfigError::new("max-lag-ms", "must be above 0"));
        }
        if self.snapshot_keep == 0 {
            return Err(ConfigError::new("snapshot-keep", "must be at least 1"));
        }
        if self.leader_ttl_secs < 2 {
            return Err(ConfigError::new(
                "leader-ttl-secs",
                "etcd's minimum lease TTL is 2 s",
            ));
        }
        self.index_config()
            .validate()
            .map_err(|e| ConfigError::new("max-entries", e.to_string()))?;
        Ok(())
    }

    pub fn replica_id(&self) -> String {
        self.replica_id.clone().unwrap_or_else(|| {
            format!(
                "indexer-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        })
    }

    pub fn index_config(&self) -> IndexConfig {
        IndexConfig {
            max_entries: self.max_entries,
            ..IndexConfig::default()
        }
    }

    /// When this replica counts as falling behind on queries (and leaves the query group).
    pub fn watchdog(&self) -> kvroute_common::ops::WatchdogConfig {
        kvroute_common::ops::WatchdogConfig::new(Duration::from_millis(self.max_lag_ms))
    }

    pub fn leader_ttl(&self) -> Duration {
        Duration::from_secs(self.leader_ttl_secs)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(args: &[&str]) -> IndexerConfig {
        IndexerConfig::try_parse_from(
            std::iter::once("kvroute-indexer").chain(args.iter().copied()),
        )
        .unwrap()
    }

    #[test]
    fn defaults_are_valid_and_bad_values_name_their_flag() {
        parse(&[]).validate().unwrap();
        for (args, field) in [
            (&["--stream-replicas", "0"][..], "stream-replicas"),
            (&["--snapshot-keep", "0"][..], "snapshot-keep"),
            (&["--leader-ttl-secs", "1"][..], "leader-ttl-secs"),
            (&["--max-entries", "0"][..], "max-entries"),
            (&["--nats-url", "http://x:1"][..], "nats-url"),
            (&["--stream-max-age-secs", "5"][..], "stream-max-age-secs"),
        ] {
            assert_eq!(parse(args).validate().unwrap_err().field, field, "{args:?}");
        }
        assert!(IndexerConfig::try_parse_from(["x", "--namespace", "a.b"]).is_err());
    }
}
