//! The mocker as vLLM and SGLang, over real HTTP (reqwest): a client that disconnects aborts
//! its request as the engines do (it leaves the running or waiting set, its blocks are freed
//! and its prefix stays cached; counted by the mocker and, for SGLang, on its `/metrics`),
//! streams carry one token per chunk at the simulated decode pace, and a stream the engine
//! drops (shutdown) ends without `[DONE]`.

use std::time::{Duration, Instant};

use kvroute_mocker::engine_face::{EngineApi, EventFormat};
use kvroute_mocker::fleet::FleetConfig;
use kvroute_tests::{EngineFace, eventually, face_config, sample};
use serde_json::{Value, json};

/// 40 ms per decoded token (a step costs 10 ms more), room for a long answer, and the
/// mocker's own `/metrics` on a free port.
fn slow_decode(api: EngineApi) -> FleetConfig {
    let mut c = face_config(api, EventFormat::Maps);
    c.engine.num_blocks = 512;
    c.engine.decode_ns_per_seq = 40_000_000;
    c.http_addr = Some("127.0.0.1:0".parse().unwrap());
    c
}

/// A 40-token prompt asking for 1000 tokens: about 50 s of decoding.
fn long_request(stream: bool) -> Value {
    json!({"model": "mock-model", "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 1000,
        "stream": stream})
}

/// The server-sent events of a streamed answer, each with its arrival time.
struct Events {
    resp: reqwest::Response,
    buf: String,
    start: Instant,
}

impl Events {
    async fn open(face: &EngineFace, path: &str, body: &Value) -> Self {
        let start = Instant::now();
        let resp = face
            .http
            .post(face.url(path))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        Self {
            resp,
            buf: String::new(),
            start,
        }
    }

    /// The next event's data (after `data: `) and when its end arrived; `None` at the end of
    /// the body (or if the connection broke).
    async fn next(&mut self) -> Option<(String, Duration)> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                let data = event
                    .trim_end()
                    .strip_prefix("data: ")
                    .expect("an SSE data line");
                return Some((data.to_owned(), self.start.elapsed()));
            }
            let bytes = self.resp.chunk().await.ok()??;
            self.buf.push_str(std::str::from_utf8(&bytes).unwrap());
        }
    }
}

/// The engine's running and waiting requests, from its own endpoints.
async fn requests_in_flight(face: &EngineFace, api: EngineApi) -> (f64, f64) {
    match api {
        EngineApi::Sglang => {
            let l = &face.get_json("/v1/loads").await["loads"][0];
            let n = |k: &str| l[k].as_f64().unwrap();
            (n("num_running_reqs"), n("num_waiting_reqs"))
        }
        _ => {
            let m = face.get("/metrics").await.1;
            let labels = "{engine=\"0\",model_name=\"mock-model\"}";
            let n = |name: &str| sample(&m, &format!("{name}{labels}")).unwrap();
            (
                n("vllm:num_requests_running"),
                n("vllm:num_requests_waiting"),
            )
        }
    }
}

/// The mocker's own count of aborted requests, from its `/metrics` on `--http-addr`.
async fn mocker_aborts(face: &EngineFace) -> Option<f64> {
    let addr = face.fleet.http_addr().expect("--http-addr");
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    sample(
        &text,
        "kvroute_mocker_requests_finished_total{outcome=\"aborted\"}",
    )
}

async fn a_dropped_stream_aborts(api: EngineApi) {
    let face = EngineFace::start(&slow_decode(api)).await.unwrap();
    let mut events = Events::open(&face, "/v1/completions", &long_request(true)).await;
    let (first, _) = events.next().await.unwrap();
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["choices"][0]["text"], "tok ");
    assert_eq!(requests_in_flight(&face, api).await, (1.0, 0.0));
    assert_eq!(mocker_aborts(&face).await, None, "nothing aborted yet");

    drop(events); // the client goes away after the first chunk
    let left = Instant::now();
    if api == EngineApi::Sglang {
        // SGLang aborts a stream 2 s after its client left (its response's abort task).
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(requests_in_flight(&face, api).await, (1.0, 0.0));
    }
    eventually("the request leaves the running set", async || {
        requests_in_flight(&face, api).await == (0.0, 0.0)
    })
    .await;
    let took = left.elapsed();
    let limit = match api {
        EngineApi::Sglang => Duration::from_millis(3500),
        _ => Duration::from_millis(1000),
    };
    assert!(took < limit, "aborted {took:?} after the client left");
    assert_eq!(mocker_aborts(&face).await, Some(1.0));
    assert_eq!(face.fleet.metrics().requests_finished.get("ok"), 0);

    match api {
        EngineApi::Sglang => {
            let m = face.get("/metrics").await.1;
            let tokenizer = "engine_type=\"unified\",model_name=\"mock-model\"";
            assert_eq!(
                sample(
                    &m,
                    &format!("sglang:num_aborted_requests_total{{{tokenizer}}}")
                ),
                Some(1.0),
                "{m}"
            );
            assert_eq!(
                sample(
                    &m,
                    "sglang:num_requests_total{engine_type=\"unified\",is_streaming=\"true\",model_name=\"mock-model\"}"
                ),
                Some(1.0),
                "an aborted request ends like any other: {m}"
            );
            assert_eq!(
                face.get_json("/v1/loads").await["loads"][0]["token_usage"],
                0.0
            );
        }
        _ => {
            let m = face.get("/metrics").await.1;
            let series = |reason: &str| {
                format!(
                    "vllm:request_success_total{{engine=\"0\",finished_reason=\"{reason}\",model_name=\"mock-model\"}}"
                )
            };
            // vLLM does not count a client's abort among its finish reasons; every reason's
            // series is there from the start.
            for reason in ["stop", "length", "abort", "error", "repetition"] {
                assert_eq!(sample(&m, &series(reason)), Some(0.0), "{reason}\n{m}");
            }
            let labels = "{engine=\"0\",model_name=\"mock-model\"}";
            let generated = sample(&m, &format!("vllm:generation_tokens_total{labels}")).unwrap();
            assert!((1.0..100.0).contains(&generated), "{generated}");
            assert_eq!(
                sample(&m, &format!("vllm:kv_cache_usage_perc{labels}")),
                Some(0.0),
                "its blocks are free"
            );
        }
    }
    // Its prompt's blocks stayed cached, as a finished request's do.
    let again = face.complete(&(0..40).collect::<Vec<u32>>(), 2).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 39);
    assert_eq!(face.fleet.metrics().requests_finished.get("ok"), 1);
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_vllm_stream_aborts_its_request_at_once() {
    a_dropped_stream_aborts(EngineApi::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_an_sglang_stream_aborts_its_request_two_seconds_later() {
    a_dropped_stream_aborts(EngineApi::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_plain_request_aborts_it_running_or_waiting() {
    for api in [EngineApi::Vllm, EngineApi::Sglang] {
        let mut config = slow_decode(api);
        config.engine.max_num_seqs = 1;
        let face = EngineFace::start(&config).await.unwrap();
        let short = reqwest::Client::builder()
            .timeout(Duration::from_millis(600))
            .build()
            .unwrap();
        let url = face.url("/v1/completions");
        // One runs, one waits for the batch slot; both clients give up after 600 ms.
        let running = short.post(&url).json(&long_request(false)).send();
        let waiting = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut body = long_request(false);
            body["prompt"] = json!((100..140).collect::<Vec<u32>>());
            short.post(&url).json(&body).send().await
        };
        let probe = async {
            eventually("one running, one waiting", async || {
                requests_in_flight(&face, api).await == (1.0, 1.0)
            })
            .await;
        };
        let (a, b, ()) = tokio::join!(running, waiting, probe);
        assert!(a.unwrap_err().is_timeout() && b.unwrap_err().is_timeout());
        eventually("both requests leave", async || {
            requests_in_flight(&face, api).await == (0.0, 0.0)
        })
        .await;
        assert_eq!(mocker_aborts(&face).await, Some(2.0), "{api:?}");
        assert_eq!(face.fleet.metrics().requests_finished.get("ok"), 0);
        face.fleet.shutdown().await;
    }
}

/// A streamed chat of 20 tokens: the role chunk, then one chunk per token, one decode step
/// (about 50 ms) apart, the finish reason on the last, the usage, `[DONE]`.
async fn tokens_stream_at_the_decode_pace(api: EngineApi) {
    let face = EngineFace::start(&slow_decode(api)).await.unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Count to twenty."}],
        "max_tokens": 20, "stream": true, "stream_options": {"include_usage": true}});
    let mut events = Events::open(&face, "/v1/chat/completions", &body).await;
    let mut seen = Vec::new();
    while let Some(e) = events.next().await {
        seen.push(e);
    }
    assert_eq!(seen.len(), 23, "role, 20 tokens, usage, [DONE]: {seen:?}");
    assert_eq!(seen[22].0, "[DONE]");
    let chunks: Vec<Value> = seen[..22]
        .iter()
        .map(|(d, _)| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "");
    for (i, c) in chunks[1..21].iter().enumerate() {
        let choice = &c["choices"][0];
        assert_eq!(choice["delta"]["content"], "tok ", "{c}");
        assert!(choice["delta"].get("role").is_none());
        let reason = if i == 19 {
            json!("length")
        } else {
            json!(null)
        };
        assert_eq!(choice["finish_reason"], reason, "{c}");
    }
    assert_eq!(chunks[21]["choices"], json!([]));
    assert_eq!(chunks[21]["usage"]["completion_tokens"], 20);

    // Decode steps of one sequence: 10 ms + 40 ms (+ a little per context token).
    let at: Vec<f64> = seen[1..21].iter().map(|(_, t)| t.as_secs_f64()).collect();
    let mut gaps: Vec<f64> = at.windows(2).map(|w| w[1] - w[0]).collect();
    let span = at[19] - at[0];
    assert!(
        (0.85..1.3).contains(&span),
        "19 steps took {span} s: {gaps:?}"
    );
    gaps.sort_by(f64::total_cmp);
    let median = gaps[gaps.len() / 2];
    assert!(
        (0.045..0.07).contains(&median),
        "median gap {median} s: {gaps:?}"
    );
    let paced = gaps.iter().filter(|g| (0.03..0.1).contains(*g)).count();
    assert!(paced >= 12, "most gaps are one decode step: {gaps:?}");
    face.fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_streams_one_token_per_chunk_at_the_decode_pace() {
    tokens_stream_at_the_decode_pace(EngineApi::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_streams_one_token_per_chunk_at_the_decode_pace() {
    tokens_stream_at_the_decode_pace(EngineApi::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_drops_ends_without_done() {
    let face = EngineFace::start(&slow_decode(EngineApi::Vllm))
        .await
        .unwrap();
    let mut events = Events::open(&face, "/v1/completions", &long_request(true)).await;
    assert!(events.next().await.is_some());
    let reader = tokio::spawn(async move {
        let mut rest = Vec::new();
        while let Some((data, _)) = events.next().await {
            rest.push(data);
        }
        rest
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    face.fleet.shutdown().await;
    let rest = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the stream ends")
        .unwrap();
    assert!(!rest.is_empty(), "tokens flowed until the shutdown");
    assert!(
        rest.iter().all(|d| d != "[DONE]"),
        "no [DONE] after a shutdown: {rest:?}"
    );
}
