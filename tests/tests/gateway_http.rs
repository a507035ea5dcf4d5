//! `kvroute-gateway` in front of mocker engines impersonating vLLM behind kvroute-bridge, with
//! a real router and indexer: the OpenAI endpoints streamed and not, prefix-aware placement,
//! sessions across two gateway replicas, the selection API and its lifecycle events, request
//! ids, and every kind of bad input answered with the right status and an OpenAI error body.

use std::time::Duration;

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle};
use kvroute_tests::{GatewayProcess, GatewayStack, STACK_MODEL};
use serde_json::{Value, json};

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1000 + seed * 10_000 + i).collect()
}

async fn complete(
    http: &reqwest::Client,
    gateway: &GatewayProcess,
    body: Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut r = http.post(gateway.url("/v1/completions")).json(&body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    let (status, h) = (r.status().as_u16(), r.headers().clone());
    (status, h, r.text().await.unwrap())
}

fn worker_of(h: &reqwest::header::HeaderMap) -> u64 {
    h["x-kvroute-worker-id"].to_str().unwrap().parse().unwrap()
}

fn overlap_of(h: &reqwest::header::HeaderMap) -> u64 {
    h["x-kvroute-overlap-blocks"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_streamed_and_not_with_lifecycle_and_request_ids() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let http = reqwest::Client::new();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle_all()).await.unwrap();

    let body = json!({"model": STACK_MODEL, "prompt": prompt(1, 20), "max_tokens": 5});
    let (status, h, text) = complete(&http, &gateway, body, &[("x-request-id", "job-17")]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(h["x-request-id"], "job-17");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 20);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // kvroute's request id is derived from the header; the prefill load goes at the answer's
    // first byte, the rest at the end.
    let mut events = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(5), lifecycle.next())
            .await
            .expect("a lifecycle event")
            .unwrap();
        events.push(decode::<RequestLifecycle>(&m.payload).unwrap());
    }
    for event in &events {
        assert_eq!(
            event.request_id,
            kvroute_gateway::request_id::derive("job-17")
        );
        assert_eq!(event.worker_id, 100);
    }
    assert!(
        matches!(events[0].kind, LifecycleKind::PrefillDone { .. }),
        "{:?}",
        events[0].kind
    );
    assert_eq!(events[1].kind, LifecycleKind::Finished { output_tokens: 5 });

    let body = json!({"model": STACK_MODEL, "prompt": prompt(2, 20), "max_tokens": 4,
        "stream": true, "stream_options": {"include_usage": true}});
    let (status, h, text) = complete(&http, &gateway, body, &[]).await;
    assert_eq!(status, 200);
    assert!(
        h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert!(
        uuid::Uuid::parse_str(h["x-request-id"].to_str().unwrap()).is_ok(),
        "assigned"
    );
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
    let usage: Value =
        serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4, "{text}");
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(5), lifecycle.next())
            .await
            .unwrap()
            .unwrap();
        kinds.push(decode::<RequestLifecycle>(&m.payload).unwrap().kind);
    }
    assert!(
        matches!(kinds[0], LifecycleKind::PrefillDone { .. }),
        "{kinds:?}"
    );
    assert_eq!(kinds[1], LifecycleKind::Finished { output_tokens: 4 });
    assert_eq!(
        gateway.metric(
            "kvroute_gateway_requests_total{endpoint=\"completions\",model=\"m\",status=\"200\"}"
        ),
        2.0
    );
    assert_eq!(
        gateway.metric("kvroute_gateway_ttft_seconds_count{model=\"m\"}"),
        1.0
    );
    assert!(
        gateway.log().contains("kvroute_gateway::access"),
        "access log lines"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_sharing_a_prefix_go_to_the_worker_holding_it() {
    let stack = GatewayStack::start(2, |_| {}).await.unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let http = reqwest::Client::new();
    let mut homes = Vec::new();
    for doc in 0..4u32 {
        let first = prompt(doc, 64);
        let body = json!({"model": STACK_MODEL, "prompt": first, "max_tokens": 2});
        let (status, h, text) = complete(&http, &gateway, body, &[]).await;
        assert_eq!(status, 200, "{text}");
        homes.push(worker_of(&h));
    }
    // The engines' KV events reach the index through the bridge and the event log.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (doc, home) in homes.iter().enumerate() {
        let mut next = prompt(doc as u32, 64);
        next.extend(prompt(50 + doc as u32, 16));
        let body = json!({"model": STACK_MODEL, "prompt": next, "max_tokens": 2});
        let (status, h, _) = complete(&http, &gateway, body, &[]).await;
        assert_eq!(status, 200);
        assert_eq!(
            worker_of(&h),
            *home,
            "document {doc} goes back to its worker"
        );
        assert_eq!(overlap_of(&h), 16, "its 64 tokens are 16 cached blocks");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stays_on_its_worker_across_two_gateways() {
    let stack = GatewayStack::start(2, |_| {}).await.unwrap();
    let a = stack.gateway("a", &[]).unwrap();
    let b = stack.gateway("b", &[]).unwrap();
    let http = reqwest::Client::new();
    // Round robin alternates the workers, unless a session binds the request.
    let rr = ("x-kvroute-policy", "round-robin");
    for (n, session) in ["", "s1", "s2", "s3"].into_iter().enumerate() {
        let mut workers = Vec::new();
        for (turn, gateway) in [&a, &b, &a, &b].into_iter().enumerate() {
            let seed = 100 * n as u32 + turn as u32;
            let body = json!({"model": STACK_MODEL, "prompt": prompt(seed, 12), "max_tokens": 1});
            let mut headers = vec![rr];
            if !session.is_empty() {
                headers.push(("x-session-id", session));
            }
            let (status, h, text) = complete(&http, gateway, body, &headers).await;
            assert_eq!(status, 200, "{text}");
            workers.push(worker_of(&h));
        }
        let same = workers.windows(2).all(|w| w[0] == w[1]);
        if session.is_empty() {
            assert!(!same, "without a session the turns spread: {workers:?}");
        } else {
            assert!(same, "{session}: {workers:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_selection_api_selects_reserves_and_releases() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let gateway = stack
        .gateway("g", &["--reservation-ttl-ms", "60000"])
        .unwrap();
    let http = reqwest::Client::new();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut lifecycle = nats.subscribe(names.lifecycle(100)).await.unwrap();
    let mut next_kind = async || {
        let m = tokio::time::timeout(Duration::from_secs(5), lifecycle.next())
            .await
            .expect("a lifecycle event")
            .unwrap();
        let e: RequestLifecycle = decode(&m.payload).unwrap();
        (e.request_id, e.kind)
    };
    let post = async |path: &str, body: Value| {
        let r = http
            .post(gateway.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };

    let (status, v) = post(
        "/v1/select",
        json!({"model": STACK_MODEL, "token_ids": prompt(3, 40)}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["worker_id"], 100);
    // 40 tokens are 10 blocks of 4, of which an engine can reuse 9: it computes the last token.
    assert_eq!(v["request_blocks"], 9);
    assert_eq!(v["http_url"], stack.endpoints[0].url());
    assert!(v.get("reservation_id").is_none());
    // A plain selection holds no load.
    let (id, kind) = next_kind().await;
    assert_eq!(id.to_string(), v["request_id"].as_str().unwrap());
    assert!(matches!(kind, LifecycleKind::Finished { .. }));
    // Selections are timed; requests refused before selecting (below) are not.
    let selections = || gateway.metric("kvroute_gateway_select_seconds_count{model=\"-\"}");
    assert_eq!(selections(), 1.0);

    let (status, v) = post(
        "/v1/select_and_reserve",
        json!({"model": STACK_MODEL, "token_ids": prompt(4, 40)}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let reservation = v["reservation_id"].as_str().unwrap().to_owned();
    assert!(v["expires_at_ms"].as_u64().unwrap() > 0);
    assert_eq!(gateway.metric("kvroute_gateway_reservations"), 1.0);
    let (status, done) = post(
        &format!("/v1/reservations/{reservation}/prefill_complete"),
        json!({}),
    )
    .await;
    assert_eq!((status, done["held_here"].clone()), (200, json!(true)));
    assert!(matches!(
        next_kind().await.1,
        LifecycleKind::PrefillDone { .. }
    ));
    for held in [true, false] {
        let r = http
            .delete(gateway.url(&format!("/v1/reservations/{reservation}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["held_here"], held, "releasing twice is harmless");
        assert!(matches!(
            next_kind().await.1,
            LifecycleKind::Finished { .. }
        ));
    }
    assert_eq!(gateway.metric("kvroute_gateway_reservations"), 0.0);
    let r = http
        .delete(gateway.url("/v1/reservations/nonsense"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // Block hashes need their block size; exactly one prompt form.
    let (status, v) = post(
        "/v1/select",
        json!({"model": STACK_MODEL, "block_hashes": [1, 2]}),
    )
    .await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("block_size"))
    );
    let (status, _) = post(
        "/v1/select",
        json!({"model": STACK_MODEL, "token_ids": [1], "text": "x"}),
    )
    .await;
    assert_eq!(status, 400);
    let (status, v) = post("/v1/select", json!({"model": STACK_MODEL, "text": "hello"})).await;
    assert_eq!(status, 400, "no tokenizer configured for m");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--model m=DIR"),
        "{v}"
    );
    let (status, _) = post(
        "/v1/select",
        json!({"model": "nobody", "token_ids": [1, 2]}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(selections(), 2.0, "the select and the select_and_reserve");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_the_gateway_keeps_serving() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# test keys\nsk-good\n").unwrap();
    let gateway = stack
        .gateway(
            "g",
            &[
                "--api-keys-file",
                &keys.display().to_string(),
                "--max-body-bytes",
                "4096",
                "--max-prompt-tokens",
                "100",
            ],
        )
        .unwrap();
    let http = reqwest::Client::new();
    let send = async |path: &str, key: Option<&str>, body: Vec<u8>| {
        let mut r = http
            .post(gateway.url(path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON error body: {text}"));
        assert!(v["error"]["message"].is_string(), "{v}");
        assert!(v["error"]["type"].is_string(), "{v}");
        (status, v)
    };
    let good = || {
        json!({"model": STACK_MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1})
            .to_string()
            .into_bytes()
    };
    let cases: Vec<(&str, Option<&str>, Vec<u8>, u16)> = vec![
        ("/v1/completions", None, good(), 401),
        ("/v1/completions", Some("sk-bad"), good(), 401),
        (
            "/v1/completions",
            Some("sk-good"),
            b"{not json".to_vec(),
            400,
        ),
        ("/v1/completions", Some("sk-good"), b"[]".to_vec(), 400),
        (
            "/v1/completions",
            Some("sk-good"),
            json!({"model": STACK_MODEL, "prompt": {"a": 1}})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "/v1/completions",
            Some("sk-good"),
            json!({"model": STACK_MODEL, "prompt": [1], "max_tokens": -3})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "/v1/chat/completions",
            Some("sk-good"),
            json!({"model": STACK_MODEL, "messages": "hi"})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "/v1/completions",
            Some("sk-good"),
            json!({"model": "no-such-model", "prompt": [1, 2]})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            "/v1/completions",
            Some("sk-good"),
            json!({"model": STACK_MODEL, "prompt": (0..200).collect::<Vec<u32>>()})
                .to_string()
                .into_bytes(),
            400,
        ),
        ("/v1/completions", Some("sk-good"), vec![b' '; 5000], 413),
        ("/v1/nothing-here", Some("sk-good"), good(), 404),
    ];
    for (path, key, body, want) in cases {
        let (status, v) = send(path, key, body).await;
        assert_eq!(status, want, "{path}: {v}");
    }
    // A completions prompt too long names `prompt` (a chat's names `messages`).
    let long = json!({"model": STACK_MODEL, "prompt": (0..101).collect::<Vec<u32>>()});
    let (status, v) = send(
        "/v1/completions",
        Some("sk-good"),
        long.to_string().into_bytes(),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    // Unauthenticated health and metrics; the process still serves.
    assert_eq!(
        http.get(gateway.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = http
        .post(gateway.url("/v1/completions"))
        .bearer_auth("sk-good")
        .header("content-type", "application/json")
        .body(good())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let models: Value = http
        .get(gateway.url("/v1/models"))
        .bearer_auth("sk-good")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], STACK_MODEL, "{models}");
    assert_eq!(
        gateway.metric("kvroute_gateway_requests_total{endpoint=\"completions\",model=\"unknown\",status=\"401\"}"),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_gets_the_body_as_sent_with_the_request_id() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    let engine = kvroute_tests::play(kvroute_tests::Play::Answer).await;
    let _card = kvroute_tests::register(
        &stack.env,
        kvroute_tests::http_card(910, "played", &engine.url),
    )
    .await
    .unwrap();
    let model = format!("played={}", kvroute_tests::model_dir("chatml").display());
    let plain = stack.gateway("plain", &["--model", &model]).unwrap();
    let ids = stack
        .gateway("ids", &["--model", &model, "--forward-token-ids"])
        .unwrap();
    let http = reqwest::Client::new();
    let body = json!({"model": "played", "prompt": "Hello, engine!", "max_tokens": 3, "temperature": 0.5,
        "kvroute": {"session": {"id": "s-1"}}});
    for gateway in [&plain, &ids] {
        let (status, _, text) =
            complete(&http, gateway, body.clone(), &[("x-request-id", "req-9")]).await;
        assert_eq!(status, 200, "{text}");
    }
    let got = engine.received.lock().unwrap().clone();
    assert_eq!(got.len(), 2);
    for r in &got {
        assert!(r.head.starts_with("POST /v1/completions "), "{}", r.head);
        assert_eq!(r.header("x-request-id"), Some("req-9"));
    }
    let sent = got[0].json();
    let mut expected = body.clone();
    expected.as_object_mut().unwrap().remove("kvroute");
    assert_eq!(
        sent, expected,
        "the client's fields, kvroute's extension removed"
    );
    // With --forward-token-ids, the prompt the gateway routed on, as token ids.
    let model =
        kvroute_text::ModelText::load("played", &kvroute_tests::model_dir("chatml")).unwrap();
    let tokens = model.encode("Hello, engine!", true).unwrap();
    assert_eq!(got[1].json()["prompt"], json!(tokens));
    assert_eq!(got[1].json()["temperature"], 0.5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_overloaded_is_503_with_retry_after() {
    // A worker is busy above 8 prompt tokens in prefill; one that reports no load keeps a
    // reservation's 40 tokens charged.
    let stack = GatewayStack::start_with(1, &["--busy-prefill-tokens", "8"], |_| {})
        .await
        .unwrap();
    let _card = kvroute_tests::register(
        &stack.env,
        kvroute_tests::http_card(911, "busy", "http://127.0.0.1:9"),
    )
    .await
    .unwrap();
    // The request may wait 300 ms in the router's admission queue, then gets its 503.
    let gateway = stack
        .gateway(
            "g",
            &[
                "--retry-after-secs",
                "3",
                "--select-queue-timeout-ms",
                "300",
            ],
        )
        .unwrap();
    let http = reqwest::Client::new();
    let r = http
        .post(gateway.url("/v1/select_and_reserve"))
        .json(&json!({"model": "busy", "token_ids": prompt(9, 40)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let body = json!({"model": "busy", "prompt": prompt(8, 40), "max_tokens": 1});
    let started = std::time::Instant::now();
    let (status, h, text) = complete(&http, &gateway, body, &[]).await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(h["retry-after"], "3");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_selection_api_answers_only_workers_with_an_http_url_unless_asked() {
    let stack = GatewayStack::start(1, |_| {}).await.unwrap();
    // A worker of the same model reached only over NATS (no http_url in its card).
    let mut card = kvroute_tests::http_card(950, STACK_MODEL, "http://unused");
    card.http_url = None;
    let _nats_only = kvroute_tests::register(&stack.env, card).await.unwrap();
    let gateway = stack.gateway("g", &[]).unwrap();
    let http = reqwest::Client::new();
    let select = async |extra: Value| {
        let mut body = json!({"model": STACK_MODEL, "token_ids": prompt(7, 16),
            "policy": "round-robin"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = http
            .post(gateway.url("/v1/select"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v["worker_id"].as_u64().unwrap()
    };
    for _ in 0..6 {
        assert_eq!(
            select(json!({})).await,
            100,
            "only the worker with an http_url"
        );
    }
    let mut chosen = Vec::new();
    for _ in 0..6 {
        chosen.push(select(json!({"http_only": false})).await);
    }
    assert!(chosen.contains(&950), "any worker when asked: {chosen:?}");
    // Only NATS workers allowed: nothing to answer over HTTP.
    let r = http
        .post(gateway.url("/v1/select"))
        .json(&json!({"model": STACK_MODEL, "token_ids": prompt(7, 16), "allowed_workers": [950]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_http_worker", "{v}");
}
