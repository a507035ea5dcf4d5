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
//!
//! Parity (`tests/parity.rs`): for the test models and cases, the rendered text, token ids,
//! `raise_exception` messages and detected content format equal what vLLM's own preprocessing
//! (its source from the pinned wheel) and the pinned transformers produce. No input panics; a
//! rendering stops at `Limits::fuel` instructions or `max_output_bytes` with `TextError::Input`.
//!
//! Known gaps (not reproduced): SGLang's own preprocessing, which differs from vLLM's (string
//! content joined with `" "`, `continue_final_message` by token prefix, no developer-role
//! conversion); media content parts (refused: their tokens are the engine's processor's);
//! unknown fields of text parts in "openai" format (vLLM keeps them); vLLM's built-in fallback
//! templates for models without one, and processors' `chat_template.json`; `~` and `|string`
//! print floats and bools through minijinja (`True`, but `1e16` where Python prints `1e+16`);
//! Python `%` string formatting; `str.isprintable` is approximated; `strftime_now` uses UTC;
//! integers beyond 64 bits arrive as floats (serde_json); a config's `added_tokens_decoder`
//! flags are not re-applied to tokens tokenizer.json already has; `sanitize_control_tokens` and
//! other `apply_chat_template` options in `chat_template_kwargs` are ignored.

mod bound;
mod chat;
mod config;
mod error;
mod model;
mod segments;
mod template;

pub use bound::max_bytes_per_token;
pub use chat::ChatInput;
pub use error::{LoadCause, LoadError, TextError};
pub use model::{DEFAULT_SEGMENT_CACHE_BYTES, ModelText, load_dir};
pub use segments::SegmentStats;
pub use template::{ChatTemplate, ContentFormat, Limits};
