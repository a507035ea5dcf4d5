//! The bench's engine: answers `POST /v1/completions` and `/v1/chat/completions` as vLLM shapes
//! them, at once, with a fixed number of output tokens — whole JSON with `usage`, or SSE chunks
//! (`data: {...}\n\n`, one per token, the usage chunk when asked, `data: [DONE]\n\n`). It reads
//! only `stream`, `stream_options.include_usage` and the prompt's length, so nearly all of a
//! request's cost through it is the HTTP hop.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt as _;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};

/// Which OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }

    /// `data:` events of a streamed answer of `tokens` tokens: one per token, chat's role
    /// chunk first, the usage chunk when asked for, and `[DONE]`.
    pub fn stream_events(self, tokens: usize, usage: bool) -> usize {
        tokens + usize::from(self == Api::Chat) + usize::from(usage) + 1
    }
}

/// The prompt's length: bytes of a text, elements of a list (token ids or a batch).
#[derive(Debug, Default)]
struct PromptLen(usize);

impl<'de> Deserialize<'de> for PromptLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptLen;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptLen, E> {
                Ok(PromptLen(s.len()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptLen, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(PromptLen(n))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// What the engine reads of a request (other fields are skipped).
#[derive(Debug, Deserialize)]
struct EngineRequest {
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    prompt: Option<PromptLen>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<PromptLen>,
}

impl EngineRequest {
    fn prompt_tokens(&self) -> usize {
        match (&self.prompt, &self.messages) {
            (Some(p), _) => p.0,
            (None, Some(m)) => m
                .iter()
                .filter_map(|m| m.content.as_ref())
                .map(|c| c.0)
                .sum(),
            (None, None) => 0,
        }
    }
}

/// The answers' fixed parts, built once.
#[derive(Debug)]
struct Shapes {
    model: String,
    tokens: usize,
    completion_events: Vec<Bytes>,
    chat_events: Vec<Bytes>,
}

const DONE: &[u8] = b"data: [DONE]\n\n";

impl Shapes {
    fn new(model: &str, tokens: usize) -> Self {
        let event = |json: serde_json::Value| Bytes::from(format!("data: {json}\n\n"));
        let last = |i: usize| (i + 1 == tokens).then_some("length");
        let completion_events = (0..tokens)
            .map(|i| {
                event(serde_json::json!({
                    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": model,
                    "choices": [{"index": 0, "text": " tok", "logprobs": null,
                                 "finish_reason": last(i), "stop_reason": null}]
                }))
            })
            .collect();
        let chunk = |delta: serde_json::Value, finish: Option<&str>| {
            event(serde_json::json!({
                "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null,
                             "finish_reason": finish}]
            }))
        };
        let mut chat_events = vec![chunk(
            serde_json::json!({"role": "assistant", "content": ""}),
            None,
        )];
        chat_events
            .extend((0..tokens).map(|i| chunk(serde_json::json!({"content": " tok"}), last(i))));
        Self {
            model: model.to_owned(),
            tokens,
            completion_events,
            chat_events,
        }
    }

    fn usage(&self, prompt: usize) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": prompt, "total_tokens": prompt + self.tokens,
            "completion_tokens": self.tokens
        })
    }

    fn whole(&self, api: Api, prompt: usize) -> Bytes {
        let text = " tok".repeat(self.tokens);
        let body = match api {
            Api::Completions => serde_json::json!({
                "id": "cmpl-bench", "object": "text_completion", "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": "length", "stop_reason": null}],
                "usage": self.usage(prompt)
            }),
            Api::Chat => serde_json::json!({
                "id": "chatcmpl-bench", "object": "chat.completion", "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": "length"}],
                "usage": self.usage(prompt)
            }),
        };
        Bytes::from(serde_json::to_vec(&body).expect("JSON serializes"))
    }

    fn streamed(&self, api: Api, prompt: usize, usage: bool) -> Vec<Bytes> {
        let mut events = match api {
            Api::Completions => self.completion_events.clone(),
            Api::Chat => self.chat_events.clone(),
        };
        if usage {
            let object = match api {
                Api::Completions => "text_completion",
                Api::Chat => "chat.completion.chunk",
            };
            events.push(Bytes::from(format!(
                "data: {}\n\n",
                serde_json::json!({"id": "bench", "object": object, "created": 0,
                                   "model": self.model, "choices": [],
                                   "usage": self.usage(prompt)})
            )));
        }
        events.push(Bytes::from_static(DONE));
        events
    }
}

async fn answer(shapes: Arc<Shapes>, api: Api, body: Bytes) -> Response {
    let request: EngineRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let prompt = request.prompt_tokens();
    if !request.stream {
        return (
            [(header::CONTENT_TYPE, "application/json")],
            shapes.whole(api, prompt),
        )
            .into_response();
    }
    let usage = request.stream_options.is_some_and(|o| o.include_usage);
    let events = shapes.streamed(api, prompt, usage);
    let body = Body::from_stream(futures::stream::iter(
        events.into_iter().map(Ok::<_, Infallible>),
    ));
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn completions(State(shapes): State<Arc<Shapes>>, body: Bytes) -> Response {
    answer(shapes, Api::Completions, body).await
}

async fn chat(State(shapes): State<Arc<Shapes>>, body: Bytes) -> Response {
    answer(shapes, Api::Chat, body).await
}

/// Serves the engine on a free loopback port of the current runtime; returns its address.
pub async fn start(model: &str, tokens: usize) -> anyhow::Result<SocketAddr> {
    let shapes = Arc::new(Shapes::new(model, tokens));
    let app = Router::new()
        .route(Api::Completions.path(), post(completions))
        .route(Api::Chat.path(), post(chat))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(shapes);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // TCP_NODELAY on accepted connections, as engines' servers and nginx set it.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("engine: {e}");
        }
    });
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_answers_have_the_events_they_promise() {
        let s = Shapes::new("m", 3);
        for api in [Api::Completions, Api::Chat] {
            for usage in [false, true] {
                let events = s.streamed(api, 10, usage);
                assert_eq!(events.len(), api.stream_events(3, usage));
                assert_eq!(events.last().map(|b| &b[..]), Some(DONE));
            }
        }
        let r: EngineRequest =
            serde_json::from_slice(br#"{"prompt":[1,2,3],"stream":true,"x":{"y":[1]}}"#).unwrap();
        assert_eq!(r.prompt_tokens(), 3);
        let r: EngineRequest =
            serde_json::from_slice(br#"{"messages":[{"role":"user","content":"abcd"}]}"#).unwrap();
        assert_eq!(r.prompt_tokens(), 4);
    }
}
