//! A 64-bit digest of the logical state, so replicas can prove they agree.
//!
//! The state is the set of facts `(worker, dp rank, block hash, block path, tiers)`, where the
//! block path is the chain of `tokens_hash` from the root. Each fact is hashed on its own with
//! XXH3-64 and the hashes are added (wrapping), so the digest depends neither on the order
//! events arrived in nor on node ids, slot numbers, runs or table layout: every layout of the
//! index so far computes the same value for the same state.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::arena::{BlockSlot, CHUNK, ROOT_ANCHOR};
use super::blockmap::BlockMap;
use super::core::Core;
use super::radix::RadixIndex;
use super::view::{NodeId, ROOT, Slot, View, owner_end, owner_tiers};

/// Path hash of the root (the empty path).
const EMPTY_PATH: u64 = 0x6b76_726f_7574_6500;

/// The maps of the pairs, wherever they are kept (the writer's side, or a pin's copies).
pub(crate) trait Maps {
    fn map(&self, slot: Slot) -> Option<&BlockMap>;
}

impl Maps for Core {
    fn map(&self, slot: Slot) -> Option<&BlockMap> {
        self.pair(slot).map(|p| &p.map)
    }
}

impl Maps for [Option<BlockMap>] {
    fn map(&self, slot: Slot) -> Option<&BlockMap> {
        self.get(slot as usize)?.as_ref()
    }
}

/// Each arena slot's node, computed from a view (a pinned view has no writer's table).
pub(crate) fn node_table(view: &View) -> Vec<NodeId> {
    let mut table = vec![ROOT; view.arena.chunks() * CHUNK];
    for id in view.live_ids() {
        let n = view.node(id);
        table[n.start as usize..(n.start + n.len) as usize].fill(id);
    }
    table
}

/// The parent of a live node.
pub(crate) fn parent_in(view: &View, table: &[NodeId], id: NodeId) -> NodeId {
    match view.node(id).anchor {
        ROOT_ANCHOR => ROOT,
        a => table[a as usize],
    }
}

/// The path hash of every block, by arena slot.
fn path_hashes(view: &View, table: &[NodeId]) -> Vec<u64> {
    let mut path = vec![0u64; table.len()];
    let mut known = vec![false; view.id_bound()];
    known[ROOT as usize] = true;
    let mut stack = Vec::new();
    let end_hash = |path: &[u64], id: NodeId| {
        if id == ROOT {
            EMPTY_PATH
        } else {
            path[view.node(id).last() as usize]
        }
    };
    for id in view.live_ids() {
        let mut n = id;
        while !known[n as usize] {
            stack.push(n);
            n = parent_in(view, table, n);
        }
        while let Some(m) = stack.pop() {
            let mut prev = end_hash(&path, parent_in(view, table, m));
            let node = view.node(m);
            for (i, t) in view.tokens(m).iter().enumerate() {
                let mut buf = [0u8; 16];
                buf[..8].copy_from_slice(&prev.to_le_bytes());
                buf[8..]
                    .copy_from_slice(&t.load(std::sync::atomic::Ordering::Relaxed).to_le_bytes());
                prev = xxh3_64_with_seed(&buf, EMPTY_PATH);
                path[(node.start + i as BlockSlot) as usize] = prev;
            }
            known[m as usize] = true;
        }
    }
    path
}

/// The digest of the state `view` and `maps` hold together (see the module docs).
pub(crate) fn digest_of(view: &View, maps: &(impl Maps + ?Sized)) -> u64 {
    let table = node_table(view);
    let path = path_hashes(view, &table);
    let mut sum = 0u64;
    for (slot, pair) in view.pairs() {
        let Some(map) = maps.map(slot) else {
            continue;
        };
        for (block_hash, loc, _) in map.iter() {
            let node = table[loc as usize];
            let o = view.owner_of(node, slot).expect("a named block is held");
            debug_assert!(loc - view.node(node).start < owner_end(o));
            let mut fact = [0u8; 29];
            fact[..8].copy_from_slice(&pair.worker_id.to_le_bytes());
            fact[8..12].copy_from_slice(&pair.dp_rank.to_le_bytes());
            fact[12..20].copy_from_slice(&block_hash.to_le_bytes());
            fact[20..28].copy_from_slice(&path[loc as usize].to_le_bytes());
            fact[28] = owner_tiers(o);
            sum = sum.wrapping_add(xxh3_64(&fact));
        }
    }
    sum
}

impl RadixIndex {
    /// The digest of the logical state (see the module docs). Equal states give equal digests
    /// whatever the history; O(entries + blocks).
    pub fn digest(&self) -> u64 {
        digest_of(&self.view, &self.core)
    }
}
