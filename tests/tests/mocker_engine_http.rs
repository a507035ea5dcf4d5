//! The mocker impersonating vLLM and SGLang over HTTP: the real `openai` client and curl
//! against the completions endpoints (streaming token by token from the simulated TTFT, usage
//! with cached tokens), vLLM's `/metrics` and SGLang's `/get_server_info` and `/v1/loads`
//! moving while requests run, the health hooks, and errors in each engine's shape. Aborts on
//! disconnect and inter-token timing: `mocker_engine_streams.rs`.

use std::process::Command;
use std::time::Duration;

use kvroute_mocker::engine_face::{EngineApi, EventFormat};
use kvroute_mocker::fleet::FleetConfig;
use kvroute_tests::{EngineFace, eventually, face_config, python_json, sample};
use serde_json::{Value, json};

/// 40 ms per decoded token (a step costs 10 ms more), so streams visibly take their time.
fn slow_decode(api: EngineApi) -> FleetConfig {
    let mut c = face_config(api, EventFormat::Maps);
    c.engine.num_blocks = 256;
    c.engine.decode_ns_per_seq = 40_000_000;
    c
}

fn filler(n: usize) -> String {
    "tok ".repeat(n)
}

async fn openai_client(api: EngineApi) {
    let face = EngineFace::start(&slow_decode(api)).await.unwrap();
    let seen = python_json(
        "openai_client.py",
        vec![
            "--base-url".into(),
            face.url("/v1"),
            "--model".into(),
            "mock-model".into(),
            "--max-tokens".into(),
            "8".into(),
        ],
    )
    .await;
    let prompt_tokens = "The engine face answers with filler tokens. ".len() * 3;
    assert_eq!(seen["models"], json!(["mock-model"]));
    let plain = &seen["completion"];
    assert_eq!(plain["text"], filler(8));
    assert_eq!(plain["finish_reason"], "length");
    assert_eq!(plain["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(plain["usage"]["completion_tokens"], 8);
    assert_eq!(plain["usage"]["total_tokens"], prompt_tokens + 8);
    assert_eq!(plain["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    // The same prompt again, streamed: the first token at TTFT, then one chunk per decode step
    // (7 more of 50 ms), the last with the finish reason, then the usage chunk; the prompt is
    // cached but its last token.
    let stream = &seen["completion_stream"];
    let texts: Vec<&str> = stream["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(texts.concat(), filler(8));
    let mut reasons = vec![Value::Null; 7];
    reasons.push(json!("length"));
    assert_eq!(stream["finish_reasons"], json!(reasons));
    assert_eq!(stream["chunks"], 9, "8 tokens, usage: {stream}");
    let times: Vec<f64> = stream["times"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_f64().unwrap())
        .collect();
    assert!(
        times[7] - times[0] > 0.25,
        "the first chunk comes at TTFT, well before the end: {times:?}"
    );
    // A busy client may read two chunks at once now and then (reqwest times them closely in
    // mocker_engine_streams.rs).
    let paced = times.windows(2).filter(|w| w[1] - w[0] > 0.02).count();
    assert!(paced >= 5, "one chunk per decode step: {times:?}");
    let usage = &stream["usage"];
    assert_eq!(usage["completion_tokens"], 8);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1
    );

    let chat_prompt = "<|system|>\nYou are a simulated engine.\n<|user|>\n".len()
        + "Say something ".len() * 8
        + "\n<|assistant|>\n".len();
    let chat_stream = &seen["chat_stream"];
    assert_eq!(chat_stream["texts"][0], "", "the role chunk comes first");
    let chat_text: String = chat_stream["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(chat_text, filler(8));
    reasons.insert(0, Value::Null); // the role chunk
    assert_eq!(chat_stream["finish_reasons"], json!(reasons));
    assert_eq!(chat_stream["usage"]["prompt_tokens"], chat_prompt);
    assert_eq!(
        chat_stream["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let chat = &seen["chat"];
    assert_eq!(
        (&chat["role"], &chat["text"], &chat["finish_reason"]),
        (&json!("assistant"), &json!(filler(8)), &json!("length"))
    );
    // Full 4-token blocks only (and never the last prompt token).
    assert_eq!(
        chat["usage"]["prompt_tokens_details"]["cached_tokens"],
        (chat_prompt / 4 * 4).min(chat_prompt - 1)
    );
    assert_eq!(seen["missing_model_status"], 404);
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_talks_to_the_vllm_face() {
    openai_client(EngineApi::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_talks_to_the_sglang_face() {
    openai_client(EngineApi::Sglang).await;
}

/// Runs curl with `args` off the runtime; its stdout.
async fn curl(args: Vec<String>) -> String {
    let out = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "--max-time", "20"])
            .args(args)
            .output()
            .expect("curl runs (scripts/install-deps installs it)")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_sees_server_sent_events_and_plain_json() {
    let face = EngineFace::start(&face_config(EngineApi::Vllm, EventFormat::Maps))
        .await
        .unwrap();
    let body = json!({"model": "mock-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3,
        "stream": true, "stream_options": {"include_usage": true}});
    let raw = curl(vec![
        "-N".into(),
        "-i".into(),
        "-H".into(),
        "Content-Type: application/json".into(),
        "-d".into(),
        body.to_string(),
        face.url("/v1/completions"),
    ])
    .await;
    let (head, events) = raw
        .split_once("\r\n\r\n")
        .expect("headers, then the stream");
    assert!(
        head.to_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    let events: Vec<&str> = events.split_terminator("\n\n").collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")), "{events:?}");
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    // vLLM's first chunk, field for field in its order (exclude_unset keeps the set nulls).
    let first = events[0];
    assert!(first.starts_with("data: {\"id\":\"cmpl-"), "{first}");
    assert!(
        first.contains("\",\"object\":\"text_completion\",\"created\":"),
        "{first}"
    );
    assert!(
        first.ends_with(",\"model\":\"mock-model\",\"choices\":[{\"index\":0,\"text\":\"tok \",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null,\"token_ids\":null}]}"),
        "{first}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    assert_eq!(chunks.len(), 4, "3 tokens, usage");
    assert!(
        chunks
            .iter()
            .all(|c| c["id"] == chunks[0]["id"] && c["object"] == "text_completion")
    );
    for (c, reason) in chunks[..3]
        .iter()
        .zip([json!(null), json!(null), json!("length")])
    {
        assert_eq!(c["choices"][0]["text"], "tok ");
        assert_eq!(c["choices"][0]["finish_reason"], reason);
    }
    assert_eq!(chunks[3]["choices"], json!([]));
    assert_eq!(
        chunks[3]["usage"],
        json!({"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 0}})
    );
    face.fleet.shutdown().await;

    let face = EngineFace::start(&face_config(EngineApi::Sglang, EventFormat::Maps))
        .await
        .unwrap();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let text = curl(vec![
        "-d".into(),
        body.to_string(),
        face.url("/v1/chat/completions"),
    ])
    .await;
    let full: Value = serde_json::from_str(&text).unwrap();
    assert!(full["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(
        full["choices"],
        json!([{"index": 0, "message": {"role": "assistant", "content": "tok tok ",
            "reasoning_content": null}, "logprobs": null, "finish_reason": "length",
            "matched_stop": null}])
    );
    assert_eq!(full["usage"]["reasoning_tokens"], 0, "SGLang's UsageInfo");
    assert!(full.get("metadata").is_some());
    face.fleet.shutdown().await;
}

/// Two requests of the same 40-token prompt on an engine running one at a time: the first
/// runs (30 tokens, about 1.5 s), the second waits, then hits the cache.
fn two_requests(face: &EngineFace) -> tokio::task::JoinHandle<()> {
    let url = face.url("/v1/completions");
    let http = face.http.clone();
    tokio::spawn(async move {
        let body = json!({"prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 30});
        let first = http.post(&url).json(&body).send();
        let second = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            http.post(&url).json(&body).send().await
        };
        let (a, b) = tokio::join!(first, second);
        assert_eq!(a.unwrap().status(), 200);
        assert_eq!(b.unwrap().status(), 200);
    })
}

fn one_at_a_time(api: EngineApi) -> FleetConfig {
    let mut c = slow_decode(api);
    c.engine.max_num_seqs = 1;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_metrics_have_the_real_names_and_move_while_requests_run() {
    let face = EngineFace::start(&one_at_a_time(EngineApi::Vllm))
        .await
        .unwrap();
    let labels = "{engine=\"0\",model_name=\"mock-model\"}";
    let (status, idle) = face.get("/metrics").await;
    assert_eq!(status, 200);
    for (name, kind) in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:prefix_cache_hits", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:cache_config_info", "gauge"),
    ] {
        assert!(
            idle.contains(&format!("# TYPE {name} {kind}\n")),
            "{name}\n{idle}"
        );
    }
    assert_eq!(
        sample(&idle, &format!("vllm:num_requests_running{labels}")),
        Some(0.0)
    );
    let info = idle
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .unwrap();
    for label in [
        "block_size=\"4\"",
        "num_gpu_blocks=\"256\"",
        "engine=\"0\"",
        "enable_prefix_caching=\"True\"",
    ] {
        assert!(info.contains(label), "{info}");
    }
    assert!(info.ends_with("} 1.0"), "{info}");

    let requests = two_requests(&face);
    eventually("one request running, one waiting", async || {
        let m = face.get("/metrics").await.1;
        sample(&m, &format!("vllm:num_requests_running{labels}")) == Some(1.0)
            && sample(&m, &format!("vllm:num_requests_waiting{labels}")) == Some(1.0)
            && sample(&m, &format!("vllm:kv_cache_usage_perc{labels}")) > Some(0.0)
    })
    .await;
    let (status, _) = face.post("/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 400, "no reset while requests run");
    requests.await.unwrap();

    let done = face.get("/metrics").await.1;
    let value = |series: &str| sample(&done, series).unwrap_or_else(|| panic!("{series}\n{done}"));
    assert_eq!(value(&format!("vllm:num_requests_running{labels}")), 0.0);
    assert_eq!(value(&format!("vllm:prompt_tokens_total{labels}")), 80.0);
    assert_eq!(
        value(&format!("vllm:generation_tokens_total{labels}")),
        60.0
    );
    assert_eq!(
        value(&format!("vllm:prefix_cache_queries_total{labels}")),
        80.0
    );
    assert_eq!(
        value(&format!("vllm:prefix_cache_hits_total{labels}")),
        39.0
    );
    assert_eq!(
        value(
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"mock-model\"}"
        ),
        2.0
    );
    assert_eq!(
        value(&format!("vllm:kv_cache_usage_perc{labels}")),
        0.0,
        "idle cached blocks count as free"
    );
    assert_eq!(
        face.get_json("/version").await,
        json!({"version": "0.32.0"})
    );
    assert_eq!(face.post("/reset_prefix_cache", &json!({})).await.0, 200);
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_server_info_and_loads_have_the_real_shape_and_move() {
    let face = EngineFace::start(&one_at_a_time(EngineApi::Sglang))
        .await
        .unwrap();
    let ep = face.endpoints[0].clone();
    let port = |e: &str| e.rsplit(':').next().unwrap().parse::<u64>().unwrap();
    for path in ["/get_server_info", "/server_info"] {
        let info = face.get_json(path).await;
        assert_eq!(info["page_size"], 4);
        assert_eq!(info["max_total_num_tokens"], 1024);
        assert_eq!(info["dp_size"], 1);
        assert_eq!(info["chunked_prefill_size"], 8192);
        assert_eq!(info["max_running_requests"], 1);
        assert_eq!(info["version"], "0.5.23");
        assert_eq!(
            (&info["model_path"], &info["served_model_name"]),
            (&json!("mock-model"), &json!("mock-model"))
        );
        let kv = &info["kv_events"];
        assert_eq!(kv["publisher"], "zmq");
        assert_eq!(kv["endpoint_port_base"], port(&ep.zmq[0]));
        assert_eq!(kv["replay_endpoint_port_base"], port(&ep.replay[0]));
        assert_eq!(
            (&kv["block_size"], &kv["dp_size"], &kv["topic"]),
            (&json!(4), &json!(1), &json!("kv"))
        );
        assert_eq!(info["internal_states"].as_array().unwrap().len(), 1);
    }
    let loads = face.get_json("/v1/loads").await;
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(
        keys(&loads),
        [
            "accelerator",
            "loads",
            "num_accelerators",
            "timestamp",
            "version"
        ]
    );
    assert!(
        loads["timestamp"].as_str().unwrap().ends_with("+00:00"),
        "isoformat()"
    );
    let mut want = vec![
        "timestamp",
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_waiting_uncached_tokens",
        "num_used_tokens",
        "num_total_tokens",
        "num_active_tokens",
        "num_prealloc_ready_tokens",
        "max_total_num_tokens",
        "max_running_requests",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
        "total_prefill_uncached_tokens",
        "total_prefill_busy_us",
        "decode_moments",
        "memory",
        "disaggregation",
        "queues",
    ];
    want.sort();
    let idle = &loads["loads"][0];
    assert_eq!(keys(idle), want);
    assert_eq!(
        (&idle["num_running_reqs"], &idle["max_total_num_tokens"]),
        (&json!(0), &json!(1024))
    );
    assert_eq!(idle["disaggregation"]["mode"], "null");

    let requests = two_requests(&face);
    eventually("one request running, one waiting", async || {
        let l = &face.get_json("/v1/loads").await["loads"][0];
        l["num_running_reqs"] == 1
            && l["num_waiting_reqs"] == 1
            && l["queues"]["waiting"] == 1
            && l["token_usage"].as_f64() > Some(0.0)
            && l["num_used_tokens"].as_u64() > Some(0)
    })
    .await;
    let (status, _) = face.get("/flush_cache").await;
    assert_eq!(status, 400, "no flush while requests run");
    requests.await.unwrap();
    let done = &face.get_json("/v1/loads?dp_rank=0").await["loads"];
    assert_eq!(done.as_array().unwrap().len(), 1);
    assert_eq!(done[0]["num_running_reqs"], 0);
    assert!(done[0]["cache_hit_rate"].as_f64().unwrap() > 0.4, "{done}");
    assert_eq!(
        face.get_json("/v1/loads?dp_rank=3").await["loads"],
        json!([])
    );
    let (status, body) = face
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "routed_dp_rank": 3}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        (&body["object"], &body["code"]),
        (&json!("error"), &json!(400)),
        "SGLang's error shape"
    );
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_hooks_fail_and_recover_health() {
    for api in [EngineApi::Vllm, EngineApi::Sglang] {
        let face = EngineFace::start(&face_config(api, EventFormat::Maps))
            .await
            .unwrap();
        assert_eq!(face.get("/health").await.0, 200);
        assert_eq!(face.post("/kvroute/fail-health", &json!({})).await.0, 200);
        assert_eq!(face.get("/health").await.0, 503);
        if api == EngineApi::Sglang {
            assert_eq!(face.get("/health_generate").await.0, 503);
        }
        face.complete(&[1, 2, 3], 1).await; // only health fails
        assert_eq!(
            face.post("/kvroute/recover-health", &json!({})).await.0,
            200
        );
        assert_eq!(face.get("/health").await.0, 200);
        face.fleet.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_lists_and_bad_requests() {
    let face = EngineFace::start(&face_config(EngineApi::Vllm, EventFormat::Maps))
        .await
        .unwrap();
    let (status, body) = face
        .post(
            "/v1/completions",
            &json!({"prompt": ["abcdefgh", [1, 2, 3]], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let indexes: Vec<&Value> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["index"])
        .collect();
    assert_eq!(indexes, [&json!(0), &json!(1)]);
    assert_eq!(body["usage"]["prompt_tokens"], 11);
    assert_eq!(body["usage"]["completion_tokens"], 4);
    for (bad, status) in [
        (json!({"prompt": "x", "max_tokens": 0}), 400),
        (json!({"prompt": "x", "n": 2}), 400),
        (json!({"prompt": ""}), 400),
        (json!({"prompt": {"not": "a prompt"}}), 400),
        (json!({"model": "other", "prompt": "x"}), 404),
        // 64 blocks of 4 tokens hold no 300-token prompt.
        (json!({"prompt": vec![7; 300]}), 400),
    ] {
        let (got, body) = face.post("/v1/completions", &bad).await;
        assert_eq!(got, status, "{bad}: {body}");
        assert_eq!(body["error"]["code"], status, "vLLM's error shape: {body}");
        assert!(body["error"]["message"].is_string());
    }
    let (got, _) = face
        .post("/v1/chat/completions", &json!({"messages": []}))
        .await;
    assert_eq!(got, 400);
    face.fleet.shutdown().await;
}
