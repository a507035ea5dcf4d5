//! Snapshots: the whole index as versioned bytes, and back.
//!
//! Format v1, all integers little-endian:
//! `"KVRIDX\0\0"`, version `u32`, config (`max_entries` `u64`, 0 = none; `write_chunk_events`
//! `u64`), the anomaly counters (7 × `u64`), the next eviction stamp `u32`; nodes (`u64`
//! count, then per node its parent `u32` and `tokens_hash` `u64`, parents before children,
//! ids from 1; written in depth-first preorder, so a chain restores into consecutive ids);
//! (worker, rank) pairs (`u64` count, then per pair `worker_id` `u64`, `dp_rank` `u32`, entry
//! count `u64`, and per entry `block_hash` `u64`, node `u32`, tiers `u8`, stamp `u32`); and
//! last an XXH3-64 of everything before it. Restore checks every invariant the
//! index relies on, so corrupt bytes give an error, never a broken index.

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

use super::config::{ConfigError, IndexConfig};
use super::eviction::{EvictionQueue, Queued};
use super::radix::RadixIndex;
use super::stats::Anomalies;
use super::tree::{NodeId, ROOT, Tree, mix};
use super::workers::{Entry, Workers};

const MAGIC: &[u8; 8] = b"KVRIDX\0\0";
/// The snapshot format this build writes and the newest it reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Why bytes could not be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("not an index snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot version {found} is newer than this build reads ({SNAPSHOT_VERSION})")]
    UnsupportedVersion { found: u32 },
    #[error("snapshot truncated")]
    Truncated,
    #[error("snapshot checksum mismatch")]
    ChecksumMismatch,
    #[error("snapshot corrupt: {detail}")]
    Corrupt { detail: &'static str },
    #[error("snapshot config invalid: {0}")]
    Config(#[from] ConfigError),
}

fn corrupt(detail: &'static str) -> SnapshotError {
    SnapshotError::Corrupt { detail }
}

struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let end = self.at.checked_add(N).ok_or(SnapshotError::Truncated)?;
        let s = self
            .bytes
            .get(self.at..end)
            .ok_or(SnapshotError::Truncated)?;
        self.at = end;
        Ok(s.try_into().expect("length checked"))
    }
    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// A count of items of at least `min_bytes` each, checked against the bytes left.
    fn count(&mut self, min_bytes: usize) -> Result<usize, SnapshotError> {
        let n = usize::try_from(self.u64()?).map_err(|_| SnapshotError::Truncated)?;
        let left = self.bytes.len() - self.at;
        if n.checked_mul(min_bytes).is_none_or(|b| b > left) {
            return Err(SnapshotError::Truncated);
        }
        Ok(n)
    }
}

fn anomalies_fields(a: &mut Anomalies) -> [&mut u64; 7] {
    [
        &mut a.parent_unknown_events,
        &mut a.parent_unknown_blocks,
        &mut a.removed_unknown_blocks,
        &mut a.duplicate_stored_blocks,
        &mut a.rebound_blocks,
        &mut a.aliased_blocks,
        &mut a.evicted_entries,
    ]
}

impl RadixIndex {
    /// The whole index as versioned bytes (format in the module docs). O(entries + nodes).
    pub fn snapshot(&self) -> Vec<u8> {
        // Renumber live nodes in depth-first preorder: parents come before their children (the
        // format's rule), and a chain's nodes get consecutive ids, so the arena a restore
        // builds keeps each chain's nodes adjacent, as a live index's are. (Ordered by depth,
        // every block of a walk was a cache miss: queries on a restored index ran ~10x slower.)
        let bound = self.tree.id_bound();
        // Each node's children as a range of one array, from the parent links.
        let mut first = vec![0u32; bound + 1];
        for id in self.tree.live_ids() {
            first[self.tree.node(id).parent as usize + 1] += 1;
        }
        for i in 1..first.len() {
            first[i] += first[i - 1];
        }
        let mut kids = vec![ROOT; self.tree.len()];
        let mut next = first.clone();
        for id in self.tree.live_ids() {
            let p = self.tree.node(id).parent as usize;
            kids[next[p] as usize] = id;
            next[p] += 1;
        }
        drop(next);
        let mut order = Vec::with_capacity(self.tree.len() + 1);
        order.push(ROOT);
        let mut new_id = vec![0 as NodeId; bound];
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            if n != ROOT {
                new_id[n as usize] = order.len() as NodeId;
                order.push(n);
            }
            let children = &kids[first[n as usize] as usize..first[n as usize + 1] as usize];
            stack.extend(children.iter().rev());
        }
        drop((first, kids, stack));
        debug_assert_eq!(order.len(), self.tree.len() + 1, "every live node once");

        // Exactly sized: a reallocation of a buffer this large (a copy, and page faults on
        // fresh memory) also stalls the index's writer thread in the kernel.
        let size = 8
            + 4
            + 16
            + 7 * 8
            + 4
            + 8
            + self.tree.len() * 12
            + 8
            + self.workers.len() * 20
            + self.entries * 17
            + 8;
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        let cap = self.config.max_entries.map_or(0, |c| c as u64);
        out.extend_from_slice(&cap.to_le_bytes());
        out.extend_from_slice(&(self.config.write_chunk_events as u64).to_le_bytes());
        let mut anomalies = self.anomalies;
        for field in anomalies_fields(&mut anomalies) {
            out.extend_from_slice(&field.to_le_bytes());
        }
        out.extend_from_slice(&self.queue.next_stamp().to_le_bytes());
        out.extend_from_slice(&(self.tree.len() as u64).to_le_bytes());
        for &id in &order[1..] {
            let n = self.tree.node(id);
            out.extend_from_slice(&new_id[n.parent as usize].to_le_bytes());
            out.extend_from_slice(&n.tokens_hash.to_le_bytes());
        }
        out.extend_from_slice(&(self.workers.len() as u64).to_le_bytes());
        for (slot, sb) in self.workers.iter() {
            out.extend_from_slice(&sb.worker_id.to_le_bytes());
            out.extend_from_slice(&sb.dp_rank.to_le_bytes());
            out.extend_from_slice(&(sb.blocks.len() as u64).to_le_bytes());
            for e in sb.blocks.iter() {
                out.extend_from_slice(&e.block_hash.to_le_bytes());
                out.extend_from_slice(&new_id[e.node as usize].to_le_bytes());
                out.push(self.tree.tiers_of(e.node, slot));
                out.extend_from_slice(&e.stamp.to_le_bytes());
            }
        }
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        debug_assert_eq!(out.len(), size, "snapshot size");
        out
    }

    /// Rebuilds an index from [`Self::snapshot`] bytes. It answers every query, and has the
    /// same digest, stats counters and eviction order, as the index that wrote them.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        if bytes.len() < MAGIC.len() + 4 || &bytes[..MAGIC.len()] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version > SNAPSHOT_VERSION || version == 0 {
            return Err(SnapshotError::UnsupportedVersion { found: version });
        }
        let body_len = bytes.len().checked_sub(8).ok_or(SnapshotError::Truncated)?;
        let (body, sum) = bytes.split_at(body_len);
        if body_len < 12 {
            return Err(SnapshotError::Truncated);
        }
        if xxh3_64(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(SnapshotError::ChecksumMismatch);
        }
        let mut r = Reader {
            bytes: body,
            at: 12,
        };

        let cap = r.u64()?;
        let config = IndexConfig {
            max_entries: (cap != 0).then_some(usize::try_from(cap).unwrap_or(usize::MAX)),
            write_chunk_events: usize::try_from(r.u64()?).unwrap_or(usize::MAX),
        };
        config.validate()?;
        let mut anomalies = Anomalies::default();
        for field in anomalies_fields(&mut anomalies) {
            *field = r.u64()?;
        }
        let next_stamp = r.u32()?;

        let node_count = r.count(12)?;
        if node_count >= u32::MAX as usize {
            return Err(corrupt("too many nodes"));
        }
        let mut parents = Vec::with_capacity(node_count);
        for _ in 0..node_count {
            parents.push((r.u32()?, r.u64()?));
        }
        let mut tree = Tree::from_parents(parents.into_iter()).map_err(corrupt)?;

        let pair_count = r.count(20)?;
        let mut workers = Workers::default();
        let mut entries = 0usize;
        let mut queued = Vec::new();
        for _ in 0..pair_count {
            let (worker_id, dp_rank) = (r.u64()?, r.u32()?);
            let n = r.count(17)?;
            if n == 0 {
                return Err(corrupt("a worker holding nothing"));
            }
            let mut blocks = HashTable::with_capacity(n);
            let mut raw = Vec::with_capacity(n);
            for _ in 0..n {
                let e = Entry {
                    block_hash: r.u64()?,
                    node: r.u32()?,
                    stamp: 0,
                };
                let tiers = r.u8()?;
                let e = Entry {
                    stamp: r.u32()?,
                    ..e
                };
                if e.node == ROOT || e.node as usize > node_count {
                    return Err(corrupt("entry names no node"));
                }
                if tiers == 0 || tiers > 7 {
                    return Err(corrupt("entry with invalid tiers"));
                }
                let hash = mix(e.block_hash);
                if blocks
                    .find(hash, |x: &Entry| x.block_hash == e.block_hash)
                    .is_some()
                {
                    return Err(corrupt("one block hash twice for a worker"));
                }
                blocks.insert_unique(hash, e, |x| mix(x.block_hash));
                raw.push((e, tiers));
            }
            let slot = workers
                .push_restored(worker_id, dp_rank, blocks)
                .ok_or(corrupt("one (worker, rank) twice"))?;
            for (e, tiers) in raw {
                if !tree.push_owner_sorted(e.node, slot, tiers) {
                    return Err(corrupt("a worker holds one block under two hashes"));
                }
                if config.max_entries.is_some() {
                    queued.push(Queued {
                        block_hash: e.block_hash,
                        slot,
                        stamp: e.stamp,
                    });
                }
            }
            entries += n;
        }
        workers.finish_restore();
        if r.at != body.len() {
            return Err(corrupt("trailing bytes"));
        }
        if tree.has_unused_node() {
            return Err(corrupt("a node with neither owners nor children"));
        }
        Ok(Self {
            config,
            tree,
            workers,
            entries,
            queue: EvictionQueue::rebuild(queued, next_stamp),
            anomalies,
        })
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};

    use super::*;

    /// Stores a chain of `len` blocks from the root on `worker` (hashes `first..first + len`).
    fn store_chain(ix: &mut RadixIndex, worker: u64, first: u64, len: u64) {
        let blocks = (first..first + len)
            .map(|h| StoredBlock {
                block_hash: h,
                tokens_hash: h,
            })
            .collect();
        let stored = KvEventData::Stored {
            parent_hash: None,
            blocks,
            tier: StorageTier::Device,
        };
        ix.apply(worker, 0, &stored).unwrap();
    }

    #[test]
    fn a_restored_chain_has_consecutive_node_ids() {
        let mut ix = RadixIndex::new(IndexConfig::default());
        // Two chains from the root: numbered by depth, their nodes would alternate.
        store_chain(&mut ix, 1, 1_000, 50);
        store_chain(&mut ix, 2, 5_000, 50);
        let restored = RadixIndex::restore(&ix.snapshot()).unwrap();
        assert_eq!(restored.digest(), ix.digest());
        for first in [1_000u64, 5_000] {
            let mut node = ROOT;
            let ids: Vec<NodeId> = (first..first + 50)
                .map(|h| {
                    node = restored.tree.child(node, h).expect("the chain is restored");
                    node
                })
                .collect();
            assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
        }
    }
}
