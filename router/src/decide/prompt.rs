//! The prompt as a selection needs it: local block hashes at the partition's block size.

use kvroute_common::hashing::{LocalBlockHash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::SelectRequest;

use super::candidates::Partition;
use crate::select::SelectFailure;

/// The prompt as the selection needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub hashes: Vec<LocalBlockHash>,
    /// Prompt tokens (full blocks × block size when only hashes were given).
    pub tokens: u64,
}

impl Prompt {
    pub fn blocks(&self) -> u32 {
        u32::try_from(self.hashes.len()).unwrap_or(u32::MAX)
    }
}

/// Hashes the prompt with the partition's block size (or checks the caller's hashes used it).
pub fn prompt(request: &SelectRequest, partition: &Partition) -> Result<Prompt, SelectFailure> {
    let block_size = partition.block_size;
    if let Some(tokens) = &request.token_ids {
        let seed = seed_for_lora(request.lora_name.as_deref());
        return Ok(Prompt {
            hashes: local_block_hashes(tokens, block_size as usize, seed),
            tokens: tokens.len() as u64,
        });
    }
    let hashes = request.block_hashes.clone().unwrap_or_default();
    if let Some(given) = request.block_size
        && given != block_size
    {
        return Err(SelectFailure::BadRequest {
            message: format!(
                "block_size {given} does not match the workers' block size {block_size} for model {:?}",
                request.model
            ),
        });
    }
    let tokens = hashes.len() as u64 * u64::from(block_size);
    Ok(Prompt { hashes, tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> SelectRequest {
        SelectRequest {
            model: "m".into(),
            token_ids: Some((0..40).collect()),
            ..SelectRequest::default()
        }
    }

    #[test]
    fn hashes_full_blocks_and_checks_the_callers_block_size() {
        let partition = Partition {
            cards: vec![],
            block_size: 16,
        };
        let p = prompt(&request(), &partition).unwrap();
        assert_eq!((p.blocks(), p.tokens), (2, 40));
        let mut r = request();
        r.token_ids = None;
        r.block_hashes = Some(vec![1, 2, 3]);
        r.block_size = Some(32);
        assert!(prompt(&r, &partition).is_err());
        r.block_size = Some(16);
        let p = prompt(&r, &partition).unwrap();
        assert_eq!((p.blocks(), p.tokens), (3, 48));
    }
}
