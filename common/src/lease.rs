//! Keeping an etcd lease alive: shared by worker registration and the indexer's leader
//! election.

use std::time::Duration;

/// Sends keep-alives every `ttl / 3` and returns when the lease can no longer be kept alive
/// (an error, an expired lease, or no answer within one interval).
pub async fn keep_alive(etcd: &mut etcd_client::Client, lease_id: i64, ttl: Duration) {
    let interval = ttl / 3;
    let Ok((mut keeper, mut responses)) = etcd.lease_keep_alive(lease_id).await else {
        return;
    };
    loop {
        if keeper.keep_alive().await.is_err() {
            return;
        }
        match tokio::time::timeout(interval, responses.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {}
            _ => return,
        }
        tokio::time::sleep(interval).await;
    }
}
