//! Per-worker signals the caller gathers for one selection: prefix overlap (from the index) and
//! observed load (from the load view). The core reads them through [`SignalSource`], only for
//! the groups some component asked for (see [`crate::pipeline::WorkerInputs`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_common::messages::{IndexReply, StorageTier, WorkerCard, WorkerLoad, WorkerMatch};

use crate::worker::WorkerRank;

/// Leading blocks of the request's prompt that one rank holds, per storage tier. The rank's own
/// tiers are disjoint: each leading block counts in the best tier holding it (device, host,
/// disk). `shared` is the fleet's, not the rank's: see [`Overlap::shared_beyond_device_blocks`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    pub device: u32,
    pub host: u32,
    pub disk: u32,
    /// Leading prompt blocks the shared tier (LMCache, a remote store) holds, which every
    /// worker can load: the index's shared prefix (`WorkerMatch::shared`), the same for every
    /// rank of one selection; 0 when no worker announced shared-tier blocks of the prompt.
    pub shared: u32,
    /// Blocks this rank holds in all, matching or not (a tie-break: fewer is better).
    pub cached_blocks: u64,
}

impl Overlap {
    /// Device-resident prefix overlap in blocks.
    pub fn device_overlap_blocks(&self) -> u32 {
        self.device
    }

    /// Leading blocks past the device prefix whose best tier on this rank is host memory.
    pub fn host_overlap_blocks(&self) -> u32 {
        self.host
    }

    /// Leading blocks past the device and host prefix whose best tier on this rank is disk.
    pub fn disk_overlap_blocks(&self) -> u32 {
        self.disk
    }

    /// Shared-cache hits beyond the device-resident prefix: `max(shared − device, 0)`, the
    /// leading blocks this rank would load from the shared tier instead of recomputing. Only the
    /// device tier counts as the rank's prefix here: blocks the rank also holds in host memory
    /// or on disk are counted both here and in `host` / `disk` (a policy combining both credits
    /// should weigh that; the default cost model does, through its multiplier).
    pub fn shared_beyond_device_blocks(&self) -> u32 {
        self.shared.saturating_sub(self.device)
    }

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
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ObservedLoad {
    /// Prompt tokens admitted but not yet prefilled.
    pub active_prefill_tokens: u64,
    /// KV blocks held by running requests.
    pub active_decode_blocks: u64,
    pub active_requests: u64,
    /// Requests the engine holds waiting whose prompt tokens the report does not count: its
    /// `waiting_requests` when it reports no `active_prefill_tokens` (vLLM reports none), else
    /// 0. The cost model charges each as a prompt of the request's own size.
    pub unsized_waiting_requests: u64,
    /// Placeholder blocks of predicted requests' output, weighted by the output still expected
    /// (0 unless the load view tracks output blocks).
    pub output_blocks: f64,
}

impl ObservedLoad {
    /// Decode blocks: the active ones plus the output placeholders.
    pub fn decode_blocks(&self) -> f64 {
        self.active_decode_blocks as f64 + self.output_blocks
    }
}

impl From<&WorkerLoad> for ObservedLoad {
    fn from(load: &WorkerLoad) -> Self {
        Self {
            active_prefill_tokens: load.active_prefill_tokens,
            active_decode_blocks: load.active_decode_blocks,
            active_requests: load.active_requests,
            unsized_waiting_requests: if load.active_prefill_tokens == 0 {
                load.waiting_requests
            } else {
                0
            },
            output_blocks: 0.0,
        }
    }
}

/// How a rank stands for the LoRA adapter a request names (the Gateway API inference
/// extension's adapter affinity: 1.0 loaded, 0.8 a free slot, 0.6 waiting, 0 full).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterAffinity {
    /// Resident (reported, or sent there by a recent decision).
    Loaded,
    /// Not resident; a slot is free to load it into.
    FreeSlot,
    /// Requests waiting there name it: it is about to be loaded.
    Waiting,
    /// Not resident and every slot holds another adapter.
    Full,
}

impl AdapterAffinity {
    /// 1.0 loaded, 0.8 free slot, 0.6 waiting, 0 full.
    pub fn score(self) -> f64 {
        match self {
            Self::Loaded => 1.0,
            Self::FreeSlot => 0.8,
            Self::Waiting => 0.6,
            Self::Full => 0.0,
        }
    }
}

/// Where the core reads per-rank signals. Called once per eligible rank and requested group.
pub trait SignalSource {
    /// The request's prefix overlap with `worker`; zero when the index knows nothing of it.
    fn overlap(&self, worker: WorkerRank) -> Overlap;
    /// The rank's load; `None` when no report has arrived yet (treated as idle).
    fn load(&self, worker: WorkerRank) -> Option<ObservedLoad>;
    /// How the rank stands for the request's LoRA adapter; `None` when the request names
    /// none or nothing is known of the rank's adapters.
    fn adapter(&self, worker: WorkerRank) -> Option<AdapterAffinity> {
        let _ = worker;
        None
    }
    /// The request's LoRA adapter's held share of its model's recent adapter requests, in
    /// [0, 1], when the router places adapters (`SelectionSettings::adapter_placement`);
    /// `None` otherwise.
    fn adapter_share(&self) -> Option<f64> {
        None
    }
    /// The adapter slots the rank reports; `None` when unknown.
    fn adapter_slots(&self, worker: WorkerRank) -> Option<u32> {
        let _ = worker;
        None
    }
}

/// Per-rank values sorted by rank, read in rank order: the core asks for the ranks of the
/// partition's cards in card order (by worker id), so a read usually finds its rank at the
/// slot after the previous read's and costs a comparison; any other order falls back to a
/// binary search. (A hash map here cost a SipHash per candidate rank and per signal group.)
#[derive(Debug)]
struct RankTable<T> {
    entries: Vec<(WorkerRank, T)>,
    /// Where the next read looks first. Only a hint: any value is correct.
    next: AtomicUsize,
}

impl<T> Default for RankTable<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            next: AtomicUsize::new(0),
        }
    }
}

impl<T: Copy> Clone for RankTable<T> {
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
            next: AtomicUsize::new(0),
        }
    }
}

impl<T: Copy> RankTable<T> {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            entries: Vec::with_capacity(capacity),
            next: AtomicUsize::new(0),
        }
    }

    /// Sets `rank`'s value; appending in rank order is the fast case.
    fn insert(&mut self, rank: WorkerRank, value: T) {
        match self.entries.last() {
            Some((last, _)) if *last >= rank => {
                match self.entries.binary_search_by_key(&rank, |(r, _)| *r) {
                    Ok(i) => self.entries[i].1 = value,
                    Err(i) => self.entries.insert(i, (rank, value)),
                }
            }
            _ => self.entries.push((rank, value)),
        }
    }

    fn get(&self, rank: WorkerRank) -> Option<T> {
        let hint = self.next.load(Ordering::Relaxed);
        let at_hint = self.entries.get(hint).map(|(r, _)| *r);
        // `rank` would sit right before the hinted slot: absent (most ranks have no load
        // and no overlap, so a miss must be as cheap as a hit).
        let after_previous =
            hint == 0 || self.entries.get(hint - 1).is_some_and(|(r, _)| *r < rank);
        let found = match at_hint {
            Some(r) if r == rank => Ok(hint),
            Some(r) if r > rank && after_previous => Err(hint),
            None if hint == self.entries.len() && after_previous => Err(hint),
            _ => self.entries.binary_search_by_key(&rank, |(r, _)| *r),
        };
        match found {
            Ok(i) => {
                self.next.store(i + 1, Ordering::Relaxed);
                Some(self.entries[i].1)
            }
            Err(i) => {
                self.next.store(i, Ordering::Relaxed);
                None
            }
        }
    }
}

/// A [`SignalSource`] over tables the caller filled beforehand (an index reply, a load view).
#[derive(Debug, Clone, Default)]
pub struct SignalSnapshot {
    overlaps: RankTable<Overlap>,
    loads: RankTable<ObservedLoad>,
    adapters: RankTable<AdapterAffinity>,
    /// The prompt's shared-tier prefix, reported for every rank (also ranks without a row).
    shared: u32,
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
        self.overlaps.entries.reserve(matches.len());
        for m in matches {
            let overlap = Overlap {
                device: m.device,
                host: m.host,
                disk: m.disk,
                shared: m.shared,
                cached_blocks: m.total_blocks,
            };
            self.shared = self.shared.max(m.shared);
            self.overlaps
                .insert(WorkerRank::new(m.worker_id, m.dp_rank), overlap);
        }
        self
    }

    /// Sets the prompt's shared-tier prefix (`Overlap::shared`) for every rank.
    pub fn with_shared_prefix(mut self, blocks: u32) -> Self {
        self.shared = blocks;
        self
    }

    /// Adds the load `load` knows of every rank of `cards` (ranks it knows nothing of stay
    /// absent: idle).
    pub fn with_loads(
        mut self,
        cards: &[WorkerCard],
        load: impl Fn(WorkerRank) -> Option<ObservedLoad>,
    ) -> Self {
        if self.loads.entries.is_empty() {
            self.loads = RankTable::with_capacity(cards.len());
        }
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

    pub fn with_adapter(mut self, worker: WorkerRank, affinity: AdapterAffinity) -> Self {
        self.adapters.insert(worker, affinity);
        self
    }
}

impl SignalSource for SignalSnapshot {
    fn overlap(&self, worker: WorkerRank) -> Overlap {
        let overlap = self.overlaps.get(worker).unwrap_or_default();
        Overlap {
            shared: self.shared,
            ..overlap
        }
    }

    fn load(&self, worker: WorkerRank) -> Option<ObservedLoad> {
        self.loads.get(worker)
    }

    fn adapter(&self, worker: WorkerRank) -> Option<AdapterAffinity> {
        self.adapters.get(worker)
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerMatch;

    use super::*;

    #[test]
    fn waiting_requests_are_unsized_only_when_the_report_counts_no_prefill_tokens() {
        let report = |prefill_tokens, waiting| WorkerLoad {
            v: Default::default(),
            worker_id: 1,
            dp_rank: 0,
            seq: 1,
            active_prefill_tokens: prefill_tokens,
            active_decode_blocks: 8,
            active_requests: 2,
            waiting_requests: waiting,
            kv_used_blocks: 8,
            total_kv_blocks: 64,
            ts: 0,
            new_requests: None,
            adapters: None,
        };
        // vLLM: waiting requests, no token count.
        let vllm = ObservedLoad::from(&report(0, 3));
        assert_eq!(
            (vllm.unsized_waiting_requests, vllm.active_requests),
            (3, 2)
        );
        // SGLang and the mocker count the waiting requests' uncached tokens.
        assert_eq!(
            ObservedLoad::from(&report(500, 3)).unsized_waiting_requests,
            0
        );
        assert_eq!(
            ObservedLoad::from(&report(0, 0)).unsized_waiting_requests,
            0
        );
    }

    #[test]
    fn snapshot_reads_index_matches_and_defaults_to_zero() {
        let reply = IndexReply {
            matches: vec![WorkerMatch {
                worker_id: 1,
                dp_rank: 2,
                device: 5,
                host: 1,
                disk: 0,
                shared: 0,
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

    #[test]
    fn the_shared_prefix_reaches_every_rank_and_counts_beyond_the_device_prefix() {
        let row = |worker_id, device| WorkerMatch {
            worker_id,
            device,
            shared: 6,
            ..WorkerMatch::default()
        };
        let snap = SignalSnapshot::from_matches(&[row(1, 2), row(2, 8)]);
        let beyond = |w| {
            snap.overlap(WorkerRank::new(w, 0))
                .shared_beyond_device_blocks()
        };
        assert_eq!(snap.overlap(WorkerRank::new(1, 0)).shared, 6);
        // max(6 − 2, 0), max(6 − 8, 0), and a rank with no row: all 6.
        assert_eq!([beyond(1), beyond(2), beyond(3)], [4, 0, 6]);
        assert_eq!(
            snap.overlap(WorkerRank::new(1, 0)).by_tier().len(),
            1,
            "overlap_blocks keeps the rank's own tiers"
        );
    }

    #[test]
    fn tables_answer_in_any_order_and_keep_the_last_value() {
        let load = |n: u64| ObservedLoad {
            active_requests: n,
            ..ObservedLoad::default()
        };
        let mut snap = SignalSnapshot::new();
        // Out of order, with a rank set twice.
        for (w, r, n) in [(3, 0, 30), (1, 1, 11), (1, 0, 10), (2, 0, 20), (1, 1, 12)] {
            snap = snap.with_load(WorkerRank::new(w, r), load(n));
        }
        let reads = [
            (1, 0, Some(10)),
            (1, 1, Some(12)),
            (2, 0, Some(20)),
            (3, 0, Some(30)),
        ];
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]] {
            for i in order {
                let (w, r, n) = reads[i];
                assert_eq!(snap.load(WorkerRank::new(w, r)), n.map(load));
            }
            assert_eq!(snap.load(WorkerRank::new(2, 1)), None);
            assert_eq!(snap.load(WorkerRank::new(9, 0)), None);
        }
        assert_eq!(snap.clone().load(WorkerRank::new(3, 0)), Some(load(30)));
    }

    #[test]
    fn loads_come_from_every_rank_of_the_cards() {
        let mut cards = crate::testing::cards(3);
        cards[1].dp_size = 2;
        let snap = SignalSnapshot::new().with_loads(&cards, |rank| {
            (rank.worker_id != 3).then_some(ObservedLoad {
                active_requests: rank.worker_id * 10 + u64::from(rank.dp_rank),
                ..ObservedLoad::default()
            })
        });
        let requests = |w, r| snap.load(WorkerRank::new(w, r)).map(|l| l.active_requests);
        assert_eq!(
            [
                requests(1, 0),
                requests(2, 0),
                requests(2, 1),
                requests(3, 0)
            ],
            [Some(10), Some(20), Some(21), None]
        );
    }
}
