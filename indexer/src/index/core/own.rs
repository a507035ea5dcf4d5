//! A pair's ownership of single blocks. An owner holds a prefix `0..end` of a run in one set of
//! tiers; a change that keeps that shape (the next block stored, the last one removed) is a
//! counter move on the *cursor*, written to the view once the event moves elsewhere. Anything
//! else — a block after a hole, a tier change inside the prefix, a hole — splits the run so
//! each piece has the prefix shape again.

use super::Core;
use crate::index::arena::BlockSlot;
use crate::index::ops::{Op, Rec};
use crate::index::view::{NodeId, Slot, owner_end, owner_tiers};

/// A pair's entry on one node, as changed by the current event, with the node's range (valid
/// until the next flush: only splits change a node's range while a cursor is loaded).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cursor {
    node: NodeId,
    slot: Slot,
    start: BlockSlot,
    len: u32,
    tiers: u8,
    end: u32,
    dirty: bool,
}

impl Core {
    /// Writes the cursor's pending change to the view.
    pub(super) fn flush(&mut self, rec: &mut Rec<'_>) {
        if let Some(c) = self.cursor.take()
            && c.dirty
        {
            rec.op(Op::SetOwner {
                node: c.node,
                slot: c.slot,
                tiers: if c.end == 0 { 0 } else { c.tiers },
                end: c.end,
            });
        }
    }

    /// `slot`'s entry on `node`, through the cursor (which then points there).
    fn load(&mut self, rec: &mut Rec<'_>, node: NodeId, slot: Slot) -> &mut Cursor {
        if !matches!(self.cursor, Some(c) if c.node == node && c.slot == slot) {
            self.flush(rec);
            let (tiers, end) = rec
                .view
                .owner_of(node, slot)
                .map_or((0, 0), |o| (owner_tiers(o), owner_end(o)));
            let n = rec.view.node(node);
            self.cursor = Some(Cursor {
                node,
                slot,
                start: n.start,
                len: n.len,
                tiers,
                end,
                dirty: false,
            });
        }
        self.cursor.as_mut().expect("just loaded")
    }

    /// The node of `loc` and the block's offset in it.
    #[inline]
    fn locate(&self, rec: &Rec<'_>, loc: BlockSlot) -> (NodeId, u32) {
        let n = self.node_of(loc);
        (n, loc - rec.view.node(n).start)
    }

    /// `slot` now holds block `loc` in the tiers of `mask` too. Returns the tiers it held it in
    /// before.
    #[inline]
    pub(crate) fn own(&mut self, rec: &mut Rec<'_>, loc: BlockSlot, slot: Slot, mask: u8) -> u8 {
        // The common case: the next block of the prefix the cursor is on.
        if let Some(c) = &mut self.cursor
            && c.slot == slot
            && loc.wrapping_sub(c.start) == c.end
            && c.end < c.len
            && c.tiers == mask
        {
            c.end += 1;
            c.dirty = true;
            if c.end == c.len {
                // A whole run held: it may merge with its only child again.
                let n = c.node;
                self.touch(n);
            }
            return 0;
        }
        self.own_slow(rec, loc, slot, mask)
    }

    #[inline(never)]
    fn own_slow(&mut self, rec: &mut Rec<'_>, loc: BlockSlot, slot: Slot, mask: u8) -> u8 {
        let (n, o) = self.locate(rec, loc);
        let c = self.load(rec, n, slot);
        let (tiers, end) = (c.tiers, c.end);
        if o < end {
            if tiers & mask != mask {
                self.set_tiers_range(rec, n, slot, o, o + 1, tiers | mask);
            }
            return tiers;
        }
        if o == end && (end == 0 || tiers == mask) {
            c.tiers = mask;
            c.end = end + 1;
            c.dirty = true;
            if end + 1 == rec.view.node(n).len {
                // A whole run held: it may merge with its only child again.
                self.touch(n);
            }
            return 0;
        }
        // After a hole, or in other tiers than the prefix: the block starts a run of its own.
        let tail = self.split(rec, n, o);
        let c = self.load(rec, tail, slot);
        c.tiers = mask;
        c.end = 1;
        c.dirty = true;
        0
    }

    /// `slot` no longer holds block `loc` in `bits`. Returns the tiers it held it in before.
    #[inline]
    pub(super) fn disown(&mut self, rec: &mut Rec<'_>, loc: BlockSlot, slot: Slot, bits: u8) -> u8 {
        // The common case: the last block of the prefix the cursor is on, in every tier held
        // (leaf-first eviction).
        if let Some(c) = &mut self.cursor
            && c.slot == slot
            && c.end > 0
            && loc.wrapping_sub(c.start) == c.end - 1
            && c.tiers & !bits == 0
        {
            let (tiers, n) = (c.tiers, c.node);
            c.end -= 1;
            c.dirty = true;
            self.touch(n);
            return tiers;
        }
        self.disown_slow(rec, loc, slot, bits)
    }

    #[inline(never)]
    fn disown_slow(&mut self, rec: &mut Rec<'_>, loc: BlockSlot, slot: Slot, bits: u8) -> u8 {
        let (n, o) = self.locate(rec, loc);
        let c = self.load(rec, n, slot);
        let (tiers, end) = (c.tiers, c.end);
        if o >= end {
            return 0;
        }
        if tiers & bits == 0 {
            return tiers;
        }
        self.touch(n);
        let left = tiers & !bits;
        if left != 0 {
            self.set_tiers_range(rec, n, slot, o, o + 1, left);
        } else if o + 1 == end {
            let c = self.load(rec, n, slot);
            c.end = end - 1;
            c.dirty = true;
        } else {
            // A hole: the run is cut after the block, and the prefix ends before it.
            self.split(rec, n, o + 1);
            let c = self.load(rec, n, slot);
            c.end = o;
            c.dirty = true;
        }
        tiers
    }

    /// `slot` holds `a..b` of `node` (inside its prefix) in `tiers` from now on: cuts the run
    /// so that range is a prefix of a run of its own.
    fn set_tiers_range(
        &mut self,
        rec: &mut Rec<'_>,
        node: NodeId,
        slot: Slot,
        a: u32,
        b: u32,
        tiers: u8,
    ) {
        let end = self.load(rec, node, slot).end;
        debug_assert!(a < b && b <= end);
        let mut n = node;
        if b < end {
            self.split(rec, n, b);
        }
        if a > 0 {
            n = self.split(rec, n, a);
        }
        let c = self.load(rec, n, slot);
        debug_assert_eq!(c.end, b - a);
        c.tiers = tiers;
        c.dirty = true;
        self.touch(n);
    }

    /// Cuts `node` after `at` blocks; returns the new node holding the rest (its only child).
    pub(super) fn split(&mut self, rec: &mut Rec<'_>, node: NodeId, at: u32) -> NodeId {
        self.flush(rec);
        let n = *rec.view.node(node);
        let ext = self.node_ext[node as usize];
        self.extents.get_mut(ext).refs += 1;
        let tail = self.alloc_node(ext);
        rec.op(Op::Split { id: node, at, tail });
        self.node_of.fill(n.start + at, n.len - at, tail);
        self.touch(node);
        self.touch(tail);
        tail
    }
}
