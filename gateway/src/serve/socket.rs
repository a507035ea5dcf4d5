//! One client connection's socket, watched: a read fails once the head or the idle period
//! outlasts its timeout, a write once the client took nothing for `--write-timeout-ms`, and
//! hyper's own empty answer to a head it cannot parse (a bare CR, a NUL, an invalid method, a
//! head above its buffer) is replaced with the same status in OpenAI's JSON. The answer is known
//! to be hyper's because no request of the gateway's is in flight on the connection: a request
//! counts from its head until hyper flushed the last byte of its response ([`Tracked`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};

use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use super::Limits;

/// What one connection is doing, shared by its IO (reads), its service (requests) and the
/// accept loop (eviction).
#[derive(Debug)]
pub(super) struct Activity {
    state: Mutex<ActivityState>,
    /// Notified to close the connection now.
    pub(super) evict: Notify,
    /// A read failed for the head or idle timeout.
    pub(super) timed_out: AtomicBool,
}

#[derive(Debug)]
struct ActivityState {
    /// Requests whose response is not fully sent.
    active: u32,
    /// When the connection last had no request (its start, or the end of the last response).
    idle_since: Instant,
    /// The first byte of the next head, while no request is active.
    head_started: Option<Instant>,
    /// No request was read yet.
    fresh: bool,
    /// Responses whose body hyper finished, not yet flushed to the socket.
    unflushed: u32,
    /// The read that found no deadline (a request active): woken when the request ends, so the
    /// idle deadline starts counting.
    reader: Option<Waker>,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            state: Mutex::new(ActivityState {
                active: 0,
                idle_since: Instant::now(),
                head_started: None,
                fresh: true,
                unflushed: 0,
                reader: None,
            }),
            evict: Notify::new(),
            timed_out: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        self.state.lock().expect("connection activity lock")
    }

    /// When the connection must have made progress: the head's deadline, or the idle one; none
    /// while a request is active.
    fn deadline(&self, limits: &Limits, waker: &Waker) -> Option<Instant> {
        let mut s = self.lock();
        if s.active > 0 {
            s.reader = Some(waker.clone());
            return None;
        }
        Some(match s.head_started {
            Some(t) => t + limits.header_read_timeout,
            None if s.fresh => s.idle_since + limits.header_read_timeout,
            None => s.idle_since + limits.idle_timeout,
        })
    }

    pub(super) fn request_started(&self) {
        let mut s = self.lock();
        s.active += 1;
        s.head_started = None;
        s.fresh = false;
    }

    /// hyper has the response's last byte; the request ends once it is flushed.
    fn response_done(&self) {
        self.lock().unflushed += 1;
    }

    /// The socket was flushed: the responses hyper had finished are sent.
    fn flushed(&self) {
        let mut s = self.lock();
        if s.unflushed == 0 {
            return;
        }
        s.active = s.active.saturating_sub(s.unflushed);
        s.unflushed = 0;
        if s.active == 0 {
            s.idle_since = Instant::now();
            s.head_started = None;
            if let Some(reader) = s.reader.take() {
                reader.wake();
            }
        }
    }

    fn bytes_read(&self) {
        let mut s = self.lock();
        if s.active == 0 && s.head_started.is_none() {
            s.head_started = Some(Instant::now());
        }
    }

    pub(super) fn idle(&self) -> bool {
        self.lock().active == 0
    }
}

/// The client's socket, failing a read once the connection's deadline passed.
pub(super) struct Guarded {
    inner: TcpStream,
    activity: Arc<Activity>,
    limits: Limits,
    timer: Pin<Box<Sleep>>,
    armed_for: Option<Instant>,
    /// Since when writes have been blocked (the client reads nothing), and the timer for it.
    write_blocked_since: Option<Instant>,
    write_timer: Pin<Box<Sleep>>,
    write_armed_for: Option<Instant>,
    /// The gateway's JSON answer written instead of hyper's own error answer, and how much of
    /// it is written; hyper's bytes are dropped from then on.
    replacement: Option<(Vec<u8>, usize)>,
}

impl Guarded {
    pub(super) fn new(inner: TcpStream, activity: Arc<Activity>, limits: Limits) -> Self {
        let now = Instant::now();
        Self {
            inner,
            activity,
            limits,
            timer: Box::pin(tokio::time::sleep_until(now + limits.header_read_timeout)),
            armed_for: None,
            write_blocked_since: None,
            write_timer: Box::pin(tokio::time::sleep_until(now + limits.write_timeout)),
            write_armed_for: None,
            replacement: None,
        }
    }

    /// Whether `first` (the start of a write) is to be replaced: hyper's own answer to a head it
    /// could not parse, written while no request of the gateway is in flight.
    fn replaces(&mut self, first: &[u8]) -> bool {
        if self.replacement.is_some() {
            return true;
        }
        if !first.starts_with(b"HTTP/1.") || !self.activity.idle() {
            return false;
        }
        let status = first
            .get(9..12)
            .and_then(|code| std::str::from_utf8(code).ok())
            .and_then(|code| code.parse::<u16>().ok())
            .and_then(|code| axum::http::StatusCode::from_u16(code).ok())
            .unwrap_or(axum::http::StatusCode::BAD_REQUEST);
        self.replacement = Some((hyper_error_answer(status), 0));
        true
    }

    /// A write's outcome, failed once writes stayed blocked for `--write-timeout-ms`.
    fn watch_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.write_blocked_since = None;
            return r;
        }
        let since = *self.write_blocked_since.get_or_insert_with(Instant::now);
        let deadline = since + self.limits.write_timeout;
        if self.write_armed_for != Some(deadline) {
            self.write_timer.as_mut().reset(deadline);
            self.write_armed_for = Some(deadline);
        }
        match self.write_timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.activity.timed_out.store(true, Ordering::Relaxed);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing in time",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// Writes the replacement; ready once all of it is written.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some((bytes, written)) = &mut self.replacement else {
            return Poll::Ready(Ok(()));
        };
        while *written < bytes.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }
}

/// The gateway's answer for a head hyper refused with `status`: OpenAI's JSON, then close.
fn hyper_error_answer(status: axum::http::StatusCode) -> Vec<u8> {
    use crate::error::ApiError;
    let error = match status.as_u16() {
        431 => ApiError {
            status,
            code: "request_header_fields_too_large",
            ..ApiError::invalid("the request line and headers are larger than this server reads")
        },
        414 => ApiError {
            status,
            code: "uri_too_long",
            ..ApiError::invalid("the request's URI is too long")
        },
        _ => ApiError {
            status,
            code: "malformed_request",
            ..ApiError::invalid(
                "the request line or a header could not be parsed (a bare CR, a NUL, an invalid \
                 method, URI, header name or HTTP version)",
            )
        },
    };
    let body = error.body();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.activity.bytes_read();
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        let Some(deadline) = this.activity.deadline(&this.limits, cx.waker()) else {
            return Poll::Pending;
        };
        if this.armed_for != Some(deadline) {
            this.timer.as_mut().reset(deadline);
            this.armed_for = Some(deadline);
        }
        match this.timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.activity.timed_out.store(true, Ordering::Relaxed);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no complete request in time",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.replaces(buf) {
            ready!(this.poll_replacement(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch_write(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        if this.replaces(first) {
            ready!(this.poll_replacement(cx))?;
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_replacement(cx))?;
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        this.activity.flushed();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// A response body that marks its request ended when hyper is done with it.
pub(super) struct Tracked {
    inner: Body,
    activity: Arc<Activity>,
}

impl Tracked {
    pub(super) fn new(inner: Body, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.activity.response_done();
    }
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_fresh_connection_has_the_head_timeout_and_a_kept_one_the_idle_timeout() {
        let limits = Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        };
        let a = Activity::new();
        let w = Waker::noop();
        let start = a.lock().idle_since;
        assert_eq!(
            a.deadline(&limits, w),
            Some(start + limits.header_read_timeout)
        );
        a.request_started();
        assert_eq!(
            a.deadline(&limits, w),
            None,
            "no deadline while a request is active"
        );
        a.response_done();
        assert_eq!(
            a.deadline(&limits, w),
            None,
            "nor until its response is flushed"
        );
        a.flushed();
        let idle = a.lock().idle_since;
        assert_eq!(a.deadline(&limits, w), Some(idle + limits.idle_timeout));
        a.bytes_read();
        let head = a.lock().head_started.expect("the next head started");
        assert_eq!(
            a.deadline(&limits, w),
            Some(head + limits.header_read_timeout)
        );
    }
}
