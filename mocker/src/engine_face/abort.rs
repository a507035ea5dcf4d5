//! The guard that aborts a handler's prompts still in flight when the handler goes away (its
//! client disconnected).

use std::sync::Arc;
use std::time::Duration;

use kvroute_common::RequestId;

use super::rank::Rank;

/// The prompts a handler submitted. Dropped while armed — the handler future or the streamed
/// body was dropped because the client went away — it aborts those still in flight, at once
/// or after `delay`.
#[derive(Debug)]
pub(crate) struct AbortOnDrop {
    requests: Vec<(Arc<Rank>, RequestId)>,
    delay: Duration,
    armed: bool,
}

impl AbortOnDrop {
    pub fn new(delay: Duration) -> Self {
        Self {
            requests: Vec::new(),
            delay,
            armed: true,
        }
    }

    pub fn push(&mut self, rank: Arc<Rank>, request_id: RequestId) {
        self.requests.push((rank, request_id));
    }

    /// Every prompt has ended: nothing is left to abort.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed || self.requests.is_empty() {
            return;
        }
        let requests = std::mem::take(&mut self.requests);
        let abort = move || {
            for (rank, id) in &requests {
                rank.abort(*id);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) if !self.delay.is_zero() => {
                let delay = self.delay;
                rt.spawn(async move {
                    tokio::time::sleep(delay).await;
                    abort();
                });
            }
            _ => abort(),
        }
    }
}
