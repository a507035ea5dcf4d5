//! A worker card in etcd, bound to a lease that a background task keeps alive. After an etcd
//! outage (or a lease that expired meanwhile) the task grants a new lease and writes the card
//! again. Dropping or [`Registration::deregister`]ing revokes the lease, so the card disappears
//! at once instead of after the TTL.

use std::time::Duration;

use etcd_client::PutOptions;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use crate::codec::encode;
use crate::messages::WorkerCard;
use crate::names::Names;

/// How to register.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// Lease TTL (etcd's minimum is 2 s; default 10 s). Keep-alives go out every TTL / 3.
    pub lease_ttl: Duration,
    /// Wait between attempts while etcd is unreachable.
    pub retry_interval: Duration,
}

impl Default for RegistrationConfig {
    fn default() -> Self {
        Self {
            lease_ttl: Duration::from_secs(10),
            retry_interval: Duration::from_millis(500),
        }
    }
}

/// A live registration. The card stays in etcd while this value lives.
#[derive(Debug)]
pub struct Registration {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    registered: watch::Receiver<bool>,
}

impl Registration {
    /// Starts registering `card`; returns at once (see [`Registration::wait_registered`]).
    pub fn start(
        etcd: etcd_client::Client,
        names: &Names,
        card: WorkerCard,
        config: RegistrationConfig,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            config.lease_ttl >= Duration::from_secs(2),
            "lease TTL {:?} is below etcd's minimum of 2 s",
            config.lease_ttl
        );
        let key = names.worker_key(card.worker_id);
        let value = encode(&card)?.to_vec();
        let (stop_tx, stop_rx) = oneshot::channel();
        let (reg_tx, reg_rx) = watch::channel(false);
        let task = tokio::spawn(keep_registered(etcd, key, value, config, stop_rx, reg_tx));
        Ok(Self {
            stop: Some(stop_tx),
            task: Some(task),
            registered: reg_rx,
        })
    }

    /// Whether the card is in etcd under a live lease (as far as the last keep-alive knows).
    pub fn is_registered(&self) -> bool {
        *self.registered.borrow()
    }

    /// Waits until the card has been written.
    pub async fn wait_registered(&mut self) {
        let _ = self.registered.wait_for(|r| *r).await;
    }

    /// Revokes the lease (the card disappears at once) and stops the keep-alive task.
    pub async fn deregister(mut self) {
        self.shutdown().await;
    }

    /// Stops keeping the lease alive *without* revoking it, like a crashed worker: the card
    /// disappears when the lease expires.
    pub fn abandon(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        // Never signal the task: it must not revoke. Leaking the sender is harmless.
        if let Some(stop) = self.stop.take() {
            std::mem::forget(stop);
        }
    }

    async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // The task revokes the lease when it sees the stop signal (or the sender dropped).
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn keep_registered(
    mut etcd: etcd_client::Client,
    key: String,
    value: Vec<u8>,
    config: RegistrationConfig,
    mut stop: oneshot::Receiver<()>,
    registered: watch::Sender<bool>,
) {
    let ttl_secs = config.lease_ttl.as_secs().max(2) as i64;
    loop {
        // One lease's life: grant, put, keep alive until it fails.
        let lease = tokio::select! {
            _ = &mut stop => return,
            lease = grant_and_put(&mut etcd, &key, &value, ttl_secs) => lease,
        };
        match lease {
            Ok(lease_id) => {
                let _ = registered.send(true);
                tracing::info!(key, lease_id, "worker registered");
                let stopped = tokio::select! {
                    _ = &mut stop => true,
                    _ = crate::lease::keep_alive(&mut etcd, lease_id, config.lease_ttl) => false,
                };
                let _ = registered.send(false);
                if stopped {
                    if let Err(e) = etcd.lease_revoke(lease_id).await {
                        tracing::warn!(key, error = %e, "revoking lease at shutdown failed; the card expires with its TTL");
                    }
                    tracing::info!(key, "worker deregistered");
                    return;
                }
                tracing::warn!(key, "lease lost; registering again");
            }
            Err(e) => tracing::warn!(key, error = %e, "registering in etcd failed; retrying"),
        }
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(config.retry_interval) => {}
        }
    }
}

async fn grant_and_put(
    etcd: &mut etcd_client::Client,
    key: &str,
    value: &[u8],
    ttl_secs: i64,
) -> anyhow::Result<i64> {
    let lease_id = etcd.lease_grant(ttl_secs, None).await?.id();
    etcd.put(key, value, Some(PutOptions::new().with_lease(lease_id)))
        .await?;
    Ok(lease_id)
}
