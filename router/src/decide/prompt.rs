//! The request as a selection needs it ([`Prepared`], built once per request and kept while it
//! waits in a queue): the prompt's local block hashes at the partition's block size, of the
//! blocks an engine can reuse.

use std::sync::Arc;

use kvroute_common::RequestId;
use kvroute_common::hashing::{LocalBlockHash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::{Disaggregation, SelectRequest};

use super::candidates::Partition;
use crate::select::SelectFailure;

/// The prompt as the selection needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The blocks an engine can reuse. From token ids: the full blocks of all tokens but the
    /// last, since an engine always computes the last prompt token (vLLM and SGLang cap a hit at
    /// length − 1 tokens, so a prompt of exactly N blocks reuses N − 1). From the caller's
    /// hashes: those hashes.
    pub hashes: Vec<LocalBlockHash>,
    /// Prompt tokens (full blocks × block size when only hashes were given).
    pub tokens: u64,
}

impl Prompt {
    pub fn blocks(&self) -> u32 {
        u32::try_from(self.hashes.len()).unwrap_or(u32::MAX)
    }
}

/// A request prepared for selection: its id, its partition's workers and its prompt hashed at
/// their block size.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub request: SelectRequest,
    pub request_id: RequestId,
    pub partition: Arc<Partition>,
    pub prompt: Prompt,
    /// A request decided in the prefill partition that gets a decode hop after its prefill
    /// decision (how: always, or by the conditional rule); `None`: one hop.
    pub pair: Option<Disaggregation>,
}

impl Prepared {
    /// Hashes `request`'s prompt for `partition` (see [`prompt`]).
    pub fn new(
        request: SelectRequest,
        request_id: RequestId,
        partition: Arc<Partition>,
    ) -> Result<Self, SelectFailure> {
        let prompt = prompt(&request, &partition)?;
        Ok(Self {
            request,
            request_id,
            partition,
            prompt,
            pair: None,
        })
    }

    /// A request whose prompt the caller hashed (tests, and `kvroute-sim`, whose prompt counts
    /// the blocks of all its tokens).
    pub fn with_prompt(
        request: SelectRequest,
        request_id: RequestId,
        partition: Arc<Partition>,
        prompt: Prompt,
    ) -> Self {
        Self {
            request,
            request_id,
            partition,
            prompt,
            pair: None,
        }
    }

    /// The same request over its partition's workers as they are now (a queued request's
    /// turn): hashed again only when their block size changed.
    pub fn refresh(&mut self, partition: Arc<Partition>) -> Result<(), SelectFailure> {
        if partition.block_size != self.partition.block_size {
            self.prompt = prompt(&self.request, &partition)?;
        }
        self.partition = partition;
        Ok(())
    }
}

/// Hashes the prompt with the partition's block size (or checks the caller's hashes used it).
pub fn prompt(request: &SelectRequest, partition: &Partition) -> Result<Prompt, SelectFailure> {
    let block_size = partition.block_size;
    if let Some(tokens) = &request.token_ids {
        let seed = seed_for_lora(request.lora_name.as_deref());
        let reusable = &tokens[..tokens.len().saturating_sub(1)];
        return Ok(Prompt {
            hashes: local_block_hashes(reusable, block_size as usize, seed),
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
        // Exactly 3 blocks: the last token is always computed, so 2 can be reused.
        let mut r = request();
        r.token_ids = Some((0..48).collect());
        assert_eq!(prompt(&r, &partition).unwrap().blocks(), 2);
        r.token_ids = Some((0..49).collect());
        let p = prompt(&r, &partition).unwrap();
        assert_eq!((p.blocks(), p.tokens), (3, 49));
        r.token_ids = Some(vec![]);
        assert_eq!(prompt(&r, &partition).unwrap().blocks(), 0);
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
