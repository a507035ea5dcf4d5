//! A simulated continuous-batching engine: a FCFS waiting queue, a running batch, chunked
//! prefill under a per-step token budget, and the paged [`KvCache`]. Driven by simulated time.
//!
//! Each step is planned when it starts (decodes first, then prefill chunks of running requests,
//! then admissions from the queue while budget, batch slots and cache allow) and takes
//! [`EngineConfig::step_duration`] of its work; its outputs are dated at its end. Prefill
//! chunks and decodes share steps, so every decode in a step with a prefill chunk waits for
//! that chunk: the interference disaggregated serving removes (a decode worker whose prompts
//! arrive as [`SimRequest::transferred_tokens`] computes one token of each).
//!
//! LoRA adapters (with [`EngineConfig::max_loras`]): a request naming an adapter is admitted
//! only when its adapter is resident, or a slot is free, or a resident adapter no running
//! request uses can be evicted (the least recently used); otherwise it stays in the queue and
//! later requests may pass it, as vLLM's scheduler skips a request whose adapter does not fit.
//! Loading an adapter adds [`EngineConfig::lora_load_us`] to the step that admits it.
//!
//! Deliberately simple: a request reserves its output blocks at admission, so there is no
//! preemption; a block is reusable by other requests from the step that allocates it. No
//! timing noise: the model is deterministic (add noise in a shell if wanted).
//!
//! *Invariant:* the outputs depend only on the submissions and their times, not on how often
//! `advance_to` is called (submit everything arriving at or before `t` first).

mod config;
#[cfg(test)]
mod interference;
mod io;
#[cfg(test)]
mod tests;

use std::collections::{HashSet, VecDeque};
use std::time::Duration;

pub use config::{EngineConfig, InvalidEngineConfig, StepWork};
pub use io::{Aborted, EngineLoad, EngineOutput, Ready, SimRequest, TokenOutput};

use crate::cache::{CacheConfig, CacheError, KvCache};
use kvroute_common::RequestId;
use kvroute_common::messages::AdapterSlots;

/// A request the engine refuses at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("request {request_id} is already on this engine")]
    Duplicate { request_id: RequestId },
    #[error(
        "request {request_id}: {blocks} hashed blocks for {prompt_tokens} prompt tokens at block size {block_size}"
    )]
    BlockCountMismatch {
        request_id: RequestId,
        blocks: usize,
        prompt_tokens: u32,
        block_size: u32,
    },
    #[error("request {request_id} needs {needed} blocks, the cache has {capacity}")]
    TooLarge {
        request_id: RequestId,
        needed: u64,
        capacity: u64,
    },
}

#[derive(Debug)]
struct Waiting {
    req: SimRequest,
    arrival: Duration,
}

#[derive(Debug)]
struct Running {
    req: SimRequest,
    arrival: Duration,
    cached_tokens: u32,
    /// Prompt tokens in the cache so far (cached or computed).
    prefilled: u32,
    generated: u32,
    ttft: Duration,
    /// Tokens this request computes in the step in flight.
    scheduled: u32,
}

impl Running {
    fn decoding(&self) -> bool {
        self.prefilled == self.req.prompt_tokens
    }

    fn output_target(&self) -> u32 {
        self.req.output_tokens.max(1)
    }
}

/// One simulated engine (one worker, one dp rank).
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    cache: KvCache,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    ids: HashSet<RequestId>,
    /// When the step in flight ends, if one is.
    step_end: Option<Duration>,
    /// End of the last step (simulated time the engine has reached while busy).
    clock: Duration,
    /// Report computed prompts in [`Ready::prefilled`].
    shared_writes: bool,
    /// Resident LoRA adapters (with `max_loras`), each with the step that last admitted a
    /// request of it.
    adapters: Vec<(String, Duration)>,
    /// Adapters loaded into a slot so far.
    adapter_loads: u64,
}

/// Where a request's adapter comes from when it is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdapterSlot {
    /// Base model, adapters not modelled, or already resident (at this index).
    Ready(Option<usize>),
    /// Loaded into a free slot.
    Free,
    /// Loaded in place of the idle adapter at this index.
    Evict(usize),
}

impl Engine {
    pub fn new(config: EngineConfig) -> Result<Self, InvalidEngineConfig> {
        config.validate()?;
        let cache = KvCache::new(CacheConfig {
            num_blocks: config.num_blocks,
            block_size: config.block_size,
        });
        Ok(Self {
            config,
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ids: HashSet::new(),
            step_end: None,
            clock: Duration::ZERO,
            shared_writes: false,
            adapters: Vec::new(),
            adapter_loads: 0,
        })
    }

    /// Reports every computed prompt's blocks in [`Ready::prefilled`] (a fleet writing
    /// through to a shared tier).
    pub fn with_shared_writes(mut self, on: bool) -> Self {
        self.shared_writes = on;
        self
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request that arrived at `now`. Submit every request arriving at or before `t`
    /// before calling `advance_to(t)`; then results do not depend on how often it is called.
    pub fn submit(&mut self, req: SimRequest, now: Duration) -> Result<(), SubmitError> {
        let request_id = req.request_id;
        let bs = self.config.block_size;
        if req.hashes.sequence.len() != (req.prompt_tokens / bs) as usize
            || req.hashes.local.len() != req.hashes.sequence.len()
        {
            return Err(SubmitError::BlockCountMismatch {
                request_id,
                blocks: req.hashes.sequence.len(),
                prompt_tokens: req.prompt_tokens,
                block_size: bs,
            });
        }
        let needed = req.hashes.sequence.len() as u64 + u64::from(self.private_blocks(&req));
        if needed > self.config.num_blocks {
            return Err(SubmitError::TooLarge {
                request_id,
                needed,
                capacity: self.config.num_blocks,
            });
        }
        if !self.ids.insert(request_id) {
            return Err(SubmitError::Duplicate { request_id });
        }
        self.waiting.push_back(Waiting { req, arrival: now });
        Ok(())
    }

    /// Runs every step that ends at or before `now`, and starts the next one if due.
    pub fn advance_to(&mut self, now: Duration) -> Ready {
        let mut ready = Ready::default();
        loop {
            if let Some(end) = self.step_end {
                if end > now {
                    break;
                }
                self.finish_step(end, &mut ready);
            }
            match self.next_step_start() {
                Some(start) if start <= now => self.start_step(start),
                _ => break,
            }
        }
        ready.kv_events = self.cache.drain_events();
        ready
    }

    /// Takes out a request that has not finished (its client went away), as the engines abort
    /// one: a waiting request leaves the queue; a running one leaves the batch and releases its
    /// blocks as a finished request does (the prompt's blocks stay cached, unpinned; private
    /// blocks are freed). The step in flight keeps its planned end. `None` if the request is
    /// not on this engine (never submitted, or already finished).
    pub fn abort(&mut self, request_id: RequestId) -> Option<Aborted> {
        if !self.ids.remove(&request_id) {
            return None;
        }
        if let Some(i) = self
            .running
            .iter()
            .position(|r| r.req.request_id == request_id)
        {
            let r = self.running.remove(i);
            self.cache.release(request_id);
            return Some(Aborted {
                was_running: true,
                output_tokens: u64::from(r.generated),
            });
        }
        let i = self
            .waiting
            .iter()
            .position(|w| w.req.request_id == request_id)
            .expect("a known request is running or waiting");
        self.waiting.remove(i);
        Some(Aborted {
            was_running: false,
            output_tokens: 0,
        })
    }

    /// When the engine next has something to do (a step ends or can start), if ever without
    /// new submissions. The shell sleeps until then, or until the next submission.
    pub fn next_wakeup(&self) -> Option<Duration> {
        self.step_end.or_else(|| self.next_step_start())
    }

    /// `Stored` events that rebuild the cache's contents from empty (publish after `Cleared`).
    /// Publish the events of every earlier `Ready` first.
    pub fn kv_snapshot(&self) -> Vec<kvroute_common::messages::KvEventData> {
        self.cache.snapshot_events()
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Requests (running, waiting): a cheap check of whether [`Engine::load`] changed shape.
    /// LoRA adapters loaded into a slot since the start (0 without `max_loras`).
    pub fn adapter_loads(&self) -> u64 {
        self.adapter_loads
    }

    /// The resident LoRA adapters (with `max_loras`), least recently used first.
    pub fn resident_adapters(&self) -> Vec<&str> {
        let mut by_use: Vec<_> = self.adapters.iter().collect();
        by_use.sort_by_key(|(name, used)| (*used, name.clone()));
        by_use.into_iter().map(|(name, _)| name.as_str()).collect()
    }

    /// The adapter slots as a load report carries them (with `max_loras`; else `None`): the
    /// resident adapters, the adapters waiting requests name that no slot holds, and the
    /// number of slots. Lists are cut at [`AdapterSlots::MAX_NAMES`].
    pub fn adapter_slots(&self) -> Option<AdapterSlots> {
        if self.config.max_loras == 0 {
            return None;
        }
        let loaded: Vec<String> = self
            .resident_adapters()
            .into_iter()
            .rev()
            .take(AdapterSlots::MAX_NAMES)
            .map(str::to_owned)
            .collect();
        let mut waiting: Vec<String> = Vec::new();
        for name in self
            .waiting
            .iter()
            .filter_map(|w| w.req.lora_name.as_deref())
        {
            if waiting.len() == AdapterSlots::MAX_NAMES {
                break;
            }
            if !loaded.iter().any(|a| a == name) && !waiting.iter().any(|a| a == name) {
                waiting.push(name.to_owned());
            }
        }
        Some(AdapterSlots {
            loaded,
            waiting,
            max_loaded: self.config.max_loras,
        })
    }

    /// The adapters running requests use, each once, in batch order (what vLLM's
    /// `lora_requests_info` lists as `running_lora_adapters`).
    pub fn running_adapters(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for name in self
            .running
            .iter()
            .filter_map(|r| r.req.lora_name.as_deref())
        {
            if !out.iter().any(|a| a == name) {
                out.push(name.to_owned());
            }
        }
        out
    }

    /// How a request of adapter `name` would get its adapter now (`None`: it cannot: every
    /// slot holds an adapter a running request uses).
    fn adapter_slot(&self, name: Option<&str>) -> Option<AdapterSlot> {
        let Some(name) = name.filter(|_| self.config.max_loras > 0) else {
            return Some(AdapterSlot::Ready(None));
        };
        if let Some(i) = self.adapters.iter().position(|(a, _)| a == name) {
            return Some(AdapterSlot::Ready(Some(i)));
        }
        if self.adapters.len() < self.config.max_loras as usize {
            return Some(AdapterSlot::Free);
        }
        let in_use = |a: &str| {
            self.running
                .iter()
                .any(|r| r.req.lora_name.as_deref() == Some(a))
        };
        self.adapters
            .iter()
            .enumerate()
            .filter(|(_, (a, _))| !in_use(a))
            .min_by_key(|(_, (a, used))| (*used, a.clone()))
            .map(|(i, _)| AdapterSlot::Evict(i))
    }

    /// Makes `name` resident as `slot` says, at `now`; counts a load in `work`.
    fn take_adapter_slot(
        &mut self,
        slot: AdapterSlot,
        name: Option<&str>,
        now: Duration,
        work: &mut StepWork,
    ) {
        let entry = || (name.unwrap_or_default().to_owned(), now);
        match slot {
            AdapterSlot::Ready(None) => {}
            AdapterSlot::Ready(Some(i)) => self.adapters[i].1 = now,
            AdapterSlot::Free => {
                self.adapters.push(entry());
                self.adapter_loads += 1;
                work.lora_loads += 1;
            }
            AdapterSlot::Evict(i) => {
                self.adapters[i] = entry();
                self.adapter_loads += 1;
                work.lora_loads += 1;
            }
        }
    }

    pub fn request_counts(&self) -> (u64, u64) {
        (self.running.len() as u64, self.waiting.len() as u64)
    }

    pub fn load(&self) -> EngineLoad {
        let bs = u64::from(self.config.block_size);
        let running_prefill: u64 = self
            .running
            .iter()
            .map(|r| u64::from(r.req.prompt_tokens - r.prefilled))
            .sum();
        let waiting_prefill: u64 = self
            .waiting
            .iter()
            .map(|w| {
                let cached = u64::from(self.cache.cached_prefix(&w.req.hashes)) * bs;
                u64::from(w.req.prompt_tokens).saturating_sub(cached)
            })
            .sum();
        let active_decode_blocks = self
            .running
            .iter()
            .filter(|r| r.decoding())
            .map(|r| r.req.hashes.sequence.len() as u64 + u64::from(self.private_blocks(&r.req)))
            .sum();
        EngineLoad {
            active_prefill_tokens: running_prefill + waiting_prefill,
            active_decode_blocks,
            active_requests: self.running.len() as u64,
            waiting_requests: self.waiting.len() as u64,
            kv_used_blocks: self.cache.used_blocks(),
            total_kv_blocks: self.config.num_blocks,
        }
    }

    /// Blocks beyond the prompt's full ones: its partial tail and every output token.
    fn private_blocks(&self, req: &SimRequest) -> u32 {
        let bs = u64::from(self.config.block_size);
        let tokens = u64::from(req.prompt_tokens) + u64::from(req.output_tokens.max(1));
        (tokens.div_ceil(bs) - u64::from(req.prompt_tokens) / bs) as u32
    }

    fn next_step_start(&self) -> Option<Duration> {
        if self.step_end.is_some() {
            None
        } else if !self.running.is_empty() {
            Some(self.clock)
        } else {
            self.waiting.front().map(|w| w.arrival.max(self.clock))
        }
    }

    fn start_step(&mut self, start: Duration) {
        let mut budget = self.config.max_num_batched_tokens;
        let mut work = StepWork::default();
        for r in self.running.iter_mut().filter(|r| r.decoding()) {
            r.scheduled = 1;
            budget -= 1;
            work.decode_seqs += 1;
            work.decode_context_tokens += u64::from(r.req.prompt_tokens + r.generated);
        }
        for r in self.running.iter_mut().filter(|r| !r.decoding()) {
            r.scheduled = (r.req.prompt_tokens - r.prefilled).min(budget);
            budget -= r.scheduled;
            work.prefill_tokens += u64::from(r.scheduled);
        }
        // The queue's position being considered: requests whose adapter cannot get a slot
        // stay where they are, and the next ones are considered.
        let mut at = 0;
        while budget > 0 && self.running.len() < self.config.max_num_seqs as usize {
            let Some(head) = self.waiting.get(at) else {
                break;
            };
            if head.arrival > start {
                break;
            }
            let Some(slot) = self.adapter_slot(head.req.lora_name.as_deref()) else {
                at += 1;
                continue;
            };
            let private = self.private_blocks(&head.req);
            let admission = match self
                .cache
                .admit(head.req.request_id, &head.req.hashes, private)
            {
                Ok(a) => a,
                // FCFS: the head waits for running requests to release blocks.
                Err(CacheError::Full { .. }) => break,
                Err(e) => unreachable!("submit checked the request: {e}"),
            };
            let w = self.waiting.remove(at).expect("head exists");
            self.take_adapter_slot(slot, w.req.lora_name.as_deref(), start, &mut work);
            // An engine always computes at least the last prompt token.
            let last = w.req.prompt_tokens.saturating_sub(1);
            let cached_tokens = (admission.cached_blocks * self.config.block_size).min(last);
            // The shared tier's blocks past the device prefix are loaded, not computed.
            let loaded = (w.req.shared_blocks.saturating_sub(admission.cached_blocks)
                * self.config.block_size)
                .min(last - cached_tokens);
            work.shared_load_tokens += u64::from(loaded);
            // A prefill worker's transferred KV covers what the device prefix does not.
            let not_computed = (cached_tokens + loaded).max(w.req.transferred_tokens.min(last));
            let scheduled = (w.req.prompt_tokens - not_computed).min(budget);
            budget -= scheduled;
            work.prefill_tokens += u64::from(scheduled);
            self.running.push(Running {
                req: w.req,
                arrival: w.arrival,
                cached_tokens: not_computed,
                prefilled: not_computed,
                generated: 0,
                ttft: Duration::ZERO,
                scheduled,
            });
        }
        debug_assert!(!self.running.is_empty(), "a step starts only with work");
        self.clock = start;
        self.step_end = Some(start + self.config.step_duration(work));
    }

    fn finish_step(&mut self, end: Duration, ready: &mut Ready) {
        self.step_end = None;
        self.clock = end;
        let outputs = &mut ready.outputs;
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            let scheduled = std::mem::take(&mut r.scheduled);
            if r.decoding() {
                r.generated += scheduled;
                let token = TokenOutput {
                    request_id: r.req.request_id,
                    at: end,
                    generated: u64::from(r.generated),
                };
                if scheduled > 0 && r.generated < r.output_target() {
                    if r.req.report_tokens {
                        ready.tokens.push(token);
                    }
                    if r.generated.is_multiple_of(self.config.block_size) {
                        ready.progress.push(token);
                    }
                }
            } else if scheduled > 0 {
                r.prefilled += scheduled;
                if r.decoding() {
                    r.generated = 1;
                    r.ttft = end - r.arrival;
                    if self.shared_writes {
                        ready.prefilled.push(r.req.hashes.clone());
                    }
                    outputs.push(EngineOutput::PrefillDone {
                        request_id: r.req.request_id,
                        at: end,
                        cached_tokens: u64::from(r.cached_tokens),
                        ttft: r.ttft,
                    });
                }
            }
            if r.decoding() && r.generated >= r.output_target() {
                outputs.push(EngineOutput::Finished {
                    request_id: r.req.request_id,
                    at: end,
                    output_tokens: u64::from(r.generated),
                    ttft: r.ttft,
                    latency: end - r.arrival,
                });
                let id = r.req.request_id;
                self.cache.release(id);
                self.ids.remove(&id);
                self.running.remove(i);
            } else {
                i += 1;
            }
        }
    }
}
