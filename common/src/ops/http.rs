//! The HTTP/1.1 server of the operations endpoints, on hyper: GET (and HEAD) only, one
//! response per connection. Enough for Prometheus scrapes, health probes and `curl`, and bounded
//! against clients that misbehave: the request head must arrive whole within
//! [`HEADER_READ_TIMEOUT`] and fit in [`MAX_HEAD_BYTES`], a GET with a body is refused, a
//! connection lives at most [`CONNECTION_DEADLINE`], and at most [`MAX_CONNECTIONS`] are open at
//! once (beyond that a new connection is closed at once).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, TRANSFER_ENCODING};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How long a client has to send its whole request head (request line and headers), counted
/// from the connection's start: a slow or idle client is disconnected after it.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head (request line and headers) read; a longer one is answered 431.
pub const MAX_HEAD_BYTES: usize = 8192;
/// The most headers a request may carry.
const MAX_HEADERS: usize = 64;
/// The longest a connection lives, response included (a client that never reads its answer).
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(30);
/// The most connections served at once; further ones are closed as soon as they are accepted.
pub const MAX_CONNECTIONS: usize = 256;

/// A response: status, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl HttpResponse {
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: body.into(),
        }
    }
    /// A [`Registry::render`](super::Registry::render) text.
    pub fn prometheus(body: String) -> Self {
        Self {
            status: 200,
            content_type: super::metrics::OPENMETRICS_CONTENT_TYPE,
            body,
        }
    }
}

/// Answers a GET for a path (query string included). Asynchronous, so a handler may ask the
/// process's main loop for a consistent view.
pub trait HttpHandler: Send + Sync + 'static {
    fn get(&self, path: &str) -> futures::future::BoxFuture<'static, HttpResponse>;
}

/// The HTTP listener could not bind: names the flag and the address.
#[derive(Debug, thiserror::Error)]
#[error("--{flag} {addr}: {}", reason(error))]
pub struct ListenError {
    /// The address's flag, without dashes (`http-addr`).
    pub flag: &'static str,
    pub addr: SocketAddr,
    pub error: std::io::Error,
}

fn reason(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::AddrInUse => "address already in use (another process listens there)".into(),
        ErrorKind::AddrNotAvailable => "address not available on this machine".into(),
        ErrorKind::PermissionDenied => {
            "permission denied (ports below 1024 need privileges)".into()
        }
        _ => crate::config::io_reason(e),
    }
}

/// Bounds on what a client may cost the server.
#[derive(Debug, Clone, Copy)]
struct Limits {
    header_read_timeout: Duration,
    connection_deadline: Duration,
    max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: HEADER_READ_TIMEOUT,
            connection_deadline: CONNECTION_DEADLINE,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Binds `addr` (the value of `--flag`) and serves until the task is dropped; returns the
/// bound address (port 0 picks a free port).
pub async fn serve_http(
    flag: &'static str,
    addr: SocketAddr,
    handler: Arc<dyn HttpHandler>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ListenError> {
    serve_with(flag, addr, handler, Limits::default()).await
}

async fn serve_with(
    flag: &'static str,
    addr: SocketAddr,
    handler: Arc<dyn HttpHandler>,
    limits: Limits,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ListenError> {
    let listen_error = |error| ListenError { flag, addr, error };
    let listener = TcpListener::bind(addr).await.map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?;
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let task = tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, "operations endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                continue; // dropping the stream closes it
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(answer(&*handler, request).await) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_read_timeout)
                    .max_buf_size(MAX_HEAD_BYTES)
                    .max_headers(MAX_HEADERS)
                    .keep_alive(false)
                    .serve_connection(TokioIo::new(stream), service);
                // Errors are the client's (malformed, too slow, gone): hyper has answered 4xx
                // where it could, and the connection closes either way.
                let _ = tokio::time::timeout(limits.connection_deadline, connection).await;
                drop(permit);
            });
        }
    });
    Ok((bound, task))
}

/// One request's response: the handler's for a GET or HEAD without a body, 405 or 400 else.
async fn answer(handler: &dyn HttpHandler, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = request.method();
    let response = if method != Method::GET && method != Method::HEAD {
        HttpResponse::text(405, "only GET is supported\n")
    } else if has_body(&request) {
        HttpResponse::text(400, "a GET request has no body\n")
    } else {
        let path = request.uri().path_and_query().map_or("/", |p| p.as_str());
        handler.get(path).await
    };
    let mut built = Response::new(Full::new(Bytes::from(response.body)));
    *built.status_mut() =
        StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    built.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(response.content_type),
    );
    if response.status == 405 {
        built
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
    }
    built
}

fn has_body(request: &Request<Incoming>) -> bool {
    let headers = request.headers();
    headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

#[cfg(test)]
mod tests;
