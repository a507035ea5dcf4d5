//! Starting (or restarting) a replica: load the newest snapshot the log still reaches back to,
//! and consume from the sequence after it. Without such a snapshot, start empty from the
//! log's first message; if the log no longer starts at 1 (purged or expired), ask every
//! registered worker to resync and stay not-ready until those resyncs are applied — never
//! serve a silently incomplete state as ready.

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: times the bootstrap and hands the duties their now"
)]

use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use futures::future::join_all;
use std::sync::atomic::Ordering;

use kvroute_common::names::Names;

use super::snapshots::SnapshotStore;
use super::{IndexerProcess, Input};
use crate::replica::ReplicaState;

/// The newest snapshot the log still reaches back to (the log's first sequence is `first`),
/// restored; damaged snapshots are skipped for older ones. Shared with [`super::IndexFollower`].
pub(super) async fn newest_usable_snapshot(
    store: &SnapshotStore,
    names: &Names,
    first: u64,
) -> Option<(u64, ReplicaState)> {
    for seq in store.list().await.unwrap_or_default() {
        // The log must still hold every message after the snapshot.
        if seq + 1 < first {
            tracing::info!(seq, first, "snapshot is older than the log; skipping it");
            continue;
        }
        let loaded = match store.load(seq).await {
            Ok(bytes) => ReplicaState::restore(names, &bytes).map_err(anyhow::Error::from),
            Err(e) => Err(e),
        };
        match loaded {
            Ok(state) => return Some((seq, state)),
            Err(e) => tracing::warn!(seq, error = %e, "snapshot unusable; trying an older one"),
        }
    }
    None
}

impl IndexerProcess {
    /// Returns the stream sequence to consume from.
    pub(super) async fn bootstrap(&mut self) -> anyhow::Result<u64> {
        self.set_ready(false);
        let info = self.stream.info().await?;
        let (first, last) = (info.state.first_sequence, info.state.last_sequence);
        self.stream_last_seq = last;
        let started = Instant::now();
        let restored = newest_usable_snapshot(&self.store, &self.names, first).await;
        let start = match restored {
            Some((seq, state)) => {
                tracing::info!(
                    seq,
                    entries = state.index().stats().entries,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "loaded snapshot"
                );
                self.state = state;
                self.duties
                    .on_bootstrap(Some(seq), tokio::time::Instant::now());
                self.shared.metrics.snapshot_age_seconds.set(0);
                self.awaiting_resync_until = None;
                seq + 1
            }
            None => {
                self.state = ReplicaState::new(&self.names, self.config.index_config());
                self.duties.on_bootstrap(None, tokio::time::Instant::now());
                if first > 1 {
                    tracing::warn!(
                        first,
                        "no snapshot reaches the start of the log; asking every worker to resync"
                    );
                    self.awaiting_resync_until = Some(0);
                    self.resync_all();
                } else {
                    self.awaiting_resync_until = None;
                }
                first.max(1)
            }
        };
        *self.shared.index.write().expect("index lock") = self.state.index().clone();
        self.shared
            .applied_seq
            .store(self.state.applied_seq(), Ordering::Release);
        Ok(start)
    }

    /// Asks every registered worker to publish `Cleared` and its state; when all answered
    /// (or timed out), reports the stream's last sequence, which the replica must reach.
    fn resync_all(&self) {
        let mut etcd = self.etcd.clone();
        let nats = self.nats.clone();
        let names = self.names.clone();
        let mut stream = self.stream.clone();
        let tx = self.input_tx.clone();
        let metrics_resyncs = self.shared.clone();
        tokio::spawn(async move {
            let workers: Vec<u64> = loop {
                match etcd
                    .get(
                        names.workers_prefix(),
                        Some(GetOptions::new().with_prefix().with_keys_only()),
                    )
                    .await
                {
                    Ok(resp) => {
                        break resp
                            .kvs()
                            .iter()
                            .filter_map(|kv| names.worker_id_of_key(kv.key()))
                            .collect();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "listing workers for resync failed; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            };
            let requests = workers.iter().map(|&w| {
                let nats = nats.clone();
                let subject = names.worker_resync(w);
                async move {
                    let answer = tokio::time::timeout(Duration::from_secs(10), nats.request(subject, "".into())).await;
                    if !matches!(answer, Ok(Ok(_))) {
                        tracing::error!(worker_id = w, "worker did not answer the bootstrap resync; its state is missing until it publishes again");
                    }
                }
            });
            metrics_resyncs
                .metrics
                .resync_requests
                .add(workers.len() as u64);
            join_all(requests).await;
            let target = loop {
                match stream.info().await {
                    Ok(info) => break info.state.last_sequence.max(1),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            };
            let _ = tx.send(Input::ResyncAllDone(target)).await;
        });
    }
}
