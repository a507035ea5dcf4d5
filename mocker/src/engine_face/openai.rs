//! The OpenAI-compatible requests the impersonated engines take, and how their prompts become
//! token ids. Pure: parsing and "tokenizing" only.
//!
//! With `--engine-tokenizer DIR`, prompts are tokenized and chats rendered with that model's
//! tokenizer and chat template (kvroute-text), as the real engines do: a completions text with
//! the model's special tokens, a chat through its template without adding them.
//!
//! Without it, tokenizing is deterministic and has no vocabulary: **one token per UTF-8 byte
//! of the text, the token id being the byte's value**. The same text always gives the same tokens, and two
//! texts sharing a prefix share that many tokens, so they share blocks. A chat is rendered
//! first, each message as `<|role|>\n{content}\n`, followed by `<|assistant|>\n` (the
//! generation prompt); text parts of a content list are joined.

use serde::Deserialize;
use serde_json::Value;

/// Output tokens when a request names none (the OpenAI completions API's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// `stream_options`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The fields of `POST /v1/completions` the mocker uses; others are accepted and ignored
/// (`ignore_eos` among them: the simulated engine always runs to `max_tokens`).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Value,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(flatten)]
    pub common: CommonFields,
}

/// The fields of `POST /v1/chat/completions` the mocker uses.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(flatten)]
    pub common: CommonFields,
}

/// Fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u32>,
    /// SGLang's rank pin (`data_parallel_rank` is its deprecated spelling).
    #[serde(default)]
    pub routed_dp_rank: Option<u32>,
    #[serde(default)]
    pub data_parallel_rank: Option<u32>,
    /// vLLM's disaggregation hand-off (`disagg.rs`).
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    /// SGLang's disaggregation fields (`disagg.rs`).
    #[serde(default)]
    pub bootstrap_host: Option<Value>,
    #[serde(default)]
    pub bootstrap_port: Option<Value>,
    #[serde(default)]
    pub bootstrap_room: Option<Value>,
}

impl CommonFields {
    pub fn streaming(&self) -> bool {
        self.stream == Some(true)
    }

    pub fn include_usage(&self) -> bool {
        self.streaming() && self.stream_options.and_then(|o| o.include_usage) == Some(true)
    }

    /// Checks what the mocker cannot do.
    pub fn check(&self) -> Result<(), String> {
        match self.n {
            None | Some(1) => Ok(()),
            Some(n) => Err(format!(
                "n must be 1 here (the mocker samples one sequence), got {n}"
            )),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
}

/// The token ids of `text` (one per UTF-8 byte).
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// The prompts of a completion request: `prompt` is a string, a list of token ids, or a list of
/// either (one token per byte).
#[cfg(test)]
pub fn prompts(prompt: &Value) -> Result<Vec<Vec<u32>>, String> {
    prompts_with(prompt, None)
}

/// [`prompts`], texts encoded with `model` when given.
pub fn prompts_with(
    prompt: &Value,
    model: Option<&kvroute_text::ModelText>,
) -> Result<Vec<Vec<u32>>, String> {
    let encode = |s: &str| match model {
        Some(m) => m.encode(s, true).map_err(|e| e.to_string()),
        None => Ok(tokenize(s)),
    };
    let out = match prompt {
        Value::String(s) => vec![encode(s)?],
        Value::Array(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
            vec![token_ids(items)?]
        }
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .map(|p| match p {
                Value::String(s) => encode(s),
                Value::Array(ids) => token_ids(ids),
                other => Err(format!(
                    "each prompt must be a string or a list of token ids, got {other}"
                )),
            })
            .collect::<Result<_, _>>()?,
        other => {
            return Err(format!(
                "prompt must be a string, a list of token ids, or a list of those, got {other}"
            ));
        }
    };
    if out.iter().any(Vec::is_empty) {
        return Err("the prompt is empty".into());
    }
    Ok(out)
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, String> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("token ids must be integers in 0..2^32, got {v}"))
        })
        .collect()
}

/// The chat rendered as one text (see the module docs).
pub fn render_chat(messages: &[ChatMessage]) -> Result<String, String> {
    if messages.is_empty() {
        return Err("messages must not be empty".into());
    }
    let mut text = String::new();
    for m in messages {
        let content = match &m.content {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            other => return Err(format!("message content must be text, got {other}")),
        };
        text.push_str(&format!("<|{}|>\n{content}\n", m.role));
    }
    text.push_str("<|assistant|>\n");
    Ok(text)
}

/// A chat request's prompt as `model` renders and tokenizes it (from the raw body: messages,
/// tools, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`).
pub fn chat_tokens(model: &kvroute_text::ModelText, body: &[u8]) -> Result<Vec<u32>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid request: {e}"))?;
    let messages = v
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be a list")?;
    if messages.is_empty() {
        return Err("messages must not be empty".into());
    }
    let flag = |name: &str, default: bool| v.get(name).and_then(Value::as_bool).unwrap_or(default);
    let chat = kvroute_text::ChatInput {
        messages,
        tools: v.get("tools").filter(|t| !t.is_null()),
        add_generation_prompt: flag("add_generation_prompt", true),
        continue_final_message: flag("continue_final_message", false),
        template_kwargs: v.get("chat_template_kwargs").and_then(Value::as_object),
    };
    model.chat_tokens(&chat).map_err(|e| e.to_string())
}

/// `max_tokens` checked (at least 1), or the default.
pub fn max_tokens(requested: Option<u32>) -> Result<u32, String> {
    match requested {
        None => Ok(DEFAULT_MAX_TOKENS),
        Some(0) => Err("max_tokens must be at least 1, got 0".into()),
        Some(n) => Ok(n),
    }
}

/// The text of `n` generated tokens (filler: every token is `tok `).
pub fn filler(n: u64) -> String {
    "tok ".repeat(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_prompt_form_gives_token_ids() {
        assert_eq!(prompts(&json!("ab")).unwrap(), vec![vec![97, 98]]);
        assert_eq!(prompts(&json!([1, 2, 3])).unwrap(), vec![vec![1, 2, 3]]);
        assert_eq!(
            prompts(&json!(["a", [7, 8]])).unwrap(),
            vec![vec![97], vec![7, 8]]
        );
        assert!(prompts(&json!("")).is_err());
        assert!(prompts(&json!([])).is_err());
        assert!(prompts(&json!([-1])).is_err());
        assert!(prompts(&json!({"a": 1})).is_err());
        assert!(prompts(&json!([[1], {"b": 2}])).is_err());
    }

    #[test]
    fn shared_text_prefixes_share_tokens() {
        let a = tokenize("You are a helpful assistant. Hello");
        let b = tokenize("You are a helpful assistant. Goodbye");
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert_eq!(common, "You are a helpful assistant. ".len());
        assert_eq!(tokenize("é"), vec![0xc3, 0xa9]);
    }

    #[test]
    fn chats_render_deterministically() {
        let messages: Vec<ChatMessage> = serde_json::from_value(json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
        ]))
        .unwrap();
        assert_eq!(
            render_chat(&messages).unwrap(),
            "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
        );
        assert!(render_chat(&[]).is_err());
    }

    #[test]
    fn request_options() {
        let r: CompletionRequest = serde_json::from_value(json!({
            "model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": true},
            "ignore_eos": true, "temperature": 0.0
        }))
        .unwrap();
        assert!(r.common.include_usage());
        assert_eq!(max_tokens(r.max_tokens), Ok(16));
        assert!(max_tokens(Some(0)).is_err());
        let r: CompletionRequest = serde_json::from_value(json!({"prompt": "x", "n": 2})).unwrap();
        assert!(r.common.check().is_err());
        assert!(!r.common.include_usage());
        assert_eq!(filler(2), "tok tok ");
    }
}
