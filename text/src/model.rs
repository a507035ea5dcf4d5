//! `ModelText`: one model's tokenizer, special tokens and chat templates, loaded from a model
//! folder as transformers loads it.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use tokenizers::models::ModelWrapper;
use tokenizers::{PostProcessor, Tokenizer};

use crate::chat::{self, ChatInput};
use crate::config::read_config;
use crate::error::{LoadCause, LoadError, TextError};
use crate::segments::{SegmentStats, Segmenter};
use crate::template::{ChatTemplate, Limits};

/// A model's text side. `Send + Sync`: share it in an `Arc`.
#[derive(Debug)]
pub struct ModelText {
    name: String,
    tokenizer: Tokenizer,
    templates: BTreeMap<String, ChatTemplate>,
    special_tokens: Vec<(String, String)>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// transformers' `clean_up_tokenization_spaces` on decode (which it skips for BPE models).
    clean_up_spaces: bool,
    /// Every token stands for at most this many bytes of text (`None`: no sound bound).
    max_bytes_per_token: Option<usize>,
    /// Encodes piece by piece between added tokens with a cache of the pieces' ids, or why it
    /// cannot for this tokenizer ([`crate::segments`]).
    segmenter: Result<Segmenter, String>,
    /// The post-processor adds tokens to a single sequence (then an encoding with
    /// `add_special_tokens` goes the whole-text way).
    post_adds_tokens: bool,
}

/// The segment cache's budget unless [`ModelText::with_segment_cache`] sets one: 64 MiB.
pub const DEFAULT_SEGMENT_CACHE_BYTES: usize = 64 << 20;

impl ModelText {
    /// Loads `dir/tokenizer.json`, `dir/tokenizer_config.json` (may be absent) and the chat
    /// template files beside it, with the default rendering limits.
    pub fn load(name: &str, dir: &Path) -> Result<ModelText, LoadError> {
        Self::load_with_limits(name, dir, Limits::default())
    }

    /// `load`, with the bounds on each rendering.
    pub fn load_with_limits(
        name: &str,
        dir: &Path,
        limits: Limits,
    ) -> Result<ModelText, LoadError> {
        let path = dir.join("tokenizer.json");
        let bytes = fs::read(&path).map_err(|e| LoadError::new(name, &path, LoadCause::Read(e)))?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes)
            .map_err(|e| LoadError::new(name, &path, LoadCause::Tokenizer(e.to_string())))?;
        // transformers encodes without the file's truncation and padding unless asked.
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::new(name, &path, LoadCause::Tokenizer(e.to_string())))?;
        tokenizer.with_padding(None);

        let config = read_config(name, dir)?;
        let known: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let mut missing = Vec::new();
        for token in &config.tokens_to_add {
            if !known.contains(&token.content)
                && !missing
                    .iter()
                    .any(|t: &tokenizers::AddedToken| t.content == token.content)
            {
                missing.push(token.clone());
            }
        }
        if !missing.is_empty() {
            tokenizer
                .add_tokens(missing)
                .map_err(|e| LoadError::new(name, &path, LoadCause::Tokenizer(e.to_string())))?;
        }
        tokenizer.set_encode_special_tokens(config.split_special_tokens);

        let mut templates = BTreeMap::new();
        for (template_name, source) in &config.templates {
            let template = ChatTemplate::compile(source, limits).map_err(|e| {
                LoadError::new(
                    name,
                    dir,
                    LoadCause::Template {
                        name: template_name.clone(),
                        reason: e.to_string(),
                    },
                )
            })?;
            templates.insert(template_name.clone(), template);
        }
        let is_bpe = matches!(tokenizer.get_model(), ModelWrapper::BPE(_));
        let max_bytes_per_token = crate::bound::max_bytes_per_token(&tokenizer);
        let post_adds_tokens = tokenizer
            .get_post_processor()
            .is_some_and(|p| p.added_tokens(false) > 0);
        let segmenter = Segmenter::new(&tokenizer, DEFAULT_SEGMENT_CACHE_BYTES);
        Ok(ModelText {
            max_bytes_per_token,
            segmenter,
            post_adds_tokens,
            name: name.to_owned(),
            bos_token: config.token("bos_token").map(str::to_owned),
            eos_token: config.token("eos_token").map(str::to_owned),
            clean_up_spaces: config.clean_up_tokenization_spaces && !is_bpe,
            special_tokens: config.special_tokens,
            templates,
            tokenizer,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets the segment cache's budget in bytes (0: no segment cache, every text encoded
    /// whole).
    pub fn with_segment_cache(mut self, bytes: usize) -> Self {
        self.segmenter = if bytes == 0 {
            Err("turned off (a budget of 0 bytes)".into())
        } else {
            Segmenter::new(&self.tokenizer, bytes)
        };
        self
    }

    /// The segment cache's counters, or why this model has none.
    pub fn segment_cache(&self) -> Result<SegmentStats, &str> {
        self.segmenter
            .as_ref()
            .map(Segmenter::stats)
            .map_err(String::as_str)
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (a BOS,
    /// say), as for a completion prompt.
    ///
    /// Encoded piece by piece with the segment cache where the tokenizer allows it (see
    /// [`crate::segments`]): the same ids, faster for texts whose long pieces were seen.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        if let Ok(segmenter) = &self.segmenter
            && (!add_special_tokens || !self.post_adds_tokens)
            && let Some(ids) = segmenter.encode(&self.tokenizer, text)
        {
            return ids.map_err(TextError::Tokenizer);
        }
        self.encode_whole(text, add_special_tokens)
    }

    /// [`encode`](Self::encode) the whole text at once, without the segment cache.
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TextError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The fewest tokens a text of `bytes` bytes can have (0 when the tokenizer allows no sound
    /// bound): a text whose bound is above a limit is over it without being tokenized.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        self.max_bytes_per_token
            .map_or(0, |per| bytes.div_ceil(per))
    }

    /// The text of `ids`, special tokens skipped; ids the vocabulary lacks are skipped too.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        let text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The prompt text the engine's chat endpoint renders for `chat`.
    pub fn render_chat(&self, chat: &ChatInput<'_>) -> Result<String, TextError> {
        chat::render(
            |tools| self.select_template(tools),
            &self.special_tokens,
            chat,
        )
    }

    /// `render_chat` with another template (a request's own `chat_template`).
    pub fn render_chat_with(
        &self,
        template: &ChatTemplate,
        chat: &ChatInput<'_>,
    ) -> Result<String, TextError> {
        chat::render(|_| Ok(template), &self.special_tokens, chat)
    }

    /// `render_chat` then `encode(…, false)`: the ids vLLM's and SGLang's chat paths prefill.
    pub fn chat_tokens(&self, chat: &ChatInput<'_>) -> Result<Vec<u32>, TextError> {
        self.encode(&self.render_chat(chat)?, false)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The template variables the model's special tokens give (`bos_token`, `eos_token`, …).
    pub fn special_tokens(&self) -> impl Iterator<Item = (&str, &str)> {
        self.special_tokens
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
    }

    /// The template used without tools (`None`: chat fails with `NoChatTemplate`).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.templates.get("default")
    }

    /// The template for a request with or without tools: `tool_use` when there are tools and
    /// the model names one, else `default` (transformers' `get_chat_template`).
    fn select_template(&self, tools: bool) -> Result<&ChatTemplate, TextError> {
        tools
            .then(|| self.templates.get("tool_use"))
            .flatten()
            .or_else(|| self.templates.get("default"))
            .ok_or(TextError::NoChatTemplate)
    }

    /// The underlying tokenizer (vocabulary look-ups and the like).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

/// transformers' `clean_up_tokenization`: spaces before punctuation and contractions removed.
fn clean_up_tokenization(text: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(text.to_owned(), |t, (from, to)| t.replace(from, to))
}

/// Every model folder under `dir` (a folder holding tokenizer.json), named by its folder name,
/// in name order.
pub fn load_dir(dir: &Path) -> Result<Vec<ModelText>, LoadError> {
    let unreadable = |e| LoadError {
        model: None,
        path: dir.to_owned(),
        cause: LoadCause::Read(e),
    };
    let mut folders = Vec::new();
    for entry in fs::read_dir(dir).map_err(unreadable)? {
        let path = entry.map_err(unreadable)?.path();
        if path.join("tokenizer.json").is_file() {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            folders.push((name, path));
        }
    }
    folders.sort();
    folders
        .iter()
        .map(|(name, path)| ModelText::load(name, path))
        .collect()
}
