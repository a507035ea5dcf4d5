//! Restoring format v1, written by the layout with one node per block: nodes (`u64` count, then
//! per node its parent `u32` and `tokens_hash` `u64`, parents before children, ids from 1);
//! (worker, rank) pairs (`u64` count, then per pair `worker_id` `u64`, `dp_rank` `u32`, entry
//! count `u64`, and per entry `block_hash` `u64`, node `u32`, tiers `u8`, stamp `u32`).
//!
//! Chains of single-child nodes become runs; each pair's blocks are then taken in position
//! order through the same ownership steps as stored events, which cut runs wherever a pair's
//! holding is not a prefix in one set of tiers.

use hashbrown::HashSet;

use super::{Reader, SnapshotError, corrupt, restore_entry};
use crate::index::arena::BlockSlot;
use crate::index::blockmap::BlockMap;
use crate::index::core::Pair;
use crate::index::eviction::Queued;
use crate::index::extents::MAX_RUN;
use crate::index::ops::{Op, Rec};
use crate::index::radix::RadixIndex;
use crate::index::view::{NodeId, ROOT};

/// Reads a v1 body (after the shared header) into an empty index; returns the eviction
/// queue's items.
pub(crate) fn read(ix: &mut RadixIndex, r: &mut Reader<'_>) -> Result<Vec<Queued>, SnapshotError> {
    let capped = ix.core.config.max_entries.is_some();
    let node_count = r.count(12)?;
    if node_count >= u32::MAX as usize {
        return Err(corrupt("too many nodes"));
    }
    // v1 node ids from 1; index 0 is the root.
    let mut parent = vec![0u32; node_count + 1];
    let mut tokens = vec![0u64; node_count + 1];
    let mut children = vec![0u32; node_count + 1];
    let mut edges = HashSet::with_capacity(node_count);
    for id in 1..=node_count {
        let (p, t) = (r.u32()?, r.u64()?);
        if p as usize >= id {
            return Err(corrupt("node parent does not precede it"));
        }
        if !edges.insert((p, t)) {
            return Err(corrupt("duplicate node under one parent"));
        }
        parent[id] = p;
        tokens[id] = t;
        children[p as usize] += 1;
    }
    drop(edges);

    let pair_count = r.count(20)?;
    let mut pairs = Vec::with_capacity(pair_count);
    let mut named = vec![false; node_count + 1];
    for _ in 0..pair_count {
        let (worker_id, dp_rank) = (r.u64()?, r.u32()?);
        let n = r.count(17)?;
        if n == 0 {
            return Err(corrupt("a worker holding nothing"));
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let (h, node, tiers, stamp) = (r.u64()?, r.u32()?, r.u8()?, r.u32()?);
            if node == 0 || node as usize > node_count {
                return Err(corrupt("entry names no node"));
            }
            if tiers == 0 || tiers > 7 {
                return Err(corrupt("entry with invalid tiers"));
            }
            named[node as usize] = true;
            entries.push((node, h, tiers, stamp));
        }
        pairs.push((worker_id, dp_rank, entries));
    }
    if (1..=node_count).any(|id| children[id] == 0 && !named[id]) {
        return Err(corrupt("a node with neither owners nor children"));
    }

    // Runs: a node continues its parent's run when it is that parent's only child.
    let RadixIndex { core, view } = ix;
    let mut rec = Rec::new(view, None);
    let mut run_of = vec![(ROOT, 0u32); node_count + 1];
    let mut pending: Vec<Vec<u32>> = Vec::new();
    let mut run_first = Vec::new();
    for id in 1..=node_count {
        let p = parent[id] as usize;
        if p != 0 && children[p] == 1 && pending[run_of[p].0 as usize].len() < MAX_RUN as usize {
            let run = run_of[p].0;
            run_of[id] = (run, pending[run as usize].len() as u32);
            pending[run as usize].push(id as u32);
        } else {
            run_of[id] = (pending.len() as u32, 0);
            run_first.push(id as u32);
            pending.push(vec![id as u32]);
        }
    }
    // Create the runs in order of their first node (parents come first), then map each v1
    // node to its slot.
    let mut run_node: Vec<NodeId> = Vec::with_capacity(pending.len());
    let mut slot_of = vec![0 as BlockSlot; node_count + 1];
    let mut run_tokens = Vec::new();
    for (run, members) in pending.iter().enumerate() {
        let first = run_first[run] as usize;
        let parent_node = match parent[first] {
            0 => ROOT,
            p => run_node[run_of[p as usize].0 as usize],
        };
        run_tokens.clear();
        run_tokens.extend(members.iter().map(|&m| tokens[m as usize]));
        let anchor = rec.view.anchor_below(parent_node);
        let node = core.push_restored_node(&mut rec, parent_node, anchor, &run_tokens);
        let start = rec.view.node(node).start;
        for (i, &m) in members.iter().enumerate() {
            slot_of[m as usize] = start + i as BlockSlot;
        }
        run_node.push(node);
    }
    drop((pending, run_of, tokens, parent));

    let mut queued = Vec::new();
    for (worker_id, dp_rank, mut entries) in pairs {
        let slot = core
            .push_restored_pair(Pair {
                worker_id,
                dp_rank,
                map: BlockMap::with_capacity(entries.len(), capped),
            })
            .ok_or(corrupt("one (worker, rank) twice"))?;
        rec.op(Op::NewPair {
            slot,
            worker_id,
            dp_rank,
        });
        // In position order, so a pair holding a whole run extends one prefix.
        entries.sort_unstable_by_key(|e| slot_of[e.0 as usize]);
        for &(node, h, tiers, stamp) in &entries {
            let loc = slot_of[node as usize];
            if core.own(&mut rec, loc, slot, tiers) != 0 {
                return Err(corrupt("a worker holds one block under two hashes"));
            }
            restore_entry(core, slot, h, loc, stamp, capped.then_some(&mut queued))?;
        }
        rec.op(Op::PairBlocks {
            slot,
            blocks: entries.len() as u64,
        });
    }
    core.tidy(&mut rec);
    core.recount();
    Ok(queued)
}
