//! What readers see: the tree of runs, each run's owners, the child edges and the
//! (worker, dp rank) table. The writer changes a view only through [`Op`](super::ops::Op)s (`view/apply.rs`), so two views that
//! applied the same ops are the same (see `shared.rs`); the block hashes themselves live in the
//! [`Arena`] all views share.
//!
//! A node is a run of consecutive blocks `start..start + len` of the arena. Its children continue
//! the chain after its last block; a child is either its parent's *hint* (kept in the node) or in
//! the edge tables keyed by `(anchor, first tokens_hash)`, where the anchor is the slot of the
//! parent's last block — a key that survives splits and merges, which keep the last block.
//! An owner of a node holds a prefix `0..end` of its run, in one set of tiers; anything else
//! (a hole, a tier change inside a run) is a node boundary.

use hashbrown::HashTable;
use kvroute_common::ids::{DpRank, WorkerId};
use std::sync::atomic::AtomicU64;

use super::arena::{Arena, BlockSlot, ROOT_ANCHOR};
use super::blockmap::mix;
mod apply;

/// An index into the node table.
pub(crate) type NodeId = u32;

/// The root: the empty prefix, `len` 0, never an owner, never freed.
pub(crate) const ROOT: NodeId = 0;

/// The number of a (worker, dp rank) pair.
pub(crate) type Slot = u32;

/// Tier masks take the low bits of an owner's first word: device, host, disk, shared.
pub(crate) const TIER_BITS: u32 = 4;

/// The shared tier's bit in a tier mask.
pub(crate) const SHARED_BIT: u8 = 1 << 3;

/// Largest slot number an owner entry can carry.
pub(crate) const MAX_SLOTS: usize = 1 << (32 - TIER_BITS);

/// `children` of a node on the free list.
const FREE: u32 = u32::MAX;

/// Owners kept in the node itself; more go to the spill arena.
const INLINE: usize = 2;

/// An owner entry: `slot << 4 | tiers` in the low word, `end` in the high word.
pub(crate) type Owner = u64;

#[inline]
pub(crate) fn owner(slot: Slot, tiers: u8, end: u32) -> Owner {
    u64::from(slot << TIER_BITS | u32::from(tiers)) | u64::from(end) << 32
}

#[inline]
pub(crate) fn owner_slot(o: Owner) -> Slot {
    (o as u32) >> TIER_BITS
}

#[inline]
pub(crate) fn owner_tiers(o: Owner) -> u8 {
    (o as u32 & ((1 << TIER_BITS) - 1)) as u8
}

#[inline]
pub(crate) fn owner_end(o: Owner) -> u32 {
    (o >> 32) as u32
}

/// One run of blocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Node {
    pub start: BlockSlot,
    pub len: u32,
    /// The slot of the parent's last block ([`ROOT_ANCHOR`] for the root's children).
    pub anchor: BlockSlot,
    /// One child kept out of the edge tables ([`ROOT`]: none).
    pub hint: NodeId,
    /// Number of children, or [`FREE`].
    pub children: u32,
    n_owners: u32,
    /// Owners sorted by slot when `n_owners <= INLINE`; else `[offset, capacity]` in the spill.
    owners: [u64; INLINE],
}

const _: () = assert!(std::mem::size_of::<Node>() == 40);

impl Node {
    const fn empty() -> Self {
        Self {
            start: 0,
            len: 0,
            anchor: ROOT_ANCHOR,
            hint: ROOT,
            children: FREE,
            n_owners: 0,
            owners: [0; INLINE],
        }
    }

    pub fn is_live(&self) -> bool {
        self.children != FREE
    }

    pub fn last(&self) -> BlockSlot {
        self.start + self.len - 1
    }
}

/// One (worker, dp rank) as readers see it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PairInfo {
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
    /// Blocks the pair holds.
    pub blocks: u64,
    /// Position among pairs in use, ordered by (worker, rank).
    pub rank: u32,
    pub used: bool,
}

/// Spilled owner lists: power-of-two blocks of one flat array, a free list per size.
#[derive(Debug, Clone, Default)]
struct Spill {
    words: Vec<u64>,
    free: Vec<Vec<u32>>,
}

impl Spill {
    fn alloc(&mut self, cap: usize) -> u32 {
        let class = cap.trailing_zeros() as usize;
        if let Some(off) = self.free.get_mut(class).and_then(Vec::pop) {
            return off;
        }
        let off = self.words.len();
        self.words.resize(off + cap, 0);
        u32::try_from(off).expect("more than 2^32 spilled owner entries")
    }

    fn release(&mut self, off: u32, cap: usize) {
        let class = cap.trailing_zeros() as usize;
        if self.free.len() <= class {
            self.free.resize_with(class + 1, Vec::new);
        }
        self.free[class].push(off);
    }

    fn bytes(&self) -> usize {
        self.words.capacity() * 8 + self.free.iter().map(|f| f.capacity() * 4).sum::<usize>()
    }
}

/// Edge tables (a power of two), chosen by middle bits of the edge hash, so a table resize
/// stalls the writer for a fraction of the edges.
const EDGE_SHARDS: usize = 16;

#[inline]
fn edge_hash(anchor: BlockSlot, tokens_hash: u64) -> u64 {
    mix(tokens_hash ^ (u64::from(anchor) << 32 | u64::from(anchor)))
}

#[inline]
fn shard_of(hash: u64) -> usize {
    (hash >> 40) as usize & (EDGE_SHARDS - 1)
}

#[derive(Debug, Clone)]
pub(crate) struct View {
    pub arena: Arena,
    nodes: Vec<Node>,
    live: usize,
    /// Blocks in live runs.
    blocks: usize,
    spill: Spill,
    edges: Vec<HashTable<NodeId>>,
    pairs: Vec<PairInfo>,
    pairs_used: usize,
    /// Slots in use ordered by (worker, rank); `PairInfo::rank` is the position here.
    order: Vec<Slot>,
}

impl Default for View {
    fn default() -> Self {
        let mut root = Node::empty();
        root.children = 0;
        Self {
            arena: Arena::default(),
            nodes: vec![root],
            live: 0,
            blocks: 0,
            spill: Spill::default(),
            edges: (0..EDGE_SHARDS).map(|_| HashTable::new()).collect(),
            pairs: Vec::new(),
            pairs_used: 0,
            order: Vec::new(),
        }
    }
}

impl View {
    /// Live nodes (runs), not counting the root.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Blocks in the tree (distinct prefixes).
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    #[inline]
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Size of the node table (live and free ids).
    pub fn id_bound(&self) -> usize {
        self.nodes.len()
    }

    /// Every live node other than the root.
    pub fn live_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| n.is_live())
            .map(|(i, _)| i as NodeId)
    }

    /// The owners of `id`, sorted by slot.
    #[inline]
    pub fn owners(&self, id: NodeId) -> &[Owner] {
        let n = &self.nodes[id as usize];
        let len = n.n_owners as usize;
        if len <= INLINE {
            &n.owners[..len]
        } else {
            let off = n.owners[0] as usize;
            &self.spill.words[off..off + len]
        }
    }

    /// The owner entry of `slot` on `id`.
    #[inline]
    pub fn owner_of(&self, id: NodeId, slot: Slot) -> Option<Owner> {
        let owners = self.owners(id);
        owners
            .binary_search_by_key(&slot, |&o| owner_slot(o))
            .ok()
            .map(|i| owners[i])
    }

    /// The block hashes of `id`'s run.
    #[inline]
    pub fn tokens(&self, id: NodeId) -> &[AtomicU64] {
        let n = &self.nodes[id as usize];
        self.arena.run(n.start, n.len)
    }

    /// The anchor that children of `id` carry.
    #[inline]
    pub fn anchor_below(&self, id: NodeId) -> BlockSlot {
        if id == ROOT {
            ROOT_ANCHOR
        } else {
            self.nodes[id as usize].last()
        }
    }

    /// The child of `parent` whose run starts with `tokens_hash`. The hint is checked inline
    /// (the common case on a chain); the edge tables out of line.
    #[inline(always)]
    pub fn child(&self, parent: NodeId, tokens_hash: u64) -> Option<NodeId> {
        let p = &self.nodes[parent as usize];
        if p.children == 0 {
            return None;
        }
        let mut in_table = p.children;
        if p.hint != ROOT {
            if self.arena.get(self.nodes[p.hint as usize].start) == tokens_hash {
                return Some(p.hint);
            }
            in_table -= 1;
        }
        if in_table == 0 {
            return None;
        }
        self.child_in_table(self.anchor_below(parent), tokens_hash)
    }

    #[inline(never)]
    fn child_in_table(&self, anchor: BlockSlot, tokens_hash: u64) -> Option<NodeId> {
        let hash = edge_hash(anchor, tokens_hash);
        let (nodes, arena) = (&self.nodes, &self.arena);
        self.edges[shard_of(hash)]
            .find(hash, |&c| {
                let n = &nodes[c as usize];
                n.anchor == anchor && arena.get(n.start) == tokens_hash
            })
            .copied()
    }

    pub fn pair(&self, slot: Slot) -> &PairInfo {
        &self.pairs[slot as usize]
    }

    /// Pairs in use.
    pub fn pairs_used(&self) -> usize {
        self.pairs_used
    }

    /// Every pair in use: (slot, info), in slot order.
    pub fn pairs(&self) -> impl Iterator<Item = (Slot, &PairInfo)> {
        self.pairs
            .iter()
            .enumerate()
            .filter(|(_, p)| p.used)
            .map(|(i, p)| (i as Slot, p))
    }

    /// Bytes of the view's own tables (the shared arena not included).
    pub fn bytes(&self) -> usize {
        let edges: usize = self.edges.iter().map(HashTable::allocation_size).sum();
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.spill.bytes()
            + edges
            + self.pairs.capacity() * std::mem::size_of::<PairInfo>()
    }

    /// A node other than the root that holds nothing for anyone: no children, and no owner
    /// reaching the end of its run (a leak).
    pub fn has_unused_node(&self) -> bool {
        self.live_ids().any(|id| {
            let n = self.node(id);
            n.children == 0 && self.owners(id).iter().map(|&o| owner_end(o)).max() != Some(n.len)
        })
    }
}
