//! The prompts and their request bodies. Without a model folder a prompt is a list of token
//! ids (seeded, in a 151,936-token vocabulary), sent as such: nothing to tokenize. With one
//! (`--model-dir`), it is text of seeded words cut at the shortest prefix that the model's
//! tokenizer encodes to at least the wanted number of tokens; its chat form is one user
//! message. Bodies are serialized once, before anything is timed.

use std::path::Path;

use bytes::Bytes;
use kvroute_text::{ChatInput, ModelText};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::engine::Api;

const VOCABULARY: u32 = 151_936;

/// Words the text prompts are drawn from.
const WORDS: &[&str] = &[
    "the",
    "cache",
    "of",
    "a",
    "worker",
    "holds",
    "blocks",
    "which",
    "prompt",
    "router",
    "request",
    "serves",
    "tokens",
    "prefix",
    "model",
    "engine",
    "stream",
    "answer",
    "load",
    "index",
    "query",
    "reply",
    "decode",
    "prefill",
    "batch",
    "event",
    "session",
    "policy",
    "score",
    "picker",
    "filter",
    "latency",
    "throughput",
    "gateway",
    "client",
    "server",
    "memory",
    "tier",
    "device",
    "host",
    "disk",
    "hash",
    "chain",
    "parent",
    "child",
    "radix",
    "tree",
    "node",
    "edge",
    "lease",
    "card",
    "namespace",
    "subject",
    "stream",
    "consumer",
    "snapshot",
    "replica",
    "leader",
    "digest",
    "sequence",
    "order",
    "time",
    "clock",
    "random",
    "seed",
    "deterministic",
    "pure",
    "core",
    "shell",
    "socket",
    "thread",
    "task",
    "runtime",
    "kernel",
    "scheduler",
    "interrupt",
    "buffer",
    "queue",
    "backpressure",
    "retry",
    "timeout",
    "deadline",
    "budget",
    "attempt",
    "failure",
    "success",
    "metric",
    "histogram",
    "counter",
    "gauge",
    "label",
    "bucket",
    "quantile",
    "median",
    "tail",
    "percentile",
    "benchmark",
    "measure",
    "compare",
    "peer",
    "ratio",
    "target",
    "Hello,",
    "world.",
    "What",
    "is",
    "why",
    "how",
    "when",
    "where",
    "3.14",
    "2026",
    "(see",
    "below)",
    "—",
    "naïve",
    "café",
    "über",
];

/// One prompt in every form a request can carry it.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// What the gateway routes a completions request on (the ids sent, or the text encoded
    /// with special tokens).
    pub tokens: Vec<u32>,
    pub text: Option<String>,
    /// The chat form's tokens (the model's template), when it has one.
    pub chat_tokens: Option<Vec<u32>>,
}

/// The prompts of one length.
#[derive(Debug, Clone)]
pub struct PromptSet {
    /// Tokens wanted.
    pub size: usize,
    pub prompts: Vec<Prompt>,
}

impl PromptSet {
    pub fn mean_tokens(&self) -> f64 {
        self.prompts.iter().map(|p| p.tokens.len()).sum::<usize>() as f64
            / self.prompts.len().max(1) as f64
    }

    /// Whether the chat form exists (text prompts of a model with a chat template).
    pub fn has_chat(&self) -> bool {
        self.prompts.iter().all(|p| p.chat_tokens.is_some())
    }
}

/// The model the gateway tokenizes with, when `--model-dir` is given.
#[derive(Debug)]
pub struct TextModel {
    pub model: ModelText,
}

impl TextModel {
    /// The model without its segment cache: the bench's own tokenization of its prompts, which
    /// it repeats, then measures tokenizing each whole text (what a text not seen before costs).
    pub fn load(name: &str, dir: &Path) -> anyhow::Result<Self> {
        Self::load_with_cache(name, dir, 0)
    }

    /// The model with a segment cache of `cache_bytes` (0: none).
    pub fn load_with_cache(name: &str, dir: &Path, cache_bytes: usize) -> anyhow::Result<Self> {
        let model = ModelText::load(name, dir)
            .map_err(|e| anyhow::anyhow!("loading model {name} from {}: {e}", dir.display()))?
            .with_segment_cache(cache_bytes);
        Ok(Self { model })
    }

    /// The chat tokens of `messages` (the template's generation prompt added).
    pub fn chat_messages(&self, messages: &[Value]) -> Option<Vec<u32>> {
        self.model.chat_tokens(&ChatInput::new(messages)).ok()
    }

    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        self.model
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))
    }

    pub fn chat(&self, text: &str) -> Option<Vec<u32>> {
        let messages = [user_message(text)];
        self.model
            .chat_tokens(&ChatInput {
                messages: &messages,
                tools: None,
                add_generation_prompt: true,
                continue_final_message: false,
                template_kwargs: None,
            })
            .ok()
    }
}

fn user_message(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// `count` prompts of `size` tokens (seeded by the size, so every run sends the same).
pub fn build(size: usize, count: usize, model: Option<&TextModel>) -> anyhow::Result<PromptSet> {
    let mut prompts = Vec::with_capacity(count);
    for doc in 0..count {
        let mut rng = StdRng::seed_from_u64(((size as u64) << 20) | doc as u64);
        prompts.push(match model {
            None => Prompt {
                tokens: (0..size).map(|_| rng.random_range(0..VOCABULARY)).collect(),
                text: None,
                chat_tokens: None,
            },
            Some(m) => text_prompt(m, size, &mut rng)?,
        });
    }
    Ok(PromptSet { size, prompts })
}

/// `count` seeded words.
pub fn words(rng: &mut StdRng, count: usize) -> String {
    (0..count)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The shortest run of seeded words that encodes to at least `size` tokens.
fn text_prompt(m: &TextModel, size: usize, rng: &mut StdRng) -> anyhow::Result<Prompt> {
    // Every word is at least one token, so `size` words are enough.
    let words: Vec<&str> = (0..size.max(1))
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    let text_of = |k: usize| words[..k].join(" ");
    let (mut lo, mut hi) = (1, words.len());
    anyhow::ensure!(
        m.encode(&text_of(hi))?.len() >= size,
        "{size} words encode to fewer than {size} tokens"
    );
    while lo < hi {
        let mid = (lo + hi) / 2;
        if m.encode(&text_of(mid))?.len() >= size {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let text = text_of(lo);
    let tokens = m.encode(&text)?;
    let chat_tokens = m.chat(&text);
    Ok(Prompt {
        tokens,
        text: Some(text),
        chat_tokens,
    })
}

/// A request body for `prompt` (streamed ones ask for the usage chunk, as clients that count
/// tokens do).
pub fn body(model: &str, api: Api, prompt: &Prompt, max_tokens: usize, stream: bool) -> Bytes {
    let mut b = match (api, &prompt.text) {
        (Api::Completions, Some(text)) => json!({"model": model, "prompt": text}),
        (Api::Completions, None) => json!({"model": model, "prompt": prompt.tokens}),
        (Api::Chat, text) => {
            json!({"model": model, "messages": [user_message(text.as_deref().unwrap_or(""))]})
        }
    };
    let map = b.as_object_mut().expect("an object");
    map.insert("max_tokens".into(), json!(max_tokens));
    map.insert("stream".into(), json!(stream));
    if stream {
        map.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Bytes::from(serde_json::to_vec(&b).expect("JSON serializes"))
}
