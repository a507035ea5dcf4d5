//! Disaggregated prefill and decode through `kvroute-gateway`, against mocker engines
//! impersonating vLLM's and SGLang's prefill and decode servers behind kvroute-bridge (which
//! registers each one's role, and an SGLang prefill server's bootstrap port): the official
//! `openai` client, unchanged, gets completions and chats, whole and streamed, prefilled on one
//! worker and decoded on another; a conversation keeps its prefill worker; every hop's load
//! is released by its own lifecycle events; the HTTP selection API answers the pair with a
//! reservation for each; a decode worker never gets a request without valid transfer
//! parameters. A prefill worker that cannot be reached is retried on another; decode workers
//! whose transfers fail end in a clean 502.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::messages::{LifecycleKind, RequestLifecycle, WorkerRole};
use kvroute_mocker::engine_face::EngineApi;
use kvroute_tests::{GatewayStack, STACK_MODEL, http_card, model_dir, python_json, register};
use serde_json::{Value, json};

/// 2 ms per transferred 4-token block: visible, not slow.
const MS_PER_BLOCK: f64 = 2.0;

async fn stack(api: EngineApi, decode: u32, failure_rate: f64) -> GatewayStack {
    let model = model_dir("chatml");
    GatewayStack::start_disaggregated(api, 2, decode, &[], move |c, role| {
        c.face.engine_tokenizer = Some(model.clone());
        c.face.kv_transfer_ms_per_block = MS_PER_BLOCK;
        if role == WorkerRole::Decode {
            c.face.kv_transfer_failure_rate = failure_rate;
        }
    })
    .await
    .unwrap()
}

fn gateway_flags() -> Vec<String> {
    vec![
        "--model".to_owned(),
        format!("{STACK_MODEL}={}", model_dir("chatml").display()),
    ]
}

/// Every lifecycle event published, by (request, worker).
type Hops = BTreeMap<(String, u64), Vec<&'static str>>;

/// Collects lifecycle events until `stop` fires, then for one more second.
async fn watch_lifecycle(
    stack: &GatewayStack,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Hops> {
    let nats = stack.env.nats.connect().await.unwrap();
    let subject = Names::new(&stack.env.namespace).lifecycle_all();
    let mut sub = nats.subscribe(subject).await.unwrap();
    nats.flush().await.unwrap();
    tokio::spawn(async move {
        let _keep = nats;
        let mut hops = Hops::new();
        let mut stop = stop;
        let mut deadline = None;
        loop {
            let msg = match deadline {
                None => tokio::select! {
                    _ = &mut stop => {
                        deadline = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                        continue;
                    }
                    msg = sub.next() => msg,
                },
                Some(at) => match tokio::time::timeout_at(at, sub.next()).await {
                    Ok(msg) => msg,
                    Err(_) => break,
                },
            };
            let Some(msg) = msg else { break };
            let Ok(event) = kvroute_common::codec::decode::<RequestLifecycle>(&msg.payload) else {
                continue;
            };
            let kind = match event.kind {
                LifecycleKind::PrefillDone { .. } => "prefill_done",
                LifecycleKind::Progress { .. } => "progress",
                LifecycleKind::Finished { .. } => "finished",
            };
            hops.entry((event.request_id.to_string(), event.worker_id))
                .or_default()
                .push(kind);
        }
        hops
    })
}

async fn both_hops_through_the_gateway(api: EngineApi, protocol: &str) {
    let stack = stack(api, 2, 0.0).await;
    let flags = gateway_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let gw = stack.gateway("g", &flags).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let lifecycle = watch_lifecycle(&stack, stopped).await;
    let seen = python_json(
        "gateway_disagg_client.py",
        vec![
            "--base-url".into(),
            gw.url("/v1"),
            "--model".into(),
            STACK_MODEL.into(),
        ],
    )
    .await;
    let prefill = [100, 101];
    let decode = [200, 201];
    for name in ["completion", "completion_stream", "chat", "chat_stream"] {
        let r = &seen[name];
        let (p, d) = (r["prefill"].as_u64(), r["decode"].as_u64());
        assert!(
            p.is_some_and(|p| prefill.contains(&p)),
            "{protocol} {name}: {r}"
        );
        assert!(
            d.is_some_and(|d| decode.contains(&d)),
            "{protocol} {name}: {r}"
        );
    }
    let c = &seen["completion"];
    assert_eq!(c["usage"]["completion_tokens"], 7, "{c}");
    assert_eq!(c["finish_reason"], "length");
    let cs = &seen["completion_stream"];
    assert_eq!(cs["usage"]["completion_tokens"], 7, "{cs}");
    assert!(cs["chunks"].as_u64().unwrap() >= 7, "{cs}");
    assert_eq!(seen["chat"]["role"], "assistant");
    assert_eq!(seen["chat"]["usage"]["completion_tokens"], 5);
    assert_eq!(seen["chat_stream"]["usage"]["completion_tokens"], 5);
    assert_eq!(seen["chat_stream"]["finish_reasons"], json!(["length"]));
    // A conversation's turns are prefilled where the conversation so far is cached.
    let turns = seen["conversation"].as_array().unwrap();
    for (t, turn) in turns.iter().enumerate().skip(1) {
        assert_eq!(turn["prefill"], turns[0]["prefill"], "turn {t}: {turns:?}");
        assert!(
            turn["overlap_blocks"].as_u64() > turns[t - 1]["overlap_blocks"].as_u64(),
            "turn {t} finds the earlier turns cached: {turns:?}"
        );
    }

    // The selection API answers the pair, and reserves both hops.
    let http = reqwest::Client::new();
    let body = json!({"model": STACK_MODEL, "token_ids": (0..64).collect::<Vec<u32>>()});
    let pair: Value = http
        .post(gw.url("/v1/select_and_reserve"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(pair["role"], "prefill", "{pair}");
    let d = pair["decode"]["worker_id"].as_u64().unwrap();
    assert!(decode.contains(&d), "{pair}");
    assert!(
        pair["decode_http_url"]
            .as_str()
            .unwrap()
            .starts_with("http://127.0.0.1:")
    );
    let sglang = protocol == "sglang";
    assert_eq!(pair["bootstrap_port"].is_u64(), sglang, "{pair}");
    for id in ["reservation_id", "decode_reservation_id"] {
        let id = pair[id].as_str().unwrap();
        let released: Value = http
            .delete(gw.url(&format!("/v1/reservations/{id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(released["held_here"], true, "{id}: {released}");
    }

    // Each hop of each request: prefilled, then finished once.
    stop.send(()).unwrap();
    let hops = lifecycle.await.unwrap();
    let requests = 4 + turns.len();
    let served: Vec<_> = hops
        .iter()
        .filter(|(_, kinds)| kinds.contains(&"prefill_done"))
        .collect();
    assert_eq!(served.len(), 2 * requests, "{hops:?}");
    for ((request, worker), kinds) in &hops {
        let finished = kinds.iter().filter(|k| **k == "finished").count();
        assert_eq!(finished, 1, "request {request} on {worker}: {kinds:?}");
    }
    let by_request = hops
        .keys()
        .fold(BTreeMap::<&str, Vec<u64>>::new(), |mut m, (r, w)| {
            m.entry(r).or_default().push(*w);
            m
        });
    for (request, workers) in &by_request {
        if workers.len() == 2 {
            assert!(
                prefill.contains(&workers[0]) && decode.contains(&workers[1]),
                "{request}: {workers:?}"
            );
        }
    }

    let (decode_fleet, _) = stack.decode.as_ref().unwrap();
    let m = decode_fleet.metrics();
    assert_eq!(
        m.requests_finished.get("refused"),
        0,
        "a decode worker never gets a request without valid transfer parameters"
    );
    assert_eq!(m.requests_finished.get("ok"), requests as u64);
    assert_eq!(
        gw.metric(&format!(
            "kvroute_gateway_disaggregated_attempts_total{{protocol=\"{protocol}\",result=\"ok\"}}"
        )),
        requests as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_hand_off_through_the_gateway_with_the_openai_client() {
    both_hops_through_the_gateway(EngineApi::Vllm, "vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_hand_off_through_the_gateway_with_the_openai_client() {
    both_hops_through_the_gateway(EngineApi::Sglang, "sglang").await;
}

/// A registered prefill worker nobody listens for is retried on the other prefill worker;
/// decode workers whose every transfer fails are each tried once, then the client gets a 502
/// with an OpenAI-shaped error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_is_retried_and_failed_decodes_end_in_a_502() {
    let stack = stack(EngineApi::Vllm, 2, 0.0).await;
    let mut dead = http_card(
        99,
        STACK_MODEL,
        &format!("http://127.0.0.1:{}", kvroute_tests::free_port()),
    );
    dead.role = WorkerRole::Prefill;
    dead.labels
        .insert("kvroute.bridge/engine".into(), "vllm".into());
    let _dead = register(&stack.env, dead).await.unwrap();
    let flags = gateway_flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let gw = stack.gateway("g", &flags).unwrap();
    let http = reqwest::Client::new();
    let retried = "kvroute_gateway_upstream_retries_total{reason=\"connect\"}";
    for i in 0..24 {
        let prompt: Vec<u32> = (0..40).map(|t| 1000 * i + t).collect();
        let r = http
            .post(gw.url("/v1/completions"))
            .json(&json!({"model": STACK_MODEL, "prompt": prompt, "max_tokens": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "request {i}");
        let worker = r.headers()["x-kvroute-worker-id"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_ne!(worker, "99", "the dead worker never answers");
        if gw.metric(retried) >= 1.0 {
            break;
        }
    }
    assert!(
        gw.metric(retried) >= 1.0,
        "the dead prefill worker was chosen once"
    );

    let failing = self::stack(EngineApi::Vllm, 2, 1.0).await;
    let gw = failing.gateway("f", &flags).unwrap();
    let r = http
        .post(gw.url("/v1/completions"))
        .json(&json!({"model": STACK_MODEL, "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let error: Value = r.json().await.unwrap();
    assert_eq!(error["error"]["code"], "upstream_failed", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("worker 20"),
        "{error}"
    );
    assert_eq!(
        gw.metric("kvroute_gateway_disaggregated_attempts_total{protocol=\"vllm\",result=\"decode_failed\"}"),
        2.0
    );
    let (decode_fleet, _) = failing.decode.as_ref().unwrap();
    assert_eq!(
        decode_fleet
            .metrics()
            .requests_finished
            .get("kv_transfer_failed"),
        2
    );
}

/// `kvroute-replay --selector gateway` streams a trace through the gateway's hand-off: every
/// request completes, paired, with the trace's output length; the client's inter-token gaps
/// are one per token after the first; the hits come from the prefill engines' own counters
/// (each prompt computed once, on its prefill worker; later requests of a document hit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_replayed_through_the_gateway_measures_the_streams() {
    use clap::Parser as _;
    let stack = GatewayStack::start_disaggregated(EngineApi::Vllm, 2, 2, &[], |c, _| {
        c.face.kv_transfer_ms_per_block = 0.1;
    })
    .await
    .unwrap();
    let gw = stack.gateway("g", &[]).unwrap();
    // 12 requests 100 ms apart over 3 documents: a 512-token trace block of the document's,
    // then 8 tokens of the request's own; 6 output tokens each.
    let (requests, input, output) = (12u64, 520u64, 6u64);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let lines: Vec<String> = (0..requests)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": {input}, "output_length": {output}, "hash_ids": [{}, {}]}}"#,
                i * 100,
                i % 3,
                1000 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let mut argv: Vec<String> = [
        "kvroute-replay",
        "--selector",
        "gateway",
        "--gateway-url",
        &gw.url(""),
        "--model",
        STACK_MODEL,
        "--modes",
        "kv",
        "--speedup",
        "1",
        "--trace",
        &trace.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    argv.extend(stack.env.server_args());
    let args = kvroute_lab::replay::ReplayArgs::try_parse_from(argv).unwrap();
    let report = kvroute_lab::replay::run(&args).await.unwrap();
    let m = &report.modes[0];
    assert_eq!((m.completed, m.errors), (requests, 0), "{m:?}");
    assert_eq!(m.output_tokens, requests * output);
    let itl = m.itl_ms.expect("the streams were read");
    assert_eq!(itl.count, requests * (output - 1));
    assert!(
        m.ttft_ms.p50 > 0.0 && m.e2e_latency_ms.p50 >= m.ttft_ms.p50,
        "{m:?}"
    );
    let d = m.disaggregation.as_ref().expect("a prefill/decode fleet");
    assert_eq!(
        (d.prefill_workers, d.decode_workers, d.paired, d.unpaired),
        (2, 2, requests, 0),
        "{d:?}"
    );
    assert!(m.hits_from_engines, "{m:?}");
    assert_eq!(
        m.prompt_tokens,
        requests * input,
        "each prompt computed once"
    );
    // A document's 512 tokens are cached where it was computed before, and the routers send
    // its later requests there.
    assert!(
        m.cached_prompt_tokens > 0 && m.cached_prompt_tokens < m.prompt_tokens,
        "{} cached of {}",
        m.cached_prompt_tokens,
        m.prompt_tokens
    );
}
