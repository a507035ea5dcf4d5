//! Snapshots: the whole index as versioned bytes, and back.
//!
//! Format v3 is v2 whose owner tier masks may carry the shared tier (bit 3, so up to 15);
//! this build writes v3 only when some owner holds blocks in the shared tier, and v2
//! otherwise, so a replica older than the shared tier still restores a snapshot without it.
//!
//! Format v2, all integers little-endian: `"KVRIDX\0\0"`, version
//! `u32`, config (`max_entries` `u64`, 0 = none; `write_chunk_events` `u64`), the anomaly
//! counters (7 × `u64`), the next eviction stamp `u32`; (worker, rank) pairs (`u64` count, then
//! per pair `worker_id` `u64`, `dp_rank` `u32`, entry count `u64`); runs (`u64` count, then per
//! run in depth-first preorder, numbered from 1: parent run `u32` (0 = root), length `u32`, its
//! `tokens_hash`es (`u64` each), owner count `u32` and per owner: pair index `u32` (increasing),
//! tiers `u8`, end `u32` — the pair holds the run's first `end` blocks); per pair, its entries
//! sorted by position: `block_hash` `u64`, run `u32`, offset `u32`, stamp `u32`; and last an
//! XXH3-64 of everything before it. Every held block is named by exactly one entry of its pair.
//!
//! Format v1 (one node per block; `snapshot/v1.rs`) still restores. Restore checks every
//! invariant the index relies on, so corrupt bytes give an error, never a broken index.

mod v1;

use std::sync::atomic::Ordering;

use kvroute_common::hashing::SequenceHash;
use xxhash_rust::xxh3::xxh3_64;

use super::arena::BlockSlot;
use super::blockmap::{BlockMap, Probe};
use super::config::{ConfigError, IndexConfig};
use super::core::{AHEAD, Core, Pair};
use super::digest::{Maps, node_table, parent_in};
use super::eviction::{EvictionQueue, Queued};
use super::extents::MAX_RUN;
use super::ops::{Op, Rec};
use super::radix::RadixIndex;
use super::stats::Anomalies;
use super::view::{NodeId, ROOT, SHARED_BIT, Slot, View, owner_end, owner_slot, owner_tiers};

pub(crate) const MAGIC: &[u8; 8] = b"KVRIDX\0\0";
/// The newest snapshot format this build writes and reads (v3: v2 with the shared tier).
pub const SNAPSHOT_VERSION: u32 = 3;

/// The format written when no owner holds the shared tier.
const NO_SHARED_VERSION: u32 = 2;

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

pub(crate) fn corrupt(detail: &'static str) -> SnapshotError {
    SnapshotError::Corrupt { detail }
}

/// Names restored block `loc` by `h` in pair `slot`'s map, and queues it for eviction when the
/// index is capped; a hash the pair already names is corrupt.
pub(crate) fn restore_entry(
    core: &mut Core,
    slot: Slot,
    h: SequenceHash,
    loc: BlockSlot,
    stamp: u32,
    queued: Option<&mut Vec<Queued>>,
) -> Result<(), SnapshotError> {
    let map = core.restored_map(slot);
    match map.probe(h) {
        Probe::Found(_) => return Err(corrupt("one block hash twice for a worker")),
        Probe::Vacant(i) => map.insert_at(i, h, loc, stamp),
    }
    if let Some(q) = queued {
        q.push(Queued {
            block_hash: h,
            slot,
            stamp,
        });
    }
    Ok(())
}

/// Bytes of one map entry in format v2: block hash, run, offset, stamp.
const ENTRY_BYTES: usize = 8 + 4 + 4 + 4;

pub(crate) struct Reader<'b> {
    pub bytes: &'b [u8],
    pub at: usize,
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
    pub fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take::<1>()?[0])
    }
    pub fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    pub fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    /// A count of items of at least `min_bytes` each, checked against the bytes left.
    pub fn count(&mut self, min_bytes: usize) -> Result<usize, SnapshotError> {
        let n = usize::try_from(self.u64()?).map_err(|_| SnapshotError::Truncated)?;
        self.check_left(n, min_bytes)?;
        Ok(n)
    }
    pub fn check_left(&self, n: usize, min_bytes: usize) -> Result<(), SnapshotError> {
        let left = self.bytes.len() - self.at;
        if n.checked_mul(min_bytes).is_none_or(|b| b > left) {
            return Err(SnapshotError::Truncated);
        }
        Ok(())
    }
}

pub(crate) fn anomalies_fields(a: &mut Anomalies) -> [&mut u64; 7] {
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

/// What a snapshot carries besides the view and the maps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Meta {
    pub config: IndexConfig,
    pub anomalies: Anomalies,
    pub next_stamp: u32,
}

impl Meta {
    pub fn of(core: &Core) -> Self {
        Self {
            config: core.config,
            anomalies: core.anomalies,
            next_stamp: core.queue.next_stamp(),
        }
    }
}

/// The v2 bytes of the state `view` and `maps` hold together.
pub(crate) fn write(view: &View, maps: &(impl Maps + ?Sized), meta: &Meta) -> Vec<u8> {
    let table = node_table(view);
    // Runs in depth-first preorder (parents first, each subtree's runs adjacent, so a restore
    // lays chains out as a live index does); children as ranges of one array.
    let bound = view.id_bound();
    let mut first = vec![0u32; bound + 1];
    for id in view.live_ids() {
        first[parent_in(view, &table, id) as usize + 1] += 1;
    }
    for i in 1..first.len() {
        first[i] += first[i - 1];
    }
    let mut kids = vec![ROOT; view.len()];
    let mut next = first.clone();
    for id in view.live_ids() {
        let p = parent_in(view, &table, id) as usize;
        kids[next[p] as usize] = id;
        next[p] += 1;
    }
    drop(next);
    let mut order = Vec::with_capacity(view.len());
    let mut new_id = vec![0u32; bound];
    let mut stack = vec![ROOT];
    while let Some(n) = stack.pop() {
        if n != ROOT {
            order.push(n);
            new_id[n as usize] = order.len() as u32;
        }
        stack.extend(
            kids[first[n as usize] as usize..first[n as usize + 1] as usize]
                .iter()
                .rev(),
        );
    }
    drop((first, kids, stack));
    debug_assert_eq!(order.len(), view.len(), "every live run once");

    let mut pair_index = Vec::new();
    let mut pairs = Vec::new();
    for (slot, p) in view.pairs() {
        if pair_index.len() <= slot as usize {
            pair_index.resize(slot as usize + 1, u32::MAX);
        }
        pair_index[slot as usize] = pairs.len() as u32;
        pairs.push((
            slot,
            p.worker_id,
            p.dp_rank,
            maps.map(slot).map_or(0, BlockMap::len),
        ));
    }
    let blocks: usize = order.iter().map(|&n| view.node(n).len as usize).sum();
    let owners: usize = order.iter().map(|&n| view.owners(n).len()).sum();
    let entries: usize = pairs.iter().map(|p| p.3).sum();
    // Exactly sized: a reallocation of a buffer this large also stalls other threads in the
    // kernel.
    let size = 8
        + 4
        + 16
        + 7 * 8
        + 4
        + 8
        + pairs.len() * 20
        + 8
        + order.len() * 12
        + blocks * 8
        + owners * 9
        + entries * 20
        + 8;
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(MAGIC);
    let version_at = out.len();
    out.extend_from_slice(&NO_SHARED_VERSION.to_le_bytes());
    let mut shared = false;
    let cap = meta.config.max_entries.map_or(0, |c| c as u64);
    out.extend_from_slice(&cap.to_le_bytes());
    out.extend_from_slice(&(meta.config.write_chunk_events as u64).to_le_bytes());
    let mut anomalies = meta.anomalies;
    for field in anomalies_fields(&mut anomalies) {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(&meta.next_stamp.to_le_bytes());
    out.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
    for &(_, worker_id, dp_rank, n) in &pairs {
        out.extend_from_slice(&worker_id.to_le_bytes());
        out.extend_from_slice(&dp_rank.to_le_bytes());
        out.extend_from_slice(&(n as u64).to_le_bytes());
    }
    out.extend_from_slice(&(order.len() as u64).to_le_bytes());
    for &id in &order {
        let n = view.node(id);
        out.extend_from_slice(&new_id[parent_in(view, &table, id) as usize].to_le_bytes());
        out.extend_from_slice(&n.len.to_le_bytes());
        for t in view.tokens(id) {
            out.extend_from_slice(&t.load(Ordering::Relaxed).to_le_bytes());
        }
        let owners = view.owners(id);
        out.extend_from_slice(&(owners.len() as u32).to_le_bytes());
        for &o in owners {
            out.extend_from_slice(&pair_index[owner_slot(o) as usize].to_le_bytes());
            out.push(owner_tiers(o));
            shared |= owner_tiers(o) & SHARED_BIT != 0;
            out.extend_from_slice(&owner_end(o).to_le_bytes());
        }
    }
    if shared {
        out[version_at..version_at + 4].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    }
    let mut list = Vec::new();
    for &(slot, ..) in &pairs {
        list.clear();
        if let Some(map) = maps.map(slot) {
            list.extend(map.iter().map(|(h, loc, stamp)| {
                let node = table[loc as usize];
                (new_id[node as usize], loc - view.node(node).start, h, stamp)
            }));
        }
        list.sort_unstable();
        for &(run, offset, h, stamp) in &list {
            out.extend_from_slice(&h.to_le_bytes());
            out.extend_from_slice(&run.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&stamp.to_le_bytes());
        }
    }
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    debug_assert_eq!(out.len(), size, "snapshot size");
    out
}

/// Checks magic, version and checksum; returns the version and a reader after the version.
pub(crate) fn open(bytes: &[u8]) -> Result<(u32, Reader<'_>), SnapshotError> {
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
    Ok((
        version,
        Reader {
            bytes: body,
            at: 12,
        },
    ))
}

/// Reads the header both versions share: config, anomalies, next stamp.
pub(crate) fn read_meta(r: &mut Reader<'_>) -> Result<Meta, SnapshotError> {
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
    Ok(Meta {
        config,
        anomalies,
        next_stamp: r.u32()?,
    })
}

impl RadixIndex {
    /// The whole index as versioned bytes (format in the module docs). O(entries + blocks).
    pub fn snapshot(&self) -> Vec<u8> {
        write(&self.view, &self.core, &Meta::of(&self.core))
    }

    /// Rebuilds an index from [`Self::snapshot`] bytes (this format or v1). It answers every
    /// query, and has the same digest, stats counters and eviction order, as the index that
    /// wrote them.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let (version, mut r) = open(bytes)?;
        let meta = read_meta(&mut r)?;
        let mut ix = RadixIndex::new(meta.config);
        ix.core.anomalies = meta.anomalies;
        let queued = if version == 1 {
            v1::read(&mut ix, &mut r)?
        } else {
            read_v2(&mut ix, &mut r, version)?
        };
        if r.at != r.bytes.len() {
            return Err(corrupt("trailing bytes"));
        }
        if ix.view.has_unused_node() {
            return Err(corrupt("a run nobody holds, with no children"));
        }
        ix.core.queue = EvictionQueue::rebuild(queued, meta.next_stamp);
        ix.core.views_caught_up();
        Ok(ix)
    }
}

/// Reads a v2 or v3 body (they differ only in the tier masks they allow) into an empty
/// index; returns the eviction queue's items.
fn read_v2(
    ix: &mut RadixIndex,
    r: &mut Reader<'_>,
    version: u32,
) -> Result<Vec<Queued>, SnapshotError> {
    let max_tiers = if version >= 3 { 15 } else { 7 };
    let capped = ix.core.config.max_entries.is_some();
    let RadixIndex { core, view } = ix;
    let mut rec = Rec::new(view, None);
    let pair_count = r.count(20)?;
    let mut declared = Vec::with_capacity(pair_count);
    for _ in 0..pair_count {
        let (worker_id, dp_rank, n) = (r.u64()?, r.u32()?, r.u64()?);
        let n = usize::try_from(n).map_err(|_| SnapshotError::Truncated)?;
        r.check_left(n, 20)?;
        if n == 0 {
            return Err(corrupt("a worker holding nothing"));
        }
        let slot = core
            .push_restored_pair(Pair {
                worker_id,
                dp_rank,
                map: BlockMap::with_capacity(n, capped),
            })
            .ok_or(corrupt("one (worker, rank) twice"))?;
        rec.op(Op::NewPair {
            slot,
            worker_id,
            dp_rank,
        });
        declared.push(n);
    }
    let run_count = r.count(16)?;
    if run_count >= u32::MAX as usize {
        return Err(corrupt("too many runs"));
    }
    // Restored node id of each run number (0 = root), and the blocks each pair holds.
    let mut ids: Vec<NodeId> = Vec::with_capacity(run_count + 1);
    ids.push(ROOT);
    let mut held = vec![0usize; pair_count];
    let mut tokens = Vec::new();
    for _ in 0..run_count {
        let parent = r.u32()? as usize;
        let len = r.u32()?;
        if parent >= ids.len() {
            return Err(corrupt("run parent does not precede it"));
        }
        if len == 0 || len > MAX_RUN {
            return Err(corrupt("run length out of range"));
        }
        r.check_left(len as usize, 8)?;
        tokens.clear();
        for _ in 0..len {
            tokens.push(r.u64()?);
        }
        let parent = ids[parent];
        if rec.view.child(parent, tokens[0]).is_some() {
            return Err(corrupt("two runs under one parent start alike"));
        }
        let anchor = rec.view.anchor_below(parent);
        let id = core.push_restored_node(&mut rec, parent, anchor, &tokens);
        ids.push(id);
        let owners = r.u32()? as usize;
        r.check_left(owners, 9)?;
        let mut prev = None;
        for _ in 0..owners {
            let (pair, tiers, end) = (r.u32()?, r.u8()?, r.u32()?);
            if (pair as usize) >= pair_count || prev.is_some_and(|p| p >= pair) {
                return Err(corrupt("run owners out of order"));
            }
            if tiers == 0 || tiers > max_tiers || end == 0 || end > len {
                return Err(corrupt("run owner out of range"));
            }
            prev = Some(pair);
            held[pair as usize] += end as usize;
            rec.op(Op::SetOwner {
                node: id,
                slot: pair,
                tiers,
                end,
            });
        }
    }
    let mut queued = Vec::new();
    for (pair, &n) in declared.iter().enumerate() {
        if n != held[pair] {
            return Err(corrupt(
                "a pair's entries do not name exactly the blocks it holds",
            ));
        }
        let slot = pair as u32;
        let mut prev: Option<(u32, u32)> = None;
        for i in 0..n {
            // The entries' hashes are random places in the pair's map (sized above): ask for
            // the bucket of the entry `AHEAD` on, as the apply loop does.
            if i + AHEAD < n {
                let at = r.at + AHEAD * ENTRY_BYTES;
                if let Some(b) = r.bytes.get(at..at + 8) {
                    let ahead = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                    core.restored_map(slot).prefetch(ahead);
                }
            }
            let (h, run, offset, stamp) = (r.u64()?, r.u32()?, r.u32()?, r.u32()?);
            if run == 0 || run as usize > run_count || prev.is_some_and(|p| p >= (run, offset)) {
                return Err(corrupt("entries out of order"));
            }
            prev = Some((run, offset));
            let node = ids[run as usize];
            let end = rec.view.owner_of(node, slot).map_or(0, owner_end);
            if offset >= end {
                return Err(corrupt("an entry names a block its pair does not hold"));
            }
            let loc: BlockSlot = rec.view.node(node).start + offset;
            restore_entry(core, slot, h, loc, stamp, capped.then_some(&mut queued))?;
        }
        rec.op(Op::PairBlocks {
            slot,
            blocks: n as u64,
        });
    }
    core.recount();
    Ok(queued)
}
