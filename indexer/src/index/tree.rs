//! The shared prefix tree: an arena of nodes navigated by `tokens_hash`, with each node's
//! owners. It knows nothing of engines' block hashes; `workers.rs` maps those to nodes.
//!
//! *Invariant:* every node other than the root has at least one owner or one child, so a node
//! is freed the moment its last owner leaves and it has no children (and then its parent is
//! checked the same way).

use hashbrown::HashTable;
use smallvec::SmallVec;

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

/// One prefix: the block `tokens_hash` under `parent`.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub tokens_hash: u64,
    /// The parent; on the free list, the next free node.
    pub parent: NodeId,
    /// Number of children, or [`FREE`].
    pub children: u32,
    /// A child to try before the edge table ([`ROOT`]: none). Chains are the common shape and
    /// their nodes are allocated together, so following the hint reads memory the walk is
    /// about to touch anyway, where an edge-table probe is a cache miss.
    pub hint: NodeId,
    /// Owner entries sorted by slot. Four fit inline; more spill to the heap.
    pub owners: SmallVec<[u32; 4]>,
}

const _: () = assert!(std::mem::size_of::<Node>() == 48);

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

/// The arena and its edge table `(parent, tokens_hash) -> child`.
#[derive(Debug, Clone)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free_head: NodeId,
    live: usize,
    /// Child ids, keyed by their node's `(parent, tokens_hash)`, in [`EDGE_SHARDS`] tables
    /// chosen by the hash's top bits, so a table resize (which rehashes through the arena)
    /// stalls a writer, and readers behind it, for 1/64 of the edges only.
    edges: Vec<HashTable<NodeId>>,
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
            nodes: vec![Node {
                tokens_hash: 0,
                parent: ROOT,
                children: 0,
                hint: ROOT,
                owners: SmallVec::new(),
            }],
            free_head: FREE,
            live: 0,
            edges: (0..EDGE_SHARDS).map(|_| HashTable::new()).collect(),
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

    #[inline]
    pub fn child(&self, parent: NodeId, tokens_hash: u64) -> Option<NodeId> {
        let nodes = &self.nodes;
        let p = &nodes[parent as usize];
        if p.children == 0 {
            return None;
        }
        // (parent, tokens_hash) names at most one live node, so a matching hint is the child.
        let h = &nodes[p.hint as usize];
        if p.hint != ROOT
            && h.parent == parent
            && h.tokens_hash == tokens_hash
            && h.children != FREE
        {
            return Some(p.hint);
        }
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
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        if p.hint == ROOT {
            p.hint = id;
        }
        let nodes = &self.nodes;
        let hash = edge_hash(parent, tokens_hash);
        self.edges[shard_of(hash)].insert_unique(hash, id, |&c| {
            let n = &nodes[c as usize];
            edge_hash(n.parent, n.tokens_hash)
        });
        id
    }

    fn alloc(&mut self, parent: NodeId, tokens_hash: u64) -> NodeId {
        self.live += 1;
        let fresh = Node {
            tokens_hash,
            parent,
            children: 0,
            hint: ROOT,
            owners: SmallVec::new(),
        };
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
        let owners = &self.nodes[node as usize].owners;
        match owners.binary_search_by_key(&slot, |&e| owner_slot(e)) {
            Ok(i) => owner_tiers(owners[i]),
            Err(_) => 0,
        }
    }

    /// Sets `slot`'s tier mask on `node` (a mask of 0 drops the owner, and frees the node and
    /// its ancestors if they are left unused). Returns the previous mask.
    pub fn set_tiers(&mut self, node: NodeId, slot: Slot, tiers: u8) -> u8 {
        let owners = &mut self.nodes[node as usize].owners;
        let entry = slot << TIER_BITS | u32::from(tiers);
        let before = match owners.binary_search_by_key(&slot, |&e| owner_slot(e)) {
            Ok(i) => {
                let before = owner_tiers(owners[i]);
                if tiers == 0 {
                    owners.remove(i);
                } else {
                    owners[i] = entry;
                }
                before
            }
            Err(i) => {
                if tiers != 0 {
                    owners.insert(i, entry);
                }
                0
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
            if n.children != 0 || !n.owners.is_empty() {
                return;
            }
            let (parent, tokens_hash) = (n.parent, n.tokens_hash);
            let hash = edge_hash(parent, tokens_hash);
            if let Ok(edge) = self.edges[shard_of(hash)].find_entry(hash, |&c| c == node) {
                edge.remove();
            }
            let freed = &mut self.nodes[node as usize];
            freed.children = FREE;
            freed.parent = self.free_head;
            freed.owners = SmallVec::new();
            self.free_head = node;
            self.live -= 1;
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.hint == node {
                p.hint = ROOT;
            }
            node = parent;
        }
    }

    /// Bytes allocated by the arena, spilled owner lists and the edge table.
    pub fn bytes(&self) -> usize {
        let spilled: usize = self
            .nodes
            .iter()
            .filter(|n| n.owners.spilled())
            .map(|n| n.owners.capacity() * 4)
            .sum();
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
        for shard in &mut tree.edges {
            shard.reserve(nodes.len() / EDGE_SHARDS, |_| 0);
        }
        for (parent, tokens_hash) in nodes {
            let id = tree.nodes.len() as NodeId;
            if parent >= id {
                return Err("node parent does not precede it");
            }
            if tree.child(parent, tokens_hash).is_some() {
                return Err("duplicate node under one parent");
            }
            tree.nodes.push(Node {
                tokens_hash,
                parent,
                children: 0,
                hint: ROOT,
                owners: SmallVec::new(),
            });
            tree.live += 1;
            tree.nodes[parent as usize].children += 1;
            let nodes = &tree.nodes;
            let hash = edge_hash(parent, tokens_hash);
            tree.edges[shard_of(hash)].insert_unique(hash, id, |&c| {
                let n = &nodes[c as usize];
                edge_hash(n.parent, n.tokens_hash)
            });
        }
        Ok(tree)
    }

    /// Appends an owner entry to `node` during a restore; entries must come in slot order.
    pub fn push_owner_sorted(&mut self, node: NodeId, slot: Slot, tiers: u8) -> bool {
        let owners = &mut self.nodes[node as usize].owners;
        if owners.last().is_some_and(|&e| owner_slot(e) >= slot) {
            return false;
        }
        owners.push(slot << TIER_BITS | u32::from(tiers));
        true
    }

    /// True if some node other than the root has neither owners nor children (a leak).
    pub fn has_unused_node(&self) -> bool {
        self.live_ids().any(|id| {
            let n = self.node(id);
            n.children == 0 && n.owners.is_empty()
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
}
