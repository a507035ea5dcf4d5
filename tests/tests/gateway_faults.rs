//! The gateway when workers fail: a worker that refuses connections is retried on another, a
//! worker that dies mid-stream ends the client's stream with an error event, a client that
//! leaves closes the engine's connection (engines abort on that), and a reservation nobody
//! releases frees its load at expiry. The failing engines are played by the test (raw HTTP on
//! a TCP socket), registered under their own cards next to real bridged mocker engines.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle};
use kvroute_tests::{GatewayStack, STACK_MODEL, free_port, http_card, register};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the played engine does with each request.
#[derive(Debug, Clone, Copy)]
enum Play {
    /// Answers the headers and one event, then closes the connection (a crash).
    DieAfterFirstChunk,
    /// Streams an event every 20 ms for up to 20 s; notes when the client went away.
    StreamSlowly,
}

/// A played engine on a free port; `gone` is set when a client connection closed under it.
struct PlayedEngine {
    url: String,
    requests: Arc<AtomicU32>,
    gone: Arc<AtomicBool>,
}

async fn play(mode: Play) -> PlayedEngine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicU32::new(0));
    let gone = Arc::new(AtomicBool::new(false));
    let (r, g) = (requests.clone(), gone.clone());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let (r, g) = (r.clone(), g.clone());
            tokio::spawn(async move {
                read_request(&mut socket).await;
                r.fetch_add(1, Ordering::SeqCst);
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                socket.write_all(head.as_bytes()).await.unwrap();
                let event = |i: u32| {
                    let data = format!(
                        "data: {}\n\n",
                        json!({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": format!("t{i} "), "finish_reason": null}]})
                    );
                    format!("{:x}\r\n{data}\r\n", data.len())
                };
                match mode {
                    Play::DieAfterFirstChunk => {
                        let _ = socket.write_all(event(0).as_bytes()).await;
                        // Dropped without the last chunk: the connection breaks mid-body.
                    }
                    Play::StreamSlowly => {
                        for i in 0..1000 {
                            if socket.write_all(event(i).as_bytes()).await.is_err()
                                || socket.flush().await.is_err()
                            {
                                g.store(true, Ordering::SeqCst);
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            });
        }
    });
    PlayedEngine {
        url,
        requests,
        gone,
    }
}

/// Reads one request (headers, then `content-length` bytes of body).
async fn read_request(socket: &mut tokio::net::TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket.read(&mut chunk).await.unwrap();
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = socket.read(&mut chunk).await.unwrap();
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return;
        }
    }
}

fn completion(model: &str, prompt: &[u32], stream: bool) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refusing_connections_is_retried_on_another() {
    let stack = GatewayStack::start(2, |_| {}).await.unwrap();
    // A registered worker of the same model whose engine is not listening.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let _dead = register(&stack.env, http_card(900, STACK_MODEL, &closed))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let http = reqwest::Client::new();
    // Round robin over three workers puts some of six requests on the dead one.
    for i in 0..6u32 {
        let prompt: Vec<u32> = (0..16).map(|t| t + i * 100).collect();
        let r = http
            .post(gateway.url("/v1/completions"))
            .header("x-kvroute-policy", "round-robin")
            .json(&completion(STACK_MODEL, &prompt, false))
            .send()
            .await
            .unwrap();
        let worker = r.headers()["x-kvroute-worker-id"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        assert_ne!(worker, "900", "never answered by the dead worker");
    }
    let retries = gateway.metric("kvroute_gateway_upstream_retries_total{reason=\"connect\"}");
    assert!(
        retries >= 1.0,
        "the dead worker was chosen and retried: {retries}\n{}",
        gateway.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::DieAfterFirstChunk).await;
    let _card = register(&stack.env, http_card(901, "dying", &engine.url))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&completion("dying", &[1, 2, 3, 4, 5], true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(10), r.text())
        .await
        .expect("the stream ends, never hangs")
        .unwrap_or_default();
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "the first chunk, then the error: {body}");
    assert!(events[0].contains("t0"), "{body}");
    let error: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "upstream_failed", "{body}");
    assert!(!body.contains("[DONE]"));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        engine.requests.load(Ordering::SeqCst),
        1,
        "not retried after the first byte"
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_upstream_failures_total{reason=\"mid_stream\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_closes_the_engine_connection() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::StreamSlowly).await;
    let _card = register(&stack.env, http_card(902, "slow", &engine.url))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(902)).await.unwrap();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&completion("slow", &[9, 8, 7, 6, 5], true))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("t0"));
    drop(body); // the client leaves
    let left = Instant::now();
    while !engine.gone.load(Ordering::SeqCst) {
        assert!(
            left.elapsed() < Duration::from_secs(3),
            "the engine's connection was not closed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The request's load is released: prefill_done at the first byte, then finished.
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        let m = tokio::time::timeout(Duration::from_secs(3), lifecycle.next())
            .await
            .expect("lifecycle events")
            .unwrap();
        kinds.push(decode::<RequestLifecycle>(&m.payload).unwrap().kind);
    }
    assert!(
        matches!(kinds[0], LifecycleKind::PrefillDone { .. }),
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[1], LifecycleKind::Finished { .. }),
        "{kinds:?}"
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_upstream_failures_total{reason=\"client_gone\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_never_released_frees_its_load_at_expiry() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    // A worker that reports no load: only lifecycle events take its predictions away.
    let _card = register(&stack.env, http_card(903, "quiet", "http://127.0.0.1:9"))
        .await
        .unwrap();
    let gateway = stack
        .gateway("g", &["--reservation-ttl-ms", "1500"])
        .unwrap();
    let predicted = || stack.router.metric("kvroute_router_predicted_requests");
    let r: Value = reqwest::Client::new()
        .post(gateway.url("/v1/select_and_reserve"))
        .json(&json!({"model": "quiet", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["worker_id"], 903, "{r}");
    let id = r["reservation_id"].as_str().unwrap().to_owned();
    let reserved = Instant::now();
    wait_predicted(&stack.router, 1.0, "the reservation is charged").await;
    assert!(reserved.elapsed() < Duration::from_millis(1200));
    assert_eq!(predicted(), 1.0, "still held before the TTL");
    wait_predicted(&stack.router, 0.0, "freed at expiry").await;
    let held_for = reserved.elapsed();
    assert!(
        held_for >= Duration::from_millis(1400) && held_for < Duration::from_millis(3500),
        "held {held_for:?} for a TTL of 1.5 s"
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_reservations_ended_total{outcome=\"expired\"}"),
        1.0
    );
    // Releasing it afterwards is harmless (idempotent).
    let r = reqwest::Client::new()
        .delete(gateway.url(&format!("/v1/reservations/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(predicted(), 0.0);
}

async fn wait_predicted(router: &kvroute_tests::RouterProcess, want: f64, what: &str) {
    let start = Instant::now();
    while router.metric("kvroute_router_predicted_requests") != want {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_aborts_the_request_in_the_engine() {
    // vLLM-faced mocker engines abort a request whose HTTP client went away, as vLLM does.
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(
            &json!({"model": STACK_MODEL, "prompt": (1..40).collect::<Vec<u32>>(),
            "max_tokens": 2000, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    let aborted = || stack.engines.metrics().requests_finished.get("aborted");
    assert_eq!(aborted(), 0);
    drop(body);
    let left = Instant::now();
    while aborted() != 1 {
        assert!(
            left.elapsed() < Duration::from_secs(3),
            "the engine did not abort the request"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        stack.engines.metrics().requests_finished.get("ok"),
        0,
        "it never finished"
    );
}
