//! The engines' ZMQ sockets (libzmq through the `zmq` crate; blocking, so each rank has its own
//! thread): the live SUB socket and the replay request over a DEALER.
//!
//! Live frames are `[topic, seq (8-byte big-endian), payload]`. A replay request is
//! `["", start_seq (8-byte BE)]` to the engine's ROUTER; it answers one message per buffered
//! batch from `start_seq` on — `["", topic, seq, payload]` (vLLM 0.32 and SGLang 0.5 send the
//! topic; `["", seq, payload]` is accepted too) — and ends with seq −1 and an empty payload.
//!
//! Why libzmq (zmq-sys builds libzmq 4.3.4 from source, so no system package) and not the
//! pure-Rust `zeromq` crate, measured on 2026-12-01 (libzmq PUB on loopback, 200,000 messages
//! of 1.2 KB): both receive at the sender's pace (libzmq 425k and 407k msg/s, `zeromq` 497k
//! and 420k msg/s in two runs) and both reconnect after the publisher restarts; but `zeromq`
//! 0.7's `connect` to an endpoint nobody has bound yet blocks for 30 s and then fails, where
//! libzmq connects lazily and retries (a bridge routinely starts before its engine), and
//! libzmq is what the engines' own pyzmq uses, so the ROUTER / DEALER replay exchange is the
//! engines' own peer.

use std::time::{Duration, Instant};

/// Largest message libzmq accepts at all: it drops the connection of a peer sending more (a
/// guard for memory; the engine reconnects and the seq gap that follows is replayed).
pub const MAX_PAYLOAD_BYTES: i64 = 64 * 1024 * 1024;

/// Largest batch payload decoded; a larger one is counted (`oversize`) and skipped. The
/// engines' batches are a few KB to a few MB.
pub const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;

/// The seq of the replay's end marker (−1 as 8 big-endian bytes).
const END_SEQ: u64 = u64::MAX;

/// Most payload bytes one replay answer may bring; a larger answer is refused (memory bound).
pub const MAX_REPLAY_BYTES: usize = 2 << 30;

/// Why a live message was skipped (stable: metric label values).
pub fn frames_error(frames: &[Vec<u8>]) -> Option<&'static str> {
    match frames {
        [_, seq, _] if seq.len() != 8 => Some("bad_seq_frame"),
        [_, _, _] => None,
        _ => Some("frame_count"),
    }
}

pub fn seq_of(frame: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&frame[..8]);
    u64::from_be_bytes(b)
}

/// A rank's live subscription.
pub struct Subscriber {
    socket: zmq::Socket,
}

impl std::fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Subscriber")
    }
}

impl Subscriber {
    /// Connects (lazily: libzmq retries until the engine binds) and subscribes to `topic`.
    pub fn connect(ctx: &zmq::Context, endpoint: &str, topic: &str) -> zmq::Result<Self> {
        let socket = ctx.socket(zmq::SUB)?;
        socket.set_rcvhwm(1_000_000)?;
        socket.set_maxmsgsize(MAX_PAYLOAD_BYTES)?;
        socket.set_reconnect_ivl(100)?;
        socket.set_reconnect_ivl_max(2_000)?;
        socket.set_linger(0)?;
        socket.set_rcvtimeo(100)?;
        socket.set_subscribe(topic.as_bytes())?;
        socket.connect(endpoint)?;
        Ok(Self { socket })
    }

    /// The next message, or `None` after the 100 ms receive timeout.
    pub fn recv(&self) -> zmq::Result<Option<Vec<Vec<u8>>>> {
        match self.socket.recv_multipart(0) {
            Ok(frames) => Ok(Some(frames)),
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay socket: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("the replay stalled: nothing for {0:?}")]
    Timeout(Duration),
    #[error("the replay brought more than {MAX_REPLAY_BYTES} bytes")]
    TooLarge,
    #[error("malformed replay message ({0} frames)")]
    Malformed(usize),
}

/// Asks the engine's replay ROUTER for every buffered batch from `start` on: `(seq, payload)`
/// in order. The engines answer a `start` older than their buffer from the oldest batch they
/// kept, silently, and their ROUTER drops messages past its high-water mark: the caller checks
/// the seqs ([`crate::sequence::judge_replay`]). `idle` bounds the wait for each message, so a
/// long replay that keeps coming is never cut, however many batches it brings.
pub fn replay(
    ctx: &zmq::Context,
    endpoint: &str,
    start: u64,
    idle: Duration,
) -> Result<Vec<(u64, Vec<u8>)>, ReplayError> {
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.set_maxmsgsize(MAX_PAYLOAD_BYTES)?;
    socket.set_rcvhwm(1_000_000)?;
    socket.connect(endpoint)?;
    socket.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)?;
    socket.set_rcvtimeo(idle.as_millis().clamp(1, i32::MAX as u128) as i32)?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    let mut deadline = Instant::now() + idle;
    loop {
        let frames = match socket.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => return Err(ReplayError::Timeout(idle)),
            // A signal: the wait goes on, but only until the current message's deadline.
            Err(zmq::Error::EINTR) if Instant::now() < deadline => continue,
            Err(zmq::Error::EINTR) => return Err(ReplayError::Timeout(idle)),
            Err(e) => return Err(e.into()),
        };
        deadline = Instant::now() + idle;
        let (seq, payload) = match frames.as_slice() {
            [empty, _topic, seq, payload] if empty.is_empty() && seq.len() == 8 => (seq, payload),
            [empty, seq, payload] if empty.is_empty() && seq.len() == 8 => (seq, payload),
            other => return Err(ReplayError::Malformed(other.len())),
        };
        let seq = seq_of(seq);
        if seq == END_SEQ {
            return Ok(out);
        }
        bytes = bytes.saturating_add(payload.len());
        if bytes > MAX_REPLAY_BYTES {
            return Err(ReplayError::TooLarge);
        }
        out.push((seq, payload.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frames_are_checked() {
        assert_eq!(frames_error(&[vec![], vec![0; 8], vec![1]]), None);
        assert_eq!(
            frames_error(&[vec![], vec![0; 7], vec![1]]),
            Some("bad_seq_frame")
        );
        assert_eq!(frames_error(&[vec![0; 8], vec![1]]), Some("frame_count"));
        assert_eq!(frames_error(&[]), Some("frame_count"));
        assert_eq!(seq_of(&5u64.to_be_bytes()), 5);
    }
}
