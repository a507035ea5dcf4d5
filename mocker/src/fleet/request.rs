//! A decoded [`GenerateRequest`] checked against the worker and turned into the engine's
//! [`SimRequest`]; every refusal is a [`GenerateError`] with a stable code.

use kvroute_common::hashing::{BLOCK_HASH_SEED, BlockHashes, sequence_hashes};
use kvroute_common::messages::{GenerateError, GenerateErrorCode, GenerateRequest};
use kvroute_common::{DecodeError, DpRank, RequestId};

use crate::engine::{SimRequest, SubmitError};

/// The error reply for a request that could not be decoded.
pub fn decode_error(e: &DecodeError) -> GenerateError {
    GenerateError::undecodable(e)
}

/// The error reply for a request the engine refused.
pub fn submit_error(e: &SubmitError) -> GenerateError {
    let (request_id, code) = match e {
        SubmitError::Duplicate { request_id } => (*request_id, GenerateErrorCode::Duplicate),
        SubmitError::BlockCountMismatch { request_id, .. } => {
            (*request_id, GenerateErrorCode::BadRequest)
        }
        SubmitError::TooLarge { request_id, .. } => (*request_id, GenerateErrorCode::TooLarge),
    };
    error(Some(request_id), code, e.to_string())
}

pub fn error(
    request_id: Option<RequestId>,
    code: GenerateErrorCode,
    message: impl Into<String>,
) -> GenerateError {
    GenerateError::new(request_id, code, message)
}

/// Checks `req` against a worker serving `dp_rank` with `block_size`-token blocks.
pub fn to_sim_request(
    req: &GenerateRequest,
    block_size: u32,
    dp_rank: DpRank,
) -> Result<SimRequest, GenerateError> {
    let id = req.request_id;
    let bad = |message: String| error(Some(id), GenerateErrorCode::BadRequest, message);
    if let Some(rank) = req.dp_rank
        && rank != dp_rank
    {
        return Err(error(
            Some(id),
            GenerateErrorCode::UnknownDpRank,
            format!("dp rank {rank} is not served here (this worker serves rank {dp_rank})"),
        ));
    }
    let lora = req.lora_name.as_deref();
    match (&req.token_ids, &req.block_hashes) {
        (Some(_), Some(_)) => Err(bad("give token_ids or block_hashes, not both".into())),
        (None, None) => Err(bad("one of token_ids or block_hashes is required".into())),
        (Some(tokens), None) => {
            if tokens.is_empty() {
                return Err(bad("the prompt is empty".into()));
            }
            Ok(SimRequest::from_tokens(
                id,
                tokens,
                req.max_tokens,
                block_size,
                lora,
            ))
        }
        (None, Some(local)) => {
            if req.block_size != Some(block_size) {
                return Err(bad(format!(
                    "block_hashes need block_size {block_size} (this worker's), got {:?}",
                    req.block_size
                )));
            }
            let full = local.len() as u64 * u64::from(block_size);
            let prompt_tokens = u64::from(req.prompt_tokens.unwrap_or(0)).max(full);
            if prompt_tokens == 0 {
                return Err(bad("the prompt is empty".into()));
            }
            if prompt_tokens >= full + u64::from(block_size) || prompt_tokens > u64::from(u32::MAX)
            {
                return Err(bad(format!(
                    "prompt_tokens {prompt_tokens} does not match {} blocks of {block_size}",
                    local.len()
                )));
            }
            let sequence = sequence_hashes(local, BLOCK_HASH_SEED);
            Ok(SimRequest {
                request_id: id,
                prompt_tokens: prompt_tokens as u32,
                output_tokens: req.max_tokens,
                hashes: BlockHashes {
                    local: local.clone(),
                    sequence,
                },
                report_tokens: false,
                shared_blocks: 0,
                transferred_tokens: 0,
                lora_name: req.lora_name.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn request() -> GenerateRequest {
        GenerateRequest {
            request_id: Uuid::from_u128(1),
            token_ids: Some((0..40).collect()),
            max_tokens: 5,
            ..GenerateRequest::default()
        }
    }

    #[test]
    fn tokens_and_block_hashes_give_the_same_engine_request() {
        let from_tokens = to_sim_request(&request(), 16, 0).unwrap();
        assert_eq!(from_tokens.prompt_tokens, 40);
        assert_eq!(from_tokens.hashes.sequence.len(), 2);
        let hashed = GenerateRequest {
            token_ids: None,
            block_hashes: Some(from_tokens.hashes.local.clone()),
            block_size: Some(16),
            prompt_tokens: Some(40),
            ..request()
        };
        assert_eq!(to_sim_request(&hashed, 16, 0).unwrap(), from_tokens);
        let no_length = GenerateRequest {
            prompt_tokens: None,
            ..hashed.clone()
        };
        assert_eq!(to_sim_request(&no_length, 16, 0).unwrap().prompt_tokens, 32);
    }

    #[test]
    fn refusals_carry_codes() {
        let code = |req: GenerateRequest| to_sim_request(&req, 16, 0).unwrap_err().code;
        assert_eq!(
            code(GenerateRequest {
                dp_rank: Some(3),
                ..request()
            }),
            GenerateErrorCode::UnknownDpRank
        );
        assert_eq!(
            code(GenerateRequest {
                token_ids: Some(vec![]),
                ..request()
            }),
            GenerateErrorCode::BadRequest
        );
        assert_eq!(
            code(GenerateRequest {
                token_ids: None,
                ..request()
            }),
            GenerateErrorCode::BadRequest
        );
        assert_eq!(
            code(GenerateRequest {
                block_hashes: Some(vec![1]),
                ..request()
            }),
            GenerateErrorCode::BadRequest
        );
        let hashed = GenerateRequest {
            token_ids: None,
            block_hashes: Some(vec![1, 2]),
            block_size: Some(32),
            ..request()
        };
        assert_eq!(code(hashed.clone()), GenerateErrorCode::BadRequest);
        assert_eq!(
            code(GenerateRequest {
                block_size: Some(16),
                prompt_tokens: Some(48),
                ..hashed
            }),
            GenerateErrorCode::BadRequest
        );
        let e = decode_error(&DecodeError::UnsupportedVersion {
            message: "GenerateRequest",
            version: 2,
            supported: 1,
        });
        assert_eq!(
            (e.code, e.request_id),
            (GenerateErrorCode::UnsupportedVersion, None)
        );
    }
}
