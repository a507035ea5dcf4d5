//! Where runs live in the arena: ranges of slots (*extents*) carved from a buddy allocator
//! inside chunks, kept by the writer alone.
//!
//! A node lives in one extent. A split leaves head and tail in the same extent (nothing moves),
//! so an extent counts the nodes in it and is freed with the last of them. An extent is the size
//! asked for rounded up to [`GRANULE`] slots: it takes the smallest power-of-two block that fits
//! and hands the rest back as aligned pieces, so a run wastes at most a granule. Room asked for
//! past the used slots lets the run ending there grow in place, which is how a decode that
//! stores a block at a time stays a few runs. A freed range is *pending* until every view of
//! the index has dropped the nodes that used it (`release_pending`), then goes back as aligned
//! pieces that merge with their free buddies.

use std::collections::BTreeSet;

use super::arena::{Arena, BlockSlot, CHUNK, CHUNK_BITS, Chunk, MAX_CHUNKS};

pub(crate) type ExtentId = u32;

/// Extents are multiples of this many slots (and the smallest buddy block).
pub(crate) const GRANULE: u32 = 4;
const MIN_ORDER: u32 = GRANULE.trailing_zeros();
const MAX_ORDER: u32 = CHUNK_BITS;

/// The largest run one extent holds.
pub(crate) const MAX_RUN: u32 = CHUNK as u32;

/// One allocated range of `cap` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub start: BlockSlot,
    pub cap: u32,
    /// Slots handed to nodes so far, from the start: never lowered while the extent lives, so
    /// a slot a view may still reference is never written again.
    pub used: u32,
    /// Live nodes in the extent.
    pub refs: u32,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Extents {
    all: Vec<Extent>,
    free_ids: Vec<ExtentId>,
    /// Free aligned blocks by order (their starts); the lowest is handed out first.
    free: Vec<BTreeSet<BlockSlot>>,
    /// Ranges freed since the views last caught up.
    pending: Vec<(BlockSlot, u32)>,
    /// Slots in live extents (capacity, not just used).
    live_slots: usize,
}

/// `len` rounded up to whole granules.
fn round(len: u32) -> u32 {
    len.max(1).div_ceil(GRANULE) * GRANULE
}

impl Extents {
    #[inline]
    pub fn get(&self, id: ExtentId) -> &Extent {
        &self.all[id as usize]
    }

    #[inline]
    pub fn get_mut(&mut self, id: ExtentId) -> &mut Extent {
        &mut self.all[id as usize]
    }

    /// A new extent with one node in it and no slot used: `want` slots (rounded up to a
    /// granule) if a free block holds them, else the largest free block of at least
    /// `min.min(want)` slots (the caller puts part of its run there and asks again for the
    /// rest), else `want` slots from a new chunk. Free space is used before the arena grows.
    /// Returns the chunk it had to add to `arena`, if any (the caller passes it on to the
    /// views).
    pub fn alloc(&mut self, want: u32, min: u32, arena: &mut Arena) -> (ExtentId, Option<Chunk>) {
        debug_assert!(want as usize <= CHUNK);
        if self.free.is_empty() {
            self.free.resize_with(MAX_ORDER as usize + 1, BTreeSet::new);
        }
        let want = round(want);
        let fit = want.next_power_of_two().trailing_zeros().max(MIN_ORDER);
        let floor = round(min.min(want))
            .next_power_of_two()
            .trailing_zeros()
            .max(MIN_ORDER);
        let mut added = None;
        let found = (fit..=MAX_ORDER)
            .find_map(|k| self.free[k as usize].pop_first().map(|s| (s, k)))
            .map(|(s, k)| (s, k, want))
            .or_else(|| {
                // Nothing holds it all: the largest free block that is big enough to be worth it.
                (floor..fit)
                    .rev()
                    .find_map(|k| self.free[k as usize].pop_first().map(|s| (s, k, 1 << k)))
            });
        let (start, mut k, cap) = match found {
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
                (start, MAX_ORDER, want)
            }
        };
        // Split down to the smallest block holding `cap`, freeing the upper halves, then hand
        // back what `cap` leaves of that block.
        let order = cap.next_power_of_two().trailing_zeros().max(MIN_ORDER);
        while k > order {
            k -= 1;
            self.free[k as usize].insert(start + (1 << k));
        }
        self.free_range(start + cap, start + (1 << order));
        self.live_slots += cap as usize;
        let extent = Extent {
            start,
            cap,
            used: 0,
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
            self.pending.push((e.start, e.cap));
            self.live_slots -= e.cap as usize;
            self.free_ids.push(id);
        }
    }

    /// Hands out the pending ranges again: call once no view references them.
    pub fn release_pending(&mut self) {
        for (start, cap) in std::mem::take(&mut self.pending) {
            self.free_range(start, start + cap);
        }
    }

    /// Frees `from..to` (granule-aligned) as the largest aligned blocks it holds, each merged
    /// with its free buddies.
    fn free_range(&mut self, mut from: BlockSlot, to: BlockSlot) {
        while from < to {
            let mut k = from.trailing_zeros().min(MAX_ORDER);
            while from + (1 << k) > to {
                k -= 1;
            }
            self.free_block(from, k);
            from += 1 << k;
        }
    }

    fn free_block(&mut self, mut start: BlockSlot, mut k: u32) {
        while k < MAX_ORDER && self.free[k as usize].remove(&(start ^ (1 << k))) {
            start &= !(1 << k);
            k += 1;
        }
        self.free[k as usize].insert(start);
    }

    /// Slots held by live extents.
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
    fn extents_waste_at_most_a_granule_and_merge_back_into_a_whole_chunk() {
        let mut arena = Arena::default();
        let mut ex = Extents::default();
        let (a, added) = ex.alloc(5, 5, &mut arena);
        ex.get_mut(a).used = 5;
        assert!(added.is_some());
        let (b, added) = ex.alloc(400, 400, &mut arena);
        assert!(added.is_none());
        assert_eq!(ex.get(a).start, 0);
        assert_eq!(ex.get(a).cap, 8);
        assert_eq!(ex.get(b).cap, 400);
        // The rest of b's 512-slot block went back as aligned pieces.
        let (c, _) = ex.alloc(60, 60, &mut arena);
        let (f, _) = ex.alloc(16, 16, &mut arena);
        assert_eq!(ex.live_slots(), 8 + 400 + 60 + 16);
        let mut ranges: Vec<_> = [a, b, c, f]
            .map(|id| (ex.get(id).start, ex.get(id).start + ex.get(id).cap))
            .to_vec();
        ranges.sort_unstable();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "{ranges:?}");
        for id in [a, b, c, f] {
            ex.unref(id);
        }
        // Pending ranges are not handed out before release.
        let (d, _) = ex.alloc(8, 8, &mut arena);
        assert_ne!(ex.get(d).start, 0);
        ex.unref(d);
        ex.release_pending();
        let (e, added) = ex.alloc(CHUNK as u32, CHUNK as u32, &mut arena);
        assert!(
            added.is_none(),
            "everything merged back into the first chunk"
        );
        assert_eq!(ex.get(e).start, 0);
        assert_eq!(ex.live_slots(), CHUNK);
    }

    #[test]
    fn a_run_too_big_for_any_free_block_takes_the_largest_before_the_arena_grows() {
        let mut arena = Arena::default();
        let mut ex = Extents::default();
        // Fill the first chunk with 1,024-slot extents, then free every other one.
        let ids: Vec<_> = (0..64)
            .map(|_| ex.alloc(1024, 1024, &mut arena).0)
            .collect();
        assert_eq!(arena.chunks(), 1);
        for id in ids.iter().step_by(2) {
            ex.unref(*id);
        }
        ex.release_pending();
        let (big, added) = ex.alloc(4000, 256, &mut arena);
        assert!(added.is_none(), "a free 1,024-slot block is used first");
        assert_eq!(ex.get(big).cap, 1024);
        // Nothing of 256 slots or more is left free but a chunk's worth: the arena grows.
        for _ in 0..31 {
            assert!(ex.alloc(1024, 1024, &mut arena).1.is_none());
        }
        let (_, added) = ex.alloc(4000, 256, &mut arena);
        assert!(added.is_some());
    }
}
