//! A minimal HTTP/1.1 server for operations endpoints (GET only, one response per connection).
//! Enough for Prometheus scrapes, health probes and `curl`; not a general web server.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

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
    pub fn prometheus(body: String) -> Self {
        Self {
            status: 200,
            content_type: "text/plain; version=0.0.4",
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

/// Binds `addr` (the value of `--flag`) and serves until the task is dropped; returns the
/// bound address (port 0 picks a free port).
pub async fn serve_http(
    flag: &'static str,
    addr: SocketAddr,
    handler: Arc<dyn HttpHandler>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ListenError> {
    let listen_error = |error| ListenError { flag, addr, error };
    let listener = TcpListener::bind(addr).await.map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut len = 0;
                // Read until the end of the request head (or the buffer is full).
                while len < buf.len() {
                    match tokio::time::timeout(
                        std::time::Duration::from_secs(5),
                        stream.read(&mut buf[len..]),
                    )
                    .await
                    {
                        Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                        Ok(Ok(n)) => len += n,
                    }
                    if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let head = String::from_utf8_lossy(&buf[..len]);
                let mut parts = head.split_whitespace();
                let response = match (parts.next(), parts.next()) {
                    (Some("GET"), Some(path)) => handler.get(path).await,
                    _ => HttpResponse::text(405, "only GET is supported\n"),
                };
                let reason = match response.status {
                    200 => "OK",
                    404 => "Not Found",
                    405 => "Method Not Allowed",
                    503 => "Service Unavailable",
                    _ => "",
                };
                let head = format!(
                    "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    response.status,
                    response.content_type,
                    response.body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(response.body.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;
    impl HttpHandler for Nothing {
        fn get(&self, _: &str) -> futures::future::BoxFuture<'static, HttpResponse> {
            Box::pin(async { HttpResponse::text(404, "") })
        }
    }

    #[tokio::test]
    async fn an_address_in_use_names_the_flag_and_the_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = serve_http("http-addr", addr, Arc::new(Nothing))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("--http-addr {addr}: address already in use (another process listens there)")
        );
    }
}
