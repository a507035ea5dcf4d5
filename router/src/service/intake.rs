//! The edge where requests come in: the queue-group subscription on `kvroute.<ns>.select` and
//! this replica's direct subject `kvroute.<ns>.router.<id>.select` (one task per request, at
//! most `--max-in-flight` at once), held only while the replica is ready and keeping up (the
//! watchdog decides; out of the group, what was already delivered is still answered);
//! decoding with typed error codes and the checks that need no worker state.

use std::sync::Arc;

use kvroute_common::codec::{DecodeError, decode};
use kvroute_common::messages::{ErrorCode, SelectRequest, now_ms};
use kvroute_common::ops::{InFlight, Membership, serve_membership};
use tokio::sync::{Semaphore, watch};

use super::Router;

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

/// The request's clock: one wall-clock reading at intake, advanced by the monotonic clock;
/// the one place the selection path reads the clocks (the pure core takes `now_ms` as an
/// argument).
#[derive(Debug, Clone, Copy)]
#[allow(
    clippy::disallowed_types,
    reason = "a shell: stamps each request with the clock at intake"
)]
pub(super) struct Clock {
    pub(super) wall_ms: u64,
    at: std::time::Instant,
}

#[allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "a shell: stamps each request with the clock at intake"
)]
impl Clock {
    pub(super) fn now() -> Self {
        Self {
            wall_ms: now_ms(),
            at: std::time::Instant::now(),
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.wall_ms + u64::try_from(self.at.elapsed().as_millis()).unwrap_or(u64::MAX / 2)
    }

    /// Time since the reading at intake.
    pub(super) fn elapsed(&self) -> std::time::Duration {
        self.at.elapsed()
    }

    pub(super) fn expired(&self, request: &SelectRequest) -> bool {
        request.deadline_ms.is_some_and(|d| self.now_ms() > d)
    }
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
}
