//! A worker card in etcd, bound to a lease that a background task keeps alive. After an etcd
//! outage (or a lease that expired meanwhile) the task grants a new lease and writes the card
//! again. Dropping or [`Registration::deregister`]ing revokes the lease, so the card disappears
//! at once instead of after the TTL.
//!
//! Every etcd call of the task is bounded by a fraction of the TTL ([`LeaseTiming`]), far
//! below the client's own request timeout: a call stuck on a dead member of the cluster gives
//! way to another attempt, which the client's balancer may send to a live member, while the
//! lease still lives. A keep-alive stream that breaks is opened again on the *same* lease (a few
//! at once, the first to answer kept) until the lease may have expired; only then is a new
//! lease granted and the card put again.

use std::time::Duration;

use etcd_client::PutOptions;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::codec::encode;
use crate::messages::WorkerCard;
use crate::names::Names;

/// How to register.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// Lease TTL (etcd's minimum is 2 s; default 10 s). Keep-alives go out every TTL / 4
    /// (see [`LeaseTiming`]).
    pub lease_ttl: Duration,
    /// Wait between attempts to grant a lease or write the card while etcd refuses them.
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
    value: watch::Sender<Vec<u8>>,
}

impl Registration {
    /// Starts registering `card`; returns at once (see [`Registration::wait_registered`]).
    pub fn start(
        etcd: etcd_client::Client,
        names: &Names,
        card: WorkerCard,
        config: RegistrationConfig,
    ) -> anyhow::Result<Self> {
        let value = encode(&card)?.to_vec();
        Self::start_key(etcd, names.worker_key(card.worker_id), value, config)
    }

    /// Starts holding `value` under `key` in etcd under a lease kept alive as a worker's card
    /// is (a router replica's registration uses it too); returns at once.
    pub fn start_key(
        etcd: etcd_client::Client,
        key: String,
        value: Vec<u8>,
        config: RegistrationConfig,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            config.lease_ttl >= Duration::from_secs(2),
            "lease TTL {:?} is below etcd's minimum of 2 s",
            config.lease_ttl
        );
        let (stop_tx, stop_rx) = oneshot::channel();
        let (reg_tx, reg_rx) = watch::channel(false);
        let (value_tx, value_rx) = watch::channel(value);
        let task = tokio::spawn(keep_registered(
            etcd, key, value_rx, config, stop_rx, reg_tx,
        ));
        Ok(Self {
            stop: Some(stop_tx),
            task: Some(task),
            registered: reg_rx,
            value: value_tx,
        })
    }

    /// Replaces the card: written at once under the live lease (or under the next one, if the
    /// lease is being replaced).
    pub fn update(&self, card: &WorkerCard) -> anyhow::Result<()> {
        self.update_value(encode(card)?.to_vec());
        Ok(())
    }

    /// Replaces the value held under the key (see [`Registration::update`]).
    pub fn update_value(&self, value: Vec<u8>) {
        self.value.send_replace(value);
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

/// When the registration's etcd calls must give up, and when its lease may have expired.
/// Pure: times come in as arguments.
///
/// etcd renews a lease when it *receives* a keep-alive, so the lease cannot expire on the
/// server before `sent_at + ttl`, `sent_at` being when the last acknowledged keep-alive (or the
/// grant) was sent. Until then a broken keep-alive is retried on the same lease; each attempt
/// waits at most [`LeaseTiming::keep_alive_attempt`] (TTL / 6), so that after a keep-alive
/// stuck on a dead member (noticed TTL / 4 + TTL / 6 after the last good one) three more
/// attempts fit before the lease can expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    ttl: Duration,
    retry_interval: Duration,
}

impl LeaseTiming {
    pub fn new(ttl: Duration, retry_interval: Duration) -> Self {
        Self {
            ttl,
            retry_interval,
        }
    }

    /// Between acknowledged keep-alives.
    pub fn interval(&self) -> Duration {
        self.ttl / 4
    }

    /// The longest wait for the answer to one keep-alive (or for a keep-alive stream to open).
    pub fn keep_alive_attempt(&self) -> Duration {
        self.ttl / 6
    }

    /// The longest wait for a lease grant or for the card's put.
    pub fn call_attempt(&self) -> Duration {
        self.ttl / 3
    }

    /// The pause after a failed keep-alive attempt before the next (failures on a member that
    /// refuses connections come at once).
    pub fn keep_alive_pause(&self) -> Duration {
        (self.ttl / 50).min(self.retry_interval)
    }

    /// The pause after a failed grant or put.
    pub fn retry_interval(&self) -> Duration {
        self.retry_interval
    }

    /// The earliest time the lease may expire on the server, its last acknowledged keep-alive
    /// (or grant) having been sent at `ok_sent_at`.
    pub fn expires_at(&self, ok_sent_at: Instant) -> Instant {
        ok_sent_at + self.ttl
    }

    /// The deadline of a keep-alive attempt started at `now`, or `None` when the lease may
    /// already have expired (grant a new one).
    pub fn keep_alive_deadline(&self, now: Instant, ok_sent_at: Instant) -> Option<Instant> {
        self.deadline(now, ok_sent_at, self.keep_alive_attempt())
    }

    /// The deadline of a put under the lease started at `now`, or `None` when the lease may
    /// already have expired.
    pub fn put_deadline(&self, now: Instant, ok_sent_at: Instant) -> Option<Instant> {
        self.deadline(now, ok_sent_at, self.call_attempt())
    }

    fn deadline(&self, now: Instant, ok_sent_at: Instant, attempt: Duration) -> Option<Instant> {
        let expires = self.expires_at(ok_sent_at);
        (now < expires).then(|| (now + attempt).min(expires))
    }
}

async fn keep_registered(
    mut etcd: etcd_client::Client,
    key: String,
    mut value: watch::Receiver<Vec<u8>>,
    config: RegistrationConfig,
    mut stop: oneshot::Receiver<()>,
    registered: watch::Sender<bool>,
) {
    let timing = LeaseTiming::new(config.lease_ttl, config.retry_interval);
    let ttl_secs = config.lease_ttl.as_secs().max(2) as i64;
    // The lease last granted (revoked at shutdown, whether or not the card is under it yet).
    let mut granted = None;
    tokio::select! {
        _ = &mut stop => {}
        never = stay_registered(&mut etcd, &key, &mut value, timing, ttl_secs, &registered, &mut granted) => match never {},
    }
    let _ = registered.send(false);
    if let Some(lease_id) = granted {
        revoke(&mut etcd, &key, lease_id, timing).await;
    }
    tracing::info!(key, "deregistered");
}

/// Revokes the lease at shutdown, in up to [`REVOKE_ATTEMPTS`] attempts (a call may fail at
/// once on a member that was down a moment ago, or hang on one that is down now); if all fail,
/// the card expires with its TTL.
async fn revoke(etcd: &mut etcd_client::Client, key: &str, lease_id: i64, timing: LeaseTiming) {
    for attempt in 1..=REVOKE_ATTEMPTS {
        match bounded(timing.call_attempt(), etcd.lease_revoke(lease_id)).await {
            Ok(_) => return,
            // Expired meanwhile: the card is gone too.
            Err(e) if e.to_string().contains("not found") => return,
            Err(e) if attempt == REVOKE_ATTEMPTS => {
                tracing::warn!(key, error = %e, "revoking lease at shutdown failed; the key expires with its TTL");
            }
            Err(_) => tokio::time::sleep(timing.keep_alive_pause()).await,
        }
    }
}

/// Attempts to revoke the lease at shutdown.
const REVOKE_ATTEMPTS: u32 = 3;

/// Grants a lease, puts the card under it and keeps it alive, again and again; never returns
/// (the caller drops it at shutdown). `granted` is the lease last granted.
async fn stay_registered(
    etcd: &mut etcd_client::Client,
    key: &str,
    value: &mut watch::Receiver<Vec<u8>>,
    timing: LeaseTiming,
    ttl_secs: i64,
    registered: &watch::Sender<bool>,
    granted: &mut Option<i64>,
) -> std::convert::Infallible {
    loop {
        // A lease.
        let sent_at = Instant::now();
        let lease_id = match bounded(timing.call_attempt(), etcd.lease_grant(ttl_secs, None)).await
        {
            Ok(resp) => resp.id(),
            Err(e) => {
                tracing::warn!(key, error = %e, "granting a lease failed; retrying");
                tokio::time::sleep(timing.retry_interval()).await;
                continue;
            }
        };
        *granted = Some(lease_id);
        let mut ok_sent_at = sent_at;
        // The card under it (retried while the lease lives).
        let mut written = false;
        while let Some(deadline) = timing.put_deadline(Instant::now(), ok_sent_at) {
            let options = PutOptions::new().with_lease(lease_id);
            let latest = value.borrow_and_update().clone();
            match tokio::time::timeout_at(deadline, etcd.put(key, latest, Some(options))).await {
                Ok(Ok(_)) => {
                    written = true;
                    break;
                }
                Ok(Err(e)) => {
                    tracing::warn!(key, lease_id, error = %e, "writing the key failed; retrying")
                }
                Err(_) => tracing::warn!(key, lease_id, "writing the key timed out; retrying"),
            }
            tokio::time::sleep(timing.retry_interval()).await;
        }
        if !written {
            continue;
        }
        let _ = registered.send(true);
        tracing::info!(key, lease_id, "registered");
        // Keep it alive: a broken stream is opened again while the lease may live. A new value
        // is put under the same lease; if that fails, the lease is replaced and the latest
        // value put under the new one.
        loop {
            let outcome = tokio::select! {
                outcome = keep_alive(etcd, lease_id, timing, &mut ok_sent_at) => outcome,
                Ok(()) = value.changed() => {
                    let latest = value.borrow_and_update().clone();
                    let options = PutOptions::new().with_lease(lease_id);
                    let mut client = etcd.clone();
                    match bounded(timing.call_attempt(), client.put(key, latest, Some(options))).await {
                        Ok(_) => {
                            tracing::info!(key, lease_id, "value updated");
                            continue;
                        }
                        Err(e) => KeepAlive::Lost(format!("updating the value: {e}")),
                    }
                }
            };
            match outcome {
                KeepAlive::Lost(why) => {
                    tracing::warn!(key, lease_id, why, "lease lost; registering again");
                    break;
                }
                KeepAlive::Broken(why) => {
                    let left = timing
                        .expires_at(ok_sent_at)
                        .saturating_duration_since(Instant::now());
                    tracing::warn!(
                        key,
                        lease_id,
                        why,
                        lease_left_ms = left.as_millis() as u64,
                        "lease keep-alive failed; retrying"
                    );
                    tokio::time::sleep(timing.keep_alive_pause()).await;
                }
            }
        }
        let _ = registered.send(false);
    }
}

/// How many keep-alive streams [`keep_alive`] opens at once (one per member of the usual
/// three-member cluster).
const OPEN_HEDGE: usize = 3;

/// Why [`keep_alive`] returned.
#[derive(Debug)]
enum KeepAlive {
    /// etcd said the lease is gone, or it may have expired: grant a new one.
    Lost(String),
    /// The stream broke or an answer is late; the lease may still live.
    Broken(String),
}

/// Keeps `lease_id` alive on one keep-alive stream (the first of [`OPEN_HEDGE`] to open), every
/// [`LeaseTiming::interval`], until it fails; `ok_sent_at` is when the last acknowledged keep-alive (or the grant) was sent, and is
/// moved on by every acknowledged one.
async fn keep_alive(
    etcd: &mut etcd_client::Client,
    lease_id: i64,
    timing: LeaseTiming,
    ok_sent_at: &mut Instant,
) -> KeepAlive {
    let may_have_expired = || KeepAlive::Lost("no keep-alive acknowledged for a TTL".to_owned());
    // Opening the stream is itself a keep-alive (the client waits for its answer).
    let sent_at = Instant::now();
    let Some(deadline) = timing.keep_alive_deadline(sent_at, *ok_sent_at) else {
        return may_have_expired();
    };
    // Several streams opened at once, the first to answer kept: the client's balancer sends
    // each call to a member at random, so one stuck on a hung member does not hold up the
    // renewal (renewals are idempotent).
    let opens = (0..OPEN_HEDGE).map(|_| {
        let mut etcd = etcd.clone();
        Box::pin(async move { etcd.lease_keep_alive(lease_id).await })
    });
    let (mut keeper, mut responses) =
        match tokio::time::timeout_at(deadline, futures::future::select_ok(opens)).await {
            Ok(Ok((stream, _others))) => stream,
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(e))) if e.contains("not found") => {
                return KeepAlive::Lost(format!("etcd: {e}"));
            }
            Ok(Err(e)) => return KeepAlive::Broken(format!("opening the stream: {e}")),
            Err(_) => return KeepAlive::Broken("opening the stream timed out".to_owned()),
        };
    *ok_sent_at = sent_at;
    let mut last_sent = sent_at;
    loop {
        tokio::time::sleep_until(last_sent + timing.interval()).await;
        let sent_at = Instant::now();
        let Some(deadline) = timing.keep_alive_deadline(sent_at, *ok_sent_at) else {
            return may_have_expired();
        };
        let answered = tokio::time::timeout_at(deadline, async {
            keeper.keep_alive().await?;
            responses.message().await
        })
        .await;
        match answered {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                *ok_sent_at = sent_at;
                last_sent = sent_at;
            }
            Ok(Ok(Some(_))) => return KeepAlive::Lost("etcd: lease not found".to_owned()),
            Ok(Ok(None)) => return KeepAlive::Broken("the stream ended".to_owned()),
            Ok(Err(e)) => return KeepAlive::Broken(e.to_string()),
            Err(_) => return KeepAlive::Broken("no answer in time".to_owned()),
        }
    }
}

/// `call`, given up after `limit`.
async fn bounded<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => Ok(result?),
        Err(_) => anyhow::bail!("no answer within {limit:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// The keep-alive attempts that start before the lease may expire when the first
    /// keep-alive after the last good one hangs until its deadline and every later one fails
    /// after `each`: (start, deadline) pairs.
    fn attempts_after_a_hang(timing: LeaseTiming, each: Duration) -> Vec<(Instant, Instant)> {
        let ok = Instant::now();
        let mut now = ok + timing.interval();
        let mut attempts = Vec::new();
        let mut first = true;
        while let Some(deadline) = timing.keep_alive_deadline(now, ok) {
            attempts.push((now, deadline));
            let failed_at = match now.checked_add(each) {
                Some(t) if !first => t.min(deadline),
                _ => deadline,
            };
            first = false;
            now = failed_at + timing.keep_alive_pause();
        }
        attempts
    }

    #[test]
    fn keep_alive_attempts_are_a_sixth_of_the_ttl_and_stop_at_the_earliest_expiry() {
        let timing = LeaseTiming::new(Duration::from_secs(6), MS(500));
        let ok = Instant::now();
        assert_eq!(timing.interval(), MS(1500));
        assert_eq!(
            timing.keep_alive_deadline(ok + MS(1500), ok),
            Some(ok + MS(2500))
        );
        // Cut to the earliest expiry, then none.
        assert_eq!(
            timing.keep_alive_deadline(ok + MS(5500), ok),
            Some(ok + MS(6000))
        );
        assert_eq!(timing.keep_alive_deadline(ok + MS(6000), ok), None);
        assert_eq!(timing.put_deadline(ok + MS(6000), ok), None);
        assert_eq!(timing.put_deadline(ok, ok), Some(ok + MS(2000)));
        // Far below etcd-client's request timeout (5 s) at the usual TTLs.
        assert!(
            LeaseTiming::new(Duration::from_secs(10), MS(500)).call_attempt()
                < Duration::from_secs(5)
        );
    }

    #[test]
    fn after_a_keep_alive_stuck_on_a_dead_member_three_more_attempts_fit_in_the_ttl() {
        for ttl in [2, 5, 10] {
            let timing = LeaseTiming::new(Duration::from_secs(ttl), MS(500));
            // Each retry stuck as well (a member that accepts but never answers) ...
            let stuck = attempts_after_a_hang(timing, Duration::MAX);
            let full = stuck
                .iter()
                .skip(1)
                .filter(|(start, end)| *end - *start == timing.keep_alive_attempt())
                .count();
            assert!(full >= 3, "TTL {ttl} s: {stuck:?}");
            // ... or refused at once (a killed member): many retries.
            let refused = attempts_after_a_hang(timing, MS(1));
            assert!(refused.len() >= 10, "TTL {ttl} s: {}", refused.len());
        }
    }

    #[test]
    fn pauses_are_short_and_never_longer_than_the_retry_interval() {
        let timing = LeaseTiming::new(Duration::from_secs(10), MS(100));
        assert_eq!(timing.keep_alive_pause(), MS(100));
        let timing = LeaseTiming::new(Duration::from_secs(2), MS(500));
        assert_eq!(timing.keep_alive_pause(), MS(40));
    }
}
