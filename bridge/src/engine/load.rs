//! Load reports: the engine's per-rank numbers polled every `--load-interval-ms` and published
//! as one `WorkerLoad` per rank.
//!
//! What the engines report is not quite what `WorkerLoad` means, so some fields are
//! approximations:
//! - `kv_used_blocks`: `used_tokens / block_size` (SGLang) or `kv_usage × total_kv_blocks`
//!   (vLLM). Both engines count blocks held by requests and treat evictable cached prefixes
//!   as free, so this is below kvroute's "requests and cached prefixes".
//! - `active_decode_blocks`: `kv_used_blocks` (the engines do not split prefill from decode).
//! - `active_prefill_tokens`: SGLang's `num_waiting_uncached_tokens`; 0 for vLLM, which does
//!   not report it.
//! - `new_requests`: absent; the engines do not say which requests a report counts, so
//!   routers assume it counts every request decided more than one report interval before.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_common::messages::{SchemaVersion, WorkerLoad, now_ms};
use kvroute_common::{DpRank, WorkerId};

use super::report::Reporter;
use super::silence::{Silence, SilenceWatch};
use crate::engine_http::{EngineClient, EngineLoad};
use crate::metrics::{BridgeMetrics, names};
use crate::relay::Relay;

/// The capacity a rank's report is measured against (the card's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub block_size: u32,
    pub total_kv_blocks: u64,
}

/// The `WorkerLoad` of one rank's engine load (see the module docs for the approximations).
pub fn worker_load(
    worker_id: WorkerId,
    dp_rank: DpRank,
    seq: u64,
    ts: u64,
    load: &EngineLoad,
    capacity: Capacity,
) -> WorkerLoad {
    let block_size = u64::from(capacity.block_size.max(1));
    let kv_used_blocks = match (load.used_tokens, load.kv_usage) {
        (Some(tokens), _) => tokens.div_ceil(block_size),
        (None, Some(usage)) => {
            (usage.clamp(0.0, 1.0) * capacity.total_kv_blocks as f64).round() as u64
        }
        (None, None) => 0,
    }
    .min(capacity.total_kv_blocks);
    WorkerLoad {
        v: SchemaVersion::CURRENT,
        worker_id,
        dp_rank,
        seq,
        active_prefill_tokens: load.waiting_uncached_tokens.unwrap_or(0),
        active_decode_blocks: kv_used_blocks,
        active_requests: load.running.unwrap_or(0),
        waiting_requests: load.waiting.unwrap_or(0),
        kv_used_blocks,
        total_kv_blocks: capacity.total_kv_blocks,
        ts,
        new_requests: None,
        adapters: load.adapters.clone(),
    }
}

/// Each rank's last `seq`, kept by the supervisor across registrations so a new agent's
/// reports are not taken for stale ones.
#[derive(Debug)]
pub struct LoadSeqs(Vec<(DpRank, AtomicU64)>);

impl LoadSeqs {
    pub fn new(ranks: &[DpRank]) -> Self {
        Self(ranks.iter().map(|&r| (r, AtomicU64::new(0))).collect())
    }

    fn next(&self, rank: DpRank) -> Option<u64> {
        self.0
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, s)| s.fetch_add(1, Ordering::Relaxed) + 1)
    }
}

/// What the load task needs.
#[derive(Debug, Clone)]
pub struct LoadTask {
    pub label: String,
    pub client: EngineClient,
    pub ranks: Vec<DpRank>,
    pub capacity: Capacity,
    pub interval: Duration,
    /// The engine's event relay (its batch counts, for the silent-events check).
    pub relay: Relay,
    /// Where the events are expected, as the warning names it.
    pub events_endpoint: String,
    pub seqs: Arc<LoadSeqs>,
    pub reporter: Reporter,
    pub metrics: Arc<BridgeMetrics>,
}

impl LoadTask {
    /// Polls and publishes until aborted.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut silent_ranks: Vec<DpRank> = Vec::new();
        let mut silence = SilenceWatch::new(&self.ranks, self.capacity.block_size);
        loop {
            tick.tick().await;
            let loads = match self.client.load(&self.ranks).await {
                Ok(loads) => loads,
                Err(e) => {
                    self.metrics
                        .inc(names::LOAD_POLLS, &self.label, None, "failed");
                    tracing::debug!(engine = self.label, error = %e, "load poll failed");
                    continue;
                }
            };
            self.metrics.inc(names::LOAD_POLLS, &self.label, None, "ok");
            let ts = now_ms();
            let batches = self.relay.batches_received();
            // An engine without KV events is silent by design.
            for (rank, load) in loads.iter().filter(|_| self.relay.subscribed()) {
                let received = batches.iter().find(|(r, _)| r == rank).map_or(0, |b| b.1);
                self.check_silence(&mut silence, *rank, received, load);
            }
            for (rank, load) in loads {
                if !load.is_known() {
                    // Publishing zeros would call a busy rank idle.
                    if !silent_ranks.contains(&rank) {
                        silent_ranks.push(rank);
                        tracing::warn!(
                            engine = self.label,
                            dp_rank = rank,
                            "the engine reports no request counts for this rank; no load reports for it"
                        );
                    }
                    continue;
                }
                let Some(seq) = self.seqs.next(rank) else {
                    continue;
                };
                let report = worker_load(
                    self.reporter.worker_id(),
                    rank,
                    seq,
                    ts,
                    &load,
                    self.capacity,
                );
                match self.reporter.load(&report).await {
                    Ok(()) => self
                        .metrics
                        .inc(names::LOAD_REPORTS, &self.label, Some(rank), ""),
                    Err(e) => {
                        tracing::warn!(engine = self.label, error = %e, "publishing load failed")
                    }
                }
            }
        }
    }
}

impl LoadTask {
    fn check_silence(
        &self,
        watch: &mut SilenceWatch,
        rank: DpRank,
        batches: u64,
        load: &EngineLoad,
    ) {
        let computed = load.computed_prompt_tokens();
        let Silence::Silent { tokens, first } = watch.observe(rank, batches, computed) else {
            return;
        };
        self.metrics
            .inc(names::EVENTS_MISSING, &self.label, Some(rank), "");
        if first {
            tracing::warn!(
                engine = self.label,
                dp_rank = rank,
                tokens,
                batches,
                "the engine computed {tokens} prompt tokens (vllm:prefix_cache_queries - hits) but no KV event batch arrived meanwhile: routing cannot see its cache. Check {} against the engine's --kv-events-config (endpoint, topic; enable_kv_cache_events true) and that it runs with --enable-prefix-caching",
                self.events_endpoint
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Capacity = Capacity {
        block_size: 16,
        total_kv_blocks: 1000,
    };

    #[test]
    fn sglang_tokens_become_blocks() {
        let load = EngineLoad {
            running: Some(5),
            waiting: Some(2),
            kv_usage: Some(0.9),
            waiting_uncached_tokens: Some(3072),
            used_tokens: Some(8193),
            total_tokens: Some(16000),
            ..EngineLoad::default()
        };
        let w = worker_load(7, 1, 3, 1234, &load, CAP);
        assert_eq!((w.worker_id, w.dp_rank, w.seq, w.ts), (7, 1, 3, 1234));
        assert_eq!((w.active_requests, w.waiting_requests), (5, 2));
        assert_eq!(
            w.kv_used_blocks, 513,
            "used tokens win over the usage fraction"
        );
        assert_eq!(w.active_decode_blocks, 513);
        assert_eq!(w.active_prefill_tokens, 3072);
        assert_eq!(w.total_kv_blocks, 1000);
        assert_eq!(w.new_requests, None);
    }

    #[test]
    fn vllm_usage_becomes_blocks() {
        let load = EngineLoad {
            running: Some(3),
            waiting: Some(0),
            kv_usage: Some(0.2504),
            ..EngineLoad::default()
        };
        let w = worker_load(7, 0, 1, 0, &load, CAP);
        assert_eq!(w.kv_used_blocks, 250);
        assert_eq!(w.active_prefill_tokens, 0);
        let full = EngineLoad {
            used_tokens: Some(1 << 40),
            ..load
        };
        assert_eq!(worker_load(7, 0, 1, 0, &full, CAP).kv_used_blocks, 1000);
    }

    #[test]
    fn seqs_count_per_rank() {
        let seqs = LoadSeqs::new(&[2, 3]);
        assert_eq!(seqs.next(2), Some(1));
        assert_eq!(seqs.next(2), Some(2));
        assert_eq!(seqs.next(3), Some(1));
        assert_eq!(seqs.next(9), None);
    }
}
