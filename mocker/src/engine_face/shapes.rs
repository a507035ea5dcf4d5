//! The JSON the impersonated engines answer completions with, field for field in their
//! declaration order: vLLM's pydantic models (vllm/entrypoints/openai/{completion,
//! chat_completion}/protocol.py; stream chunks dumped with `exclude_unset`, the final usage
//! chunk with `exclude_none`) and SGLang's (sglang/srt/entrypoints/openai/protocol.py).

use serde::Serialize;

use super::config::EngineKind;

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Completion,
    Chat,
}

impl Api {
    pub fn id_prefix(self) -> &'static str {
        match self {
            Api::Completion => "cmpl-",
            Api::Chat => "chatcmpl-",
        }
    }

    pub fn object(self, streaming: bool) -> &'static str {
        match (self, streaming) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
        }
    }
}

/// `usage`, with `prompt_tokens_details.cached_tokens` (vLLM's `--enable-prompt-tokens-details`
/// and SGLang's `--enable-cache-report` behaviour, always on here).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    pub completion_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
    /// SGLang's `UsageInfo` carries it (0); vLLM's does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PromptTokensDetails {
    pub cached_tokens: u64,
}

impl Usage {
    pub fn new(engine: EngineKind, prompt: u64, completion: u64, cached: u64) -> Self {
        Self {
            prompt_tokens: prompt,
            total_tokens: prompt + completion,
            completion_tokens: completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            reasoning_tokens: (engine == EngineKind::Sglang).then_some(0),
        }
    }
}

/// One response or stream chunk; `C` is the choice type.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Envelope<'a, C> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(flatten)]
    pub extra: Option<TopExtra>,
}

/// Top-level nulls of full (non-stream) responses.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub(crate) enum TopExtra {
    Vllm {
        service_tier: Option<()>,
        system_fingerprint: Option<()>,
        /// A prefill worker's hand-off (`disagg.rs`), else null.
        kv_transfer_params: Option<serde_json::Value>,
    },
    Sglang {
        metadata: Option<()>,
    },
}

impl TopExtra {
    /// The nulls, but vLLM's `kv_transfer_params` when a prefill worker hands off.
    pub fn with_handoff(
        engine: EngineKind,
        kv_transfer_params: Option<serde_json::Value>,
    ) -> Option<Self> {
        Some(match engine {
            EngineKind::Vllm => TopExtra::Vllm {
                service_tier: None,
                system_fingerprint: None,
                kv_transfer_params,
            },
            EngineKind::Sglang => TopExtra::Sglang { metadata: None },
        })
    }
}

/// The engine-specific nulls of a choice.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub(crate) enum ChoiceExtra {
    Vllm {
        stop_reason: Option<()>,
        token_ids: Option<()>,
    },
    Sglang {
        matched_stop: Option<()>,
    },
    None {},
}

impl ChoiceExtra {
    pub fn of(engine: EngineKind) -> Self {
        match engine {
            EngineKind::Vllm => ChoiceExtra::Vllm {
                stop_reason: None,
                token_ids: None,
            },
            EngineKind::Sglang => ChoiceExtra::Sglang { matched_stop: None },
        }
    }
}

/// A `/v1/completions` choice (stream or full).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    #[serde(flatten)]
    pub extra: ChoiceExtra,
}

/// A chat stream choice.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DeltaChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    #[serde(flatten)]
    pub extra: ChoiceExtra,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A full chat choice.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MessageChoice {
    pub index: usize,
    pub message: Message,
    pub logprobs: Option<()>,
    pub finish_reason: Option<&'static str>,
    #[serde(flatten)]
    pub extra: ChoiceExtra,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Message {
    pub role: &'static str,
    pub content: String,
    #[serde(flatten)]
    pub extra: MessageExtra,
}

#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub(crate) enum MessageExtra {
    Vllm {
        refusal: Option<()>,
        annotations: Option<()>,
        audio: Option<()>,
        function_call: Option<()>,
        reasoning: Option<()>,
    },
    Sglang {
        reasoning_content: Option<()>,
    },
}

impl MessageExtra {
    pub fn of(engine: EngineKind) -> Self {
        match engine {
            EngineKind::Vllm => MessageExtra::Vllm {
                refusal: None,
                annotations: None,
                audio: None,
                function_call: None,
                reasoning: None,
            },
            EngineKind::Sglang => MessageExtra::Sglang {
                reasoning_content: None,
            },
        }
    }
}

/// One server-sent event: `data: {json}\n\n`.
pub(crate) fn sse<T: Serialize>(value: &T) -> String {
    format!(
        "data: {}\n\n",
        serde_json::to_string(value).expect("response shapes serialize")
    )
}

/// The stream's end.
pub(crate) const DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stream_chunks_have_the_engines_fields() {
        let chunk = Envelope {
            id: "cmpl-1",
            object: Api::Completion.object(true),
            created: 7,
            model: "m",
            choices: vec![TextChoice {
                index: 0,
                text: "tok ".into(),
                logprobs: None,
                finish_reason: None,
                extra: ChoiceExtra::of(EngineKind::Vllm),
            }],
            usage: None,
            extra: None,
        };
        let v: serde_json::Value = serde_json::to_value(&chunk).unwrap();
        assert_eq!(
            v,
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "text": "tok ", "logprobs": null, "finish_reason": null,
                    "stop_reason": null, "token_ids": null}]})
        );
        let text = sse(&chunk);
        assert!(text.starts_with("data: {\"id\":\"cmpl-1\",\"object\"") && text.ends_with("}\n\n"));
        let usage = Usage::new(EngineKind::Sglang, 10, 2, 4);
        assert_eq!(
            serde_json::to_value(&usage).unwrap(),
            json!({"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 4}, "reasoning_tokens": 0})
        );
    }

    #[test]
    fn full_responses_carry_their_top_level_nulls() {
        let full = Envelope::<MessageChoice> {
            id: "x",
            object: Api::Chat.object(false),
            created: 1,
            model: "m",
            choices: vec![],
            usage: Some(Usage::new(EngineKind::Vllm, 1, 1, 0)),
            extra: TopExtra::with_handoff(EngineKind::Vllm, None),
        };
        let v = serde_json::to_value(&full).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert!(v["service_tier"].is_null() && v.get("kv_transfer_params").is_some());
        assert!(v["usage"].get("reasoning_tokens").is_none());
    }
}
