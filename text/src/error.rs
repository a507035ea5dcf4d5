//! The crate's two errors: `LoadError` (a model folder that cannot be used, at startup) and
//! `TextError` (a request that cannot be rendered or tokenized, an HTTP 400).

use std::fmt;
use std::io;
use std::path::PathBuf;

/// A model folder that cannot be loaded: names the model, the file and the cause, e.g.
/// `model "m": /x/tokenizer.json: cannot be read: No such file or directory`.
#[derive(Debug, thiserror::Error)]
#[error("{}{}: {cause}", model_prefix(.model), .path.display())]
pub struct LoadError {
    /// The model's name; `None` when the failure is not one model's (an unreadable models dir).
    pub model: Option<String>,
    /// The file or folder at fault.
    pub path: PathBuf,
    pub cause: LoadCause,
}

fn model_prefix(model: &Option<String>) -> String {
    model
        .as_ref()
        .map(|m| format!("model {m:?}: "))
        .unwrap_or_default()
}

/// Why a file of a model folder cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadCause {
    #[error("cannot be read: {}", io_reason(.0))]
    Read(#[source] io::Error),
    #[error("is not valid JSON: {0}")]
    Json(String),
    #[error("is not a tokenizer the tokenizers library can load: {0}")]
    Tokenizer(String),
    /// A field of tokenizer_config.json with the wrong shape.
    #[error("field {field}: {reason}")]
    Field { field: String, reason: String },
    /// A chat template that does not compile.
    #[error("chat template {name:?} does not compile: {reason}")]
    Template { name: String, reason: String },
}

impl LoadError {
    pub(crate) fn new(model: &str, path: impl Into<PathBuf>, cause: LoadCause) -> Self {
        LoadError {
            model: Some(model.to_owned()),
            path: path.into(),
            cause,
        }
    }
}

/// `No such file or directory`, without the ` (os error 2)` that `io::Error` appends.
pub(crate) fn io_reason(e: &io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_owned(),
        _ => s,
    }
}

/// A request that cannot be turned into a prompt; `Display` is fit for an HTTP 400 body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    /// The model has no chat template (or several, none named `default`).
    #[error("this model has no chat template; send a prompt to /v1/completions instead")]
    NoChatTemplate,
    /// The template failed: `raise_exception(msg)` gives `msg` as is; other failures say where.
    #[error("{0}")]
    Template(String),
    /// The messages, tools or options are malformed, or are too large to render.
    #[error("{0}")]
    Input(String),
    /// The tokenizer refused the text or the ids.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

impl TextError {
    pub(crate) fn input(msg: impl fmt::Display) -> Self {
        TextError::Input(msg.to_string())
    }
}
