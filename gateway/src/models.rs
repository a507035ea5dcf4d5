//! The models this gateway tokenizes ([`kvroute_text::ModelText`]), and a request's prompt
//! as token ids: completions text with the model's special tokens (as engines encode a
//! completions prompt), chat rendered by the model's chat template and encoded without adding
//! special tokens (the template has them), token-id prompts as given.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kvroute_common::config::ConfigError;
use kvroute_text::{ChatInput, ModelText, TextError};
use serde_json::Value;

use crate::config::ModelSpec;
use crate::error::ApiError;
use crate::openai::{Api, Parsed, Prompt};

/// Prompts longer than this (in bytes) are tokenized on a blocking thread, not on the runtime.
pub const INLINE_TOKENIZE_BYTES: usize = 2048;

/// Tokenizers by model name, and the context length each model's folder declares.
#[derive(Debug, Clone, Default)]
pub struct Models {
    by_name: HashMap<String, Arc<ModelText>>,
    context: HashMap<String, usize>,
}

impl Models {
    /// Loads every `--model` and every folder of `--models-dir`, each with a segment cache of
    /// `cache_bytes` (0: none); a model that cannot be loaded stops startup with a message
    /// naming it.
    pub fn load(
        specs: &[ModelSpec],
        dir: Option<&Path>,
        cache_bytes: usize,
    ) -> Result<Self, ConfigError> {
        let mut by_name = HashMap::new();
        let mut context = HashMap::new();
        if let Some(dir) = dir {
            let found = kvroute_text::load_dir(dir)
                .map_err(|e| ConfigError::new("models-dir", e.to_string()))?;
            for m in found {
                if let Some(n) = context_length(&dir.join(m.name())) {
                    context.insert(m.name().to_owned(), n);
                }
                by_name.insert(
                    m.name().to_owned(),
                    Arc::new(m.with_segment_cache(cache_bytes)),
                );
            }
        }
        for spec in specs {
            let m = ModelText::load(&spec.name, &spec.dir)
                .map_err(|e| ConfigError::new("model", e.to_string()))?;
            match context_length(&spec.dir) {
                Some(n) => context.insert(spec.name.clone(), n),
                None => context.remove(&spec.name),
            };
            by_name.insert(
                spec.name.clone(),
                Arc::new(m.with_segment_cache(cache_bytes)),
            );
        }
        for (name, m) in &by_name {
            match m.segment_cache() {
                Ok(_) => {}
                Err(why) if cache_bytes > 0 => {
                    tracing::info!(model = %name, "no tokenize cache for this model: {why}");
                }
                Err(_) => {}
            }
        }
        Ok(Self { by_name, context })
    }

    /// The segment caches' counters, as Prometheus text (`kvroute_gateway_tokenize_cache_*`).
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let mut names: Vec<&String> = self.by_name.keys().collect();
        names.sort();
        let stats: Vec<(&String, kvroute_text::SegmentStats)> = names
            .into_iter()
            .filter_map(|n| Some((n, self.by_name[n].segment_cache().ok()?)))
            .collect();
        for (name, kind, help, value) in [
            (
                "kvroute_gateway_tokenize_cache_hits_total",
                "counter",
                "Long text pieces (between special tokens) whose token ids came from the tokenize cache.",
                (|s: &kvroute_text::SegmentStats| s.hits) as fn(&kvroute_text::SegmentStats) -> u64,
            ),
            (
                "kvroute_gateway_tokenize_cache_misses_total",
                "counter",
                "Long text pieces tokenized and added to the tokenize cache.",
                |s| s.misses,
            ),
            (
                "kvroute_gateway_tokenize_cache_bytes",
                "gauge",
                "Memory the tokenize cache holds (bounded by --tokenize-cache-mib).",
                |s| s.bytes,
            ),
            (
                "kvroute_gateway_tokenize_cache_disabled",
                "gauge",
                "1 once a sampled check found the cache's ids differ from the whole text's (the cache is then off).",
                |s| u64::from(s.disabled),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (model, s) in &stats {
                let model = crate::metrics::escape(model);
                let _ = writeln!(out, "{name}{{model=\"{model}\"}} {}", value(s));
            }
        }
    }

    /// The context length the model's folder declares, if any.
    pub fn context_length(&self, name: &str) -> Option<usize> {
        self.context.get(name).copied()
    }

    pub fn from_models(models: impl IntoIterator<Item = ModelText>) -> Self {
        Self {
            by_name: models
                .into_iter()
                .map(|m| (m.name().to_owned(), Arc::new(m)))
                .collect(),
            context: HashMap::new(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<ModelText>> {
        self.by_name.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

/// The context length a model folder declares. `config.json`, read as vLLM derives its
/// `max_model_len`: `max_position_embeddings` (or another of its length keys, the smallest),
/// times `rope_scaling.factor` when the model is served with linear, dynamic or YaRN scaling
/// (YaRN from `original_max_position_embeddings`). Without a `config.json` (a folder of
/// tokenizer files only), `tokenizer_config.json`'s `model_max_length` (transformers' 1e30 for
/// "unlimited" ignored). Unreadable files declare nothing.
pub fn context_length(dir: &Path) -> Option<usize> {
    let read = |file: &str| -> Option<Value> {
        let bytes = std::fs::read(dir.join(file)).ok()?;
        serde_json::from_slice(&bytes).ok()
    };
    match read("config.json") {
        Some(config) => config_context_length(&config),
        None => positive(read("tokenizer_config.json")?.get("model_max_length")?),
    }
}

/// A length field: a positive integer below 2^40 (larger ones mean "unlimited").
fn positive(v: &Value) -> Option<usize> {
    let n = v.as_u64()?;
    (n > 0 && n < 1 << 40).then_some(n as usize)
}

/// vLLM's `max_model_len` from a model's `config.json` (`_get_and_verify_max_len`).
fn config_context_length(config: &Value) -> Option<usize> {
    // A multimodal model's language part may sit under `text_config`.
    let config = config.get("text_config").unwrap_or(config);
    let keys = [
        "max_position_embeddings",
        "n_positions",
        "max_seq_len",
        "seq_length",
        "model_max_length",
        "max_sequence_length",
        "max_seq_length",
        "seq_len",
    ];
    let mut length = keys
        .iter()
        .filter_map(|k| config.get(*k).and_then(positive))
        .min()?;
    if let Some(rope) = config.get("rope_scaling").filter(|r| r.is_object()) {
        let kind = rope
            .get("rope_type")
            .or_else(|| rope.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let factor = rope.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
        if !matches!(kind, "su" | "longrope" | "llama3" | "mrope" | "default") && factor > 1.0 {
            if kind == "yarn"
                && let Some(original) = rope
                    .get("original_max_position_embeddings")
                    .and_then(positive)
            {
                length = original;
            }
            length = (length as f64 * factor) as usize;
        }
    }
    Some(length)
}

/// The prompt is over `limit` tokens: a 400 naming the prompt's field. `at_least`: the count
/// is a lower bound from the text's size (it was not tokenized).
pub fn too_long(api: Api, tokens: usize, at_least: bool, limit: usize) -> ApiError {
    ApiError {
        code: "context_length_exceeded",
        ..ApiError::invalid_param(
            api.prompt_field(),
            format!(
                "the prompt has {}{tokens} tokens, more than the limit of {limit} for this model",
                if at_least { "at least " } else { "" }
            ),
        )
    }
}

/// Refuses, without tokenizing, a completions text whose size alone proves it longer than
/// `limit` tokens (a chat is checked once rendered, in [`prompt_tokens`]).
pub fn precheck(model: Option<&ModelText>, parsed: &Parsed, limit: usize) -> Result<(), ApiError> {
    if let (Some(model), Api::Completions, Some(Prompt::Text(text))) =
        (model, parsed.api, parsed.prompts.first())
    {
        let least = model.min_tokens(text.len());
        if least > limit {
            return Err(too_long(parsed.api, least, true, limit));
        }
    }
    Ok(())
}

/// The token ids kvroute routes `parsed` on (a batch of completions prompts routes on its
/// first). Text needs the model's tokenizer: without one the answer names the flag to add.
/// A text (or rendered chat) whose size alone proves it over `limit` is refused unencoded.
pub fn prompt_tokens(
    model: Option<&ModelText>,
    parsed: &Parsed,
    limit: usize,
) -> Result<Vec<u32>, ApiError> {
    let no_tokenizer = || {
        ApiError::invalid_param(
            "model",
            format!(
                "this gateway has no tokenizer for model `{}` (start it with --model {}=DIR), \
                 so it can route only prompts given as token ids",
                parsed.model, parsed.model
            ),
        )
    };
    match parsed.api {
        Api::Completions => match parsed.prompts.first() {
            Some(Prompt::Tokens(ids)) => Ok(ids.clone()),
            Some(Prompt::Text(text)) => {
                let model = model.ok_or_else(no_tokenizer)?;
                precheck(Some(model), parsed, limit)?;
                model.encode(text, true).map_err(text_error)
            }
            None => Err(ApiError::invalid_param("prompt", "`prompt` is required")),
        },
        Api::Chat => {
            let model = model.ok_or_else(no_tokenizer)?;
            let body = &parsed.chat_options;
            let flag = |name: &'static str, default: bool| -> Result<bool, ApiError> {
                match body.get(name) {
                    None | Some(Value::Null) => Ok(default),
                    Some(Value::Bool(b)) => Ok(*b),
                    Some(_) => Err(ApiError::invalid_param(
                        name,
                        format!("`{name}` must be a boolean"),
                    )),
                }
            };
            let template_kwargs = match body.get("chat_template_kwargs") {
                None | Some(Value::Null) => None,
                Some(Value::Object(o)) => Some(o),
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        "chat_template_kwargs",
                        "`chat_template_kwargs` must be an object",
                    ));
                }
            };
            let chat = ChatInput {
                messages: &parsed.messages,
                tools: body.get("tools").filter(|t| !t.is_null()),
                add_generation_prompt: flag("add_generation_prompt", true)?,
                continue_final_message: flag("continue_final_message", false)?,
                template_kwargs,
            };
            let text = model.render_chat(&chat).map_err(text_error)?;
            let least = model.min_tokens(text.len());
            if least > limit {
                return Err(too_long(parsed.api, least, true, limit));
            }
            model.encode(&text, false).map_err(text_error)
        }
    }
}

/// The size of what tokenizing `parsed` reads, to choose where to run it.
pub fn prompt_bytes(parsed: &Parsed) -> usize {
    match parsed.api {
        Api::Completions => match parsed.prompts.first() {
            Some(Prompt::Text(t)) => t.len(),
            _ => 0,
        },
        Api::Chat => parsed
            .messages
            .iter()
            .map(|m| match m.get("content") {
                Some(Value::String(s)) => s.len(),
                Some(other) => other.to_string().len(),
                None => 0,
            })
            .sum(),
    }
}

fn text_error(e: TextError) -> ApiError {
    match e {
        TextError::NoChatTemplate => ApiError::invalid_param(
            "messages",
            "this model has no chat template (tokenizer_config.json has no chat_template): use /v1/completions",
        ),
        other => ApiError::invalid(other.to_string()),
    }
}

#[cfg(test)]
mod context_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn config_json_is_read_as_vllm_derives_max_model_len() {
        let len = |v: Value| config_context_length(&v);
        assert_eq!(len(json!({"max_position_embeddings": 32768})), Some(32768));
        assert_eq!(
            len(json!({"max_position_embeddings": 4096, "seq_length": 2048})),
            Some(2048)
        );
        let yarn = json!({"max_position_embeddings": 32768, "rope_scaling":
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}});
        assert_eq!(len(yarn), Some(131072));
        let llama3 = json!({"max_position_embeddings": 131072, "rope_scaling":
            {"rope_type": "llama3", "factor": 8.0}});
        assert_eq!(
            len(llama3),
            Some(131072),
            "llama3 scaling is already counted"
        );
        assert_eq!(len(json!({"hidden_size": 8})), None);
    }

    #[test]
    fn the_tokenize_cache_is_counted_per_model() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models/chatml");
        let spec = ModelSpec {
            name: "m\"x".into(),
            dir: dir.clone(),
        };
        let render = |models: &Models| {
            let mut out = String::new();
            models.render_metrics(&mut out);
            out
        };
        let off = Models::load(std::slice::from_ref(&spec), None, 0).expect("loads");
        assert!(!render(&off).contains("{model="), "no cache, no series");
        let models = Models::load(&[spec], None, 1 << 20).expect("loads");
        let m = models.get("m\"x").expect("loaded");
        let long = "tell me more about the routers and their caches ".repeat(8);
        let messages = [json!({"role": "user", "content": long})];
        for _ in 0..3 {
            m.chat_tokens(&ChatInput::new(&messages)).expect("encodes");
        }
        let text = render(&models);
        for line in [
            "kvroute_gateway_tokenize_cache_hits_total{model=\"m\\\"x\"} 2",
            "kvroute_gateway_tokenize_cache_misses_total{model=\"m\\\"x\"} 1",
            "kvroute_gateway_tokenize_cache_disabled{model=\"m\\\"x\"} 0",
            "# TYPE kvroute_gateway_tokenize_cache_bytes gauge",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[test]
    fn without_config_json_the_tokenizer_config_says() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |name: &str, v: Value| {
            std::fs::write(dir.path().join(name), v.to_string()).expect("write");
        };
        write("tokenizer_config.json", json!({"model_max_length": 1e30}));
        assert_eq!(context_length(dir.path()), None, "1e30 means unlimited");
        write("tokenizer_config.json", json!({"model_max_length": 8192}));
        assert_eq!(context_length(dir.path()), Some(8192));
        write("config.json", json!({"max_position_embeddings": 32768}));
        assert_eq!(
            context_length(dir.path()),
            Some(32768),
            "config.json wins, as in vLLM"
        );
    }
}
