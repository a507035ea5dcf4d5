//! The completions stream, byte by byte: [`SseDecoder`] cuts server-sent events out of the
//! body's chunks (however the network splits them), [`StreamTally`] reads each event's JSON
//! (OpenAI `text_completion` chunks, as vLLM's `completion/serving.py` and SGLang's
//! `serving_completions.py` write them) into what the reply needs. No clock: the shell notes
//! the time when [`Chunk::Output`] first comes back.

use serde_json::Value;

/// Longest event the decoder buffers (a chunk with logprobs is a few KiB).
pub const MAX_EVENT_BYTES: usize = 1 << 20;

/// Cuts `data:` payloads out of an event stream.
#[derive(Debug, Default)]
pub struct SseDecoder {
    line: Vec<u8>,
    data: String,
    has_data: bool,
}

/// The stream broke the event-stream format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an event is longer than {MAX_EVENT_BYTES} bytes")]
    TooLong,
    #[error("an event is not UTF-8")]
    NotUtf8,
}

impl SseDecoder {
    /// Feeds body bytes; returns the `data` of every event they complete, in order.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        let mut events = Vec::new();
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                if self.line.len() + self.data.len() > MAX_EVENT_BYTES {
                    return Err(SseError::TooLong);
                }
                continue;
            }
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8(line).map_err(|_| SseError::NotUtf8)?;
            if line.is_empty() {
                if self.has_data {
                    events.push(std::mem::take(&mut self.data));
                    self.has_data = false;
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment (keep-alive)
            }
            let (field, value) = line.split_once(':').unwrap_or((&line, ""));
            if field == "data" {
                let value = value.strip_prefix(' ').unwrap_or(value);
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            // `event`, `id`, `retry`: not used by the engines' completions.
        }
        Ok(events)
    }

    /// The body ended: an event still open (no blank line after it) counts.
    pub fn finish(&mut self) -> Option<String> {
        if !self.line.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut self.line)).into_owned();
            if let Some(value) = line.strip_prefix("data:") {
                let value = value.strip_prefix(' ').unwrap_or(value);
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value.trim_end_matches('\r'));
                self.has_data = true;
            }
        }
        self.has_data.then(|| {
            self.has_data = false;
            std::mem::take(&mut self.data)
        })
    }
}

/// What one event was.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// Generated text or tokens (or the choice's finish).
    Output,
    /// Nothing to count (a usage-only chunk, an empty choice list, `sglext` extras).
    Other,
    /// `[DONE]`: the stream is complete.
    Done,
}

/// The engine reported an error inside the stream (`{"error": {...}}`), or sent bad JSON.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChunkError {
    #[error("the engine failed the request: {message}")]
    Engine {
        status: Option<u16>,
        message: String,
    },
    #[error("a stream event is not a completion chunk: {reason}")]
    Malformed { reason: String },
}

/// The final `usage`, as far as the engine reports it. vLLM fills `prompt_tokens_details`
/// only with `--enable-prompt-tokens-details`, SGLang only with `--enable-cache-report`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// Everything read from a stream so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamTally {
    /// Events that carried output.
    pub output_chunks: u64,
    /// The last `usage` seen (the final chunk's, with `include_usage`).
    pub usage: Option<Usage>,
    pub done: bool,
}

impl StreamTally {
    /// Reads one event's data.
    pub fn on_event(&mut self, data: &str) -> Result<Chunk, ChunkError> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(Chunk::Done);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| ChunkError::Malformed {
            reason: e.to_string(),
        })?;
        if let Some(err) = stream_error(&v) {
            return Err(err);
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let uint = |v: Option<&Value>| v.and_then(Value::as_u64);
            self.usage = Some(Usage {
                prompt_tokens: uint(u.get("prompt_tokens")),
                completion_tokens: uint(u.get("completion_tokens")),
                cached_tokens: uint(u.pointer("/prompt_tokens_details/cached_tokens")),
            });
        }
        let choices = v.get("choices").and_then(Value::as_array);
        let output = choices.is_some_and(|cs| cs.iter().any(carries_output));
        if output {
            self.output_chunks += 1;
            Ok(Chunk::Output)
        } else if v.get("choices").is_some_and(|c| !c.is_array()) {
            Err(ChunkError::Malformed {
                reason: "`choices` is not a list".into(),
            })
        } else {
            Ok(Chunk::Other)
        }
    }
}

fn carries_output(choice: &Value) -> bool {
    let text = choice
        .get("text")
        .and_then(Value::as_str)
        .is_some_and(|t| !t.is_empty());
    let tokens = choice
        .get("token_ids")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
    text || tokens || finished
}

/// `{"error": {"message", "type", "code"}}` (both engines) or the older flat
/// `{"object": "error", "message", "code"}`.
pub fn stream_error(v: &Value) -> Option<ChunkError> {
    let e = match v.get("error") {
        Some(e) if e.is_object() => e,
        Some(Value::String(message)) => {
            return Some(ChunkError::Engine {
                status: None,
                message: message.clone(),
            });
        }
        _ if v.get("object").and_then(Value::as_str) == Some("error") => v,
        _ => return None,
    };
    let message = e
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .to_owned();
    let status = e
        .get("code")
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok());
    Some(ChunkError::Engine { status, message })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM 0.32 stream (`stream_options.include_usage`, `--enable-prompt-tokens-details`).
    pub(crate) const VLLM_STREAM: &str = concat!(
        "data: {\"id\":\"cmpl-7f3c\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[{\"index\":0,\"text\":\" the\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n",
        "data: {\"id\":\"cmpl-7f3c\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[{\"index\":0,\"text\":\" cat\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n",
        "data: {\"id\":\"cmpl-7f3c\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}]}\n\n",
        "data: {\"id\":\"cmpl-7f3c\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"total_tokens\":43,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
        "data: [DONE]\n\n",
    );

    /// An SGLang 0.5.23 stream without `--enable-cache-report` (no `prompt_tokens_details`);
    /// its chunks carry `"usage": null` until the final one.
    pub(crate) const SGLANG_STREAM: &str = concat!(
        "data: {\"id\":\"9d1e\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[{\"index\":0,\"text\":\" the\",\"logprobs\":null,\"finish_reason\":null,\"matched_stop\":null,\"token_ids\":null,\"prompt_token_ids\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"9d1e\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[{\"index\":0,\"text\":\" cat\",\"logprobs\":null,\"finish_reason\":\"length\",\"matched_stop\":null,\"token_ids\":null,\"prompt_token_ids\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"9d1e\",\"object\":\"text_completion\",\"created\":1764612311,\"model\":\"Qwen/Qwen3-0.6B\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"total_tokens\":42,\"completion_tokens\":2,\"reasoning_tokens\":0}}\n\n",
        "data: [DONE]\n\n",
    );

    fn events_split_every(text: &str, step: usize) -> Vec<String> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for piece in text.as_bytes().chunks(step) {
            out.extend(d.feed(piece).unwrap());
        }
        out.extend(d.finish());
        out
    }

    fn tally(text: &str) -> (Vec<Chunk>, StreamTally) {
        let mut t = StreamTally::default();
        let kinds = events_split_every(text, 7)
            .iter()
            .map(|e| t.on_event(e).unwrap())
            .collect();
        (kinds, t)
    }

    #[test]
    fn events_survive_any_split() {
        let whole = events_split_every(VLLM_STREAM, VLLM_STREAM.len());
        assert_eq!(whole.len(), 5);
        for step in [1, 2, 3, 5, 64, 1000] {
            assert_eq!(events_split_every(VLLM_STREAM, step), whole, "step {step}");
        }
        let crlf = VLLM_STREAM.replace('\n', "\r\n");
        assert_eq!(events_split_every(&crlf, 11), whole);
    }

    #[test]
    fn comments_fields_multiline_data_and_an_unterminated_last_event() {
        let text = ": keep-alive\n\nevent: x\nid: 3\ndata: a\ndata:b\n\ndata: [DONE]";
        assert_eq!(events_split_every(text, 4), ["a\nb", "[DONE]"]);
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(&[0xff, b'\n']), Err(SseError::NotUtf8));
        let mut d = SseDecoder::default();
        let long = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(d.feed(&long), Err(SseError::TooLong));
    }

    #[test]
    fn vllm_usage_with_cached_tokens() {
        let (kinds, t) = tally(VLLM_STREAM);
        use Chunk::*;
        assert_eq!(kinds, [Output, Output, Output, Other, Done]);
        assert_eq!(t.output_chunks, 3);
        assert!(t.done);
        assert_eq!(
            t.usage,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(3),
                cached_tokens: Some(32),
            })
        );
    }

    #[test]
    fn sglang_usage_without_a_cache_report() {
        let (kinds, t) = tally(SGLANG_STREAM);
        use Chunk::*;
        assert_eq!(kinds, [Output, Output, Other, Done]);
        assert_eq!(
            t.usage,
            Some(Usage {
                prompt_tokens: Some(40),
                completion_tokens: Some(2),
                cached_tokens: None,
            })
        );
    }

    #[test]
    fn errors_inside_the_stream() {
        let mut t = StreamTally::default();
        // SGLang: an abort with a status; vLLM: a generation error.
        let sglang = r#"{"error": {"object": "error", "message": "Generation aborted.", "type": "SERVICE_UNAVAILABLE", "param": null, "code": 503}}"#;
        assert_eq!(
            t.on_event(sglang),
            Err(ChunkError::Engine {
                status: Some(503),
                message: "Generation aborted.".into()
            })
        );
        let vllm = r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#;
        assert!(matches!(
            t.on_event(vllm),
            Err(ChunkError::Engine {
                status: Some(500),
                ..
            })
        ));
        let flat = r#"{"object": "error", "message": "bad", "code": 400}"#;
        assert!(matches!(
            t.on_event(flat),
            Err(ChunkError::Engine {
                status: Some(400),
                ..
            })
        ));
        assert!(matches!(
            t.on_event("{not json"),
            Err(ChunkError::Malformed { .. })
        ));
        assert!(matches!(
            t.on_event(r#"{"choices": 3}"#),
            Err(ChunkError::Malformed { .. })
        ));
        assert_eq!(
            t.on_event(r#"{"choices": [{"text": ""}]}"#),
            Ok(Chunk::Other)
        );
    }
}
