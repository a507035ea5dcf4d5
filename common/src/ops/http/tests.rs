//! The operations server against real TCP clients on loopback: well-formed, malformed, slow,
//! oversized and too many.

use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

/// Answers `/metrics` with a fixed text, 404 elsewhere.
struct Metrics;
impl HttpHandler for Metrics {
    fn get(&self, path: &str) -> futures::future::BoxFuture<'static, HttpResponse> {
        let response = match path {
            "/metrics" => HttpResponse::prometheus("up 1\n# EOF\n".into()),
            _ => HttpResponse::text(404, "not found\n"),
        };
        Box::pin(std::future::ready(response))
    }
}

const TEST_LIMITS: Limits = Limits {
    header_read_timeout: Duration::from_millis(500),
    connection_deadline: Duration::from_secs(5),
    max_connections: 200,
};

async fn server(limits: Limits) -> SocketAddr {
    let (addr, task) = serve_with(
        "http-addr",
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(Metrics),
        limits,
    )
    .await
    .unwrap();
    // The server lives as long as the test's runtime.
    std::mem::forget(task);
    addr
}

/// Sends `raw`, then reads until the server closes: what came back (empty when it closed
/// without answering). Fails if the server neither answers nor closes within 5 s.
async fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    // The server may close before reading everything: a write error is an answer too.
    let _ = stream.write_all(raw).await;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server neither answered nor closed");
    String::from_utf8_lossy(&out).into_owned()
}

fn status(response: &str) -> Option<u16> {
    let rest = response
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| response.strip_prefix("HTTP/1.0 "))?;
    rest.get(..3)?.parse().ok()
}

/// Refused: a 4xx status, or closed without an answer.
fn assert_refused(response: &str, what: &str) {
    match status(response) {
        None => assert!(response.is_empty(), "{what}: {response:?}"),
        Some(code) => assert!((400..500).contains(&code), "{what}: {response:?}"),
    }
}

#[tokio::test]
async fn a_get_is_answered_and_the_connection_closes() {
    let addr = server(TEST_LIMITS).await;
    let response = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(status(&response), Some(200), "{response}");
    assert!(
        response.contains("content-type: application/openmetrics-text"),
        "{response}"
    );
    assert!(response.ends_with("up 1\n# EOF\n"), "{response}");
    let response = exchange(addr, b"GET /nothing HTTP/1.0\r\n\r\n").await;
    assert_eq!(status(&response), Some(404), "{response}");
    let response = exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert_eq!(status(&response), Some(200), "{response}");
    assert!(!response.contains("up 1"), "HEAD has no body: {response}");
}

#[tokio::test]
async fn malformed_requests_are_refused_and_the_server_keeps_serving() {
    let addr = server(TEST_LIMITS).await;
    let huge_url = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(64 * 1024));
    let huge_head = format!(
        "GET /metrics HTTP/1.1\r\nHost: x\r\n{}\r\n",
        "X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n".repeat(2000)
    );
    let many_headers = format!(
        "GET /metrics HTTP/1.1\r\n{}\r\n",
        (0..100)
            .map(|i| format!("X-{i}: y\r\n"))
            .collect::<String>()
    );
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", (0..=255u8).cycle().take(4096).collect()),
        ("no version", b"GET /metrics\r\n\r\n".to_vec()),
        ("bad version", b"GET /metrics HTTP/9.9\r\n\r\n".to_vec()),
        ("huge URL", huge_url.into_bytes()),
        ("huge header block", huge_head.into_bytes()),
        ("too many headers", many_headers.into_bytes()),
        ("bad header", b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n".to_vec()),
        (
            "body on GET",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello".to_vec(),
        ),
        (
            "chunked body on GET",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
        ),
        (
            "POST",
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".to_vec(),
        ),
    ];
    for (what, raw) in cases {
        let response = exchange(addr, &raw).await;
        assert_refused(&response, what);
        let ok = exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
        assert_eq!(status(&ok), Some(200), "after {what}: {ok}");
    }
    let response = exchange(addr, b"GET /metrics HTTP/1.1\r\nContent-Length: 1\r\n\r\nx").await;
    assert_eq!(status(&response), Some(400), "a body on GET: {response}");
    let response = exchange(addr, b"DELETE /metrics HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&response), Some(405), "{response}");
    assert!(response.contains("allow: GET, HEAD"), "{response}");
}

/// A client that sends one byte at a time, every `gap`, until the server closes; returns how
/// long the server kept it.
async fn trickle(addr: SocketAddr, gap: Duration) -> Duration {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for byte in request.iter().cycle() {
        if stream.write_all(&[*byte]).await.is_err() {
            break;
        }
        let mut buf = [0u8; 512];
        match tokio::time::timeout(gap, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(_)) => {} // an answer (408): wait for the close
            Err(_) => {}
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never closed");
    }
    started.elapsed()
}

#[tokio::test]
async fn a_slowloris_client_is_cut_off_at_the_header_read_timeout() {
    let addr = server(TEST_LIMITS).await;
    let kept = trickle(addr, Duration::from_millis(50)).await;
    assert!(
        kept >= TEST_LIMITS.header_read_timeout && kept < TEST_LIMITS.header_read_timeout * 4,
        "kept {kept:?}"
    );
    // A client that connects and sends nothing is cut off the same way.
    let started = Instant::now();
    let response = exchange(addr, b"").await;
    assert!(
        response.is_empty() || status(&response) == Some(408),
        "{response}"
    );
    assert!(started.elapsed() < TEST_LIMITS.header_read_timeout * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_stays_fast_while_a_hundred_slow_clients_hold_connections() {
    let addr = server(Limits {
        header_read_timeout: Duration::from_secs(3),
        ..TEST_LIMITS
    })
    .await;
    let slow: Vec<_> = (0..100)
        .map(|_| tokio::spawn(trickle(addr, Duration::from_millis(200))))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::new();
    for _ in 0..20 {
        let at = Instant::now();
        let response = exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
        latencies.push(at.elapsed());
        assert_eq!(status(&response), Some(200), "{response}");
    }
    latencies.sort();
    let (median, worst) = (
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1],
    );
    eprintln!("/metrics with 100 slow clients: median {median:?}, worst {worst:?}");
    assert!(
        worst < Duration::from_millis(500),
        "median {median:?}, worst {worst:?}"
    );
    for s in slow {
        let kept = s.await.unwrap();
        assert!(
            kept < Duration::from_secs(5),
            "a slow client was kept {kept:?}"
        );
    }
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_and_served_again_once_freed() {
    let limits = Limits {
        max_connections: 4,
        ..TEST_LIMITS
    };
    let addr = server(limits).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let response = exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
    assert_eq!(response, "", "over the cap: closed at once");
    drop(idle);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let response = exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
    assert_eq!(status(&response), Some(200), "{response}");
}

#[tokio::test]
async fn an_address_in_use_names_the_flag_and_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let err = serve_http("http-addr", addr, Arc::new(Metrics))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("--http-addr {addr}: address already in use (another process listens there)")
    );
}
