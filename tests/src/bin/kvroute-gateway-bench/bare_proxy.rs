//! The bare reverse proxy, the gateway's peer: axum in, reqwest out, to one fixed engine —
//! no parsing, tokenization or selection. It reads the request body whole (as the gateway
//! must, and as nginx does by default), forwards it with the content type, and streams the
//! answer's body back as it arrives.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt as _;

#[derive(Debug)]
struct Upstream {
    base: String,
    http: reqwest::Client,
}

async fn forward(State(up): State<Arc<Upstream>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let url = format!("{}{}", up.base, parts.uri.path());
    let mut out = up.http.request(parts.method, url).body(body);
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        out = out.header(header::CONTENT_TYPE, ct);
    }
    let answer = match out.send().await {
        Ok(a) => a,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let status = answer.status();
    let content_type = answer.headers().get(header::CONTENT_TYPE).cloned();
    let mut response = Response::new(Body::from_stream(answer.bytes_stream()));
    *response.status_mut() = status;
    if let Some(ct) = content_type {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
}

/// Serves the proxy to `engine` on a free loopback port of the current runtime.
pub async fn start(engine: SocketAddr) -> anyhow::Result<SocketAddr> {
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(60))
        .build()?;
    let upstream = Arc::new(Upstream {
        base: format!("http://{engine}"),
        http,
    });
    let app = Router::new().fallback(forward).with_state(upstream);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // TCP_NODELAY on accepted connections, as engines' servers and nginx set it.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("bare proxy: {e}");
        }
    });
    Ok(addr)
}
