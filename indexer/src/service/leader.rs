//! Snapshot-leader election through etcd: the replica that creates
//! `/kvroute/<ns>/leader/indexer` under its lease leads until the lease is lost. Candidates
//! retry every [`RETRY`]; a dead leader's key disappears with its lease, so another replica
//! takes over within one lease TTL (plus one retry interval). The key's create revision is the
//! leader's *term*, and the campaign reports with it until when the lease may be trusted
//! ([`LeaseFence`]), so the leader stops acting before its lease can expire on the server.

#![allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: stamps the lease grant it hands the duties"
)]

use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use kvroute_common::lease::{LeaseFence, keep_alive_fenced};
use tokio::sync::watch;
use tokio::time::Instant;

use super::duties::LeaderLease;

const RETRY: Duration = Duration::from_millis(250);

/// Campaigns forever; the receiver holds this replica's lease on leadership while it holds
/// the key (`None` otherwise), renewed after every acknowledged keep-alive. Dropping the
/// returned handle's sender side (the task ends with the runtime) revokes nothing: the lease
/// then expires with its TTL. Call [`resign`] for a clean hand-over.
pub fn campaign(
    etcd: etcd_client::Client,
    key: String,
    replica_id: String,
    ttl: Duration,
) -> (watch::Receiver<Option<LeaderLease>>, watch::Sender<bool>) {
    let (leader_tx, leader_rx) = watch::channel(None);
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
    leader: watch::Sender<Option<LeaderLease>>,
    mut stop: watch::Receiver<bool>,
) {
    let ttl_secs = ttl.as_secs().max(2) as i64;
    let ttl = Duration::from_secs(ttl_secs as u64);
    loop {
        if *stop.borrow() {
            return;
        }
        match try_acquire(&mut etcd, &key, &replica_id, ttl_secs).await {
            Ok(Some(held)) => {
                let term = held.term;
                tracing::info!(replica_id, term, "leader key acquired");
                let _ = leader.send(Some(LeaderLease {
                    term,
                    valid_until: LeaseFence::new(ttl).valid_until(held.granted_sent_at),
                }));
                let resigned = tokio::select! {
                    _ = keep_alive_fenced(&mut etcd, held.lease, ttl, held.granted_sent_at, |valid_until| {
                        let _ = leader.send(Some(LeaderLease { term, valid_until }));
                    }) => false,
                    _ = stop.changed() => true,
                };
                let _ = leader.send(None);
                if resigned {
                    let _ = etcd.lease_revoke(held.lease).await;
                    return;
                }
                tracing::warn!(replica_id, term, "leader lease lost or not renewed in time");
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

/// A lease that holds the leader key.
struct Held {
    lease: i64,
    /// The key's create revision.
    term: u64,
    /// When the lease grant was sent: the lease cannot expire before this + TTL.
    granted_sent_at: Instant,
}

/// Creates the key if absent, under a fresh lease. `None`: someone else leads.
async fn try_acquire(
    etcd: &mut etcd_client::Client,
    key: &str,
    replica_id: &str,
    ttl_secs: i64,
) -> anyhow::Result<Option<Held>> {
    // Cheap check first, so followers do not create a lease every retry.
    if !etcd.get(key, None).await?.kvs().is_empty() {
        return Ok(None);
    }
    let granted_sent_at = Instant::now();
    let lease = etcd.lease_grant(ttl_secs, None).await?.id();
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            replica_id,
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let resp = etcd.txn(txn).await?;
    if resp.succeeded() {
        // The put is the transaction's only write: its revision is the key's create revision.
        let term = resp.header().map_or(0, |h| h.revision()) as u64;
        Ok(Some(Held {
            lease,
            term,
            granted_sent_at,
        }))
    } else {
        let _ = etcd.lease_revoke(lease).await;
        Ok(None)
    }
}
