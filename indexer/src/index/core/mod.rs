//! The writer's side of the index: what only applying events needs, kept once however many
//! views readers use. Per (worker, dp rank) the map from engine block hash to arena slot; per
//! slot its node; the extents and node ids in use; the eviction queue and the counters.
//!
//! Every change to a view goes through a [`Rec`], so it can be replayed on other views.
//! Within one event, nodes are never freed or merged: ownership changes mark nodes *touched*,
//! and [`Core::tidy`] trims, frees and merges them when the event is done. Block slots are
//! stable, so positions are carried as slots and their node is looked up when needed.
//!
//! - `shape.rs`: placing a stored chain in the tree (follow, split, grow, new runs), and tidying;
//! - `own.rs`: a pair's ownership of single blocks, with the pending-owner cursor;
//! - `events.rs`: `Stored`, `Removed`, `Cleared`, worker removal and eviction;
//! - `pin.rs`: copying the maps for a snapshot without stopping the writer.

mod events;
pub(crate) use events::AHEAD;
mod own;
mod pin;
mod shape;

use hashbrown::HashMap;
use kvroute_common::ids::{DpRank, WorkerId};

pub(crate) use pin::PinMaps;

use super::arena::{Arena, BlockSlot, ROOT_ANCHOR, SlotTable};
use super::blockmap::BlockMap;
use super::config::IndexConfig;
use super::eviction::EvictionQueue;
use super::extents::{ExtentId, Extents};
use super::ops::{Op, Rec};
use super::stats::{Anomalies, WorkerBlocks};
use super::view::{MAX_SLOTS, NodeId, ROOT, Slot, View};
use own::Cursor;
use pin::PinState;

/// The writer's bytes by part (see [`Core::memory`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CoreMemory {
    /// The pairs' block maps.
    pub maps: usize,
    /// Each arena slot's node.
    pub slot_nodes: usize,
    pub other: usize,
    /// Arena slots in live extents (used or room to grow).
    pub arena_slots_live: usize,
}

/// One (worker, dp rank) and its blocks.
#[derive(Debug, Clone)]
pub(crate) struct Pair {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    pub map: BlockMap,
}

#[derive(Debug, Clone)]
pub(crate) struct Core {
    pub config: IndexConfig,
    pub anomalies: Anomalies,
    /// (block, worker, dp rank) entries.
    pub entries: usize,
    pub queue: EvictionQueue,
    pairs: Vec<Option<Pair>>,
    free_pairs: Vec<Slot>,
    by_pair: HashMap<(WorkerId, DpRank), Slot>,
    /// The writer's handle on the shared arena.
    pub arena: Arena,
    /// Each block slot's node.
    node_of: SlotTable,
    /// Each node's extent (by node id).
    node_ext: Vec<ExtentId>,
    free_nodes: Vec<NodeId>,
    next_node: NodeId,
    extents: Extents,
    /// Ownership change not yet written to the view.
    cursor: Option<Cursor>,
    /// Nodes whose ownership or shape changed in the current event.
    touched: Vec<NodeId>,
    /// Pairs whose block count changed in the current event.
    counted: Vec<Slot>,
    /// Slots of the current event's stored blocks.
    locs: Vec<BlockSlot>,
    pin: Option<PinState>,
}

impl Core {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            anomalies: Anomalies::default(),
            entries: 0,
            queue: EvictionQueue::default(),
            pairs: Vec::new(),
            free_pairs: Vec::new(),
            by_pair: HashMap::new(),
            arena: Arena::default(),
            node_of: SlotTable::default(),
            node_ext: vec![0],
            free_nodes: Vec::new(),
            next_node: 1,
            extents: Extents::default(),
            cursor: None,
            touched: Vec::new(),
            counted: Vec::new(),
            locs: Vec::new(),
            pin: None,
        }
    }

    fn capped(&self) -> bool {
        self.config.max_entries.is_some()
    }

    #[inline]
    pub fn slot_of(&self, worker_id: WorkerId, dp_rank: DpRank) -> Option<Slot> {
        self.by_pair.get(&(worker_id, dp_rank)).copied()
    }

    #[inline]
    pub fn pair(&self, slot: Slot) -> Option<&Pair> {
        self.pairs.get(slot as usize).and_then(Option::as_ref)
    }

    #[inline]
    fn map_mut(&mut self, slot: Slot) -> &mut BlockMap {
        &mut self.pairs[slot as usize].as_mut().expect("slot in use").map
    }

    /// Makes room in `slot`'s map for `additional` more entries.
    fn reserve_map(&mut self, slot: Slot, additional: usize) {
        self.map_mut(slot).reserve(additional);
    }

    /// Shrinks `slot`'s map if it has become mostly empty.
    fn shrink_map(&mut self, slot: Slot) {
        if let Some(p) = self.pairs.get_mut(slot as usize).and_then(Option::as_mut) {
            p.map.shrink_if_sparse();
        }
    }

    /// Every pair in use, in slot order.
    pub fn pairs(&self) -> impl Iterator<Item = (Slot, &Pair)> {
        self.pairs
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.as_ref().map(|p| (i as Slot, p)))
    }

    /// Slots of every dp rank of `worker_id`.
    pub fn slots_of_worker(&self, worker_id: WorkerId) -> Vec<Slot> {
        self.pairs()
            .filter(|(_, p)| p.worker_id == worker_id)
            .map(|(s, _)| s)
            .collect()
    }

    /// The slot of a pair, assigned (and announced to the view) if new; `None` when every slot
    /// number is taken.
    fn slot_or_assign(
        &mut self,
        rec: &mut Rec<'_>,
        worker_id: WorkerId,
        dp_rank: DpRank,
    ) -> Option<Slot> {
        if let Some(s) = self.slot_of(worker_id, dp_rank) {
            return Some(s);
        }
        let slot = match self.free_pairs.pop() {
            Some(s) => s,
            None => {
                if self.pairs.len() >= MAX_SLOTS {
                    return None;
                }
                self.pairs.push(None);
                (self.pairs.len() - 1) as Slot
            }
        };
        self.pairs[slot as usize] = Some(Pair {
            worker_id,
            dp_rank,
            map: BlockMap::new(self.capped()),
        });
        self.by_pair.insert((worker_id, dp_rank), slot);
        rec.op(Op::NewPair {
            slot,
            worker_id,
            dp_rank,
        });
        Some(slot)
    }

    /// Frees a pair that holds nothing.
    fn drop_if_empty(&mut self, rec: &mut Rec<'_>, slot: Slot) {
        if self.pair(slot).is_some_and(|p| p.map.is_empty()) {
            self.free_pair(rec, slot);
        }
    }

    fn free_pair(&mut self, rec: &mut Rec<'_>, slot: Slot) -> Option<Pair> {
        self.before_map_change(slot);
        self.flush(rec);
        let pair = self.pairs[slot as usize].take()?;
        self.by_pair.remove(&(pair.worker_id, pair.dp_rank));
        self.free_pairs.push(slot);
        self.counted.retain(|&s| s != slot);
        rec.op(Op::FreePair { slot });
        Some(pair)
    }

    /// Tells the view the block counts of pairs changed by this event (and shrinks their maps
    /// if they have become mostly empty: never during an event, which reserved room).
    fn publish_counts(&mut self, rec: &mut Rec<'_>) {
        let mut counted = std::mem::take(&mut self.counted);
        counted.sort_unstable();
        counted.dedup();
        for &slot in &counted {
            self.shrink_map(slot);
            if let Some(p) = self.pair(slot) {
                rec.op(Op::PairBlocks {
                    slot,
                    blocks: p.map.len() as u64,
                });
            }
        }
        counted.clear();
        self.counted = counted;
    }

    #[inline]
    fn count(&mut self, slot: Slot) {
        if self.counted.last() != Some(&slot) {
            self.counted.push(slot);
        }
    }

    /// The node of a block slot.
    #[inline]
    pub fn node_of(&self, slot: BlockSlot) -> NodeId {
        self.node_of.get(slot)
    }

    /// The parent of a live node.
    fn parent_of(&self, view: &View, id: NodeId) -> NodeId {
        match view.node(id).anchor {
            ROOT_ANCHOR => ROOT,
            a => self.node_of.get(a),
        }
    }

    fn alloc_node(&mut self, ext: ExtentId) -> NodeId {
        let id = match self.free_nodes.pop() {
            Some(id) => id,
            None => {
                let id = self.next_node;
                self.next_node = id.checked_add(1).expect("more than 2^32 nodes");
                self.node_ext.push(0);
                id
            }
        };
        self.node_ext[id as usize] = ext;
        id
    }

    fn release_node(&mut self, id: NodeId) {
        self.extents.unref(self.node_ext[id as usize]);
        self.free_nodes.push(id);
    }

    /// Extents freed since the views last caught up become available again. Call once every
    /// view has applied every op recorded so far.
    pub fn views_caught_up(&mut self) {
        self.extents.release_pending();
    }

    /// Blocks held per pair, sorted by (worker, rank).
    pub fn blocks_per_worker(&self) -> Vec<WorkerBlocks> {
        let mut out: Vec<WorkerBlocks> = self
            .pairs()
            .map(|(_, p)| WorkerBlocks {
                worker_id: p.worker_id,
                dp_rank: p.dp_rank,
                blocks: p.map.len() as u64,
            })
            .collect();
        out.sort_unstable_by_key(|w| (w.worker_id, w.dp_rank));
        out
    }

    /// Bytes of the writer's own tables (the arena not included).
    pub fn bytes(&self) -> usize {
        let parts = self.memory();
        parts.maps + parts.slot_nodes + parts.other
    }

    /// The writer's bytes by part.
    pub fn memory(&self) -> CoreMemory {
        CoreMemory {
            maps: self.pairs().map(|(_, p)| p.map.bytes()).sum(),
            slot_nodes: self.node_of.bytes(),
            other: self.pairs.capacity() * std::mem::size_of::<Option<Pair>>()
                + self.by_pair.allocation_size()
                + self.node_ext.capacity() * 4
                + self.free_nodes.capacity() * 4
                + self.extents.bytes()
                + self.queue.bytes(),
            arena_slots_live: self.extents.live_slots(),
        }
    }
}

/// Rebuilding a core around a restored view (`snapshot.rs`).
impl Core {
    /// Registers a restored pair at the next slot number (its entries come later, through
    /// [`Core::restored_map`]; then [`Core::recount`]).
    pub fn push_restored_pair(&mut self, pair: Pair) -> Option<Slot> {
        let slot = self.pairs.len() as Slot;
        if self
            .by_pair
            .insert((pair.worker_id, pair.dp_rank), slot)
            .is_some()
        {
            return None;
        }
        self.pairs.push(Some(pair));
        Some(slot)
    }

    /// A restored pair's map, to fill.
    pub fn restored_map(&mut self, slot: Slot) -> &mut BlockMap {
        self.map_mut(slot)
    }

    /// Counts the entries of every map (after a restore).
    pub fn recount(&mut self) {
        self.entries = self.pairs().map(|(_, p)| p.map.len()).sum();
    }

    /// Places a restored run of `tokens` under `parent` (whose last block is `anchor`) in a
    /// fresh extent sized to it.
    pub fn push_restored_node(
        &mut self,
        rec: &mut Rec<'_>,
        parent: NodeId,
        anchor: BlockSlot,
        tokens: &[u64],
    ) -> NodeId {
        let len = tokens.len() as u32;
        let ext = self.alloc_extent(rec, len, len);
        self.new_run(rec, ext, len, parent, anchor, tokens.iter().copied())
    }

    /// An extent of at least `min` slots, `want` if a free one has room (see
    /// [`Extents::alloc`]); a new arena chunk, if one was needed, is recorded.
    #[inline]
    pub(super) fn alloc_extent(&mut self, rec: &mut Rec<'_>, want: u32, min: u32) -> ExtentId {
        let (ext, chunk) = self.extents.alloc(want, min, &mut self.arena);
        if let Some(c) = chunk {
            self.node_of.grow();
            rec.op(Op::Chunk(c));
        }
        ext
    }

    /// Writes a run of `len` tokens hashes at the start of `ext` and adds its node under
    /// `parent` (whose last block is `anchor`).
    #[inline]
    pub(super) fn new_run(
        &mut self,
        rec: &mut Rec<'_>,
        ext: ExtentId,
        len: u32,
        parent: NodeId,
        anchor: BlockSlot,
        tokens: impl Iterator<Item = u64>,
    ) -> NodeId {
        self.extents.get_mut(ext).used = len;
        let start = self.extents.get(ext).start;
        self.arena.write(start, tokens);
        let id = self.alloc_node(ext);
        self.node_of.fill(start, len, id);
        rec.op(Op::NewNode {
            id,
            parent,
            start,
            len,
            anchor,
        });
        id
    }

    /// Marks a node for [`Core::tidy`] at the end of the event (a restore from an older
    /// format merges runs this way too).
    #[inline]
    pub fn touch(&mut self, id: NodeId) {
        if self.touched.last() != Some(&id) {
            self.touched.push(id);
        }
    }
}
