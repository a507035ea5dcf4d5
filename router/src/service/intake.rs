//! The edge where requests come in: the queue-group subscription on `kvroute.<ns>.select` and
//! this replica's direct subject `kvroute.<ns>.router.<id>.select` (one task per request, at
//! most `--max-in-flight` at once), held only while the replica is ready and keeping up (the
//! watchdog decides; out of the group, what was already delivered is still answered);
//! decoding with typed error codes, and the checks and prompt hashing that need the model's
//! block size.

use std::sync::Arc;

use kvroute_common::codec::{DecodeError, decode};
use kvroute_common::hashing::{LocalBlockHash, local_block_hashes, seed_for_lora};
use kvroute_common::messages::{ErrorCode, SelectRequest};
use kvroute_common::ops::{InFlight, Membership, serve_membership};
use tokio::sync::{Semaphore, watch};

use super::Router;
use super::candidates::Partition;

/// Longest accepted session id, in bytes (it becomes a bucket key, hex-encoded).
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// A request that cannot be served, before selection: code and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub code: ErrorCode,
    pub message: String,
}

impl Rejected {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::BadRequest,
            message: message.into(),
        }
    }
}

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

/// Decodes a request and checks what needs no worker state.
pub fn parse(payload: &[u8]) -> Result<SelectRequest, Rejected> {
    let request: SelectRequest = decode(payload).map_err(|e| Rejected {
        code: match e {
            DecodeError::TooLarge { .. } => ErrorCode::TooLarge,
            DecodeError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            DecodeError::Empty { .. } | DecodeError::Malformed { .. } => ErrorCode::BadRequest,
        },
        message: e.to_string(),
    })?;
    if request.model.is_empty() {
        return Err(Rejected::bad("model must not be empty"));
    }
    match (&request.token_ids, &request.block_hashes) {
        (None, None) => return Err(Rejected::bad("one of token_ids, block_hashes is required")),
        (Some(_), Some(_)) => {
            return Err(Rejected::bad("give token_ids or block_hashes, not both"));
        }
        (Some(tokens), None) if tokens.is_empty() => {
            return Err(Rejected::bad("token_ids must not be empty (the prompt)"));
        }
        (None, Some(hashes)) if hashes.is_empty() => {
            return Err(Rejected::bad(
                "block_hashes must not be empty (a prompt shorter than one block goes as token_ids)",
            ));
        }
        _ => {}
    }
    if let Some(session) = &request.session
        && (session.id.is_empty() || session.id.len() > MAX_SESSION_ID_BYTES)
    {
        return Err(Rejected::bad(format!(
            "session.id must be 1-{MAX_SESSION_ID_BYTES} bytes"
        )));
    }
    Ok(request)
}

/// Hashes the prompt with the partition's block size (or checks the caller's hashes used it).
pub fn prompt(request: &SelectRequest, partition: &Partition) -> Result<Prompt, Rejected> {
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
        return Err(Rejected::bad(format!(
            "block_size {given} does not match the workers' block size {block_size} for model {:?}",
            request.model
        )));
    }
    let tokens = hashes.len() as u64 * u64::from(block_size);
    Ok(Prompt { hashes, tokens })
}

/// Serves selections whenever `serve` is true: joins the queue group (and subscribes to the
/// direct subject), and leaves both when `serve` turns false, answering (or dropping, when
/// expired) what was delivered before. Each request runs in its own task, tracked in
/// `in_flight` from the moment it is taken.
pub async fn serve(router: Arc<Router>, serve: watch::Receiver<bool>, in_flight: Arc<InFlight>) {
    let slots = Arc::new(Semaphore::new(router.max_in_flight));
    let names = &router.names;
    let membership = Membership {
        subject: names.select(),
        queue_group: names.router_queue_group(),
        direct_subject: names.router_select(&router.router_id),
        what: "select",
    };
    let on_state = |serving: bool| {
        router
            .serving
            .store(serving, std::sync::atomic::Ordering::Release);
        router.metrics.serving.set(i64::from(serving));
    };
    let take = |msg: async_nats::Message| {
        let router = router.clone();
        let slots = slots.clone();
        let started = in_flight.enter();
        async move {
            let Ok(permit) = slots.acquire_owned().await else {
                return;
            };
            tokio::spawn(async move {
                router.handle(msg).await;
                drop((permit, started));
            });
        }
    };
    serve_membership(&router.nats, &membership, serve, on_state, take).await;
}

#[cfg(test)]
mod tests {
    use kvroute_common::codec::encode;
    use kvroute_common::messages::SessionContext;

    use super::*;

    fn request() -> SelectRequest {
        SelectRequest {
            model: "m".into(),
            token_ids: Some((0..40).collect()),
            ..SelectRequest::default()
        }
    }

    #[test]
    fn bad_requests_get_codes() {
        assert_eq!(parse(b"").unwrap_err().code, ErrorCode::BadRequest);
        assert_eq!(
            parse(b"\x93garbage").unwrap_err().code,
            ErrorCode::BadRequest
        );
        let big = vec![0u8; 5 * 1024 * 1024];
        assert_eq!(parse(&big).unwrap_err().code, ErrorCode::TooLarge);
        let mut r = request();
        r.v.0 = 99;
        assert_eq!(
            parse(&encode(&r).unwrap()).unwrap_err().code,
            ErrorCode::UnsupportedVersion
        );
        let mut r = request();
        r.token_ids = None;
        assert!(
            parse(&encode(&r).unwrap())
                .unwrap_err()
                .message
                .contains("token_ids")
        );
        let mut r = request();
        r.token_ids = Some(vec![]);
        let e = parse(&encode(&r).unwrap()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("token_ids"), "{}", e.message);
        let mut r = request();
        r.token_ids = None;
        r.block_hashes = Some(vec![]);
        let e = parse(&encode(&r).unwrap()).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("block_hashes"), "{}", e.message);
        let mut r = request();
        r.token_ids = Some(vec![1, 2, 3]);
        assert!(
            parse(&encode(&r).unwrap()).is_ok(),
            "a prompt shorter than one block is a prompt"
        );
        let mut r = request();
        r.session = Some(SessionContext::default());
        assert!(
            parse(&encode(&r).unwrap())
                .unwrap_err()
                .message
                .contains("session.id")
        );
        assert!(parse(&encode(&request()).unwrap()).is_ok());
    }

    #[test]
    fn prompts_hash_full_blocks_and_check_the_callers_block_size() {
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
