//! A tiny in-process stand-in for a vLLM or SGLang server: the endpoints the bridge calls,
//! answering as the real engines do (the same fixtures' shapes), with knobs to fail `/health`
//! and to change the load. One request per connection (`Connection: close`), which reqwest
//! handles like any server.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Vllm,
    Sglang,
}

/// What the fake engine reports; change it while it runs.
#[derive(Debug, Clone)]
pub struct EngineState {
    pub healthy: bool,
    pub model: String,
    pub block_size: u32,
    pub num_gpu_blocks: u64,
    /// SGLang's `dp_size` (vLLM's `engine` labels 0..dp_size).
    pub dp_size: u32,
    /// Per rank: running, waiting, KV usage (0..1).
    pub load: Vec<(u64, u64, f64)>,
    /// `usage.prompt_tokens_details.cached_tokens` of every completion (`None`: not reported).
    pub cached_tokens: Option<u64>,
    /// Pause before each streamed chunk.
    pub chunk_delay: Duration,
    /// Longer prompts are refused with HTTP 400, as vLLM refuses them.
    pub max_context: usize,
    /// After this many chunks the stream carries an error chunk (an SGLang abort).
    pub abort_after: Option<u64>,
    /// vLLM's `prefix_cache_queries_total` and `prefix_cache_hits_total` per rank (absent when
    /// empty).
    pub prefix_cache: Vec<(u64, u64)>,
    /// What vLLM's `/reset_prefix_cache` answers as `success` (SGLang's `/flush_cache`: 200 or
    /// 400); the resets asked are counted in `resets`.
    pub reset_succeeds: bool,
    pub resets: u64,
}

/// A completion request the engine received.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
pub struct FakeEngine {
    pub addr: SocketAddr,
    pub state: Arc<Mutex<EngineState>>,
    pub completions: Arc<Mutex<Vec<Received>>>,
    task: JoinHandle<()>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeEngine {
    pub async fn start(kind: Kind, state: EngineState) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(state));
        let completions = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let (state, completions) = (state.clone(), completions.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let (state, completions) = (state.clone(), completions.clone());
                    tokio::spawn(async move {
                        let _ = serve(kind, stream, state, completions).await;
                    });
                }
            })
        };
        Self {
            addr,
            state,
            completions,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, f: impl FnOnce(&mut EngineState)) {
        f(&mut self.state.lock().unwrap());
    }
}

async fn serve(
    kind: Kind,
    mut stream: TcpStream,
    state: Arc<Mutex<EngineState>>,
    completions: Arc<Mutex<Vec<Received>>>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let head_end = loop {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let s = state.lock().unwrap().clone();
    let (status, content_type, text) = match (method, path, kind) {
        ("GET", "/health", _) => (
            if s.healthy { 200 } else { 503 },
            "text/plain",
            String::new(),
        ),
        ("GET", "/v1/models", _) => (200, "application/json", models(&s)),
        ("GET", "/metrics", Kind::Vllm) => (200, "text/plain; version=0.0.4", vllm_metrics(&s)),
        ("GET", "/version", Kind::Vllm) => {
            (200, "application/json", r#"{"version":"0.32.0"}"#.into())
        }
        ("GET", "/server_info", Kind::Sglang) => (200, "application/json", sglang_server_info(&s)),
        ("POST", "/reset_prefix_cache", Kind::Vllm) => {
            state.lock().unwrap().resets += 1;
            let body = json!({"success": s.reset_succeeds}).to_string();
            (200, "application/json", body)
        }
        ("POST", "/flush_cache", Kind::Sglang) => {
            state.lock().unwrap().resets += 1;
            let status = if s.reset_succeeds { 200 } else { 400 };
            (status, "text/plain", "Cache flushed.\n".into())
        }
        ("GET", "/v1/loads", Kind::Sglang) => (200, "application/json", sglang_loads(&s)),
        ("POST", "/v1/completions", _) => {
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            completions.lock().unwrap().push(Received {
                headers: headers.clone(),
                body: body.clone(),
            });
            return stream_completion(kind, stream, &s, &body).await;
        }
        _ => (404, "application/json", r#"{"detail":"Not Found"}"#.into()),
    };
    let response = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

fn models(s: &EngineState) -> String {
    json!({"object": "list", "data": [
        {"id": s.model, "object": "model", "created": 1764612311, "owned_by": "vllm",
         "root": s.model, "parent": null, "max_model_len": 40960}
    ]})
    .to_string()
}

fn vllm_metrics(s: &EngineState) -> String {
    let mut out = String::from(
        "# HELP python_gc_objects_collected_total Objects collected during gc\n\
         # TYPE python_gc_objects_collected_total counter\n\
         python_gc_objects_collected_total{generation=\"0\"} 12734.0\n",
    );
    let m = &s.model;
    for (name, i) in [
        ("vllm:num_requests_running", 0),
        ("vllm:num_requests_waiting", 1),
        ("vllm:kv_cache_usage_perc", 2),
    ] {
        out.push_str(&format!("# HELP {name} x\n# TYPE {name} gauge\n"));
        for (rank, (running, waiting, usage)) in s.load.iter().enumerate() {
            let v = match i {
                0 => *running as f64,
                1 => *waiting as f64,
                _ => *usage,
            };
            out.push_str(&format!(
                "{name}{{engine=\"{rank}\",model_name=\"{m}\"}} {v:?}\n"
            ));
        }
    }
    for (name, hits) in [
        ("vllm:prefix_cache_queries", false),
        ("vllm:prefix_cache_hits", true),
    ] {
        if s.prefix_cache.is_empty() {
            break;
        }
        out.push_str(&format!("# HELP {name} x\n# TYPE {name} counter\n"));
        for (rank, (queries, hit)) in s.prefix_cache.iter().enumerate() {
            let v = if hits { *hit } else { *queries } as f64;
            out.push_str(&format!(
                "{name}_total{{engine=\"{rank}\",model_name=\"{m}\"}} {v:?}\n"
            ));
        }
    }
    out.push_str("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n");
    for rank in 0..s.dp_size {
        out.push_str(&format!(
            "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"{rank}\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n",
            s.block_size, s.num_gpu_blocks
        ));
    }
    out
}

fn sglang_server_info(s: &EngineState) -> String {
    json!({
        "model_path": s.model, "served_model_name": s.model, "page_size": s.block_size,
        "dp_size": s.dp_size, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
        "max_total_num_tokens": s.num_gpu_blocks * u64::from(s.block_size), "status": "ready",
        "internal_states": [{}], "version": "0.5.23", "frontend": "python"
    })
    .to_string()
}

fn sglang_loads(s: &EngineState) -> String {
    let total = s.num_gpu_blocks * u64::from(s.block_size);
    let loads: Vec<Value> = s
        .load
        .iter()
        .enumerate()
        .map(|(rank, (running, waiting, usage))| {
            json!({"timestamp": 1764612311.2, "dp_rank": rank, "num_running_reqs": running,
                   "num_waiting_reqs": waiting, "num_waiting_uncached_tokens": waiting * 100,
                   "num_used_tokens": (usage * total as f64) as u64, "num_total_tokens": 0,
                   "max_total_num_tokens": total, "token_usage": usage})
        })
        .collect();
    json!({"timestamp": "2026-12-01T14:05:11Z", "version": "0.5.23", "accelerator": null,
           "num_accelerators": 1, "loads": loads})
    .to_string()
}

async fn stream_completion(
    kind: Kind,
    mut stream: TcpStream,
    s: &EngineState,
    body: &Value,
) -> std::io::Result<()> {
    let prompt = body["prompt"].as_array().map_or(0, Vec::len) as u64;
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16);
    if prompt as usize + max_tokens as usize > s.max_context {
        let error = json!({"error": {"message": format!(
            "This model's maximum context length is {} tokens. However, you requested {} tokens.",
            s.max_context, prompt + max_tokens), "type": "BadRequestError", "param": null, "code": 400}})
        .to_string();
        let response = format!(
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{error}",
            error.len()
        );
        stream.write_all(response.as_bytes()).await?;
        return stream.shutdown().await;
    }
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\nconnection: close\r\n\r\n")
        .await?;
    let model = &s.model;
    for i in 0..max_tokens {
        tokio::time::sleep(s.chunk_delay).await;
        if s.abort_after == Some(i) {
            let error = json!({"error": {"object": "error", "message": "Generation aborted.",
                "type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}});
            stream
                .write_all(format!("data: {error}\n\ndata: [DONE]\n\n").as_bytes())
                .await?;
            return stream.shutdown().await;
        }
        let finish = if i + 1 == max_tokens {
            json!("length")
        } else {
            Value::Null
        };
        let chunk = json!({"id": "cmpl-1", "object": "text_completion", "created": 1764612311,
            "model": model, "choices": [{"index": 0, "text": format!(" t{i}"), "logprobs": null,
            "finish_reason": finish, "stop_reason": null}]});
        let data = format!("data: {chunk}\n\n");
        stream.write_all(data.as_bytes()).await?;
    }
    let mut usage = json!({"prompt_tokens": prompt, "total_tokens": prompt + max_tokens,
                           "completion_tokens": max_tokens});
    if let Some(cached) = s.cached_tokens {
        usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
    }
    if kind == Kind::Sglang {
        usage["reasoning_tokens"] = json!(0);
    }
    let last = json!({"id": "cmpl-1", "object": "text_completion", "created": 1764612311,
                      "model": model, "choices": [], "usage": usage});
    stream
        .write_all(format!("data: {last}\n\ndata: [DONE]\n\n").as_bytes())
        .await?;
    stream.shutdown().await
}
