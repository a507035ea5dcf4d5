//! Random operation streams, the lock-step run against the reference, and shrinking.

use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock, WorkerMatch};
use kvroute_indexer::{ApplyError, ApplyOk, IndexConfig, RadixIndex};

use super::reference::Reference;

/// The index under test; a broken variant implements it too (see the self-test).
pub trait Subject {
    fn build(cap: Option<usize>) -> Self;
    fn apply(&mut self, w: u64, d: u32, ev: &KvEventData) -> Result<ApplyOk, ApplyError>;
    fn remove_worker(&mut self, w: u64);
    fn remove_worker_dp_rank(&mut self, w: u64, d: u32);
    fn find_matches(&self, query: &[u64]) -> Vec<WorkerMatch>;
    fn index(&self) -> &RadixIndex;
}

impl Subject for RadixIndex {
    fn build(cap: Option<usize>) -> Self {
        RadixIndex::new(IndexConfig {
            max_entries: cap,
            ..IndexConfig::default()
        })
    }
    fn apply(&mut self, w: u64, d: u32, ev: &KvEventData) -> Result<ApplyOk, ApplyError> {
        RadixIndex::apply(self, w, d, ev)
    }
    fn remove_worker(&mut self, w: u64) {
        RadixIndex::remove_worker(self, w);
    }
    fn remove_worker_dp_rank(&mut self, w: u64, d: u32) {
        RadixIndex::remove_worker_dp_rank(self, w, d);
    }
    fn find_matches(&self, query: &[u64]) -> Vec<WorkerMatch> {
        RadixIndex::find_matches(self, query).matches
    }
    fn index(&self) -> &RadixIndex {
        self
    }
}

/// One step: a change, then a query.
#[derive(Debug, Clone)]
pub enum Op {
    Event(u64, u32, KvEventData),
    RemoveWorker(u64),
    RemoveRank(u64, u32),
}

#[derive(Debug, Clone)]
pub struct Step {
    pub op: Op,
    pub query: Vec<u64>,
}

/// SplitMix64: small, seeded, dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        (!items.is_empty()).then(|| items[self.below(items.len() as u64) as usize].clone())
    }
}

pub const WORKERS: u64 = 16;
pub const RANKS: u32 = 2;
/// A small token alphabet so paths collide and share nodes often.
const TOKENS: u64 = 4;

/// The engine's block hash: mostly a chain hash (two engine families hash differently), now
/// and then a stray value from a small set, to provoke rebinds and aliases.
fn engine_hash(rng: &mut Rng, w: u64, parent: u64, tokens: u64) -> u64 {
    if rng.below(20) == 0 {
        return 1000 + rng.below(8);
    }
    let family = w % 2;
    (parent ^ family.wrapping_mul(0xabcdef))
        .wrapping_mul(31)
        .wrapping_add(tokens + 7)
        .rotate_left(17)
}

/// A tier; with `shared` (the long cases) sometimes the shared tier. Without it, the draws
/// are those the recorded fixtures (`compat.rs`) were generated with.
fn tier(rng: &mut Rng, shared: bool) -> StorageTier {
    if shared {
        return match rng.below(12) {
            0..=6 => StorageTier::Device,
            7 | 8 => StorageTier::Host,
            9 | 10 => StorageTier::Disk,
            _ => StorageTier::Shared,
        };
    }
    match rng.below(10) {
        0..=6 => StorageTier::Device,
        7 | 8 => StorageTier::Host,
        _ => StorageTier::Disk,
    }
}

/// Generates the next step from the reference's current state (so events are plausible).
/// `long`: chains of up to 12 blocks and removals of up to 6, so runs form and are cut by
/// divergence, holes and tier changes inside them.
pub fn gen_step(rng: &mut Rng, model: &Reference, long: bool) -> Step {
    let w = rng.below(WORKERS);
    let d = rng.below(u64::from(RANKS)) as u32;
    let held = model.hashes_of((w, d));
    let op = match rng.below(100) {
        0..=54 => {
            let parent = match rng.below(10) {
                0..=3 => None,
                4..=8 => rng.pick(&held),
                _ => Some(2000 + rng.below(4)),
            };
            let mut prev = parent.unwrap_or(0);
            let n = if long && rng.below(2) == 0 {
                1 + rng.below(12)
            } else {
                1 + rng.below(4)
            };
            let blocks = (0..n)
                .map(|_| {
                    let tokens_hash = rng.below(TOKENS);
                    let block_hash = engine_hash(rng, w, prev, tokens_hash);
                    prev = block_hash;
                    StoredBlock {
                        block_hash,
                        tokens_hash,
                    }
                })
                .collect();
            Op::Event(
                w,
                d,
                KvEventData::Stored {
                    parent_hash: parent,
                    blocks,
                    tier: tier(rng, long),
                },
            )
        }
        55..=91 => {
            let n = if long {
                1 + rng.below(6)
            } else {
                1 + rng.below(3)
            };
            let block_hashes = (0..n)
                .map(|_| match rng.pick(&held) {
                    Some(h) if rng.below(8) != 0 => h,
                    _ => 1000 + rng.below(8),
                })
                .collect();
            Op::Event(
                w,
                d,
                KvEventData::Removed {
                    block_hashes,
                    tier: tier(rng, long),
                },
            )
        }
        92..=95 => Op::Event(w, d, KvEventData::Cleared),
        96..=97 => Op::RemoveWorker(w),
        _ => Op::RemoveRank(w, d),
    };
    let mut query = match rng.pick(&model.paths()) {
        Some(p) if rng.below(4) != 0 => p,
        _ => Vec::new(),
    };
    for _ in 0..rng.below(3) {
        query.push(rng.below(TOKENS));
    }
    Step { op, query }
}

/// What a passing run exercised, so a vacuous generator is noticed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Coverage {
    pub matched_queries: u64,
    pub deep_matches: u64,
    /// Steps that cut a run without adding blocks (a hole, a tier change) and steps that
    /// joined runs without removing blocks.
    pub cut_runs: u64,
    pub joined_runs: u64,
    /// Queries with a shared-tier prefix of at least 2 blocks.
    pub shared_matches: u64,
    pub anomalies: kvroute_indexer::Anomalies,
}

/// Runs `steps` on a fresh subject and reference; returns the first disagreement.
pub fn run<S: Subject>(steps: &[Step], cap: Option<usize>) -> Result<Coverage, String> {
    let mut coverage = Coverage::default();
    let mut subject = S::build(cap);
    let mut model = Reference::new(cap);
    let mut shape = (0, 0);
    for (i, step) in steps.iter().enumerate() {
        let (got, want) = match &step.op {
            Op::Event(w, d, ev) => (subject.apply(*w, *d, ev), model.apply(*w, *d, ev)),
            Op::RemoveWorker(w) => {
                subject.remove_worker(*w);
                model.remove_worker(*w);
                (Ok(ApplyOk::default()), Ok(ApplyOk::default()))
            }
            Op::RemoveRank(w, d) => {
                subject.remove_worker_dp_rank(*w, *d);
                model.remove_worker_dp_rank(*w, *d);
                (Ok(ApplyOk::default()), Ok(ApplyOk::default()))
            }
        };
        if got != want {
            return Err(format!("step {i}: outcome {got:?}, reference {want:?}"));
        }
        let (got, want) = (
            subject.find_matches(&step.query),
            model.find_matches(&step.query),
        );
        if got != want {
            return Err(format!(
                "step {i}: query {:?}: index {got:?}, reference {want:?}",
                step.query
            ));
        }
        coverage.matched_queries += u64::from(!want.is_empty());
        coverage.deep_matches += want
            .iter()
            .filter(|m| m.device + m.host + m.disk >= 3)
            .count() as u64;
        coverage.shared_matches += u64::from(want.first().is_some_and(|m| m.shared >= 2));
        let ix = subject.index();
        if ix.len() != model.len() || ix.workers() != model.workers() {
            return Err(format!(
                "step {i}: index holds {} entries of {:?}, reference {} of {:?}",
                ix.len(),
                ix.workers(),
                model.len(),
                model.workers()
            ));
        }
        if i % 5 == 4 && ix.stats().nodes != model.prefixes() {
            return Err(format!(
                "step {i}: the tree holds {} blocks, the held paths have {} prefixes",
                ix.stats().nodes,
                model.prefixes()
            ));
        }
        let stats = ix.stats();
        let now = (stats.nodes, stats.runs);
        coverage.cut_runs += u64::from(now.1 > shape.1 && now.0 <= shape.0);
        coverage.joined_runs += u64::from(now.1 < shape.1 && now.0 >= shape.0);
        shape = now;
        if ix.has_unused_node() {
            return Err(format!(
                "step {i}: a run nobody holds, with no children: a leak"
            ));
        }
        if i % 25 == 24 {
            let restored = RadixIndex::restore(&ix.snapshot())
                .map_err(|e| format!("step {i}: restore failed: {e}"))?;
            if restored.digest() != ix.digest()
                || restored.find_matches(&step.query).matches != want
            {
                return Err(format!("step {i}: restored index differs"));
            }
        }
    }
    coverage.anomalies = subject.index().stats().anomalies;
    Ok(coverage)
}

/// Delta debugging: drops chunks of steps while the run still fails.
pub fn shrink<S: Subject>(mut steps: Vec<Step>, cap: Option<usize>) -> Vec<Step> {
    let mut chunk = steps.len() / 2;
    while chunk >= 1 {
        let mut start = 0;
        while start < steps.len() {
            let mut candidate = steps.clone();
            candidate.drain(start..(start + chunk).min(steps.len()));
            if run::<S>(&candidate, cap).is_err() {
                steps = candidate;
            } else {
                start += chunk;
            }
        }
        chunk /= 2;
    }
    steps
}

/// The steps of one seeded case.
pub fn gen_steps(seed: u64, len: usize, cap: Option<usize>, long: bool) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut model = Reference::new(cap);
    let mut steps = Vec::with_capacity(len);
    for _ in 0..len {
        let step = gen_step(&mut rng, &model, long);
        // Keep the generator's model in step so the next events stay plausible.
        match &step.op {
            Op::Event(w, d, ev) => {
                let _ = model.apply(*w, *d, ev);
            }
            Op::RemoveWorker(w) => model.remove_worker(*w),
            Op::RemoveRank(w, d) => model.remove_worker_dp_rank(*w, *d),
        }
        steps.push(step);
    }
    steps
}

/// One random case; on failure returns the seed's shrunk failing steps and the message.
pub fn check_case<S: Subject>(
    seed: u64,
    len: usize,
    cap: Option<usize>,
) -> Result<Coverage, (Vec<Step>, String)> {
    // Odd seeds store and remove longer chains.
    let steps = gen_steps(seed, len, cap, seed % 2 == 1);
    match run::<S>(&steps, cap) {
        Ok(coverage) => Ok(coverage),
        Err(_) => {
            let small = shrink::<S>(steps, cap);
            let msg = run::<S>(&small, cap).unwrap_err();
            Err((small, msg))
        }
    }
}
