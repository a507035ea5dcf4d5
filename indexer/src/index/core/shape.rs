//! The tree's shape: where a stored chain goes (following runs whose hashes match, cutting a
//! run where the chain leaves it, growing the last run in place or adding new runs), and the
//! end-of-event tidy that trims, frees and merges what ownership changes left behind.

use std::sync::atomic::Ordering;

use kvroute_common::messages::StoredBlock;

use super::Core;
use crate::index::arena::{BlockSlot, ROOT_ANCHOR};
use crate::index::extents::MAX_RUN;
use crate::index::ops::{Op, Rec};
use crate::index::view::{NodeId, ROOT, owner_end, owner_slot, owner_tiers};

/// A chain continued by fewer blocks than this, at the end of a run with no children, is a
/// decode: its new run gets room to grow to twice the length of the run it continues (at most
/// [`DECODE_ROOM`]), so a long decode is a handful of runs, not one per few blocks.
const DECODE_BLOCKS: u32 = 64;
const DECODE_ROOM: u32 = 256;

/// A run too long for any free extent is stored in pieces of at least this many blocks in the
/// largest free extents before the arena grows.
const MIN_PIECE: u32 = 128;

impl Core {
    /// Fills `self.locs` with the slots of `blocks` stored under `parent` (a block slot, or the
    /// root): follows runs whose hashes match, cuts a run where the chain leaves it, and puts
    /// the rest in new blocks. Changes no ownership.
    pub(super) fn place(
        &mut self,
        rec: &mut Rec<'_>,
        parent: Option<BlockSlot>,
        blocks: &[StoredBlock],
    ) {
        self.locs.clear();
        let k = blocks.len();
        let mut pos = parent;
        let mut i = 0;
        while i < k {
            if let Some(p) = pos {
                let n = self.node_of(p);
                let node = *rec.view.node(n);
                let o = p - node.start;
                let after = node.len - o - 1;
                if after > 0 {
                    let run = rec.view.arena.run(p + 1, after);
                    let mut m = 0u32;
                    while i < k
                        && m < after
                        && run[m as usize].load(Ordering::Relaxed) == blocks[i].tokens_hash
                    {
                        self.locs.push(p + 1 + m);
                        m += 1;
                        i += 1;
                    }
                    pos = Some(p + m);
                    if i == k {
                        break;
                    }
                    if m < after {
                        // The chain leaves the run inside it: cut after the last common block.
                        self.split(rec, n, o + 1 + m);
                    }
                }
            }
            let pn = pos.map_or(ROOT, |p| self.node_of(p));
            if let Some(c) = rec.view.child(pn, blocks[i].tokens_hash) {
                let start = rec.view.node(c).start;
                self.locs.push(start);
                pos = Some(start);
                i += 1;
                continue;
            }
            self.extend(rec, pn, pos, &blocks[i..]);
            break;
        }
    }

    /// New blocks under `parent` (whose last block is `pos`): in place at the end of its run
    /// when its extent has room, else in new runs.
    fn extend(
        &mut self,
        rec: &mut Rec<'_>,
        parent: NodeId,
        pos: Option<BlockSlot>,
        blocks: &[StoredBlock],
    ) {
        let r = blocks.len() as u32;
        let mut room = 0;
        if parent != ROOT {
            let p = *rec.view.node(parent);
            let ext_id = self.node_ext[parent as usize];
            let ext = *self.extents.get(ext_id);
            if p.children == 0 && p.start + p.len == ext.start + ext.used && ext.used + r <= ext.cap
            {
                let from = p.start + p.len;
                self.arena.write(from, blocks.iter().map(|b| b.tokens_hash));
                self.extents.get_mut(ext_id).used += r;
                self.node_of.fill(from, r, parent);
                rec.op(Op::SetLen {
                    id: parent,
                    len: p.len + r,
                });
                self.locs.extend(from..from + r);
                self.touch(parent);
                return;
            }
            if p.children == 0 && r < DECODE_BLOCKS {
                room = (2 * p.len).min(DECODE_ROOM);
            }
        }
        let mut parent = parent;
        let mut anchor = pos.unwrap_or(ROOT_ANCHOR);
        let mut rest = blocks;
        while !rest.is_empty() {
            let want = (rest.len() as u32).min(MAX_RUN);
            let ext = self.alloc_extent(rec, want.max(room), MIN_PIECE);
            let len = want.min(self.extents.get(ext).cap);
            let (piece, more) = rest.split_at(len as usize);
            let id = self.new_run(
                rec,
                ext,
                len,
                parent,
                anchor,
                piece.iter().map(|b| b.tokens_hash),
            );
            let start = self.extents.get(ext).start;
            self.locs.extend(start..start + len);
            self.touch(id);
            parent = id;
            anchor = start + len - 1;
            rest = more;
        }
    }

    /// Ends an event: writes the cursor, then trims, frees and merges the touched nodes.
    pub(crate) fn tidy(&mut self, rec: &mut Rec<'_>) {
        self.flush(rec);
        let mut touched = std::mem::take(&mut self.touched);
        touched.sort_unstable();
        touched.dedup();
        for &id in &touched {
            self.tidy_node(rec, id);
        }
        touched.clear();
        self.touched = touched;
    }

    fn tidy_node(&mut self, rec: &mut Rec<'_>, mut id: NodeId) {
        loop {
            if id == ROOT || !rec.view.node(id).is_live() {
                return;
            }
            let n = *rec.view.node(id);
            if n.children == 0 {
                let held = rec
                    .view
                    .owners(id)
                    .iter()
                    .map(|&o| owner_end(o))
                    .max()
                    .unwrap_or(0);
                if held == 0 {
                    let parent = self.parent_of(rec.view, id);
                    rec.op(Op::FreeNode { id, parent });
                    self.release_node(id);
                    // The parent lost a child: it may be unused now, or mergeable.
                    id = parent;
                    continue;
                }
                if held < n.len {
                    rec.op(Op::SetLen { id, len: held });
                }
            }
            if self.try_merge(rec, id) {
                continue;
            }
            let parent = self.parent_of(rec.view, id);
            if parent != ROOT && self.try_merge(rec, parent) {
                id = parent;
                continue;
            }
            return;
        }
    }

    /// Joins `id`'s only child onto it when the two are one run in the arena and every owner
    /// of the child holds all of `id` in the same tiers.
    fn try_merge(&mut self, rec: &mut Rec<'_>, id: NodeId) -> bool {
        let n = *rec.view.node(id);
        if n.children != 1 || n.hint == ROOT {
            return false;
        }
        let c = n.hint;
        let child = *rec.view.node(c);
        if child.start != n.start + n.len || self.node_ext[c as usize] != self.node_ext[id as usize]
        {
            return false;
        }
        let owners = rec.view.owners(id);
        let compatible = rec.view.owners(c).iter().all(|&o| {
            owners
                .binary_search_by_key(&owner_slot(o), |&p| owner_slot(p))
                .is_ok_and(|i| {
                    owner_end(owners[i]) == n.len && owner_tiers(owners[i]) == owner_tiers(o)
                })
        });
        if !compatible {
            return false;
        }
        rec.op(Op::Merge { id, child: c });
        self.node_of.fill(child.start, child.len, id);
        self.release_node(c);
        true
    }
}
