//! The serving router replicas, through etcd: each replica holds
//! `/kvroute/<ns>/routers/<router_id>` under a lease while it serves (in the select queue
//! group), and watches the prefix. The set gives every (model, role) partition one owner
//! (`crate::decide::owner`); the other replicas forward that partition's requests to it.
//!
//! A replica that stops serving, or shuts down, revokes its lease at once; one that dies or is
//! cut off loses it within the lease TTL. Until every replica has seen the change, a forward may find no
//! responder (answered locally instead) or two replicas may both decide for a partition for
//! that moment.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use etcd_client::{EventType, GetOptions, PutOptions, WatchOptions};
use kvroute_common::names::Names;
use tokio::sync::watch;

use kvroute_common::messages::SelectRequest;
use kvroute_common::names::headers;

use super::Router;
use super::intake::Clock;
use super::metrics::labels;

/// The registered replicas' ids, as last read.
pub type PeerSet = Arc<BTreeSet<String>>;

/// The lease this replica's registration is bound to (0: none), for revoking it at shutdown.
#[derive(Debug, Default)]
pub struct Registration(AtomicI64);

impl Registration {
    /// Revokes the current lease, so the other replicas see this one go at once.
    pub async fn revoke(&self, etcd: &mut etcd_client::Client) {
        let lease = self.0.swap(0, Ordering::AcqRel);
        if lease != 0 {
            let revoke = etcd.lease_revoke(lease);
            if tokio::time::timeout(Duration::from_secs(1), revoke)
                .await
                .is_err()
            {
                tracing::warn!(lease, "revoking the router's lease timed out");
            }
        }
    }
}

/// Holds this replica's registration while it serves (checked every `ttl / 3`).
pub async fn register(
    router: Arc<Router>,
    mut etcd: etcd_client::Client,
    ttl: Duration,
    registration: Arc<Registration>,
) {
    let key = router.names.router_key(&router.router_id);
    let ttl_secs = i64::try_from(ttl.as_secs().max(2)).unwrap_or(2);
    let interval = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(2)) / 3;
    loop {
        while !router.is_serving() {
            tokio::time::sleep(interval.min(Duration::from_millis(200))).await;
        }
        let lease = match etcd.lease_grant(ttl_secs, None).await {
            Ok(lease) => lease.id(),
            Err(e) => {
                tracing::warn!(error = %e, "granting the router's lease failed; retrying");
                tokio::time::sleep(interval).await;
                continue;
            }
        };
        let put = etcd
            .put(
                key.as_str(),
                router.router_id.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await;
        if let Err(e) = put {
            tracing::warn!(error = %e, "registering the router failed; retrying");
            let _ = etcd.lease_revoke(lease).await;
            tokio::time::sleep(interval).await;
            continue;
        }
        tracing::info!(key, lease, "router registered as serving");
        registration.0.store(lease, Ordering::Release);
        hold(&router, &mut etcd, lease, interval).await;
        registration.0.store(0, Ordering::Release);
        let _ = etcd.lease_revoke(lease).await;
        tracing::info!(key, "router registration released");
    }
}

/// Keeps `lease` alive while the replica serves; returns when it stops serving or the lease
/// is lost.
async fn hold(router: &Router, etcd: &mut etcd_client::Client, lease: i64, interval: Duration) {
    let Ok((mut keeper, mut responses)) = etcd.lease_keep_alive(lease).await else {
        return;
    };
    loop {
        tokio::time::sleep(interval).await;
        if !router.is_serving() {
            return;
        }
        if keeper.keep_alive().await.is_err() {
            return;
        }
        match tokio::time::timeout(interval, responses.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
            _ => {
                tracing::warn!(lease, "the router's lease could not be kept alive");
                return;
            }
        }
    }
}

/// Watches the registered replicas into `tx` (a full read, then the watch; after any error,
/// a full read again: the set is small).
pub async fn watch(mut etcd: etcd_client::Client, names: Names, tx: watch::Sender<PeerSet>) {
    let prefix = names.routers_prefix();
    loop {
        if tx.is_closed() {
            return;
        }
        let read = etcd
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await;
        let (mut peers, revision) = match read {
            Ok(resp) => {
                let peers: BTreeSet<String> = resp
                    .kvs()
                    .iter()
                    .filter_map(|kv| id_of(&prefix, kv.key()))
                    .collect();
                (peers, resp.header().map_or(0, |h| h.revision()))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the router replicas failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        tx.send_replace(Arc::new(peers.clone()));
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = match etcd.watch(prefix.as_str(), Some(opts)).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "watching the router replicas failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.canceled() {
                        break;
                    }
                    let mut changed = false;
                    for event in resp.events() {
                        let Some(id) = event.kv().and_then(|kv| id_of(&prefix, kv.key())) else {
                            continue;
                        };
                        changed |= match event.event_type() {
                            EventType::Put => peers.insert(id),
                            EventType::Delete => peers.remove(&id),
                        };
                    }
                    if changed {
                        tracing::info!(replicas = ?peers, "router replicas changed");
                        tx.send_replace(Arc::new(peers.clone()));
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "the router replicas' watch ended; reading again");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn id_of(prefix: &str, key: &[u8]) -> Option<String> {
    let key = std::str::from_utf8(key).ok()?;
    let id = key.strip_prefix(prefix)?;
    (!id.is_empty()).then(|| id.to_owned())
}

/// The owner's answer to a forwarded request.
pub(super) enum Forwarded {
    /// Its reply, to pass on to the client.
    Answered(bytes::Bytes),
    /// It queued the request and answers the client itself.
    Queued,
}

impl Router {
    /// The replica owning the request's partition, when it is another one (see
    /// `crate::decide::owner`); `None` when this replica owns it, forwarding is off, or no
    /// replica is registered yet.
    pub(super) fn owner_of(&self, request: &SelectRequest) -> Option<String> {
        let peers = self.peers.as_ref()?.borrow().clone();
        let owner = crate::decide::owner::owner(
            peers.iter().map(String::as_str),
            &request.model,
            request.role,
        )?;
        (owner != self.router_id).then(|| owner.to_owned())
    }

    /// Forwards the request to `owner` with the client's inbox; its encoded reply, or word
    /// that it queued the request; `None` when the owner cannot answer in time (gone,
    /// stalled, not serving), and this replica decides instead.
    pub(super) async fn forward(
        &self,
        owner: &str,
        msg: &async_nats::Message,
        request: &SelectRequest,
        clock: Clock,
    ) -> Option<Forwarded> {
        let mut timeout = self.forward_timeout;
        if let Some(deadline) = request.deadline_ms {
            let left = deadline.saturating_sub(clock.now_ms());
            timeout = timeout.min(std::time::Duration::from_millis(left.max(1)));
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::FORWARDED_BY, self.router_id.as_str());
        if let Some(inbox) = &msg.reply {
            headers.insert(headers::REPLY_TO, inbox.as_str());
        }
        let forward = async_nats::Request::new()
            .payload(msg.payload.clone())
            .headers(headers)
            .timeout(Some(timeout));
        let outcome = self
            .nats
            .send_request(self.names.router_select(owner), forward)
            .await;
        let forwards = &self.metrics.forwards;
        match outcome {
            Ok(reply)
                if reply
                    .headers
                    .as_ref()
                    .is_some_and(|h| h.get(headers::QUEUED).is_some()) =>
            {
                forwards.inc(labels::FORWARD_QUEUED);
                Some(Forwarded::Queued)
            }
            Ok(reply) => {
                forwards.inc(labels::FORWARD_ANSWERED);
                Some(Forwarded::Answered(reply.payload))
            }
            Err(e) => {
                use async_nats::client::RequestErrorKind;
                let reason = match e.kind() {
                    RequestErrorKind::NoResponders => labels::FORWARD_NO_RESPONDERS,
                    RequestErrorKind::TimedOut => labels::FORWARD_TIMEOUT,
                    _ => labels::FORWARD_ERROR,
                };
                forwards.inc(reason);
                tracing::debug!(
                    owner,
                    reason,
                    "the partition's owner did not answer; deciding here"
                );
                None
            }
        }
    }
}
