//! Seeded differential test: the radix index against a naive reference model, with a query
//! after every step, over 16 workers × 2 dp ranks.
//!
//! CI runs a fixed number of cases; run longer with
//! `KVROUTE_DIFF_CASES=20000 cargo test -p kvroute-indexer --release --test differential`
//! (`KVROUTE_DIFF_STEPS` sets steps per case, `KVROUTE_DIFF_SEED` the first seed). A failure
//! prints the seed and a shrunk list of steps that still fails.

mod compat;
mod harness;
mod reference;

use harness::{Subject, check_case};
use kvroute_common::messages::{KvEventData, WorkerMatch};
use kvroute_indexer::{ApplyError, ApplyOk, RadixIndex};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run_cases(cap: Option<usize>, default_cases: u64) {
    let cases = env_or("KVROUTE_DIFF_CASES", default_cases);
    let steps = env_or("KVROUTE_DIFF_STEPS", 200) as usize;
    let first = env_or("KVROUTE_DIFF_SEED", 0x5eed);
    let mut seen = harness::Coverage::default();
    for seed in first..first + cases {
        match check_case::<RadixIndex>(seed, steps, cap) {
            Ok(c) => {
                seen.matched_queries += c.matched_queries;
                seen.deep_matches += c.deep_matches;
                seen.cut_runs += c.cut_runs;
                seen.joined_runs += c.joined_runs;
                seen.shared_matches += c.shared_matches;
                let (a, b) = (&mut seen.anomalies, c.anomalies);
                a.parent_unknown_events += b.parent_unknown_events;
                a.parent_unknown_blocks += b.parent_unknown_blocks;
                a.removed_unknown_blocks += b.removed_unknown_blocks;
                a.duplicate_stored_blocks += b.duplicate_stored_blocks;
                a.rebound_blocks += b.rebound_blocks;
                a.aliased_blocks += b.aliased_blocks;
                a.evicted_entries += b.evicted_entries;
            }
            Err((small, msg)) => panic!(
                "differential failure, seed {seed} (cap {cap:?}); rerun with \
                 KVROUTE_DIFF_SEED={seed} KVROUTE_DIFF_CASES=1\n{msg}\nshrunk to {} steps:\n{small:#?}",
                small.len()
            ),
        }
    }
    // The generator must reach every kind of input, or the test proves little.
    let a = seen.anomalies;
    assert!(
        seen.matched_queries > 0
            && seen.deep_matches > 0
            && seen.cut_runs > 0
            && seen.joined_runs > 0
            && seen.shared_matches > 0
            && a.parent_unknown_events > 0
            && a.removed_unknown_blocks > 0
            && a.duplicate_stored_blocks > 0
            && a.rebound_blocks > 0
            && a.aliased_blocks > 0
            && (cap.is_none() || a.evicted_entries > 0),
        "too little exercised: {seen:?}"
    );
    eprintln!("differential: {cases} cases of {steps} steps, cap {cap:?}: {seen:?}");
}

#[test]
fn index_agrees_with_reference() {
    run_cases(None, 60);
}

#[test]
fn index_agrees_with_reference_under_a_cap() {
    run_cases(Some(12), 30);
}

/// A deliberately broken index: claims to apply `Removed` but ignores it.
struct IgnoresRemoved(RadixIndex);

impl Subject for IgnoresRemoved {
    fn build(cap: Option<usize>) -> Self {
        Self(<RadixIndex as Subject>::build(cap))
    }
    fn apply(&mut self, w: u64, d: u32, ev: &KvEventData) -> Result<ApplyOk, ApplyError> {
        match ev {
            KvEventData::Removed { .. } => {
                // Report what the real index would, without changing anything.
                let mut probe = self.0.clone();
                probe.apply(w, d, ev)
            }
            _ => self.0.apply(w, d, ev),
        }
    }
    fn remove_worker(&mut self, w: u64) {
        self.0.remove_worker(w);
    }
    fn remove_worker_dp_rank(&mut self, w: u64, d: u32) {
        self.0.remove_worker_dp_rank(w, d);
    }
    fn find_matches(&self, query: &[u64]) -> Vec<WorkerMatch> {
        self.0.find_matches(query).matches
    }
    fn index(&self) -> &RadixIndex {
        &self.0
    }
}

#[test]
fn differential_test_catches_a_variant_that_ignores_removed() {
    let caught =
        (0x5eed..0x5eed + 60).find_map(|seed| check_case::<IgnoresRemoved>(seed, 200, None).err());
    let (small, msg) = caught.expect("the broken variant went unnoticed");
    // Shrinking leaves the essence: a store, a removal of it, and the query that sees it.
    assert!(
        small.len() <= 3,
        "shrunk only to {} steps: {small:#?}",
        small.len()
    );
    assert!(
        small
            .iter()
            .any(|s| matches!(s.op, harness::Op::Event(_, _, KvEventData::Removed { .. }))),
        "{msg}: {small:#?}"
    );
}
