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

/// Tokenizers by model name.
#[derive(Debug, Clone, Default)]
pub struct Models {
    by_name: HashMap<String, Arc<ModelText>>,
}

impl Models {
    /// Loads every `--model` and every folder of `--models-dir`; a model that cannot be loaded
    /// stops startup with a message naming it.
    pub fn load(specs: &[ModelSpec], dir: Option<&Path>) -> Result<Self, ConfigError> {
        let mut by_name = HashMap::new();
        if let Some(dir) = dir {
            let found = kvroute_text::load_dir(dir)
                .map_err(|e| ConfigError::new("models-dir", e.to_string()))?;
            for m in found {
                by_name.insert(m.name().to_owned(), Arc::new(m));
            }
        }
        for spec in specs {
            let m = ModelText::load(&spec.name, &spec.dir)
                .map_err(|e| ConfigError::new("model", e.to_string()))?;
            by_name.insert(spec.name.clone(), Arc::new(m));
        }
        Ok(Self { by_name })
    }

    pub fn from_models(models: impl IntoIterator<Item = ModelText>) -> Self {
        Self {
            by_name: models
                .into_iter()
                .map(|m| (m.name().to_owned(), Arc::new(m)))
                .collect(),
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<ModelText>> {
        self.by_name.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

/// The token ids kvroute routes `parsed` on (a batch of completions prompts routes on its
/// first). Text needs the model's tokenizer: without one the answer names the flag to add.
pub fn prompt_tokens(model: Option<&ModelText>, parsed: &Parsed) -> Result<Vec<u32>, ApiError> {
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
            Some(Prompt::Text(text)) => model
                .ok_or_else(no_tokenizer)?
                .encode(text, true)
                .map_err(text_error),
            None => Err(ApiError::invalid_param("prompt", "`prompt` is required")),
        },
        Api::Chat => {
            let model = model.ok_or_else(no_tokenizer)?;
            let body = &parsed.body;
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
            model.chat_tokens(&chat).map_err(text_error)
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
