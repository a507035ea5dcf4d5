//! A 64-bit digest of the logical state, so replicas can prove they agree.
//!
//! The state is the set of facts `(worker, dp rank, block hash, block path, tiers)`, where the
//! block path is the chain of `tokens_hash` from the root. Each fact is hashed on its own with
//! XXH3-64 and the hashes are added (wrapping), so the digest depends neither on the order
//! events arrived in nor on node ids, slot numbers or table layout.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::radix::RadixIndex;
use super::tree::{NodeId, ROOT, Tree};

/// Path hash of the root (the empty path).
const EMPTY_PATH: u64 = 0x6b76_726f_7574_6500;

/// Path hashes of every node, computed top-down on demand.
struct PathHashes<'t> {
    tree: &'t Tree,
    memo: Vec<u64>,
    known: Vec<bool>,
    stack: Vec<NodeId>,
}

impl<'t> PathHashes<'t> {
    fn new(tree: &'t Tree) -> Self {
        let n = tree.id_bound();
        let mut memo = vec![0; n];
        let mut known = vec![false; n];
        memo[ROOT as usize] = EMPTY_PATH;
        known[ROOT as usize] = true;
        Self {
            tree,
            memo,
            known,
            stack: Vec::new(),
        }
    }

    fn of(&mut self, node: NodeId) -> u64 {
        let mut n = node;
        while !self.known[n as usize] {
            self.stack.push(n);
            n = self.tree.node(n).parent;
        }
        while let Some(m) = self.stack.pop() {
            let parent = self.memo[self.tree.node(m).parent as usize];
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&parent.to_le_bytes());
            buf[8..].copy_from_slice(&self.tree.node(m).tokens_hash.to_le_bytes());
            self.memo[m as usize] = xxh3_64_with_seed(&buf, EMPTY_PATH);
            self.known[m as usize] = true;
        }
        self.memo[node as usize]
    }
}

impl RadixIndex {
    /// The digest of the logical state (see the module docs). Equal states give equal digests
    /// whatever the history; O(entries + nodes).
    pub fn digest(&self) -> u64 {
        let mut paths = PathHashes::new(&self.tree);
        let mut sum = 0u64;
        for (slot, sb) in self.workers.iter() {
            for e in sb.blocks.iter() {
                let mut fact = [0u8; 29];
                fact[..8].copy_from_slice(&sb.worker_id.to_le_bytes());
                fact[8..12].copy_from_slice(&sb.dp_rank.to_le_bytes());
                fact[12..20].copy_from_slice(&e.block_hash.to_le_bytes());
                fact[20..28].copy_from_slice(&paths.of(e.node).to_le_bytes());
                fact[28] = self.tree.tiers_of(e.node, slot);
                sum = sum.wrapping_add(xxh3_64(&fact));
            }
        }
        sum
    }
}
