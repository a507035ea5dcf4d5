//! The one pass over a request body: the top-level fields the gateway reads, each kept as its
//! raw JSON (the others skipped without being built), a token-id list scanned straight into
//! its ids, and the body written again when it must change. `openai.rs` judges the fields.

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::EXTENSION;
use crate::error::ApiError;

/// The body fields chat templating reads.
pub(super) const CHAT_OPTIONS: [&str; 4] = [
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
];

/// A field of `body` as a `Value`. Its raw JSON parsed, but a `Value` holds less: a number
/// beyond `f64` is an error, reported as the whole body's.
pub(super) fn built(raw: Option<&RawValue>, body: &[u8]) -> Result<Option<Value>, ApiError> {
    raw.map(|r| {
        serde_json::from_str(r.get()).map_err(|e| {
            let e = serde_json::from_slice::<Value>(body).err().unwrap_or(e);
            ApiError::invalid(format!("the body is not valid JSON: {e}"))
        })
    })
    .transpose()
}

/// The body for the engine when it must change: the client's body (which
/// [`Parsed::from_body`] accepted) without kvroute's extension, to edit further. A body the
/// gateway cannot write again as it came (a number beyond `f64` in a field it skipped) is a
/// 400 here.
pub fn forwarded_body(raw: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(raw) {
        Ok(Value::Object(mut body)) => {
            body.remove(EXTENSION);
            Ok(body)
        }
        Ok(_) => Err(ApiError::invalid("the body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!(
            "the body is not valid JSON: {e}"
        ))),
    }
}

/// The top-level fields [`Parsed::from_body`] reads, each as its raw JSON; the other fields
/// are skipped unbuilt. A repeated key's last value wins, as in a `serde_json::Map`.
#[derive(Debug, Default)]
pub(super) struct Fields<'a> {
    pub(super) model: Option<&'a RawValue>,
    pub(super) stream: Option<&'a RawValue>,
    pub(super) stream_options: Option<&'a RawValue>,
    pub(super) max_tokens: Option<&'a RawValue>,
    pub(super) max_completion_tokens: Option<&'a RawValue>,
    pub(super) prompt: Option<&'a RawValue>,
    pub(super) messages: Option<&'a RawValue>,
    pub(super) extension: Option<&'a RawValue>,
    /// In [`CHAT_OPTIONS`]' order.
    pub(super) chat_options: [Option<&'a RawValue>; 4],
}

/// A top-level key of a body.
enum Key {
    Model,
    Stream,
    StreamOptions,
    MaxTokens,
    MaxCompletionTokens,
    Prompt,
    Messages,
    Extension,
    ChatOption(usize),
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Key, E> {
                Ok(match key {
                    "model" => Key::Model,
                    "stream" => Key::Stream,
                    "stream_options" => Key::StreamOptions,
                    "max_tokens" => Key::MaxTokens,
                    "max_completion_tokens" => Key::MaxCompletionTokens,
                    "prompt" => Key::Prompt,
                    "messages" => Key::Messages,
                    EXTENSION => Key::Extension,
                    other => CHAT_OPTIONS
                        .iter()
                        .position(|o| *o == other)
                        .map_or(Key::Other, Key::ChatOption),
                })
            }
        }
        d.deserialize_identifier(Visit)
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Fields<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Fields<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut map: M,
            ) -> Result<Fields<'a>, M::Error> {
                let mut f = Fields::default();
                while let Some(key) = map.next_key::<Key>()? {
                    let slot = match key {
                        Key::Model => &mut f.model,
                        Key::Prompt => &mut f.prompt,
                        Key::Stream => &mut f.stream,
                        Key::StreamOptions => &mut f.stream_options,
                        Key::MaxTokens => &mut f.max_tokens,
                        Key::MaxCompletionTokens => &mut f.max_completion_tokens,
                        Key::Messages => &mut f.messages,
                        Key::Extension => &mut f.extension,
                        Key::ChatOption(i) => &mut f.chat_options[i],
                        Key::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(f)
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// `text`, JSON already checked, as a list of token ids: `[`, then decimal integers below
/// 2^32 separated by commas, then `]`, with JSON whitespace between. `None` for anything else
/// (a sign, a fraction, an exponent, a larger number, another kind of value), which the
/// caller reads as a `Value`. A token id takes a few instructions per digit here, against some
/// 300 per token through serde_json's `Value` (BENCHMARKS.md, "Gateway").
pub(super) fn token_id_list(text: &str) -> Option<Vec<u32>> {
    let b = text.as_bytes();
    let skip = |mut i: usize| {
        while b
            .get(i)
            .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
        {
            i += 1;
        }
        i
    };
    if b.first() != Some(&b'[') {
        return None;
    }
    let mut ids = Vec::with_capacity(b.len() / 4);
    let mut i = skip(1);
    if b.get(i) == Some(&b']') {
        return Some(ids);
    }
    loop {
        let start = i;
        let mut id: u32 = 0;
        while let Some(d) = b.get(i).filter(|c| c.is_ascii_digit()) {
            id = id.checked_mul(10)?.checked_add(u32::from(d - b'0'))?;
            i += 1;
        }
        if i == start {
            return None;
        }
        ids.push(id);
        i = skip(i);
        match b.get(i) {
            Some(b',') => i = skip(i + 1),
            Some(b']') => return Some(ids),
            _ => return None,
        }
    }
}
