//! The shared prefix tree: an arena of nodes navigated by `tokens_hash`, with each node's
//! owners. It knows nothing of engines' block hashes; `workers.rs` maps those to nodes.
//!
//! *Invariant:* every node other than the root has at least one owner or one child, so a node
//! is freed the moment its last owner leaves and it has no children (and then its parent is
//! checked the same way).

use hashbrown::HashTable;

/// An index into the node arena.
pub(crate) type NodeId = u32;

/// The root: the empty prefix. It has no owners and is never freed.
pub(crate) const ROOT: NodeId = 0;

/// The slot number of a (worker, dp rank); see `workers.rs`.
pub(crate) type Slot = u32;

/// Owner entries are `slot << TIER_BITS | tier mask`.
pub(crate) const TIER_BITS: u32 = 3;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;

/// Largest slot number an owner entry can carry.
pub(crate) const MAX_SLOTS: usize = 1 << (32 - TIER_BITS);

/// `children` of a node on the free list.
const FREE: u32 = u32::MAX;

/// Owner entries stored in the node itself; a node with more keeps them in the tree's spill
/// arena (most nodes have one or two owners, and a 32-byte node puts two in a cache line).
const INLINE: usize = 2;

/// One prefix: the block `tokens_hash` under `parent`.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub tokens_hash: u64,
    /// The parent; on the free list, the next free node.
    pub parent: NodeId,
    /// Number of children, or [`FREE`].
    pub children: u32,
    /// One child, kept out of the edge table ([`ROOT`]: none). Chains are the common shape, so
    /// most nodes' only child is their hint: finding, adding and freeing it reads memory the
    /// walk touches anyway, where an edge-table probe, insert or removal is a cache miss.
    pub hint: NodeId,
    /// Number of owner entries.
    n_owners: u32,
    /// Owner entries sorted by slot when `n_owners <= INLINE`; otherwise `[offset, capacity]`
    /// of the node's list in `Tree::spill`.
    inline: [u32; INLINE],
}

const _: () = assert!(std::mem::size_of::<Node>() == 32);

impl Node {
    fn fresh(parent: NodeId, tokens_hash: u64) -> Self {
        Self {
            tokens_hash,
            parent,
            children: 0,
            hint: ROOT,
            n_owners: 0,
            inline: [0; INLINE],
        }
    }

    #[inline]
    fn has_owners(&self) -> bool {
        self.n_owners != 0
    }
}

/// Owner entry helpers.
#[inline]
pub(crate) fn owner_slot(entry: u32) -> Slot {
    entry >> TIER_BITS
}

#[inline]
pub(crate) fn owner_tiers(entry: u32) -> u8 {
    (entry & TIER_MASK) as u8
}

/// A fast 64-bit mixer for keys that are already hashes (folded 128-bit multiply).
#[inline]
pub(crate) fn mix(x: u64) -> u64 {
    let m = (x as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (m as u64) ^ ((m >> 64) as u64)
}

#[inline]
fn edge_hash(parent: NodeId, tokens_hash: u64) -> u64 {
    mix(tokens_hash ^ (u64::from(parent) << 32 | u64::from(parent)))
}

/// The arena and its edge table `(parent, tokens_hash) -> child` (for children other than
/// their parent's hint).
#[derive(Debug, Clone)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free_head: NodeId,
    live: usize,
    /// Child ids other than hints, keyed by their node's `(parent, tokens_hash)`, in
    /// [`EDGE_SHARDS`] tables
    /// chosen by the hash's top bits, so a table resize (which rehashes through the arena)
    /// stalls a writer, and readers behind it, for 1/64 of the edges only.
    edges: Vec<HashTable<NodeId>>,
    /// Owner lists of nodes with more than [`INLINE`] owners (sorted by slot).
    spill: Spill,
}

/// One flat arena for spilled owner lists (so reaching a list from its node is one memory
/// read, as with a heap pointer), in blocks of power-of-two capacity with a free list per
/// capacity.
#[derive(Debug, Clone, Default)]
struct Spill {
    words: Vec<u32>,
    free: Vec<Vec<u32>>,
}

impl Spill {
    /// A block of `cap` (a power of two) words; returns its offset.
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

    /// Stores a list of `INLINE + 1` entries in a fresh block; returns `[offset, capacity]`.
    fn spill(&mut self, list: [u32; INLINE + 1]) -> [u32; INLINE] {
        let cap = 2 * INLINE;
        let off = self.alloc(cap);
        self.words[off as usize..off as usize + INLINE + 1].copy_from_slice(&list);
        [off, cap as u32]
    }

    /// Makes room for one more entry in a full block; returns the new `[offset, capacity]`.
    fn grow(&mut self, off: u32, cap: usize) -> [u32; INLINE] {
        let new = self.alloc(2 * cap);
        let o = off as usize;
        self.words.copy_within(o..o + cap, new as usize);
        self.release(off, cap);
        [new, 2 * cap as u32]
    }

    fn bytes(&self) -> usize {
        self.words.capacity() * 4
            + self.free.iter().map(|f| f.capacity() * 4).sum::<usize>()
            + self.free.capacity() * std::mem::size_of::<Vec<u32>>()
    }
}

/// Edge tables (a power of two).
const EDGE_SHARDS: usize = 64;

/// Middle bits: hashbrown takes bucket positions from the low bits and its control byte from
/// the top seven, so neither is skewed within a shard.
#[inline]
fn shard_of(hash: u64) -> usize {
    (hash >> 40) as usize & (EDGE_SHARDS - 1)
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

impl Tree {
    pub fn new() -> Self {
        Self {
            nodes: vec![Node::fresh(ROOT, 0)],
            free_head: FREE,
            live: 0,
            edges: (0..EDGE_SHARDS).map(|_| HashTable::new()).collect(),
            spill: Spill::default(),
        }
    }

    /// Live nodes, not counting the root.
    pub fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// The owner entries of `id`, sorted by slot.
    #[inline]
    pub fn owners(&self, id: NodeId) -> &[u32] {
        let n = &self.nodes[id as usize];
        let len = n.n_owners as usize;
        if len <= INLINE {
            &n.inline[..len]
        } else {
            let off = n.inline[0] as usize;
            &self.spill.words[off..off + len]
        }
    }

    /// Every live node id other than the root, in arena order.
    pub fn live_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| n.children != FREE)
            .map(|(i, _)| i as NodeId)
    }

    /// Size of the arena (live and free ids), for dense side tables.
    pub fn id_bound(&self) -> usize {
        self.nodes.len()
    }

    /// The child of `parent` for `tokens_hash`. The hint is checked inline (the common case on
    /// a chain: one read of a node the walk touches anyway); the edge table out of line, so
    /// this stays small enough to inline into the query walk.
    #[inline(always)]
    pub fn child(&self, parent: NodeId, tokens_hash: u64) -> Option<NodeId> {
        let nodes = &self.nodes;
        let p = &nodes[parent as usize];
        if p.children == 0 {
            return None;
        }
        // (parent, tokens_hash) names at most one live node, so a matching hint is the child.
        let mut in_table = p.children;
        if p.hint != ROOT {
            let h = &nodes[p.hint as usize];
            debug_assert!(h.parent == parent && h.children != FREE);
            if h.tokens_hash == tokens_hash {
                return Some(p.hint);
            }
            in_table -= 1;
        }
        if in_table == 0 {
            return None;
        }
        self.child_in_table(parent, tokens_hash)
    }

    /// The edge-table part of [`Self::child`].
    #[inline(never)]
    fn child_in_table(&self, parent: NodeId, tokens_hash: u64) -> Option<NodeId> {
        let nodes = &self.nodes;
        let hash = edge_hash(parent, tokens_hash);
        self.edges[shard_of(hash)]
            .find(hash, |&c| {
                let n = &nodes[c as usize];
                n.tokens_hash == tokens_hash && n.parent == parent
            })
            .copied()
    }

    /// The child of `parent` for `tokens_hash`, created (without owners) if missing. The caller
    /// must give the new node an owner or a child before the next release.
    pub fn child_or_insert(&mut self, parent: NodeId, tokens_hash: u64) -> NodeId {
        if let Some(c) = self.child(parent, tokens_hash) {
            return c;
        }
        let id = self.alloc(parent, tokens_hash);
        self.link(parent, id, tokens_hash);
        id
    }

    /// Counts `id` as a child of `parent`: as its hint if it has none, else in the edge table.
    fn link(&mut self, parent: NodeId, id: NodeId, tokens_hash: u64) {
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        if p.hint == ROOT {
            p.hint = id;
            return;
        }
        let nodes = &self.nodes;
        let hash = edge_hash(parent, tokens_hash);
        self.edges[shard_of(hash)].insert_unique(hash, id, |&c| {
            let n = &nodes[c as usize];
            edge_hash(n.parent, n.tokens_hash)
        });
    }

    fn alloc(&mut self, parent: NodeId, tokens_hash: u64) -> NodeId {
        self.live += 1;
        let fresh = Node::fresh(parent, tokens_hash);
        if self.free_head != FREE {
            let id = self.free_head;
            self.free_head = self.nodes[id as usize].parent;
            self.nodes[id as usize] = fresh;
            id
        } else {
            let id = NodeId::try_from(self.nodes.len()).expect("more than 2^32 nodes");
            self.nodes.push(fresh);
            id
        }
    }

    /// Tier mask `slot` holds on `node` (0: none).
    #[inline]
    pub fn tiers_of(&self, node: NodeId, slot: Slot) -> u8 {
        let owners = self.owners(node);
        match owners.binary_search_by_key(&slot, |&e| owner_slot(e)) {
            Ok(i) => owner_tiers(owners[i]),
            Err(_) => 0,
        }
    }

    /// Sets `slot`'s tier mask on `node` (a mask of 0 drops the owner, and frees the node and
    /// its ancestors if they are left unused). Returns the previous mask.
    pub fn set_tiers(&mut self, node: NodeId, slot: Slot, tiers: u8) -> u8 {
        let entry = slot << TIER_BITS | u32::from(tiers);
        let n = &mut self.nodes[node as usize];
        let len = n.n_owners as usize;
        let before = if len <= INLINE {
            match n.inline[..len].binary_search_by_key(&slot, |&e| owner_slot(e)) {
                Ok(i) => {
                    let before = owner_tiers(n.inline[i]);
                    if tiers == 0 {
                        n.inline.copy_within(i + 1..len, i);
                        n.n_owners -= 1;
                    } else {
                        n.inline[i] = entry;
                    }
                    before
                }
                Err(i) => {
                    if tiers != 0 {
                        if len < INLINE {
                            n.inline.copy_within(i..len, i + 1);
                            n.inline[i] = entry;
                        } else {
                            let mut list = [0; INLINE + 1];
                            list[..i].copy_from_slice(&n.inline[..i]);
                            list[i] = entry;
                            list[i + 1..].copy_from_slice(&n.inline[i..]);
                            n.inline = self.spill.spill(list);
                        }
                        n.n_owners += 1;
                    }
                    0
                }
            }
        } else {
            let [mut off, cap] = n.inline;
            let o = off as usize;
            match self.spill.words[o..o + len].binary_search_by_key(&slot, |&e| owner_slot(e)) {
                Ok(i) => {
                    let before = owner_tiers(self.spill.words[o + i]);
                    if tiers == 0 {
                        self.spill.words.copy_within(o + i + 1..o + len, o + i);
                        n.n_owners -= 1;
                        if n.n_owners as usize == INLINE {
                            n.inline.copy_from_slice(&self.spill.words[o..o + INLINE]);
                            self.spill.release(off, cap as usize);
                        }
                    } else {
                        self.spill.words[o + i] = entry;
                    }
                    before
                }
                Err(i) => {
                    if tiers != 0 {
                        if len == cap as usize {
                            n.inline = self.spill.grow(off, cap as usize);
                            off = n.inline[0];
                        }
                        let o = off as usize;
                        self.spill.words.copy_within(o + i..o + len, o + i + 1);
                        self.spill.words[o + i] = entry;
                        n.n_owners += 1;
                    }
                    0
                }
            }
        };
        if tiers == 0 && before != 0 {
            self.release(node);
        }
        before
    }

    /// Frees `node` if it has no owners and no children, then its parent likewise.
    pub fn release(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &self.nodes[node as usize];
            if n.children != 0 || n.has_owners() {
                return;
            }
            let (parent, tokens_hash) = (n.parent, n.tokens_hash);
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.hint == node {
                p.hint = ROOT;
            } else {
                let hash = edge_hash(parent, tokens_hash);
                if let Ok(edge) = self.edges[shard_of(hash)].find_entry(hash, |&c| c == node) {
                    edge.remove();
                }
            }
            let freed = &mut self.nodes[node as usize];
            freed.children = FREE;
            freed.parent = self.free_head;
            self.free_head = node;
            self.live -= 1;
            node = parent;
        }
    }

    /// Bytes allocated by the arena, spilled owner lists and the edge table.
    pub fn bytes(&self) -> usize {
        let spilled = self.spill.bytes();
        let edges: usize = self.edges.iter().map(HashTable::allocation_size).sum();
        self.nodes.capacity() * std::mem::size_of::<Node>() + spilled + edges
    }

    /// Rebuilds a tree from `(parent, tokens_hash)` pairs where every parent precedes its
    /// children (ids are positions + 1). Fails on a forward parent or a duplicate edge.
    pub fn from_parents(
        nodes: impl ExactSizeIterator<Item = (NodeId, u64)>,
    ) -> Result<Self, &'static str> {
        let mut tree = Self::new();
        tree.nodes.reserve_exact(nodes.len());
        for (parent, tokens_hash) in nodes {
            let id = tree.nodes.len() as NodeId;
            if parent >= id {
                return Err("node parent does not precede it");
            }
            if tree.child(parent, tokens_hash).is_some() {
                return Err("duplicate node under one parent");
            }
            tree.nodes.push(Node::fresh(parent, tokens_hash));
            tree.live += 1;
            tree.link(parent, id, tokens_hash);
        }
        Ok(tree)
    }

    /// Appends an owner entry to `node` during a restore; entries must come in slot order.
    pub fn push_owner_sorted(&mut self, node: NodeId, slot: Slot, tiers: u8) -> bool {
        if self
            .owners(node)
            .last()
            .is_some_and(|&e| owner_slot(e) >= slot)
        {
            return false;
        }
        let entry = slot << TIER_BITS | u32::from(tiers);
        let n = &mut self.nodes[node as usize];
        let len = n.n_owners as usize;
        if len < INLINE {
            n.inline[len] = entry;
        } else if len == INLINE {
            let mut list = [entry; INLINE + 1];
            list[..INLINE].copy_from_slice(&n.inline);
            n.inline = self.spill.spill(list);
        } else {
            if len == n.inline[1] as usize {
                n.inline = self.spill.grow(n.inline[0], len);
            }
            self.spill.words[n.inline[0] as usize + len] = entry;
        }
        n.n_owners += 1;
        true
    }

    /// True if some node other than the root has neither owners nor children (a leak).
    pub fn has_unused_node(&self) -> bool {
        self.live_ids().any(|id| {
            let n = self.node(id);
            n.children == 0 && !n.has_owners()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releasing_the_last_owner_frees_the_unused_chain() {
        let mut t = Tree::new();
        let a = t.child_or_insert(ROOT, 1);
        let b = t.child_or_insert(a, 2);
        t.set_tiers(b, 7, 1);
        assert_eq!(t.len(), 2);
        assert_eq!(t.child(a, 2), Some(b));
        t.set_tiers(b, 7, 0);
        assert_eq!(t.len(), 0);
        assert_eq!(t.child(ROOT, 1), None);
        // Freed ids are reused.
        let c = t.child_or_insert(ROOT, 3);
        assert!(c == a || c == b);
        t.set_tiers(c, 1, 2);
        assert_eq!(t.tiers_of(c, 1), 2);
        assert!(!t.has_unused_node());
    }

    #[test]
    fn a_node_with_children_outlives_its_owners() {
        let mut t = Tree::new();
        let a = t.child_or_insert(ROOT, 1);
        t.set_tiers(a, 0, 1);
        let b = t.child_or_insert(a, 2);
        t.set_tiers(b, 0, 1);
        t.set_tiers(a, 0, 0);
        assert_eq!(t.len(), 2);
        t.set_tiers(b, 0, 0);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn owner_lists_spill_and_come_back_inline() {
        let mut t = Tree::new();
        let a = t.child_or_insert(ROOT, 1);
        for slot in [5, 1, 9, 3, 7] {
            t.set_tiers(a, slot, 1);
        }
        let slots: Vec<_> = t.owners(a).iter().map(|&e| owner_slot(e)).collect();
        assert_eq!(slots, [1, 3, 5, 7, 9]);
        for slot in [1, 9, 5] {
            assert_eq!(t.set_tiers(a, slot, 0), 1);
        }
        let slots: Vec<_> = t.owners(a).iter().map(|&e| owner_slot(e)).collect();
        assert_eq!(slots, [3, 7]);
        assert_eq!(t.tiers_of(a, 7), 1);
        t.set_tiers(a, 7, 6);
        assert_eq!(t.tiers_of(a, 7), 6);
        t.set_tiers(a, 3, 0);
        t.set_tiers(a, 7, 0);
        assert_eq!(t.len(), 0);
        let b = t.child_or_insert(ROOT, 2);
        for slot in 0..4 {
            assert!(t.push_owner_sorted(b, slot, 1));
        }
        assert!(!t.push_owner_sorted(b, 2, 1));
        assert_eq!(t.owners(b).len(), 4);
    }
}
