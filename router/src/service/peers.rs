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
use std::time::Duration;

use etcd_client::{EventType, GetOptions, WatchOptions};
use kvroute_common::names::Names;
use kvroute_common::worker::{Registration as LeaseRegistration, RegistrationConfig};
use tokio::sync::watch;

use kvroute_common::messages::SelectRequest;
use kvroute_common::names::headers;

use super::Router;
use super::intake::Clock;
use super::metrics::labels;

/// The registered replicas' ids, as last read.
pub type PeerSet = Arc<BTreeSet<String>>;

/// This replica's registration while it serves, for revoking it at shutdown.
#[derive(Debug, Default)]
pub struct Registration(tokio::sync::Mutex<Option<LeaseRegistration>>);

impl Registration {
    /// Revokes the current lease, so the other replicas see this one go at once.
    pub async fn revoke(&self) {
        let held = self.0.lock().await.take();
        if let Some(held) = held
            && tokio::time::timeout(Duration::from_secs(1), held.deregister())
                .await
                .is_err()
        {
            tracing::warn!("revoking the router's lease timed out");
        }
    }
}

/// Holds this replica's registration while it serves (checked every 200 ms, or `ttl / 3`
/// if shorter). The lease is kept alive as a worker's card is
/// (`kvroute_common::worker::Registration`: every etcd call bounded by a fraction of the TTL,
/// a broken keep-alive retried on the same lease), so losing one etcd member does not move
/// this replica's partitions.
pub async fn register(
    router: Arc<Router>,
    etcd: etcd_client::Client,
    ttl: Duration,
    registration: Arc<Registration>,
) {
    let key = router.names.router_key(&router.router_id);
    let ttl = ttl.max(Duration::from_secs(2));
    let poll = Duration::from_millis(200).min(ttl / 3);
    let config = RegistrationConfig {
        lease_ttl: ttl,
        retry_interval: poll,
    };
    loop {
        while !router.is_serving() {
            tokio::time::sleep(poll).await;
        }
        let value = router.router_id.as_bytes().to_vec();
        match LeaseRegistration::start_key(etcd.clone(), key.clone(), value, config.clone()) {
            Ok(held) => *registration.0.lock().await = Some(held),
            Err(e) => {
                tracing::warn!(error = %e, "registering the router failed; retrying");
                tokio::time::sleep(poll).await;
                continue;
            }
        }
        tracing::info!(key, "router registering as serving");
        while router.is_serving() {
            tokio::time::sleep(poll).await;
        }
        registration.revoke().await;
        tracing::info!(key, "router registration released");
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
