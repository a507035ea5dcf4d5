//! The token ids of the blocks of requests in flight, by sequence hash, so that every
//! `BlockStored` can carry its blocks' tokens as the engines' events do. A block is kept while
//! some submitted, unfinished request has it in its prompt: the cache stores a request's blocks
//! between its submission and its end, so every stored block is found here.

use std::collections::HashMap;

use kvroute_common::hashing::SequenceHash;

#[derive(Debug)]
struct Entry {
    tokens: Box<[u32]>,
    /// The LoRA adapter whose request computed the block (its hash is keyed by it).
    lora: Option<std::sync::Arc<str>>,
    /// Requests in flight whose prompt holds the block.
    refs: u32,
}

/// Reference-counted token ids of full prompt blocks. Pure: no clock, no I/O.
#[derive(Debug, Default)]
pub struct BlockTokens {
    blocks: HashMap<SequenceHash, Entry>,
}

impl BlockTokens {
    /// Takes a reference on each full block of `prompt` (`hashes[i]` names block i, of
    /// `block_size` tokens), a prompt of LoRA adapter `lora` (`None`: the base model).
    pub fn retain(
        &mut self,
        hashes: &[SequenceHash],
        prompt: &[u32],
        block_size: usize,
        lora: Option<&str>,
    ) {
        let lora: Option<std::sync::Arc<str>> = lora.map(Into::into);
        for (&h, tokens) in hashes.iter().zip(prompt.chunks_exact(block_size)) {
            self.blocks
                .entry(h)
                .or_insert_with(|| Entry {
                    tokens: tokens.into(),
                    lora: lora.clone(),
                    refs: 0,
                })
                .refs += 1;
        }
    }

    /// Drops the references [`BlockTokens::retain`] took for `hashes`.
    pub fn release(&mut self, hashes: &[SequenceHash]) {
        for h in hashes {
            if let Some(e) = self.blocks.get_mut(h) {
                e.refs -= 1;
                if e.refs == 0 {
                    self.blocks.remove(h);
                }
            }
        }
    }

    /// The block's tokens and the adapter it was computed under.
    pub fn get(&self, h: SequenceHash) -> Option<(&[u32], Option<&str>)> {
        self.blocks.get(&h).map(|e| (&*e.tokens, e.lora.as_deref()))
    }

    /// Blocks known.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_common::hashing::BlockHashes;

    #[test]
    fn shared_blocks_live_until_their_last_request_ends() {
        let a: Vec<u32> = (0..10).collect();
        let mut b = a[..8].to_vec();
        b.extend([100, 101, 102, 103]);
        let ha = BlockHashes::of_tokens(&a, 4, None).sequence;
        let hb = BlockHashes::of_tokens(&b, 4, None).sequence;
        assert_eq!(ha[..2], hb[..2]);
        let mut t = BlockTokens::default();
        t.retain(&ha, &a, 4, None);
        t.retain(&hb, &b, 4, Some("sql"));
        assert_eq!(t.len(), 3, "two shared blocks and b's own third");
        assert_eq!(t.get(ha[1]), Some((&[4, 5, 6, 7][..], None)));
        t.release(&ha);
        assert_eq!(t.get(hb[2]), Some((&[100, 101, 102, 103][..], Some("sql"))));
        assert_eq!(t.get(ha[0]), Some((&[0, 1, 2, 3][..], None)));
        t.release(&hb);
        assert!(t.is_empty());
    }
}
