//! kvroute-text: a model's tokenizer and chat templates, rendered the way the engines render
//! them (vLLM and SGLang both use Hugging Face `transformers`), so the token ids kvroute hashes
//! are the tokens the engine prefills and caches.
//!
//! ```no_run
//! # use kvroute_text::{ChatInput, ModelText};
//! let model = ModelText::load("qwen", std::path::Path::new("models/qwen"))?;
//! let messages = [serde_json::json!({"role": "user", "content": "Hello"})];
//! let ids = model.chat_tokens(&ChatInput::new(&messages))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The path of a chat request: `chat/conversation.rs` and `chat/tools.rs` (vLLM's message and
//! tool preprocessing, content joined or kept as parts per `template/content_format.rs`), then
//! `chat/mod.rs` (transformers' `apply_chat_template`: variables, `continue_final_message`),
//! `template/` (the Jinja environment), and the tokenizer (`model.rs`).

mod chat;
mod config;
mod error;
mod model;
mod template;

pub use chat::ChatInput;
pub use error::{LoadCause, LoadError, TextError};
pub use model::{ModelText, load_dir};
pub use template::{ChatTemplate, ContentFormat, Limits};
