//! Block hashing: how a prompt's token ids become the block hashes the index is keyed by.
//!
//! The scheme (PROTOCOL.md, "Hashing") is the one other routers and engines have converged on,
//! so an engine in any language can reproduce it:
//! - *local* hash of a full block: XXH3-64 over the little-endian bytes of its `u32` token ids;
//! - *sequence* hash chain: `seq[0] = local[0]`, `seq[i] = XXH3-64(LE(seq[i-1]) ‖ LE(local[i]))`;
//! - local hashes with seed [`BLOCK_HASH_SEED`] (1337), or with a LoRA adapter's seed
//!   ([`seed_for_lora`]); the sequence chain always with seed 1337;
//! - a trailing partial block is never hashed.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Hash of one block's tokens alone (what the radix index navigates by).
pub type LocalBlockHash = u64;
/// Hash of a block together with everything before it (what engines name their blocks by).
pub type SequenceHash = u64;

/// The seed of every block hash when no LoRA adapter is in use.
pub const BLOCK_HASH_SEED: u64 = 1337;

/// The seed used for blocks computed under a LoRA adapter.
///
/// `None` or an empty name gives [`BLOCK_HASH_SEED`]; otherwise the seed is
/// `1337 + XXH3-64(UTF-8 bytes of the adapter name, seed 0)`, wrapping — Dynamo's scheme
/// (`dynamo_kv_hashing::compute_salt_hash`), checked against its code in
/// `bench/peers/tests/hashing.rs`. Two adapters therefore never share blocks with each other or
/// with the base model.
pub fn seed_for_lora(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None | Some("") => BLOCK_HASH_SEED,
        Some(name) => BLOCK_HASH_SEED.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0)),
    }
}

/// Local hashes of every *full* block of `tokens`.
///
/// # Panics
/// Never for `block_size > 0`; a `block_size` of 0 yields no blocks.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    // One buffer for every block, overwritten in place (a loop the compiler vectorizes; a
    // push per token cost more than the hash itself).
    let mut buf = vec![0u8; block_size * 4];
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            for (bytes, token) in buf.chunks_exact_mut(4).zip(block) {
                bytes.copy_from_slice(&token.to_le_bytes());
            }
            xxh3_64_with_seed(&buf, seed)
        })
        .collect()
}

/// The sequence hash following `parent` for a block whose local hash is `local`.
pub fn chain_hash(parent: SequenceHash, local: LocalBlockHash, seed: u64) -> SequenceHash {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&buf, seed)
}

/// The sequence hash chain of a run of local hashes that starts at the prompt's first block.
pub fn sequence_hashes(local: &[LocalBlockHash], seed: u64) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut prev: Option<SequenceHash> = None;
    for &h in local {
        let seq = match prev {
            None => h,
            Some(p) => chain_hash(p, h, seed),
        };
        out.push(seq);
        prev = Some(seq);
    }
    out
}

/// Both hash lists of a prompt: what an engine publishes for the blocks it stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHashes {
    pub local: Vec<LocalBlockHash>,
    pub sequence: Vec<SequenceHash>,
}

impl BlockHashes {
    pub fn of_tokens(tokens: &[u32], block_size: usize, lora_name: Option<&str>) -> Self {
        let local = local_block_hashes(tokens, block_size, seed_for_lora(lora_name));
        // The chain's seed does not depend on the adapter: local hashes already do.
        let sequence = sequence_hashes(&local, BLOCK_HASH_SEED);
        Self { local, sequence }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The vectors published in PROTOCOL.md ("Hashing"). Changing any of them is a wire break.
    #[test]
    fn published_test_vectors() {
        let tokens: Vec<u32> = (0..10).collect();
        let h = BlockHashes::of_tokens(&tokens, 4, None);
        assert_eq!(h.local, vec![0x7ee2cbedc694ab46, 0xa8416cfd935bdb13]);
        assert_eq!(h.sequence, vec![0x7ee2cbedc694ab46, 0x83fb702f20e2ad65]);

        // LoRA vectors as Dynamo's own functions produce them (bench/peers/tests/hashing.rs).
        assert_eq!(seed_for_lora(Some("sql-adapter")), 0x88f0c7e6c82b85a4);
        let l = BlockHashes::of_tokens(&tokens, 4, Some("sql-adapter"));
        assert_eq!(l.local, vec![0xcdb0f5875b92d24a, 0x875b9f910b1422be]);
        assert_eq!(l.sequence, vec![0xcdb0f5875b92d24a, 0x824638379cfbe8c0]);

        let tokens: Vec<u32> = (1..=32).collect();
        let h = BlockHashes::of_tokens(&tokens, 16, None);
        assert_eq!(h.local, vec![0xea06fc71a5ee6e88, 0x1fbf39bd106be0b5]);
        assert_eq!(h.sequence, vec![0xea06fc71a5ee6e88, 0xad01835a37dd294c]);
        let l = BlockHashes::of_tokens(&tokens, 16, Some("adapter-a"));
        assert_eq!(l.local, vec![0x3cbe841383bf26e8, 0xe10b57c2e132d7b1]);
        assert_eq!(l.sequence, vec![0x3cbe841383bf26e8, 0x666207ac2c1acd0f]);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(local_block_hashes(&[1, 2, 3], 4, BLOCK_HASH_SEED).len(), 0);
        assert_eq!(local_block_hashes(&[1; 9], 4, BLOCK_HASH_SEED).len(), 2);
        assert!(local_block_hashes(&[1; 9], 0, BLOCK_HASH_SEED).is_empty());
    }

    #[test]
    fn empty_lora_name_is_the_base_model() {
        assert_eq!(seed_for_lora(Some("")), BLOCK_HASH_SEED);
        assert_ne!(seed_for_lora(Some("a")), BLOCK_HASH_SEED);
    }

    proptest! {
        /// Changing one token in block i changes seq[j] for every j >= i and none for j < i.
        #[test]
        fn chain_property(
            tokens in proptest::collection::vec(any::<u32>(), 16..200),
            block_size in 1usize..16,
            pick in any::<prop::sample::Index>(),
            delta in 1u32..u32::MAX,
        ) {
            let full = tokens.len() / block_size * block_size;
            prop_assume!(full > 0);
            let pos = pick.index(full);
            let mut changed = tokens.clone();
            changed[pos] = changed[pos].wrapping_add(delta);
            let a = BlockHashes::of_tokens(&tokens, block_size, None);
            let b = BlockHashes::of_tokens(&changed, block_size, None);
            let i = pos / block_size;
            for j in 0..a.sequence.len() {
                if j < i {
                    prop_assert_eq!(a.sequence[j], b.sequence[j]);
                } else {
                    prop_assert_ne!(a.sequence[j], b.sequence[j]);
                }
            }
            prop_assert_ne!(a.local[i], b.local[i]);
        }
    }
}
