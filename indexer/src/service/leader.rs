//! Snapshot-leader election through etcd: the replica that creates
//! `/kvroute/<ns>/leader/indexer` under its lease leads until the lease is lost. Candidates
//! retry every [`RETRY`]; a dead leader's key disappears with its lease, so another replica
//! takes over within one lease TTL (plus one retry interval).

use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::sync::watch;

const RETRY: Duration = Duration::from_millis(250);

/// Campaigns forever; the receiver says whether this replica currently leads. Dropping the
/// returned handle's sender side (the task ends with the runtime) revokes nothing: the lease
/// then expires with its TTL. Call [`resign`] for a clean hand-over.
pub fn campaign(
    etcd: etcd_client::Client,
    key: String,
    replica_id: String,
    ttl: Duration,
) -> (watch::Receiver<bool>, watch::Sender<bool>) {
    let (leader_tx, leader_rx) = watch::channel(false);
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(run(etcd, key, replica_id, ttl, leader_tx, stop_rx));
    (leader_rx, stop_tx)
}

/// Asks the campaign to give up leadership (revoking its lease) and stop.
pub fn resign(stop: &watch::Sender<bool>) {
    let _ = stop.send(true);
}

async fn run(
    mut etcd: etcd_client::Client,
    key: String,
    replica_id: String,
    ttl: Duration,
    leader: watch::Sender<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let ttl_secs = ttl.as_secs().max(2) as i64;
    loop {
        if *stop.borrow() {
            return;
        }
        match try_acquire(&mut etcd, &key, &replica_id, ttl_secs).await {
            Ok(Some(lease)) => {
                tracing::info!(replica_id, "became snapshot leader");
                let _ = leader.send(true);
                let resigned = hold(&mut etcd, lease, ttl, &mut stop).await;
                let _ = leader.send(false);
                if resigned {
                    let _ = etcd.lease_revoke(lease).await;
                    return;
                }
                tracing::warn!(replica_id, "lost snapshot leadership");
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "leader campaign: etcd unavailable"),
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Creates the key if absent, under a fresh lease. `None`: someone else leads.
async fn try_acquire(
    etcd: &mut etcd_client::Client,
    key: &str,
    replica_id: &str,
    ttl_secs: i64,
) -> anyhow::Result<Option<i64>> {
    // Cheap check first, so followers do not create a lease every retry.
    if !etcd.get(key, None).await?.kvs().is_empty() {
        return Ok(None);
    }
    let lease = etcd.lease_grant(ttl_secs, None).await?.id();
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            replica_id,
            Some(PutOptions::new().with_lease(lease)),
        )]);
    if etcd.txn(txn).await?.succeeded() {
        Ok(Some(lease))
    } else {
        let _ = etcd.lease_revoke(lease).await;
        Ok(None)
    }
}

/// Keeps the lease alive; returns true if asked to resign, false if the lease was lost.
async fn hold(
    etcd: &mut etcd_client::Client,
    lease: i64,
    ttl: Duration,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        _ = kvroute_common::lease::keep_alive(etcd, lease, ttl) => false,
        _ = stop.changed() => true,
    }
}
