//! `RequestLifecycle` events for the requests the gateway forwards and the reservations it
//! holds: `prefill_done` at the first token, `finished` at the end (completed, failed or
//! cancelled), so the routers' load views follow engines that report nothing themselves. Sent
//! by one task from a channel, so a request's guard can report from `Drop` without waiting.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvroute_common::codec::encode;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle, now_ms};
use kvroute_common::{DpRank, Names, RequestId, WorkerId};
use tokio::sync::mpsc;

use crate::metrics::Metrics;

/// Queued events beyond this are dropped (counted): the routers' prediction age limit still
/// frees the load, and the gateway never blocks a request on NATS.
const QUEUE: usize = 65_536;

/// Where a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

/// Sends lifecycle events (cheap to clone).
#[derive(Debug, Clone)]
pub struct Lifecycle {
    tx: mpsc::Sender<RequestLifecycle>,
    metrics: Arc<Metrics>,
}

impl Lifecycle {
    /// Starts the publishing task.
    pub fn start(nats: async_nats::Client, names: Names, metrics: Arc<Metrics>) -> Self {
        let (tx, mut rx) = mpsc::channel::<RequestLifecycle>(QUEUE);
        let counted = metrics.clone();
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                let subject = names.lifecycle(event.worker_id);
                let sent = match encode(&event) {
                    Ok(bytes) => nats.publish(subject, bytes).await.is_ok(),
                    Err(_) => false,
                };
                if !sent {
                    counted
                        .lifecycle_publish_errors
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self { tx, metrics }
    }

    pub fn prefill_done(&self, at: Placement) {
        self.send(at, LifecycleKind::PrefillDone { cached_tokens: 0 });
    }

    pub fn finished(&self, at: Placement, output_tokens: u64) {
        self.send(at, LifecycleKind::Finished { output_tokens });
    }

    fn send(&self, at: Placement, kind: LifecycleKind) {
        let event = RequestLifecycle {
            v: Default::default(),
            request_id: at.request_id,
            worker_id: at.worker_id,
            dp_rank: at.dp_rank,
            kind,
            ts: now_ms(),
        };
        if self.tx.try_send(event).is_err() {
            self.metrics
                .lifecycle_publish_errors
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}
