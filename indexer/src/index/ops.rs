//! The changes a writer makes to a view, as values: applied to one view as they are made and,
//! recorded, replayed on the others (`shared.rs`), so every view goes through the same states.
//! Ids (nodes, pairs, slots) are chosen by the writer, so replaying needs no decisions.

use kvroute_common::ids::{DpRank, WorkerId};

use super::arena::{BlockSlot, Chunk};
use super::view::{NodeId, Slot, View};

#[derive(Debug, Clone)]
pub(crate) enum Op {
    /// The arena grew by a chunk.
    Chunk(Chunk),
    /// A run under `parent`, without owners.
    NewNode {
        id: NodeId,
        parent: NodeId,
        start: BlockSlot,
        len: u32,
        anchor: BlockSlot,
    },
    /// A childless run grows in place or loses blocks nobody holds.
    SetLen {
        id: NodeId,
        len: u32,
    },
    /// `id` keeps `at` blocks; the rest becomes `tail`.
    Split {
        id: NodeId,
        at: u32,
        tail: NodeId,
    },
    /// `child` joins `id`.
    Merge {
        id: NodeId,
        child: NodeId,
    },
    FreeNode {
        id: NodeId,
        parent: NodeId,
    },
    /// `slot` holds `0..end` of `node` in `tiers` (end 0: nothing).
    SetOwner {
        node: NodeId,
        slot: Slot,
        tiers: u8,
        end: u32,
    },
    NewPair {
        slot: Slot,
        worker_id: WorkerId,
        dp_rank: DpRank,
    },
    FreePair {
        slot: Slot,
    },
    /// The number of blocks the pair holds.
    PairBlocks {
        slot: Slot,
        blocks: u64,
    },
}

/// A view being written, and where its ops are recorded for the other views (if any).
#[derive(Debug)]
pub(crate) struct Rec<'a> {
    pub view: &'a mut View,
    pub log: Option<&'a mut Vec<Op>>,
}

impl<'a> Rec<'a> {
    pub fn new(view: &'a mut View, log: Option<&'a mut Vec<Op>>) -> Self {
        Self { view, log }
    }

    #[inline]
    pub fn op(&mut self, op: Op) {
        self.view.apply(&op);
        if let Some(log) = self.log.as_deref_mut() {
            log.push(op);
        }
    }
}
