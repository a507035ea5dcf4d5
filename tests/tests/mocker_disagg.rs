//! Disaggregated prefill/decode between the mocker's impersonated engines, over their HTTP
//! APIs: vLLM's `kv_transfer_params` hand-off (a prefill's answer carries them, a decode with
//! them streams the answer after the modelled transfer, a decode without, with forged or
//! replayed parameters, or after its prefill worker is gone is refused), and SGLang's bootstrap
//! room (a decode waits for its room's prefill; a room that never comes times out).

use std::time::{Duration, Instant};

use kvroute_mocker::engine_face::{
    DisaggregationRole, EngineApi, EngineFleet, EventFormat, WorkerEndpoints,
};
use kvroute_mocker::fleet::FleetConfig;
use kvroute_tests::{face_config, sample};
use serde_json::{Value, json};

/// 10 ms per transferred 4-token block.
const MS_PER_BLOCK: f64 = 10.0;

struct Worker {
    fleet: EngineFleet,
    at: WorkerEndpoints,
}

async fn worker(
    api: EngineApi,
    role: DisaggregationRole,
    edit: impl FnOnce(&mut FleetConfig),
) -> Worker {
    let mut c = face_config(api, EventFormat::Maps);
    c.engine.num_blocks = 256;
    c.face.disaggregation_role = role;
    c.face.engine_side_channel_port = Some(0);
    c.face.kv_transfer_ms_per_block = MS_PER_BLOCK;
    edit(&mut c);
    let fleet = EngineFleet::start(&c).await.unwrap();
    let at = fleet.endpoints()[0].clone();
    Worker { fleet, at }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn post(w: &Worker, body: &Value) -> (u16, Value) {
    let resp = client()
        .post(format!("{}/v1/completions", w.at.url()))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// A streamed completion: the seconds to the first chunk, and every `data:` payload.
async fn stream(url: &str, body: &Value) -> (u16, f64, Vec<String>) {
    let start = Instant::now();
    let mut resp = client()
        .post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let mut text = String::new();
    let mut first = None;
    while let Some(chunk) = resp.chunk().await.unwrap() {
        first.get_or_insert_with(|| start.elapsed().as_secs_f64());
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let data = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_owned)
        .collect();
    (status, first.unwrap_or_default(), data)
}

/// 40 tokens: 10 blocks of 4.
fn prompt(salt: u32) -> Vec<u32> {
    (0..40).map(|t| salt * 1000 + t).collect()
}

async fn vllm_prefill(p: &Worker, salt: u32) -> Value {
    let (status, body) = post(
        p,
        &json!({"prompt": prompt(salt), "max_tokens": 1, "stream": false,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
                "remote_port": null}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], "tok ");
    body["kv_transfer_params"].clone()
}

fn decode_body(salt: u32, params: &Value) -> Value {
    json!({"prompt": prompt(salt), "max_tokens": 8, "stream": true, "kv_transfer_params": params})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_hands_off_to_decode() {
    let p = worker(EngineApi::Vllm, DisaggregationRole::Prefill, |_| {}).await;
    let d = worker(EngineApi::Vllm, DisaggregationRole::Decode, |_| {}).await;
    let side =
        p.at.side_channel
            .expect("a prefill worker has a side channel");
    assert!(p.at.to_string().ends_with("--role prefill"), "{}", p.at);

    let params = vllm_prefill(&p, 1).await;
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(
        params["remote_block_ids"],
        json!([(0..10).collect::<Vec<u64>>()])
    );
    assert!(
        params["remote_engine_id"]
            .as_str()
            .is_some_and(|s| s.len() == 36)
    );
    assert!(
        params["remote_request_id"]
            .as_str()
            .is_some_and(|s| s.starts_with("cmpl-"))
    );
    assert_eq!(params["remote_host"], side.ip().to_string());
    assert_eq!(params["remote_port"], side.port());
    assert_eq!(params["tp_size"], 1);
    assert_eq!(params["remote_num_tokens"], 40);

    // The decode streams the answer; its first token comes after the transfer (10 blocks ×
    // 10 ms) plus one token's step.
    let (status, ttft, data) = stream(&d.at.url(), &decode_body(1, &params)).await;
    assert_eq!(status, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let text: String = data[..data.len() - 1]
        .iter()
        .map(|c| {
            serde_json::from_str::<Value>(c).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(text, "tok ".repeat(8));
    assert!(ttft >= 0.1, "the transfer is in the TTFT: {ttft}");
    assert!(ttft < 1.0, "{ttft}");

    // The same hand-off twice: the prefill no longer holds it (vLLM: 500).
    let (status, ttft, data) = stream(&d.at.url(), &decode_body(1, &params)).await;
    assert_eq!(status, 200, "a stream fails in its body");
    assert!(ttft < 0.1);
    let error: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(
        error,
        json!({"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}})
    );
    assert_eq!(data[1], "[DONE]");

    // Forged: another engine's id.
    let mut forged = vllm_prefill(&p, 2).await;
    forged["remote_engine_id"] = json!("00000000-0000-0000-0000-000000000000");
    let mut whole = decode_body(2, &forged);
    whole["stream"] = json!(false);
    let (status, body) = post(&d, &whole).await;
    assert_eq!(
        (status, &body["error"]["message"]),
        (500, &json!("Internal server error"))
    );

    // Without parameters, or without the prefill's fields: refused.
    let (status, body) = post(&d, &json!({"prompt": prompt(3), "max_tokens": 4})).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], "BadRequestError");
    let (status, _) = post(
        &d,
        &json!({"prompt": prompt(3), "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "x"}}),
    )
    .await;
    assert_eq!(status, 400);

    // The prefill worker is gone: its hand-off cannot be pulled.
    let orphan = vllm_prefill(&p, 4).await;
    p.fleet.shutdown().await;
    let mut whole = decode_body(4, &orphan);
    whole["stream"] = json!(false);
    let (status, body) = post(&d, &whole).await;
    assert_eq!(status, 500, "{body}");

    let m = d.fleet.metrics();
    assert_eq!(m.requests_finished.get("refused"), 2);
    assert_eq!(m.requests_finished.get("kv_transfer_failed"), 3);
    assert_eq!(m.requests_finished.get("ok"), 1);
    d.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_transfer_failures_are_injected() {
    let p = worker(EngineApi::Vllm, DisaggregationRole::Prefill, |_| {}).await;
    let d = worker(EngineApi::Vllm, DisaggregationRole::Decode, |c| {
        c.face.kv_transfer_failure_rate = 1.0;
    })
    .await;
    let params = vllm_prefill(&p, 1).await;
    let started = Instant::now();
    let mut whole = decode_body(1, &params);
    whole["stream"] = json!(false);
    let (status, body) = post(&d, &whole).await;
    assert_eq!(status, 500, "{body}");
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "after the transfer's time"
    );
    p.fleet.shutdown().await;
    d.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_decode_waits_for_its_room() {
    let p = worker(EngineApi::Sglang, DisaggregationRole::Prefill, |_| {}).await;
    let d = worker(EngineApi::Sglang, DisaggregationRole::Decode, |c| {
        c.face.disaggregation_timeout_secs = 0.5;
    })
    .await;
    let side = p.at.side_channel.unwrap();
    let info: Value = client()
        .get(format!("{}/get_server_info", p.at.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_eq!(info["disaggregation_bootstrap_port"], side.port());
    let body = |room: u64| {
        json!({"prompt": prompt(5), "max_tokens": 8, "stream": true,
            "bootstrap_host": side.ip().to_string(), "bootstrap_port": side.port(),
            "bootstrap_room": room})
    };

    // The decode arrives first and waits; the prefill comes 200 ms later.
    let room = 4_611_686_018_427_387_904u64 + 17;
    let decode = tokio::spawn({
        let url = d.at.url();
        let body = body(room);
        async move { stream(&url, &body).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, prefill) = post(&p, &{
        let mut b = body(room);
        b["stream"] = json!(false);
        b
    })
    .await;
    assert_eq!(status, 200, "{prefill}");
    assert_eq!(
        prefill["choices"][0]["text"], "tok ",
        "a prefill answers one token"
    );
    let (status, ttft, data) = decode.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        ttft >= 0.3,
        "waited for the room, then the transfer: {ttft}"
    );
    assert_eq!(data.len(), 9, "8 tokens and [DONE]: {data:?}");

    // No room: 400, SGLang's message.
    let (status, body_) = post(&d, &json!({"prompt": prompt(5)})).await;
    assert_eq!(status, 400);
    assert!(
        body_["message"].as_str().unwrap().starts_with(
            "Invalid request: Disaggregated request received without bootstrap room id."
        ),
        "{body_}"
    );
    // A room no prefill announces times out after 0.5 s.
    let mut lost = body(99);
    lost["stream"] = json!(false);
    let started = Instant::now();
    let (status, err) = post(&d, &lost).await;
    assert_eq!(status, 500, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    let message = err["message"].as_str().unwrap();
    assert!(
        message.starts_with("Decode transfer failed for request"),
        "{message}"
    );
    assert!(message.contains("timed out"), "{message}");
    assert_eq!(err["type"], "500");

    let metrics = client()
        .get(format!("{}/metrics", d.at.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        sample(
            &metrics,
            "sglang:num_transfer_failed_reqs_total{engine_type=\"unified\",model_name=\"mock-model\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    p.fleet.shutdown().await;
    d.fleet.shutdown().await;
}
