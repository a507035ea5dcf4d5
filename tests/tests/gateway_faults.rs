//! The gateway when workers fail: a worker that refuses connections or answers 5xx is retried on
//! another (two failing are a 502), a worker that dies mid-stream ends the client's stream with
//! an error event, a worker that goes silent is timed out (a 504 before the client saw a byte,
//! else an error event), a client that leaves closes the engine's connection (engines abort on
//! that), and a reservation nobody releases frees its load at expiry. The failing engines are played by the test (raw HTTP on
//! a TCP socket), registered under their own cards next to real bridged mocker engines.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle};
use kvroute_tests::{GatewayStack, Play, STACK_MODEL, free_port, http_card, play, register};
use serde_json::{Value, json};

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

/// The next `n` lifecycle events' kinds.
async fn lifecycle_kinds(sub: &mut async_nats::Subscriber, n: usize) -> Vec<LifecycleKind> {
    let mut kinds = Vec::new();
    while kinds.len() < n {
        let m = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .unwrap_or_else(|_| panic!("lifecycle events: only {kinds:?}"))
            .unwrap();
        kinds.push(decode::<RequestLifecycle>(&m.payload).unwrap().kind);
    }
    kinds
}

/// Polls `done` every 10 ms for up to 5 s.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The gateway holds no request any more (every guard released its load).
async fn wait_nothing_in_flight(gateway: &kvroute_tests::GatewayProcess) {
    wait_until("no request in flight", || {
        gateway.metric("kvroute_gateway_requests_in_flight") == 0.0
            && gateway.metric("kvroute_gateway_streams_in_flight") == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_before_the_first_byte_is_retried_on_another_worker() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let failing = play(Play::Fail500).await;
    let answering = play(Play::Answer).await;
    let _a = register(&stack.env, http_card(910, "flaky", &failing.url))
        .await
        .unwrap();
    let _b = register(&stack.env, http_card(911, "flaky", &answering.url))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let http = reqwest::Client::new();
    let retries =
        || gateway.metric("kvroute_gateway_upstream_retries_total{reason=\"status_5xx\"}");
    // Round robin over the two puts one of the first two requests on the failing worker.
    let mut retried = 0;
    for i in 0..4u32 {
        let before = failing.requests.load(Ordering::SeqCst);
        let prompt: Vec<u32> = (0..16).map(|t| t + i * 100).collect();
        let r = http
            .post(gateway.url("/v1/completions"))
            .header("x-kvroute-policy", "round-robin")
            .json(&completion("flaky", &prompt, false))
            .send()
            .await
            .unwrap();
        let worker = r.headers()["x-kvroute-worker-id"]
            .to_str()
            .unwrap()
            .to_owned();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], "ok", "{v}");
        assert_eq!(worker, "911", "answered by the worker that answers");
        if failing.requests.load(Ordering::SeqCst) > before {
            retried += 1;
        }
        assert_eq!(retries(), f64::from(retried), "request {i}");
    }
    assert!(retried >= 1, "the failing worker was never chosen");
    assert_eq!(answering.requests.load(Ordering::SeqCst), 4);
    assert_eq!(
        gateway.metric(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"flaky\",status=\"200\"}"
        ),
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_workers_failing_is_a_502_in_openai_error_json() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let first = play(Play::Fail500).await;
    let second = play(Play::Fail500).await;
    let _a = register(&stack.env, http_card(912, "broken", &first.url))
        .await
        .unwrap();
    let _b = register(&stack.env, http_card(913, "broken", &second.url))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&completion("broken", &[1, 2, 3, 4, 5], false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_failed", "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("500"),
        "{v}"
    );
    assert_eq!(
        (
            first.requests.load(Ordering::SeqCst),
            second.requests.load(Ordering::SeqCst)
        ),
        (1, 1),
        "each worker tried once"
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_upstream_retries_total{reason=\"status_5xx\"}"),
        2.0,
        "both failures counted"
    );
    assert_eq!(
        gateway.metric(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"broken\",status=\"502\"}"
        ),
        1.0
    );
    wait_nothing_in_flight(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_silent_before_its_headers_is_a_504() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::FreezeBeforeHeaders).await;
    let _card = register(&stack.env, http_card(914, "mute", &engine.url))
        .await
        .unwrap();
    let gateway = stack
        .gateway("g", &["--response-timeout-ms", "500"])
        .unwrap();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(914)).await.unwrap();
    let started = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::Client::new()
            .post(gateway.url("/v1/completions"))
            .json(&completion("mute", &[1, 2, 3, 4, 5], true))
            .send(),
    )
    .await
    .expect("answered, never a hang")
    .unwrap();
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_timeout", "{v}");
    assert_eq!(v["error"]["type"], "timeout_error", "{v}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_eq!(engine.requests.load(Ordering::SeqCst), 1, "not retried");
    wait_until("the engine's connection closed", || {
        engine.gone.load(Ordering::SeqCst)
    })
    .await;
    let kinds = lifecycle_kinds(&mut lifecycle, 1).await;
    assert!(
        matches!(kinds[0], LifecycleKind::Finished { .. }),
        "{kinds:?}"
    );
    assert_eq!(
        gateway.metric(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"mute\",status=\"504\"}"
        ),
        1.0
    );
    wait_nothing_in_flight(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_frozen_mid_stream_ends_the_stream_with_a_timeout_event() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::FreezeAfterFirstChunk).await;
    let _card = register(&stack.env, http_card(915, "frozen", &engine.url))
        .await
        .unwrap();
    let gateway = stack
        .gateway("g", &["--upstream-idle-timeout-ms", "500"])
        .unwrap();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(915)).await.unwrap();
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&completion("frozen", &[1, 2, 3, 4, 5], true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(10), r.text())
        .await
        .expect("the stream ends, never hangs")
        .unwrap();
    let elapsed = started.elapsed();
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "the first chunk, then the error: {body}");
    assert!(events[0].contains("t0"), "{body}");
    let error: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "upstream_timeout", "{body}");
    assert_eq!(error["error"]["type"], "timeout_error", "{body}");
    assert!(!body.contains("[DONE]"));
    assert!(
        elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(5),
        "ended after the idle timeout: {elapsed:?}"
    );
    wait_until("the engine's connection closed", || {
        engine.gone.load(Ordering::SeqCst)
    })
    .await;
    let kinds = lifecycle_kinds(&mut lifecycle, 2).await;
    assert!(
        matches!(kinds[0], LifecycleKind::PrefillDone { .. }),
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[1], LifecycleKind::Finished { .. }),
        "{kinds:?}"
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_upstream_failures_total{reason=\"idle_timeout\"}"),
        1.0
    );
    wait_nothing_in_flight(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_whose_body_stalls_is_a_504() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::FreezeMidAnswer).await;
    let _card = register(&stack.env, http_card(916, "stalled", &engine.url))
        .await
        .unwrap();
    let gateway = stack
        .gateway("g", &["--upstream-idle-timeout-ms", "500"])
        .unwrap();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(916)).await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::Client::new()
            .post(gateway.url("/v1/completions"))
            .json(&completion("stalled", &[1, 2, 3, 4, 5], false))
            .send(),
    )
    .await
    .expect("answered, never a hang")
    .unwrap();
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_timeout", "{v}");
    wait_until("the engine's connection closed", || {
        engine.gone.load(Ordering::SeqCst)
    })
    .await;
    // Half the body arrived: the prefill was over; then the load is released.
    let kinds = lifecycle_kinds(&mut lifecycle, 2).await;
    assert!(
        matches!(kinds[0], LifecycleKind::PrefillDone { .. }),
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[1], LifecycleKind::Finished { .. }),
        "{kinds:?}"
    );
    assert_eq!(
        gateway.metric(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"stalled\",status=\"504\"}"
        ),
        1.0
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_upstream_failures_total{reason=\"idle_timeout\"}"),
        1.0
    );
    wait_nothing_in_flight(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_after_the_last_token_before_done_is_a_success() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = play(Play::FinishWithoutDone).await;
    let _card = register(&stack.env, http_card(904, "finishing", &engine.url))
        .await
        .unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let r = reqwest::Client::new()
        .post(gateway.url("/v1/completions"))
        .json(&completion("finishing", &[3, 1, 4, 1, 5], true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("\"finish_reason\":\"length\"") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .expect("the last token arrives")
            .unwrap()
            .unwrap();
        got.extend_from_slice(&chunk);
    }
    drop(body); // the client has its answer and leaves before `data: [DONE]`
    wait_until("the engine's connection closed", || {
        engine.gone.load(Ordering::SeqCst)
    })
    .await;
    wait_nothing_in_flight(&gateway).await;
    let (_, metrics) = kvroute_tests::http_get(gateway.port, "/metrics").unwrap();
    let sample = |name: &str| match kvroute_tests::sample_value(&metrics, name, &[]) {
        Ok(v) => v,
        Err(kvroute_tests::SampleError::Absent(_)) => 0.0,
        Err(e) => panic!("{name}: {e}"),
    };
    assert_eq!(
        sample("kvroute_gateway_upstream_failures_total{reason=\"client_gone\"}"),
        0.0,
        "not an upstream failure"
    );
    assert_eq!(
        sample(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"finishing\",status=\"200\"}"
        ),
        1.0
    );
}
