//! One data-parallel rank of an impersonated engine: a simulated [`Engine`] behind a lock, the
//! task that drives it in real time, and its ZMQ publisher.
//!
//! HTTP handlers submit prompts (as token ids) and get their progress on a channel: the first
//! token at the simulated TTFT, then the end. Every advance of the engine turns its KV events
//! into the engine's wire form and queues them for the publisher *under the lock*, so batches
//! leave in the order the cache changed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_common::RequestId;
use kvroute_common::hashing::SequenceHash;
use kvroute_common::messages::KvEventData;
use tokio::sync::{Notify, mpsc, watch};

use super::block_tokens::BlockTokens;
use super::wire::EventWriter;
use super::zmq::Publisher;
use crate::engine::{Engine, EngineConfig, EngineLoad, EngineOutput, SimRequest, SubmitError};
use crate::fleet::{FleetMetrics, SimClock};

/// What happens to a submitted prompt, sent on its request's channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// The prompt is computed and the first token produced.
    FirstToken { index: usize, cached_tokens: u64 },
    /// The last token is produced.
    Finished { index: usize, output_tokens: u64 },
    /// The engine went away (shutdown) before the end.
    Cancelled { index: usize },
}

/// Counters since the rank started (the engines' cumulative metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RankCounters {
    /// Prompt tokens of requests whose prefill is done.
    pub prompt_tokens: u64,
    /// Of those, found in the cache.
    pub cached_tokens: u64,
    /// Prompt tokens computed (not cached).
    pub computed_tokens: u64,
    pub generation_tokens: u64,
    /// Requests finished (all at `max_tokens`: finish reason `length`).
    pub finished: u64,
}

/// A rank's state at one moment, for `/metrics` and `/v1/loads`.
#[derive(Debug, Clone)]
pub(crate) struct RankSnapshot {
    pub rank: u32,
    pub load: EngineLoad,
    /// Blocks pinned by running requests (the engines' "used": cached idle blocks are free).
    pub pinned_blocks: u64,
    pub counters: RankCounters,
}

#[derive(Debug)]
struct Pending {
    sink: mpsc::UnboundedSender<Progress>,
    index: usize,
    prompt_tokens: u64,
    hashes: Vec<SequenceHash>,
}

#[derive(Debug)]
struct Core {
    engine: Engine,
    clock: SimClock,
    tokens: BlockTokens,
    pending: HashMap<RequestId, Pending>,
    counters: RankCounters,
}

/// What a rank is: its index, its engine's parameters, its clock's speed and its event form.
#[derive(Debug, Clone)]
pub(crate) struct RankConfig {
    pub rank: u32,
    pub engine: EngineConfig,
    /// Simulated seconds per wall second.
    pub speedup: f64,
    pub writer: EventWriter,
}

/// One rank, shared by the HTTP handlers and its driver task.
#[derive(Debug)]
pub(crate) struct Rank {
    pub rank: u32,
    engine_config: EngineConfig,
    speedup: f64,
    writer: EventWriter,
    publisher: Publisher,
    metrics: Arc<FleetMetrics>,
    core: Mutex<Core>,
    wake: Notify,
}

/// The rank refuses to clear its cache while requests are in flight (as the engines do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{in_flight} requests are running or waiting")]
pub(crate) struct Busy {
    pub in_flight: usize,
}

impl Rank {
    pub fn new(config: RankConfig, publisher: Publisher, metrics: Arc<FleetMetrics>) -> Self {
        let RankConfig {
            rank,
            engine: engine_config,
            speedup,
            writer,
        } = config;
        let core = Core {
            engine: Engine::new(engine_config.clone()).expect("the fleet config was validated"),
            clock: SimClock::start(speedup),
            tokens: BlockTokens::default(),
            pending: HashMap::new(),
            counters: RankCounters::default(),
        };
        Self {
            rank,
            engine_config,
            speedup,
            writer,
            publisher,
            metrics,
            core: Mutex::new(core),
            wake: Notify::new(),
        }
    }

    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock would be a bug in the engine; keep serving anyway.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `prompt` for `max_tokens` output tokens; its progress goes to `sink`, tagged
    /// with `index`.
    pub fn submit(
        &self,
        prompt: &[u32],
        max_tokens: u32,
        index: usize,
        sink: mpsc::UnboundedSender<Progress>,
    ) -> Result<RequestId, SubmitError> {
        let request_id = uuid::Uuid::new_v4();
        let block_size = self.engine_config.block_size;
        let sim = SimRequest::from_tokens(request_id, prompt, max_tokens, block_size, None);
        let hashes = sim.hashes.sequence.clone();
        {
            let mut core = self.lock();
            let now = core.clock.now();
            core.engine.submit(sim, now)?;
            core.tokens.retain(&hashes, prompt, block_size as usize);
            core.pending.insert(
                request_id,
                Pending {
                    sink,
                    index,
                    prompt_tokens: prompt.len() as u64,
                    hashes,
                },
            );
        }
        self.metrics.requests_received.inc();
        self.wake.notify_one();
        Ok(request_id)
    }

    /// Requests running plus waiting.
    pub fn in_flight(&self) -> u64 {
        let (running, waiting) = self.lock().engine.request_counts();
        running + waiting
    }

    pub fn snapshot(&self) -> RankSnapshot {
        let core = self.lock();
        let load = core.engine.load();
        RankSnapshot {
            rank: self.rank,
            load,
            pinned_blocks: core.engine.cache().pinned_blocks(),
            counters: core.counters,
        }
    }

    /// Empties the cache (a fresh engine) and publishes `AllBlocksCleared`, if idle.
    pub fn clear_cache(&self) -> Result<(), Busy> {
        let mut core = self.lock();
        if !core.pending.is_empty() {
            return Err(Busy {
                in_flight: core.pending.len(),
            });
        }
        core.engine =
            Engine::new(self.engine_config.clone()).expect("the fleet config was validated");
        core.clock = SimClock::start(self.speedup);
        self.publish(&core, &[KvEventData::Cleared]);
        Ok(())
    }

    /// Tells every request in flight that it is cancelled (the rank is stopping).
    pub fn cancel_all(&self) {
        let mut core = self.lock();
        for (_, p) in core.pending.drain() {
            self.metrics.requests_finished.inc("cancelled");
            let _ = p.sink.send(Progress::Cancelled { index: p.index });
        }
    }

    /// Drives the engine in real time until `stop` turns true.
    pub async fn drive(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let wake = {
                let core = self.lock();
                core.engine.next_wakeup().map(|sim| core.clock.wall_at(sim))
            };
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = self.wake.notified() => {}
                _ = sleep_until(wake) => {}
            }
            self.advance();
        }
        self.cancel_all();
    }

    /// Runs the engine up to now: publishes its events, then reports its outputs.
    fn advance(&self) {
        let mut core = self.lock();
        let now = core.clock.now();
        let ready = core.engine.advance_to(now);
        // Before releasing finished requests' tokens: their blocks may be stored in this very
        // advance.
        if !ready.kv_events.is_empty() {
            self.publish(&core, &ready.kv_events);
        }
        for output in ready.outputs {
            self.on_output(&mut core, output);
        }
    }

    fn publish(&self, core: &Core, events: &[KvEventData]) {
        let mut out = Vec::new();
        for event in events {
            match self.writer.events(event, |h| core.tokens.get(h)) {
                Ok(e) => out.extend(e),
                Err(e) => tracing::error!(rank = self.rank, error = %e, "event dropped"),
            }
        }
        self.metrics.kv_events.add(events.len() as u64);
        let ts = unix_now().as_secs_f64();
        self.publisher.send(self.writer.batch(ts, out, self.rank));
    }

    fn on_output(&self, core: &mut Core, output: EngineOutput) {
        let request_id = output.request_id();
        match output {
            EngineOutput::PrefillDone {
                cached_tokens,
                ttft,
                ..
            } => {
                self.metrics.ttft.observe(ttft.as_secs_f64());
                let Some(p) = core.pending.get(&request_id) else {
                    return;
                };
                let prompt = p.prompt_tokens;
                let _ = p.sink.send(Progress::FirstToken {
                    index: p.index,
                    cached_tokens,
                });
                let c = &mut core.counters;
                c.prompt_tokens += prompt;
                c.cached_tokens += cached_tokens;
                c.computed_tokens += prompt.saturating_sub(cached_tokens);
            }
            EngineOutput::Finished { output_tokens, .. } => {
                self.metrics.requests_finished.inc("ok");
                let Some(p) = core.pending.remove(&request_id) else {
                    return;
                };
                core.tokens.release(&p.hashes);
                core.counters.generation_tokens += output_tokens;
                core.counters.finished += 1;
                let _ = p.sink.send(Progress::Finished {
                    index: p.index,
                    output_tokens,
                });
            }
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Seconds since the Unix epoch now (for `created` fields and timestamps).
pub(crate) fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}
