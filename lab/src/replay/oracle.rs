//! Upper bounds of the prefix-cache hit rate a router can reach on a trace, counted in blocks:
//! the *infinite* oracle (one shared cache that never evicts) and the *finite* oracle (one
//! shared LRU cache as large as the whole fleet's). A real fleet splits its cache across
//! workers, so a router's hit rate stays below both.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvroute_common::hashing::{BlockHashes, SequenceHash};
use kvroute_common::trace::TraceRequest;
use kvroute_mocker::engine::{EngineConfig, StepWork};
use serde::{Deserialize, Serialize};

use super::stats::Summary;

/// Both oracles for one trace, block size and fleet capacity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OracleHitRates {
    pub block_size: u32,
    /// The finite oracle's capacity: workers × blocks per worker.
    pub capacity_blocks: u64,
    /// Full prompt blocks in the trace.
    pub total_blocks: u64,
    pub infinite_hit_blocks: u64,
    pub finite_hit_blocks: u64,
    /// `infinite_hit_blocks / total_blocks`.
    pub infinite: f64,
    /// `finite_hit_blocks / total_blocks`.
    pub finite: f64,
}

/// Computes both oracles over `requests` in order, hashing each prompt at `block_size`.
pub fn oracle_hit_rates(
    requests: &[TraceRequest],
    block_size: u32,
    capacity_blocks: u64,
) -> OracleHitRates {
    oracle_with_hits(requests, block_size, capacity_blocks).0
}

/// [`oracle_hit_rates`], plus the finite oracle's hit blocks of each request.
pub fn oracle_with_hits(
    requests: &[TraceRequest],
    block_size: u32,
    capacity_blocks: u64,
) -> (OracleHitRates, Vec<u32>) {
    let mut infinite = InfiniteOracle::default();
    let mut finite = LruOracle::new(capacity_blocks);
    let (mut total, mut inf_hits, mut fin_hits) = (0u64, 0u64, 0u64);
    let mut per_request = Vec::with_capacity(requests.len());
    for req in requests {
        let hashes =
            BlockHashes::of_tokens(&req.tokens(), block_size as usize, req.lora_name.as_deref());
        total += hashes.sequence.len() as u64;
        inf_hits += infinite.observe(&hashes.sequence) as u64;
        let hits = finite.observe(&hashes.sequence);
        fin_hits += hits as u64;
        per_request.push(hits as u32);
    }
    let rates = OracleHitRates {
        block_size,
        capacity_blocks,
        total_blocks: total,
        infinite_hit_blocks: inf_hits,
        finite_hit_blocks: fin_hits,
        infinite: ratio(inf_hits, total),
        finite: ratio(fin_hits, total),
    };
    (rates, per_request)
}

/// A floor under TTFT: each request alone on an idle simulated engine (`engine`'s step-time
/// model and chunking), with the prefix the finite oracle found cached (`hits`, in blocks)
/// not recomputed. No routing does better on every request; queueing only adds to it.
pub fn ttft_floor(requests: &[TraceRequest], hits: &[u32], engine: &EngineConfig) -> Summary {
    let chunk = engine.max_num_batched_tokens.max(1);
    let floors: Vec<f64> = requests
        .iter()
        .zip(hits)
        .map(|(req, &hit)| {
            // As the engine: at least the last prompt token is computed.
            let cached = (hit * engine.block_size).min(req.input_length.saturating_sub(1));
            let mut left = req.input_length - cached;
            let mut total = std::time::Duration::ZERO;
            loop {
                let step = left.min(chunk);
                total += engine.step_duration(StepWork {
                    prefill_tokens: u64::from(step),
                    ..StepWork::default()
                });
                left -= step;
                if left == 0 {
                    break;
                }
            }
            total.as_secs_f64() * 1e3
        })
        .collect();
    Summary::of(&floors)
}

pub(crate) fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// One shared cache of unlimited size.
#[derive(Debug, Default)]
pub struct InfiniteOracle {
    seen: HashSet<SequenceHash>,
}

impl InfiniteOracle {
    /// Leading blocks of the prompt already seen; then remembers all of them.
    pub fn observe(&mut self, sequence: &[SequenceHash]) -> usize {
        let hits = sequence
            .iter()
            .take_while(|h| self.seen.contains(h))
            .count();
        self.seen.extend(&sequence[hits..]);
        hits
    }
}

/// One shared LRU cache of `capacity` blocks.
#[derive(Debug)]
pub struct LruOracle {
    capacity: u64,
    ticks: HashMap<SequenceHash, u64>,
    /// Oldest first.
    order: BTreeMap<u64, SequenceHash>,
    next_tick: u64,
}

impl LruOracle {
    pub fn new(capacity: u64) -> Self {
        Self {
            capacity,
            ticks: HashMap::new(),
            order: BTreeMap::new(),
            next_tick: 0,
        }
    }

    /// Leading blocks of the prompt held now, without touching the cache.
    pub fn peek(&self, sequence: &[SequenceHash]) -> usize {
        sequence
            .iter()
            .take_while(|h| self.ticks.contains_key(h))
            .count()
    }

    /// Leading blocks of the prompt held; then makes all of them the most recently used
    /// (deepest first, so a prefix outlives its extensions) and evicts down to capacity.
    pub fn observe(&mut self, sequence: &[SequenceHash]) -> usize {
        let hits = self.peek(sequence);
        for &h in sequence.iter().rev() {
            let tick = self.next_tick;
            self.next_tick += 1;
            if let Some(old) = self.ticks.insert(h, tick) {
                self.order.remove(&old);
            }
            self.order.insert(tick, h);
        }
        while self.ticks.len() as u64 > self.capacity {
            let (_, h) = self
                .order
                .pop_first()
                .expect("over capacity means non-empty");
            self.ticks.remove(&h);
        }
        hits
    }

    pub fn len(&self) -> usize {
        self.ticks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ticks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use kvroute_common::trace::read_trace;

    use super::*;

    #[test]
    fn infinite_oracle_counts_leading_seen_blocks() {
        let mut o = InfiniteOracle::default();
        assert_eq!(o.observe(&[1, 2, 3]), 0);
        assert_eq!(o.observe(&[1, 2, 4]), 2);
        assert_eq!(o.observe(&[1, 2, 4, 5]), 3);
        assert_eq!(o.observe(&[9, 2]), 0, "only a leading run counts");
    }

    #[test]
    fn lru_oracle_evicts_the_least_recent_extension_first() {
        let mut o = LruOracle::new(4);
        o.observe(&[1, 2, 3]);
        o.observe(&[1, 5]); // 4 blocks: 3 is now the oldest, then 2
        o.observe(&[6]); // evicts 3
        assert_eq!(o.len(), 4);
        assert_eq!(o.peek(&[1, 2, 3]), 2);
        assert_eq!(o.observe(&[1, 2, 3]), 2);
        let mut o = LruOracle::new(0);
        assert_eq!(o.observe(&[1]), 0);
        assert!(o.is_empty());
    }

    fn conversation_trace() -> Option<Vec<TraceRequest>> {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/traces/conversation_trace.jsonl"
        ));
        if !path.exists() {
            println!("skipped: {} is absent", path.display());
            return None;
        }
        Some(read_trace(path).expect("the shipped trace parses"))
    }

    /// The first 1,500 requests (fast in debug builds): the figures measured on this prefix,
    /// and a smaller fleet bounded by the larger one (LRU is a stack algorithm).
    #[test]
    fn conversation_trace_prefix_oracles() {
        let Some(trace) = conversation_trace() else {
            return;
        };
        let r = oracle_hit_rates(&trace[..1500], 64, 8 * 16_384);
        assert!((r.infinite - 0.2705).abs() < 0.001, "{r:?}");
        assert!((r.finite - 0.2412).abs() < 0.001, "{r:?}");
        let small = oracle_hit_rates(&trace[..1500], 64, 2 * 16_384);
        assert_eq!(small.infinite_hit_blocks, r.infinite_hit_blocks);
        assert!(small.finite_hit_blocks < r.finite_hit_blocks, "{small:?}");
    }

    /// The whole trace: the traces README's 0.375 (measured 0.3745), and the fleet bound for
    /// 8 × 16,384 blocks (measured 0.2740).
    /// `cargo test -p kvroute-lab --release -- --ignored oracle`
    #[test]
    #[ignore = "hashes the whole trace (about 15 s in debug builds)"]
    fn conversation_trace_full_oracles() {
        let Some(trace) = conversation_trace() else {
            return;
        };
        let r = oracle_hit_rates(&trace, 64, 8 * 16_384);
        println!("{r:?}");
        assert!((r.infinite - 0.375).abs() < 0.005, "{r:?}");
        assert!((r.finite - 0.27).abs() < 0.01, "{r:?}");
    }
}
