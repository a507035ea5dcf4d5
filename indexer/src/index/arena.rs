//! The block arena: one slot per block of the tree, holding its `tokens_hash`. A node is a range
//! of consecutive slots, so a walk compares a prompt against a run of hashes in one array.
//!
//! Slots are stable: a block keeps its slot from the store that created it until it leaves the
//! tree, whatever splits and merges its node goes through, so the per-(worker, rank) maps name
//! blocks by slot. The arena is shared by the writer and every view of the index; a slot is
//! written only while no view references it (new blocks, and freed ranges once every view has
//! dropped them), so readers never see a slot they use change. Slots are atomics so that this
//! sharing needs no `unsafe`; plain loads and stores on x86.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The number of a block's slot.
pub(crate) type BlockSlot = u32;

/// Slots per chunk: the arena grows a chunk (512 KiB) at a time and never moves a slot.
pub(crate) const CHUNK_BITS: u32 = 16;
pub(crate) const CHUNK: usize = 1 << CHUNK_BITS;
const MASK: usize = CHUNK - 1;

/// Most chunks an arena holds (2^31 slots), so no slot is [`ROOT_ANCHOR`].
pub(crate) const MAX_CHUNKS: usize = 1 << 15;

/// The anchor of the root's children: not a slot.
pub(crate) const ROOT_ANCHOR: BlockSlot = u32::MAX;

/// One chunk of slots.
pub(crate) type Chunk = Arc<[AtomicU64]>;

/// The chunks in slot order. Cloning shares them (each view holds such a clone); see
/// [`Arena::deep_copy`] for an independent arena.
#[derive(Clone, Default)]
pub(crate) struct Arena {
    chunks: Vec<Chunk>,
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Arena")
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl Arena {
    /// A fresh chunk of zeroed slots.
    pub fn new_chunk() -> Chunk {
        (0..CHUNK).map(|_| AtomicU64::new(0)).collect()
    }

    pub fn push(&mut self, chunk: Chunk) {
        self.chunks.push(chunk);
    }

    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The slots `start..start + len`, which lie in one chunk.
    #[inline]
    pub fn run(&self, start: BlockSlot, len: u32) -> &[AtomicU64] {
        let chunk = &self.chunks[(start >> CHUNK_BITS) as usize];
        let from = start as usize & MASK;
        &chunk[from..from + len as usize]
    }

    #[inline]
    pub fn get(&self, slot: BlockSlot) -> u64 {
        self.chunks[(slot >> CHUNK_BITS) as usize][slot as usize & MASK].load(Ordering::Relaxed)
    }

    /// Writes slots from `start` (within one chunk). Only for slots no view references.
    pub fn write(&self, start: BlockSlot, hashes: impl IntoIterator<Item = u64>) {
        let chunk = &self.chunks[(start >> CHUNK_BITS) as usize];
        let from = start as usize & MASK;
        for (slot, h) in chunk[from..].iter().zip(hashes) {
            slot.store(h, Ordering::Relaxed);
        }
    }

    /// An independent arena with the same contents.
    pub fn deep_copy(&self) -> Arena {
        Arena {
            chunks: self
                .chunks
                .iter()
                .map(|c| {
                    c.iter()
                        .map(|s| AtomicU64::new(s.load(Ordering::Relaxed)))
                        .collect()
                })
                .collect(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * 8 + self.chunks.capacity() * std::mem::size_of::<Chunk>()
    }
}

/// Per-slot values kept by the writer alone (a slot's node), grown with the arena.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotTable {
    chunks: Vec<Box<[u32]>>,
}

impl SlotTable {
    pub fn grow(&mut self) {
        self.chunks.push(vec![0; CHUNK].into_boxed_slice());
    }

    #[inline]
    pub fn get(&self, slot: BlockSlot) -> u32 {
        self.chunks[(slot >> CHUNK_BITS) as usize][slot as usize & MASK]
    }

    /// Sets `start..start + len` (within one chunk) to `value`.
    #[inline]
    pub fn fill(&mut self, start: BlockSlot, len: u32, value: u32) {
        let from = start as usize & MASK;
        self.chunks[(start >> CHUNK_BITS) as usize][from..from + len as usize].fill(value);
    }

    pub fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * 4
    }
}
