//! Per-worker signals the caller gathers for one selection: prefix overlap (from the index) and
//! observed load (from the load view). The core reads them through [`SignalSource`], only for
//! the groups some component asked for (see [`crate::pipeline::WorkerInputs`]).

use std::collections::HashMap;

use kvroute_common::messages::{IndexReply, StorageTier, WorkerCard, WorkerLoad, WorkerMatch};

use crate::worker::WorkerRank;

/// Leading blocks of the request's prompt that one rank holds, per storage tier. Tiers are
/// disjoint: each leading block counts in the best tier holding it (device, host, disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    /// Blocks this rank holds in all, matching or not (a tie-break: fewer is better).
    pub cached_blocks: u64,
}

impl Overlap {
    /// The non-zero tiers, as carried in `SelectReply::overlap_blocks`.
    pub fn by_tier(&self) -> std::collections::BTreeMap<StorageTier, u32> {
        [
            (StorageTier::Device, self.device),
            (StorageTier::Host, self.host),
            (StorageTier::Disk, self.disk),
        ]
        .into_iter()
        .filter(|(_, blocks)| *blocks > 0)
        .collect()
    }
}

/// What the load view last saw of one rank (reports plus the router's own predictions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ObservedLoad {
    /// Prompt tokens admitted but not yet prefilled.
    pub active_prefill_tokens: u64,
    /// KV blocks held by running requests.
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}

impl From<&WorkerLoad> for ObservedLoad {
    fn from(load: &WorkerLoad) -> Self {
        Self {
            active_prefill_tokens: load.active_prefill_tokens,
            active_decode_blocks: load.active_decode_blocks,
            active_requests: load.active_requests,
        }
    }
}

/// Where the core reads per-rank signals. Called once per eligible rank and requested group.
pub trait SignalSource {
    /// The request's prefix overlap with `worker`; zero when the index knows nothing of it.
    fn overlap(&self, worker: WorkerRank) -> Overlap;
    /// The rank's load; `None` when no report has arrived yet (treated as idle).
    fn load(&self, worker: WorkerRank) -> Option<ObservedLoad>;
}

/// A [`SignalSource`] over maps the caller filled beforehand (an index reply, a load view).
#[derive(Debug, Clone, Default)]
pub struct SignalSnapshot {
    overlaps: HashMap<WorkerRank, Overlap>,
    loads: HashMap<WorkerRank, ObservedLoad>,
}

impl SignalSnapshot {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes every match of an index reply.
    pub fn with_index_reply(self, reply: &IndexReply) -> Self {
        self.with_matches(&reply.matches)
    }

    /// A snapshot with the overlap of every match (an index reply's or a local lookup's).
    pub fn from_matches(matches: &[WorkerMatch]) -> Self {
        Self::new().with_matches(matches)
    }

    fn with_matches(mut self, matches: &[WorkerMatch]) -> Self {
        for m in matches {
            let overlap = Overlap {
                device: m.device,
                host: m.host,
                disk: m.disk,
                cached_blocks: m.total_blocks,
            };
            self.overlaps
                .insert(WorkerRank::new(m.worker_id, m.dp_rank), overlap);
        }
        self
    }

    /// Adds the load `load` knows of every rank of `cards` (ranks it knows nothing of stay
    /// absent: idle).
    pub fn with_loads(
        mut self,
        cards: &[WorkerCard],
        load: impl Fn(WorkerRank) -> Option<ObservedLoad>,
    ) -> Self {
        for card in cards {
            for rank in card.dp_ranks() {
                let worker = WorkerRank::new(card.worker_id, rank);
                if let Some(l) = load(worker) {
                    self.loads.insert(worker, l);
                }
            }
        }
        self
    }

    pub fn with_overlap(mut self, worker: WorkerRank, overlap: Overlap) -> Self {
        self.overlaps.insert(worker, overlap);
        self
    }

    pub fn with_load(mut self, worker: WorkerRank, load: ObservedLoad) -> Self {
        self.loads.insert(worker, load);
        self
    }
}

impl SignalSource for SignalSnapshot {
    fn overlap(&self, worker: WorkerRank) -> Overlap {
        self.overlaps.get(&worker).copied().unwrap_or_default()
    }

    fn load(&self, worker: WorkerRank) -> Option<ObservedLoad> {
        self.loads.get(&worker).copied()
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerMatch;

    use super::*;

    #[test]
    fn snapshot_reads_index_matches_and_defaults_to_zero() {
        let reply = IndexReply {
            matches: vec![WorkerMatch {
                worker_id: 1,
                dp_rank: 2,
                device: 5,
                host: 1,
                disk: 0,
                total_blocks: 40,
            }],
            ..IndexReply::default()
        };
        let snap = SignalSnapshot::new().with_index_reply(&reply);
        let o = snap.overlap(WorkerRank::new(1, 2));
        assert_eq!((o.device, o.host, o.disk, o.cached_blocks), (5, 1, 0, 40));
        assert_eq!(o.by_tier().len(), 2);
        assert_eq!(snap.overlap(WorkerRank::new(1, 0)), Overlap::default());
        assert_eq!(snap.load(WorkerRank::new(1, 2)), None);
    }
}
