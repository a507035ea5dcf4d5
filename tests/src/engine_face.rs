//! The mocker's engine face (`--engine-api vllm|sglang`) in-process for tests, and clients of
//! what it exposes: a ZMQ SUB and a replay client (libzmq, as the engines' consumers use), the
//! batch decoder (rmpv), HTTP (reqwest), and the Python clients in `tests/python`.

use std::process::Command;
use std::time::{Duration, Instant};

use kvroute_mocker::engine_face::{EngineApi, EngineFleet, EventFormat, WorkerEndpoints};
use kvroute_mocker::fleet::FleetConfig;
use rmpv::Value;

use crate::servers::workspace_root;

/// One worker of 4-token blocks, 64 of them, every port chosen by the OS, topic `kv`.
pub fn face_config(api: EngineApi, format: EventFormat) -> FleetConfig {
    let mut c = FleetConfig {
        workers: 1,
        ..FleetConfig::default()
    };
    c.engine.block_size = 4;
    c.engine.num_blocks = 64;
    c.face.engine_api = api;
    c.face.engine_event_format = format;
    c.face.engine_http_port = 0;
    c.face.engine_zmq_port = 0;
    c.face.engine_replay_port = 0;
    c.face.engine_topic = "kv".into();
    c
}

/// A running engine fleet and an HTTP client for it.
#[derive(Debug)]
pub struct EngineFace {
    pub fleet: EngineFleet,
    pub endpoints: Vec<WorkerEndpoints>,
    pub http: reqwest::Client,
}

impl EngineFace {
    pub async fn start(config: &FleetConfig) -> anyhow::Result<Self> {
        let fleet = EngineFleet::start(config).await?;
        Ok(Self {
            endpoints: fleet.endpoints(),
            fleet,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
        })
    }

    /// `http://host:port<path>` of worker 0.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.endpoints[0].url())
    }

    /// POSTs JSON; the status and the body as JSON (`Null` if it is not JSON).
    pub async fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        self.post_with(path, body, &[]).await
    }

    pub async fn post_with(
        &self,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> (u16, serde_json::Value) {
        let mut req = self.http.post(self.url(path)).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await.expect("the engine face answers");
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.expect("a body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    /// GETs `path`: status and text.
    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self
            .http
            .get(self.url(path))
            .send()
            .await
            .expect("the engine face answers");
        (resp.status().as_u16(), resp.text().await.expect("a body"))
    }

    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        let (status, text) = self.get(path).await;
        assert_eq!(status, 200, "GET {path}: {text}");
        serde_json::from_str(&text).expect("JSON")
    }

    /// One non-streaming completion of `prompt` (token ids); its JSON answer.
    pub async fn complete(&self, prompt: &[u32], max_tokens: u32) -> serde_json::Value {
        let (status, body) = self
            .post(
                "/v1/completions",
                &serde_json::json!({"prompt": prompt, "max_tokens": max_tokens}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body
    }
}

/// A sample's value in Prometheus text, by its name and labels as written.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Polls `probe` every 20 ms until it is true (5 s at most).
pub async fn eventually(what: &str, mut probe: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !probe().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A SUB socket on an engine's PUB endpoint.
pub struct Sub {
    socket: Option<zmq::Socket>,
}

impl std::fmt::Debug for Sub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sub").finish_non_exhaustive()
    }
}

impl Sub {
    /// Connects and subscribes to `topic`, then waits a moment: a PUB drops what it sends
    /// before the subscription reaches it.
    pub async fn connect(endpoint: &str, topic: &[u8]) -> Self {
        let socket = zmq::Context::new().socket(zmq::SUB).unwrap();
        socket.set_rcvtimeo(5000).unwrap();
        socket.connect(endpoint).unwrap();
        socket.set_subscribe(topic).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        Self {
            socket: Some(socket),
        }
    }

    /// The next message's frames, or `None` after `timeout_ms` without one.
    pub async fn recv(&mut self, timeout_ms: i32) -> Option<Vec<Vec<u8>>> {
        let socket = self.socket.take().expect("socket");
        let (socket, msg) = tokio::task::spawn_blocking(move || {
            socket.set_rcvtimeo(timeout_ms).unwrap();
            let msg = socket.recv_multipart(0).ok();
            (socket, msg)
        })
        .await
        .unwrap();
        self.socket = Some(socket);
        msg
    }
}

/// Sends one replay request (`["", start_seq]` from a DEALER, as `[client, "", start_seq]`
/// reaches the ROUTER) and returns every reply's frames after the empty delimiter, through the
/// end marker. Blocking.
pub fn replay(endpoint: &str, request: &[&[u8]]) -> Vec<Vec<Vec<u8>>> {
    let socket = zmq::Context::new().socket(zmq::DEALER).unwrap();
    socket.set_rcvtimeo(5000).unwrap();
    socket.connect(endpoint).unwrap();
    socket.send_multipart(request.iter().copied(), 0).unwrap();
    let mut replies = Vec::new();
    while let Ok(mut frames) = socket.recv_multipart(0) {
        assert_eq!(frames.remove(0), b"", "the ROUTER echoes the delimiter");
        let end = frames.get(1).map(Vec::as_slice) == Some(&(-1i64).to_be_bytes()[..]);
        replies.push(frames);
        if end {
            break;
        }
    }
    replies
}

/// A decoded batch payload `[ts, events, rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Value>,
    pub rank: u64,
}

/// Decodes a payload, asserting the envelope is the engines' three-slot array.
pub fn decode_batch(payload: &[u8]) -> Batch {
    let mut slice = payload;
    let v = rmpv::decode::read_value(&mut slice).expect("MessagePack");
    assert!(slice.is_empty(), "trailing bytes after the batch");
    let Value::Array(slots) = v else {
        panic!("the batch is an array: {v}")
    };
    assert_eq!(slots.len(), 3, "[ts, events, rank]: {slots:?}");
    Batch {
        ts: slots[0].as_f64().expect("ts is a float"),
        events: slots[1].as_array().expect("events").clone(),
        rank: slots[2].as_u64().expect("rank is an int"),
    }
}

/// A map event's field names, in order.
pub fn map_keys(event: &Value) -> Vec<String> {
    event
        .as_map()
        .expect("a map event")
        .iter()
        .map(|(k, _)| k.as_str().expect("string keys").to_owned())
        .collect()
}

/// A map event's field.
pub fn field<'v>(event: &'v Value, name: &str) -> &'v Value {
    event
        .as_map()
        .expect("a map event")
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {name} in {event}"))
}

/// Runs `tests/python/<script>` with `args` off the runtime; its stdout as JSON.
pub async fn python_json(script: &str, args: Vec<String>) -> serde_json::Value {
    let path = workspace_root().join("tests/python").join(script);
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(path)
            .args(args)
            .output()
            .expect("python3 runs (scripts/install-deps installs tests/python's packages)")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints JSON")
}
