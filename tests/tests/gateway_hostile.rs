//! The gateway against hostile clients, over real TCP: prompts whose size alone proves them too
//! long are refused before any tokenizing (bounded time and memory), tokenizing is capped, a
//! model folder's own context length caps its prompts, and bad headers and content types are
//! answered with OpenAI-shaped JSON.

use std::time::{Duration, Instant};

use kvroute_tests::{
    GatewayProcess, SampleError, TestEnv, free_port, http_card, http_get, model_dir, register,
    sample_value,
};
use serde_json::{Value, json};

/// The model the tests tokenize with (a byte-level BPE: its longest token is 90 bytes).
const MODEL: &str = "llama3";

/// A started environment, a registered worker of [`MODEL`] that nobody serves (requests that
/// pass the gateway's checks fail later, at selection or forwarding), and the card's guard.
async fn env_with_card() -> (TestEnv, kvroute_common::worker::Registration) {
    let env = TestEnv::start().unwrap();
    let closed = format!("http://127.0.0.1:{}", free_port());
    let card = register(&env, http_card(700, MODEL, &closed))
        .await
        .unwrap();
    (env, card)
}

fn model_flag(dir: &std::path::Path) -> String {
    format!("{MODEL}={}", dir.display())
}

/// A sample's value, 0 when the family has no such sample yet.
fn sample_or_zero(gateway: &GatewayProcess, name: &str) -> f64 {
    let (_, body) = http_get(gateway.port, "/metrics").expect("the gateway answers /metrics");
    match sample_value(&body, name, &[]) {
        Ok(v) => v,
        Err(SampleError::Absent(_)) => 0.0,
        Err(e) => panic!("{name}: {e}"),
    }
}

/// The peak resident memory of a process, in bytes (Linux's VmHWM).
fn peak_rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

async fn post(
    http: &reqwest::Client,
    gateway: &GatewayProcess,
    path: &str,
    body: &Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = http
        .post(gateway.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    (status, headers, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_prompt_provably_over_the_limit_is_refused_before_tokenizing() {
    let (env, _card) = env_with_card().await;
    let model = model_flag(&model_dir(MODEL));
    let gateway = GatewayProcess::start(
        &env,
        "g",
        &["--model", &model, "--max-prompt-tokens", "20000"],
    )
    .unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    // 15 MB of text: at least 15e6 / 90 tokens, far above 20,000. Tokenizing it would take
    // gigabytes and many seconds.
    let text = "the quick brown fox jumps over the lazy dog ".repeat(15_000_000 / 44);
    let started = Instant::now();
    let body = json!({"model": MODEL, "prompt": text, "max_tokens": 1});
    let (status, _, v) = post(&http, &gateway, "/v1/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("at least") && message.contains("20000"),
        "{message}"
    );
    // A chat whose rendered prompt is as long: refused after rendering, before encoding.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": text}]});
    let (status, _, v) = post(&http, &gateway, "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "messages", "{v}");
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    for endpoint in ["completions", "chat"] {
        let name = format!("kvroute_gateway_tokenize_seconds_count{{endpoint=\"{endpoint}\"}}");
        assert_eq!(
            sample_or_zero(&gateway, &name),
            0.0,
            "{endpoint}: nothing was tokenized"
        );
    }
    let peak = peak_rss(gateway.pid().unwrap());
    assert!(peak < 400 << 20, "peak memory {} MB", peak >> 20);
    // The gateway still answers.
    assert_eq!(http_get(gateway.port, "/healthz").map(|r| r.0), Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_folders_context_length_caps_its_prompts() {
    let (env, _card) = env_with_card().await;
    let dir = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(model_dir(MODEL).join(file), dir.path().join(file)).unwrap();
    }
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"max_position_embeddings": 64}"#,
    )
    .unwrap();
    let model = model_flag(dir.path());
    let gateway = GatewayProcess::start(
        &env,
        "g",
        &["--model", &model, "--max-prompt-tokens", "100000"],
    )
    .unwrap();
    let http = reqwest::Client::new();
    let ids: Vec<u32> = (0..65).collect();
    let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
    let (status, _, v) = post(&http, &gateway, "/v1/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit of 64"),
        "{v}"
    );
    // Within the model's context: past the check (it fails later, nobody serves the worker).
    let body = json!({"model": MODEL, "prompt": &ids[..64], "max_tokens": 1});
    let (status, _, v) = post(&http, &gateway, "/v1/completions", &body).await;
    assert_ne!(
        v["error"]["code"], "context_length_exceeded",
        "{status} {v}"
    );
    // The selection API has the same limit.
    let body = json!({"model": MODEL, "token_ids": ids});
    let (status, _, v) = post(&http, &gateway, "/v1/select", &body).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit of 64"),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizing_is_capped_and_beyond_the_queue_is_a_503_with_retry_after() {
    let (env, _card) = env_with_card().await;
    let model = model_flag(&model_dir(MODEL));
    let gateway = GatewayProcess::start(
        &env,
        "g",
        &[
            "--model",
            &model,
            "--max-prompt-tokens",
            "10000000",
            "--max-concurrent-tokenizations",
            "1",
            "--tokenize-queue",
            "0",
            "--retry-after-secs",
            "3",
        ],
    )
    .unwrap();
    let http = reqwest::Client::new();
    let text = "Tokenizing this takes a while. ".repeat(10_000);
    let body = json!({"model": MODEL, "prompt": text, "max_tokens": 1});
    let answers =
        futures::future::join_all((0..8).map(|_| post(&http, &gateway, "/v1/completions", &body)))
            .await;
    let busy: Vec<_> = answers
        .iter()
        .filter(|(_, _, v)| v["error"]["code"] == "tokenizer_busy")
        .collect();
    assert!(!busy.is_empty(), "{answers:?}");
    assert!(busy.len() < 8, "one at least was tokenized: {answers:?}");
    for (status, headers, _) in &busy {
        assert_eq!(*status, 503);
        assert_eq!(headers["retry-after"], "3");
    }
    assert_eq!(
        sample_or_zero(&gateway, "kvroute_gateway_tokenize_refused_total"),
        busy.len() as f64
    );
    // Once the burst is over, a text prompt is tokenized again.
    let (_, _, v) = post(&http, &gateway, "/v1/completions", &body).await;
    assert_ne!(v["error"]["code"], "tokenizer_busy", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_by_its_content_type_is_a_415() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &[]).unwrap();
    let http = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": [1, 2, 3]}).to_string();
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/select"] {
        for content_type in ["text/plain", "application/x-www-form-urlencoded"] {
            let r = http
                .post(gateway.url(path))
                .header("content-type", content_type)
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 415, "{path} {content_type}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("application/json")
            );
        }
    }
    // JSON with parameters passes the check (and fails later: nobody serves the worker).
    let r = http
        .post(gateway.url("/v1/completions"))
        .header("content-type", "application/json; charset=utf-8")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_ne!(r.status(), 415);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_session_header_is_a_400_naming_it() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &[]).unwrap();
    let http = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1});
    let long = "s".repeat(300);
    let cases: [(&str, &[u8]); 4] = [
        ("x-session-id", "café-42".as_bytes()),
        ("x-session-id", b"tab\there"),
        ("x-session-id", long.as_bytes()),
        ("x-session-parent-id", b"\xff\xfe"),
    ];
    for (name, value) in cases {
        let mut request = http.post(gateway.url("/v1/completions"));
        if name != "x-session-id" {
            request = request.header("x-session-id", "ok-1");
        }
        let r = request
            .header(
                name,
                reqwest::header::HeaderValue::from_bytes(value).unwrap(),
            )
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{name}: {value:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_header", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(name),
            "{v}"
        );
    }
    // Two session ids: which one is meant is unknown.
    let r = http
        .post(gateway.url("/v1/completions"))
        .header("x-session-id", "a")
        .header("x-session-id", "b")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_header", "{v}");
}

/// Reads what the server sends until it closes the connection or `within` passes: the bytes,
/// and how long after the call it closed (`None`: still open).
async fn read_until_closed(
    tcp: &mut tokio::net::TcpStream,
    within: Duration,
) -> (Vec<u8>, Option<Duration>) {
    use tokio::io::AsyncReadExt as _;
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = within.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, tcp.read(&mut buf)).await {
            Err(_) => return (got, None),
            Ok(Ok(0) | Err(_)) => return (got, Some(started.elapsed())),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

async fn connect(gateway: &GatewayProcess) -> tokio::net::TcpStream {
    tokio::net::TcpStream::connect(("127.0.0.1", gateway.port))
        .await
        .unwrap()
}

async fn send(tcp: &mut tokio::net::TcpStream, bytes: &[u8]) {
    use tokio::io::AsyncWriteExt as _;
    tcp.write_all(bytes).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_and_idle_connections_are_closed_at_their_timeouts() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(
        &env,
        "g",
        &[
            "--header-read-timeout-ms",
            "600",
            "--idle-timeout-ms",
            "1000",
        ],
    )
    .unwrap();
    // Slowloris: a head that trickles in a header line every 100 ms never completes.
    let trickling = (0..20).map(|_| async {
        use tokio::io::AsyncWriteExt as _;
        let mut tcp = connect(&gateway).await;
        send(&mut tcp, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n").await;
        let started = Instant::now();
        let mut buf = [0u8; 256];
        loop {
            tokio::select! {
                read = tokio::io::AsyncReadExt::read(&mut tcp, &mut buf) => {
                    if matches!(read, Ok(0) | Err(_)) {
                        return Some(started.elapsed());
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if started.elapsed() > Duration::from_secs(5) {
                        return None;
                    }
                    if tcp.write_all(b"x-slow: 1\r\n").await.is_err() {
                        return Some(started.elapsed());
                    }
                }
            }
        }
    });
    let closed = futures::future::join_all(trickling).await;
    for at in &closed {
        let at = at.expect("a trickling head is cut");
        assert!(at < Duration::from_secs(3), "closed after {at:?}");
    }
    // A connection that sends nothing: closed at the head timeout too.
    let mut silent = connect(&gateway).await;
    let (_, at) = read_until_closed(&mut silent, Duration::from_secs(5)).await;
    let at = at.expect("a silent connection is closed");
    assert!(at >= Duration::from_millis(400), "{at:?}");
    // A kept-alive connection is served, then closed after the idle timeout.
    let mut kept = connect(&gateway).await;
    send(&mut kept, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let (got, at) = read_until_closed(&mut kept, Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.ends_with("ok\n"),
        "{text}"
    );
    let at = at.expect("an idle connection is closed");
    assert!(
        at >= Duration::from_millis(800) && at < Duration::from_secs(3),
        "{at:?}"
    );
    assert!(
        sample_or_zero(
            &gateway,
            "kvroute_gateway_connections_closed_total{reason=\"timeout\"}"
        ) >= 21.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_in_time_is_a_408_in_json() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &["--body-read-timeout-ms", "500"]).unwrap();
    let mut tcp = connect(&gateway).await;
    send(
        &mut tcp,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"",
    )
    .await;
    let (got, at) = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let body: Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");
    assert!(
        at.is_some(),
        "the connection closes (the body was not read)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_idle_ones_make_room_and_health_still_answers() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &["--max-connections", "10"]).unwrap();
    // 40 connections that send nothing (the head timeout is 10 s): past 10, each new one
    // closes the oldest idle one.
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(connect(&gateway).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let http = reqwest::Client::new();
    let r = tokio::time::timeout(
        Duration::from_secs(3),
        http.get(gateway.url("/healthz")).send(),
    )
    .await
    .expect("/healthz answers under the flood")
    .unwrap();
    assert_eq!(r.status(), 200);
    let mut closed = 0;
    for tcp in &mut idle {
        if read_until_closed(tcp, Duration::from_millis(20))
            .await
            .1
            .is_some()
        {
            closed += 1;
        }
    }
    assert!(closed >= 30, "{closed} of 40 idle connections closed");
    assert!(
        sample_or_zero(
            &gateway,
            "kvroute_gateway_connections_closed_total{reason=\"evicted\"}"
        ) >= 30.0
    );
    drop(idle);

    // Every connection busy (a request head in, its body awaited): health answers on the
    // reserve, anything else is a 503 in JSON.
    let mut busy = Vec::new();
    for _ in 0..10 {
        let mut tcp = connect(&gateway).await;
        send(
            &mut tcp,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
        )
        .await;
        busy.push(tcp);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = http.get(gateway.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body = json!({"model": MODEL, "prompt": [1, 2, 3]});
    let (status, headers, v) = post(&http, &gateway, "/v1/completions", &body).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_a_431_in_json() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &[]).unwrap();
    let http = reqwest::Client::new();
    let pad = "a".repeat(40 * 1024);
    for path in ["/v1/completions", "/healthz"] {
        let r = http
            .post(gateway.url(path))
            .header("x-pad", &pad)
            .json(&json!({"model": MODEL, "prompt": [1]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 431, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "request_header_fields_too_large", "{v}");
    }
    let mut r = http.get(gateway.url("/healthz"));
    for i in 0..120 {
        r = r.header(format!("x-h{i}"), "1");
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 431, "too many header lines");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_gateway_in_time_even_with_nats_and_etcd_down() {
    let (mut env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &["--shutdown-timeout-ms", "2000"]).unwrap();
    env.nats.stop().unwrap();
    env.etcd.stop().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = nix::unistd::Pid::from_raw(gateway.pid().unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let asked = Instant::now();
    while gateway.is_running() {
        assert!(
            asked.elapsed() < Duration::from_secs(8),
            "still running 8 s after SIGTERM:\n{}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_the_http_layer_cannot_parse_are_answered_in_json() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &[]).unwrap();
    let huge = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: {}\r\n\r\n",
        "a".repeat(600 * 1024)
    );
    let cases: [(&[u8], &str, &str); 4] = [
        (
            b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: a\rb\r\n\r\n",
            "400",
            "malformed_request",
        ),
        (
            b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: a\0b\r\n\r\n",
            "400",
            "malformed_request",
        ),
        (
            b"G(T /healthz HTTP/1.1\r\nhost: x\r\n\r\n",
            "400",
            "malformed_request",
        ),
        (huge.as_bytes(), "431", "request_header_fields_too_large"),
    ];
    for (request, status, code) in cases {
        let mut tcp = connect(&gateway).await;
        // A good request first on the same connection: its answer is the gateway's, untouched.
        send(&mut tcp, b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        send(&mut tcp, request).await;
        let (got, closed) = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
        assert!(closed.is_some(), "the connection closes");
        let text = String::from_utf8_lossy(&got);
        let (first, second) = text
            .split_once("ok\n")
            .unwrap_or_else(|| panic!("{code}: the good request's answer first: {text}"));
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        assert!(
            second.starts_with(&format!("HTTP/1.1 {status}")),
            "{code}: {second}"
        );
        let body: Value = serde_json::from_str(second.split("\r\n\r\n").nth(1).unwrap())
            .unwrap_or_else(|e| panic!("{code}: not JSON ({e}): {second}"));
        assert_eq!(body["error"]["code"], code, "{body}");
    }
    // Still serving.
    assert_eq!(http_get(gateway.port, "/healthz").map(|r| r.0), Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_with_expect_100_continue_and_no_content_type_is_answered_in_json() {
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &[]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body.json");
    // Over 1 MB: curl asks `Expect: 100-continue` and waits for the interim answer.
    let body = json!({"model": MODEL, "prompt": "x ".repeat(600_000), "max_tokens": 1});
    std::fs::write(&file, body.to_string()).unwrap();
    let curl = |extra: &[&str]| {
        let out = std::process::Command::new("curl")
            .args(["-s", "-S", "-i", "--max-time", "20"])
            .args(extra)
            .arg("--data-binary")
            .arg(format!("@{}", file.display()))
            .arg(gateway.url("/v1/completions"))
            .output()
            .expect("curl runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // With the JSON content type: past every check (it fails later: nobody serves the worker).
    let text = curl(&["-H", "content-type: application/json"]);
    assert!(text.contains("HTTP/1.1 100 Continue"), "{text}");
    let answer = text.rsplit("HTTP/1.1 ").next().unwrap();
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_ne!(body["error"]["code"], "unsupported_media_type", "{body}");
    assert_ne!(body["error"]["code"], "malformed_request", "{body}");
    // curl's default form content type: a 415 in JSON.
    let text = curl(&[]);
    let answer = text.rsplit("HTTP/1.1 ").next().unwrap();
    assert!(answer.starts_with("415"), "{text}");
    let body: Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "unsupported_media_type", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_of_its_answers_is_disconnected() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (env, _card) = env_with_card().await;
    let gateway = GatewayProcess::start(&env, "g", &["--write-timeout-ms", "500"]).unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let tcp = socket
        .connect(([127, 0, 0, 1], gateway.port).into())
        .await
        .unwrap();
    let (mut reader, mut writer) = tcp.into_split();
    // Pipelined requests whose 404 answers (each naming its 30 KB path) fill the socket's
    // buffers many times over; the client never reads.
    const REQUESTS: usize = 300;
    let request = format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "p".repeat(30 * 1024));
    let sending = tokio::spawn(async move {
        for _ in 0..REQUESTS {
            if writer.write_all(request.as_bytes()).await.is_err() {
                return;
            }
        }
        let _ = writer.flush().await;
        tokio::time::sleep(Duration::from_secs(30)).await; // keep the write half open
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Now read: what was buffered, then the end (the gateway closed the connection).
    let mut total = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(3), reader.read(&mut buf)).await {
            Err(_) => break false,
            Ok(Ok(0) | Err(_)) => break true,
            Ok(Ok(n)) => total += n,
        }
    };
    sending.abort();
    assert!(closed, "still open after {total} bytes");
    assert!(
        total < REQUESTS * 30 * 1024,
        "not every answer was sent: {total} bytes"
    );
    assert!(
        sample_or_zero(
            &gateway,
            "kvroute_gateway_connections_closed_total{reason=\"timeout\"}"
        ) >= 1.0
    );
}
