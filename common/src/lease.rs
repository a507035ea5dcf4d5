//! Keeping the indexer leader's etcd lease alive, with the rule that tells a lease holder when
//! to stop trusting its lease ([`LeaseFence`]). (A worker's registration keeps its lease its
//! own way: `worker::registration`.)

use std::time::Duration;

use tokio::time::Instant;

/// When a lease holder must consider its lease gone, whether or not etcd answers.
///
/// etcd renews a lease when it *receives* a keep-alive, so the lease cannot expire on the
/// server before `sent_at + ttl`, where `sent_at` is when the last acknowledged keep-alive
/// (or the grant) was sent. The holder trusts it until `sent_at + ttl - margin`; the margin
/// (half the TTL) exceeds one keep-alive interval (a quarter of the TTL) plus a quarter TTL
/// of slack for clock rate differences and actions already under way when the holder looks.
/// Pure: times come in as arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseFence {
    ttl: Duration,
}

impl LeaseFence {
    pub fn new(ttl: Duration) -> Self {
        Self { ttl }
    }

    /// How often keep-alives are sent.
    pub fn interval(&self) -> Duration {
        self.ttl / 4
    }

    /// The margin taken off the TTL: more than one interval plus slack.
    pub fn margin(&self) -> Duration {
        self.ttl / 2
    }

    /// Until when a lease whose last acknowledged keep-alive (or grant) was sent at
    /// `ok_sent_at` may be trusted.
    pub fn valid_until(&self, ok_sent_at: Instant) -> Instant {
        ok_sent_at + (self.ttl - self.margin())
    }
}

/// Sends keep-alives every `ttl / 4` and returns when the lease can no longer be kept alive
/// (an error, an expired lease, or no answer within one interval); reports, after every
/// acknowledged keep-alive, the new [`LeaseFence::valid_until`]; `granted_sent_at` is when the
/// lease grant was sent. Returns at the latest when the current deadline passes, whatever etcd
/// does.
pub async fn keep_alive_fenced(
    etcd: &mut etcd_client::Client,
    lease_id: i64,
    ttl: Duration,
    granted_sent_at: Instant,
    mut on_ok: impl FnMut(Instant),
) {
    let fence = LeaseFence::new(ttl);
    let interval = fence.interval();
    let mut valid_until = fence.valid_until(granted_sent_at);
    let Ok(Ok((mut keeper, mut responses))) =
        tokio::time::timeout_at(valid_until, etcd.lease_keep_alive(lease_id)).await
    else {
        return;
    };
    loop {
        let sent_at = Instant::now();
        let answer_by = (sent_at + interval).min(valid_until);
        let answered = tokio::time::timeout_at(answer_by, async {
            keeper.keep_alive().await.ok()?;
            responses.message().await.ok()?
        })
        .await;
        match answered {
            Ok(Some(resp)) if resp.ttl() > 0 => {
                valid_until = fence.valid_until(sent_at);
                on_ok(valid_until);
            }
            _ => return,
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_trusted_until_well_before_it_can_expire_on_the_server() {
        let fence = LeaseFence::new(Duration::from_secs(2));
        let sent = Instant::now();
        let until = fence.valid_until(sent);
        // Trusted until a full margin before the earliest server-side expiry (sent + TTL),
        // the margin exceeding one keep-alive interval ...
        assert_eq!(until, sent + Duration::from_secs(1));
        assert!(fence.margin() > fence.interval());
        // ... while a keep-alive answered in time moves the deadline past the next send.
        let next_sent = sent + fence.interval() + Duration::from_millis(100);
        assert!(fence.valid_until(next_sent) > next_sent + fence.interval());
    }
}
