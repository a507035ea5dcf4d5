//! What a model folder says besides its tokenizer.json, read as transformers reads it:
//! tokenizer_config.json's special tokens and chat templates, and the template files newer
//! transformers saves beside it (`chat_template.jinja`, `additional_chat_templates/*.jinja`),
//! which replace the config's templates when present.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::Path;

use serde_json::{Map, Value};
use tokenizers::AddedToken;

use crate::error::{LoadCause, LoadError};

/// The special-token names every tokenizer has (transformers' `SPECIAL_TOKENS_ATTRIBUTES`).
const NAMED_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// tokenizer_config.json as far as rendering and tokenizing need it.
#[derive(Debug, Default)]
pub(crate) struct Config {
    /// Template variables: `bos_token`, `eos_token`, … and every other `*_token` (and named
    /// `extra_special_tokens`), each the token's text.
    pub special_tokens: Vec<(String, String)>,
    /// Special tokens the tokenizer must know (transformers adds those tokenizer.json lacks).
    pub tokens_to_add: Vec<AddedToken>,
    /// Chat templates by name; a single template is named `default`.
    pub templates: BTreeMap<String, String>,
    pub clean_up_tokenization_spaces: bool,
    pub split_special_tokens: bool,
}

impl Config {
    pub(crate) fn token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }
}

/// Reads `dir/tokenizer_config.json` (absent: an empty config, as transformers allows) and the
/// template files.
pub(crate) fn read_config(model: &str, dir: &Path) -> Result<Config, LoadError> {
    let path = dir.join("tokenizer_config.json");
    let fail = |cause| LoadError::new(model, &path, cause);
    let obj = match fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(obj)) => obj,
            Ok(_) => return Err(fail(LoadCause::Json("not a JSON object".into()))),
            Err(e) => return Err(fail(LoadCause::Json(e.to_string()))),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Map::new(),
        Err(e) => return Err(fail(LoadCause::Read(e))),
    };
    let field = |field: &str, reason: &str| {
        fail(LoadCause::Field {
            field: field.to_owned(),
            reason: reason.to_owned(),
        })
    };

    let mut config = Config::default();
    if let Some(Value::Object(decoder)) = obj.get("added_tokens_decoder") {
        let mut entries: Vec<(u64, AddedToken)> = Vec::new();
        for (id, token) in decoder {
            let name = format!("added_tokens_decoder.{id}");
            let id = id
                .parse()
                .map_err(|_| field(&name, "the key must be a token id"))?;
            let token = added_token(token, false)
                .ok_or_else(|| field(&name, "must be an AddedToken object"))?;
            entries.push((id, token));
        }
        entries.sort_by_key(|(id, _)| *id);
        config
            .tokens_to_add
            .extend(entries.into_iter().map(|(_, t)| t));
    }
    for (key, value) in &obj {
        let named = NAMED_TOKENS.contains(&key.as_str());
        if !(named || key.ends_with("_token")) || value.is_null() {
            continue;
        }
        match added_token(value, true) {
            Some(token) => {
                config
                    .special_tokens
                    .push((key.clone(), token.content.clone()));
                config.tokens_to_add.push(token);
            }
            None if named => {
                return Err(field(key, "must be a string, null or an AddedToken object"));
            }
            None => {} // another kind of `*_token` setting (transformers skips it too)
        }
    }
    for key in ["additional_special_tokens", "extra_special_tokens"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Array(tokens)) => {
                for (i, t) in tokens.iter().enumerate() {
                    let token = added_token(t, true)
                        .ok_or_else(|| field(&format!("{key}[{i}]"), "must be a token"))?;
                    config.tokens_to_add.push(token);
                }
            }
            Some(Value::Object(named)) if key == "extra_special_tokens" => {
                for (name, t) in named {
                    let token = added_token(t, true)
                        .ok_or_else(|| field(&format!("{key}.{name}"), "must be a token"))?;
                    config
                        .special_tokens
                        .push((name.clone(), token.content.clone()));
                    config.tokens_to_add.push(token);
                }
            }
            Some(_) => return Err(field(key, "must be a list of tokens")),
        }
    }
    config.clean_up_tokenization_spaces = obj
        .get("clean_up_tokenization_spaces")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    config.split_special_tokens = obj
        .get("split_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    match obj.get("chat_template") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) => {
            config.templates.insert("default".into(), t.clone());
        }
        Some(Value::Array(list)) => {
            for (i, entry) in list.iter().enumerate() {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                let (Some(name), Some(template)) = (name, template) else {
                    return Err(field(
                        &format!("chat_template[{i}]"),
                        "must be {\"name\": ..., \"template\": ...}",
                    ));
                };
                config
                    .templates
                    .insert(name.to_owned(), template.to_owned());
            }
        }
        Some(_) => {
            return Err(field(
                "chat_template",
                "must be a string or a list of named templates",
            ));
        }
    }
    let files = template_files(model, dir)?;
    if !files.is_empty() {
        config.templates = files;
    }
    Ok(config)
}

/// `chat_template.jinja` (as `default`) and `additional_chat_templates/NAME.jinja`.
fn template_files(model: &str, dir: &Path) -> Result<BTreeMap<String, String>, LoadError> {
    let read = |path: &Path| {
        fs::read_to_string(path).map_err(|e| LoadError::new(model, path, LoadCause::Read(e)))
    };
    let mut out = BTreeMap::new();
    let default = dir.join("chat_template.jinja");
    if default.is_file() {
        out.insert("default".to_owned(), read(&default)?);
    }
    let extra = dir.join("additional_chat_templates");
    if extra.is_dir() {
        let entries =
            fs::read_dir(&extra).map_err(|e| LoadError::new(model, &extra, LoadCause::Read(e)))?;
        for entry in entries {
            let path = entry
                .map_err(|e| LoadError::new(model, &extra, LoadCause::Read(e)))?
                .path();
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jinja"));
            if let Some(name) = name {
                out.insert(name.to_owned(), read(&path)?);
            }
        }
    }
    Ok(out)
}

/// A token written as a string or as an AddedToken object (`{"content": ..., "lstrip": ...}`,
/// with or without `"__type": "AddedToken"`). A string is special when `special` (the flags then
/// as transformers gives them: `normalized` false).
fn added_token(value: &Value, special: bool) -> Option<AddedToken> {
    match value {
        Value::String(s) => Some(AddedToken::from(s.clone(), special).normalized(!special)),
        Value::Object(o) => {
            let content = o.get("content")?.as_str()?;
            let flag =
                |k: &str, default: bool| o.get(k).and_then(Value::as_bool).unwrap_or(default);
            let is_special = special || flag("special", false);
            Some(
                AddedToken::from(content.to_owned(), is_special)
                    .single_word(flag("single_word", false))
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .normalized(flag("normalized", !is_special)),
            )
        }
        _ => None,
    }
}
