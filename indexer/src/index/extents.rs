//! Where runs live in the arena: a buddy allocator of power-of-two ranges of slots (*extents*)
//! inside chunks, kept by the writer alone.
//!
//! A node lives in one extent. A split leaves head and tail in the same extent (nothing moves),
//! so an extent counts the nodes in it and is freed with the last of them. Room past the last
//! used slot lets the run that ends there grow in place, which is how a decode that stores a
//! block at a time stays one run. A freed range is *pending* until every view of the index has
//! dropped the nodes that used it (`release_pending`), then merges with its free buddies.

use std::collections::BTreeSet;

use super::arena::{Arena, BlockSlot, CHUNK, CHUNK_BITS, Chunk, MAX_CHUNKS};

pub(crate) type ExtentId = u32;

/// Smallest extent: 4 slots.
const MIN_ORDER: u8 = 2;
const MAX_ORDER: u8 = CHUNK_BITS as u8;

/// One allocated range of `1 << order` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub start: BlockSlot,
    pub order: u8,
    /// Slots handed to nodes so far, from the start: never lowered while the extent lives, so
    /// a slot a view may still reference is never written again.
    pub used: u32,
    /// Live nodes in the extent.
    pub refs: u32,
}

impl Extent {
    pub fn cap(&self) -> u32 {
        1 << self.order
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Extents {
    all: Vec<Extent>,
    free_ids: Vec<ExtentId>,
    /// Free ranges by order (their starts); the lowest is handed out first.
    free: Vec<BTreeSet<BlockSlot>>,
    /// Ranges freed since the views last caught up.
    pending: Vec<(BlockSlot, u8)>,
    /// Slots in live extents (capacity, not just used).
    live_slots: usize,
}

/// The order of the smallest extent holding `len` slots (`len` at most a chunk).
pub(crate) fn order_for(len: u32) -> u8 {
    debug_assert!(len as usize <= CHUNK);
    (len.max(1).next_power_of_two().trailing_zeros() as u8).max(MIN_ORDER)
}

/// The largest run one extent holds.
pub(crate) const MAX_RUN: u32 = CHUNK as u32;

impl Extents {
    #[inline]
    pub fn get(&self, id: ExtentId) -> &Extent {
        &self.all[id as usize]
    }

    #[inline]
    pub fn get_mut(&mut self, id: ExtentId) -> &mut Extent {
        &mut self.all[id as usize]
    }

    /// A new extent of `1 << order` slots with one node in it and `used` slots used. Returns
    /// the chunk it had to add to `arena`, if any (the caller passes it on to the views).
    pub fn alloc(&mut self, order: u8, used: u32, arena: &mut Arena) -> (ExtentId, Option<Chunk>) {
        if self.free.is_empty() {
            self.free.resize_with(MAX_ORDER as usize + 1, BTreeSet::new);
        }
        let mut added = None;
        let (start, mut k) = match (order..=MAX_ORDER)
            .find_map(|k| self.free[k as usize].pop_first().map(|s| (s, k)))
        {
            Some(found) => found,
            None => {
                assert!(
                    arena.chunks() < MAX_CHUNKS,
                    "the block arena is full (2^31 blocks)"
                );
                let start = (arena.chunks() as BlockSlot) << CHUNK_BITS;
                let chunk = Arena::new_chunk();
                arena.push(chunk.clone());
                added = Some(chunk);
                (start, MAX_ORDER)
            }
        };
        // Split down, freeing the upper halves.
        while k > order {
            k -= 1;
            self.free[k as usize].insert(start + (1 << k));
        }
        self.live_slots += 1 << order;
        let extent = Extent {
            start,
            order,
            used,
            refs: 1,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.all[id as usize] = extent;
                id
            }
            None => {
                self.all.push(extent);
                (self.all.len() - 1) as ExtentId
            }
        };
        (id, added)
    }

    /// One node fewer in `id`; the last one frees it (its range pending until
    /// [`Extents::release_pending`]).
    pub fn unref(&mut self, id: ExtentId) {
        let e = &mut self.all[id as usize];
        e.refs -= 1;
        if e.refs == 0 {
            self.pending.push((e.start, e.order));
            self.live_slots -= 1 << e.order;
            self.free_ids.push(id);
        }
    }

    /// Hands out the pending ranges again: call once no view references them.
    pub fn release_pending(&mut self) {
        for (mut start, mut k) in std::mem::take(&mut self.pending) {
            while k < MAX_ORDER && self.free[k as usize].remove(&(start ^ (1 << k))) {
                start &= !(1 << k);
                k += 1;
            }
            self.free[k as usize].insert(start);
        }
    }

    /// Slots held by live extents.
    #[cfg(test)]
    pub fn live_slots(&self) -> usize {
        self.live_slots
    }

    pub fn bytes(&self) -> usize {
        self.all.capacity() * std::mem::size_of::<Extent>()
            + self.free_ids.capacity() * 4
            + self.pending.capacity() * 8
            // A B-tree set costs about 8 bytes a key plus node overhead.
            + self.free.iter().map(|s| s.len() * 12).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buddies_merge_back_into_a_whole_chunk() {
        let mut arena = Arena::default();
        let mut ex = Extents::default();
        let (a, added) = ex.alloc(order_for(5), 5, &mut arena);
        assert!(added.is_some());
        let (b, added) = ex.alloc(order_for(100), 100, &mut arena);
        assert!(added.is_none());
        assert_eq!(ex.get(a).start, 0);
        assert_eq!(ex.get(a).cap(), 8);
        assert_eq!(ex.get(b).cap(), 128);
        assert_eq!(ex.get(b).start % 128, 0);
        ex.unref(a);
        ex.unref(b);
        // Pending ranges are not handed out before release.
        let (c, _) = ex.alloc(order_for(8), 8, &mut arena);
        assert_ne!(ex.get(c).start, 0);
        ex.unref(c);
        ex.release_pending();
        let (d, added) = ex.alloc(MAX_ORDER, 1, &mut arena);
        assert!(
            added.is_none(),
            "everything merged back into the first chunk"
        );
        assert_eq!(ex.get(d).start, 0);
        assert_eq!(ex.live_slots(), CHUNK);
    }
}
