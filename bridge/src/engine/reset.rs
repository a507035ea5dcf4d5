//! Cache resets through the bridge: a request on the worker's reset subject
//! (`kvroute.<ns>.worker.<w>.reset`, as kvroute-mocker's workers serve it) is forwarded to the
//! engine (vLLM `/reset_prefix_cache`, SGLang `/flush_cache`); when the engine confirms, the
//! relay withdraws every rank's blocks at once (`Cleared`), because the engine announces its
//! `AllBlocksCleared` only with its next step. Answered `ok`, or `error: <why>` (the cache was
//! not reset: requests were running, or the engine refused).
//!
//! A reset sent to the engine directly is not seen: vLLM's metrics do not show one (its
//! prefix-cache counters only grow; `kv_cache_usage_perc` counts blocks held by requests, and
//! cached blocks are free), so the index keeps the blocks until the engine's next step.

use std::sync::Arc;

use futures::StreamExt;
use tokio::task::JoinHandle;

use crate::engine_http::EngineClient;
use crate::metrics::{BridgeMetrics, names};
use crate::relay::Relay;

/// Serves the reset subject of one registered engine.
#[derive(Debug)]
pub struct ResetTask {
    pub label: String,
    pub client: EngineClient,
    pub relay: Relay,
    pub nats: async_nats::Client,
    pub metrics: Arc<BridgeMetrics>,
}

impl ResetTask {
    /// Answers every request of `resets` until the subscription ends or the task is aborted.
    pub fn spawn(self, mut resets: async_nats::Subscriber) -> JoinHandle<()> {
        tokio::spawn(async move {
            while let Some(msg) = resets.next().await {
                let answer = self.reset().await;
                if let Some(reply) = msg.reply {
                    let _ = self.nats.publish(reply, answer.into()).await;
                }
            }
        })
    }

    async fn reset(&self) -> String {
        let mark = self.relay.reset_mark();
        match self.client.reset_cache().await {
            Ok(()) => {
                self.relay.withdraw(&mark);
                self.metrics.inc(names::RESETS, &self.label, None, "ok");
                tracing::info!(
                    engine = self.label,
                    "the engine reset its cache: its blocks are withdrawn"
                );
                "ok".into()
            }
            Err(e) => {
                self.metrics
                    .inc(names::RESETS, &self.label, None, "refused");
                tracing::warn!(engine = self.label, error = %e, "the engine did not reset its cache");
                format!("error: {e}")
            }
        }
    }
}
