//! What the gateway reads of an OpenAI request body, checked field by field so a wrong type is
//! a 400 naming the field. Everything else in the body goes to the engine untouched.
//!
//! kvroute's own extension is the body field `kvroute` (removed before forwarding):
//! `{"session": {"id", "parent_id", "final"}, "policy": "<name>"}`; the same can come as the
//! headers `x-session-id`, `x-session-parent-id`, `x-session-final` and `x-kvroute-policy`
//! (a header wins over the body).

use axum::http::HeaderMap;
use kvroute_common::messages::{SessionContext, SessionTrigger};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::error::ApiError;
pub use raw::forwarded_body;
use raw::{CHAT_OPTIONS, Fields, built, token_id_list};

mod raw;

pub const SESSION_ID: &str = "x-session-id";
pub const SESSION_PARENT_ID: &str = "x-session-parent-id";
pub const SESSION_FINAL: &str = "x-session-final";
pub const POLICY: &str = "x-kvroute-policy";
/// The body field of kvroute's extension.
pub const EXTENSION: &str = "kvroute";
/// The longest session id a router accepts.
const MAX_SESSION_ID: usize = 256;
/// The longest value of a kvroute header (the session ids' limit).
const MAX_HEADER_VALUE: usize = MAX_SESSION_ID;

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }

    /// The body field holding the prompt (an error about the prompt names it).
    pub fn prompt_field(self) -> &'static str {
        match self {
            Api::Completions => "prompt",
            Api::Chat => "messages",
        }
    }

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
}

/// A completions prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A parsed request: what routing and tokenizing need. The body itself is forwarded as the
/// client sent it unless it must change ([`forwarded_body`]).
#[derive(Debug, Clone)]
pub struct Parsed {
    pub api: Api,
    /// Chat: the body fields templating reads (`tools`, `chat_template_kwargs`,
    /// `add_generation_prompt`, `continue_final_message`), those present.
    pub chat_options: Map<String, Value>,
    pub model: String,
    /// Completions: the prompts (a batch routes on the first; all go to one worker).
    pub prompts: Vec<Prompt>,
    /// Chat: the messages.
    pub messages: Vec<Value>,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<u32>,
    pub session: Option<SessionContext>,
    pub policy: Option<String>,
    /// Whether the body carried kvroute's extension: the forwarded body must go without it.
    pub edited: bool,
}

impl Parsed {
    /// Reads a request body. `headers` carry the session and policy overrides.
    ///
    /// Only the fields read here are built; the rest of the body (and a token-id prompt,
    /// read straight into its ids) is never turned into `serde_json::Value`s. The answer is
    /// the one a whole-body `Value` parse gives, errors included (a repeated key's last value
    /// wins; a body the fast reading refuses is read again whole for its error), but for a
    /// number beyond `f64` in a field the gateway does not read: the engine judges that one.
    pub fn from_body(api: Api, bytes: &[u8], headers: &HeaderMap) -> Result<Self, ApiError> {
        // UTF-8 checked whole first: skipping a field does not check its strings.
        let fast = std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| serde_json::from_str::<Fields<'_>>(text).ok());
        let Some(fields) = fast else {
            return Err(match serde_json::from_slice::<Value>(bytes) {
                Err(e) => ApiError::invalid(format!("the body is not valid JSON: {e}")),
                Ok(Value::Object(_)) => ApiError::internal("a JSON object the gateway misread"),
                Ok(_) => ApiError::invalid("the body must be a JSON object"),
            });
        };
        let value = |raw: Option<&RawValue>| built(raw, bytes);
        let edited = fields.extension.is_some();
        let model = match value(fields.model)? {
            Some(Value::String(m)) if !m.is_empty() => m,
            Some(Value::String(_)) | None => {
                return Err(ApiError::invalid_param("model", "`model` is required"));
            }
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "model",
                    format!("`model` must be a string, got {}", kind(&other)),
                ));
            }
        };
        let stream = optional_bool(value(fields.stream)?.as_ref(), "stream")?.unwrap_or(false);
        let include_usage = match value(fields.stream_options)? {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(ApiError::invalid_param(
                        "stream_options",
                        format!(
                            "`stream_options.include_usage` must be a boolean, got {}",
                            kind(other)
                        ),
                    ));
                }
            },
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "stream_options",
                    format!("`stream_options` must be an object, got {}", kind(&other)),
                ));
            }
        };
        let max_tokens = match api {
            Api::Completions => optional_u32(value(fields.max_tokens)?.as_ref(), "max_tokens")?,
            Api::Chat => optional_u32(
                value(fields.max_completion_tokens)?.as_ref(),
                "max_completion_tokens",
            )?
            .or(optional_u32(
                value(fields.max_tokens)?.as_ref(),
                "max_tokens",
            )?),
        };
        let (prompts, messages, chat_options) = match api {
            Api::Completions => (prompts(fields.prompt, bytes)?, Vec::new(), Map::new()),
            Api::Chat => {
                let mut options = Map::new();
                for (name, raw) in CHAT_OPTIONS.into_iter().zip(fields.chat_options) {
                    if let Some(v) = value(raw)? {
                        options.insert(name.to_owned(), v);
                    }
                }
                (Vec::new(), messages(value(fields.messages)?)?, options)
            }
        };
        let ext = Extension::parse(value(fields.extension)?.as_ref())?;
        let session = session(headers, ext.session)?;
        let policy = match header(headers, POLICY)? {
            Some(p) => Some(p.to_owned()),
            None => ext.policy,
        };
        Ok(Self {
            api,
            chat_options,
            model,
            prompts,
            messages,
            stream,
            include_usage,
            max_tokens,
            session,
            policy,
            edited,
        })
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn optional_bool(value: Option<&Value>, field: &'static str) -> Result<Option<bool>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ApiError::invalid_param(
            field,
            format!("`{field}` must be a boolean, got {}", kind(other)),
        )),
    }
}

fn optional_u32(value: Option<&Value>, field: &'static str) -> Result<Option<u32>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) => Ok(Some(n)),
            None => Err(ApiError::invalid_param(
                field,
                format!("`{field}` must be a non-negative integer, got {v}"),
            )),
        },
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "prompt",
                        format!("token ids must be integers in 0..2^32, got {v}"),
                    )
                })
        })
        .collect()
}

/// `prompt`: a string, a list of token ids, or a list of strings or of token-id lists. A list
/// of token ids is read straight into its ids ([`token_id_list`]); any other form, and a list
/// that reading declines, goes through `Value` (for the same answer and the same error).
fn prompts(raw: Option<&RawValue>, body: &[u8]) -> Result<Vec<Prompt>, ApiError> {
    if let Some(ids) = raw.and_then(|r| token_id_list(r.get()))
        && !ids.is_empty()
    {
        return Ok(vec![Prompt::Tokens(ids)]);
    }
    prompts_of(built(raw, body)?)
}

/// `prompt` read from its `Value`: the reading [`prompts`] must agree with.
fn prompts_of(value: Option<Value>) -> Result<Vec<Prompt>, ApiError> {
    let out = match value {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param("prompt", "`prompt` is required"));
        }
        Some(Value::String(s)) => vec![Prompt::Text(s)],
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            vec![Prompt::Tokens(token_ids(&items)?)]
        }
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|p| match p {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(ids) => token_ids(ids).map(Prompt::Tokens),
                other => Err(ApiError::invalid_param(
                    "prompt",
                    format!(
                        "each prompt must be a string or a list of token ids, got {}",
                        kind(other)
                    ),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_param("prompt", "`prompt` is empty"));
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "`prompt` must be a string, a list of token ids, or a list of those, got {}",
                    kind(&other)
                ),
            ));
        }
    };
    let empty = out.iter().any(|p| match p {
        Prompt::Text(t) => t.is_empty(),
        Prompt::Tokens(t) => t.is_empty(),
    });
    if empty {
        return Err(ApiError::invalid_param("prompt", "a prompt is empty"));
    }
    Ok(out)
}

/// `messages`: a non-empty list of objects with a string `role`.
fn messages(value: Option<Value>) -> Result<Vec<Value>, ApiError> {
    let items = match value {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must not be empty",
            ));
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` is required",
            ));
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                "messages",
                format!("`messages` must be an array, got {}", kind(&other)),
            ));
        }
    };
    for (i, m) in items.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid_param(
                "messages",
                format!("messages[{i}] must be an object, got {}", kind(m)),
            ));
        };
        match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => {}
            _ => {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!("messages[{i}].role must be a non-empty string"),
                ));
            }
        }
        match m.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!(
                        "messages[{i}].content must be a string or a list of parts, got {}",
                        kind(other)
                    ),
                ));
            }
        }
    }
    Ok(items)
}

/// kvroute's body extension.
#[derive(Debug, Default)]
struct Extension {
    session: Option<SessionContext>,
    policy: Option<String>,
}

impl Extension {
    fn parse(v: Option<&Value>) -> Result<Self, ApiError> {
        let Some(v) = v else {
            return Ok(Self::default());
        };
        let Value::Object(o) = v else {
            return Err(ApiError::invalid_param(
                EXTENSION,
                format!("`{EXTENSION}` must be an object, got {}", kind(v)),
            ));
        };
        let session = match o.get("session") {
            None | Some(Value::Null) => None,
            Some(s) => Some(serde_json::from_value::<SessionContext>(s.clone()).map_err(|e| {
                ApiError::invalid_param(
                    EXTENSION,
                    format!("`{EXTENSION}.session` must be {{\"id\", \"parent_id\", \"final\"}}: {e}"),
                )
            })?),
        };
        let policy = match o.get("policy") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) => Some(p.clone()),
            Some(other) => {
                return Err(ApiError::invalid_param(
                    EXTENSION,
                    format!("`{EXTENSION}.policy` must be a string, got {}", kind(other)),
                ));
            }
        };
        Ok(Self { session, policy })
    }
}

/// A kvroute header's value, trimmed; absent or blank is `None`. A value that is not printable
/// ASCII (a space to `~`), or longer than `max` bytes, is a 400 naming the header (a silently
/// ignored session id would lose the session).
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let Some(raw) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::invalid_header(name, "is given more than once"));
    }
    let bytes = raw.as_bytes().trim_ascii();
    if let Some(bad) = bytes.iter().find(|b| !(0x20..=0x7e).contains(*b)) {
        return Err(ApiError::invalid_header(
            name,
            format!(
                "must be printable ASCII (a space to `~`); byte 0x{bad:02x} is not (percent-encode \
                 other characters, or give the session in the body's `kvroute.session`)"
            ),
        ));
    }
    if bytes.len() > MAX_HEADER_VALUE {
        return Err(ApiError::invalid_header(
            name,
            format!(
                "must be at most {MAX_HEADER_VALUE} bytes, got {}",
                bytes.len()
            ),
        ));
    }
    let value = std::str::from_utf8(bytes).expect("printable ASCII is UTF-8");
    Ok((!value.is_empty()).then_some(value))
}

/// The session from the headers, else from the body extension; checked like the router does.
fn session(
    headers: &HeaderMap,
    body: Option<SessionContext>,
) -> Result<Option<SessionContext>, ApiError> {
    let from_headers = match header(headers, SESSION_ID)? {
        // The header session replaces the body's whole; its other headers mean nothing alone.
        None => {
            for h in [SESSION_PARENT_ID, SESSION_FINAL] {
                header(headers, h)?;
            }
            if let Some(alone) = [SESSION_PARENT_ID, SESSION_FINAL]
                .into_iter()
                .find(|h| matches!(header(headers, h), Ok(Some(_))))
            {
                return Err(ApiError::invalid(format!(
                    "header {alone} needs {SESSION_ID} (a session given in headers names its id)"
                )));
            }
            None
        }
        Some(id) => {
            let is_final = match header(headers, SESSION_FINAL)? {
                None => false,
                Some(v) => kvroute_common::cli::parse_bool(v)
                    .map_err(|e| ApiError::invalid(format!("header {SESSION_FINAL}: {e}")))?,
            };
            Some(SessionContext {
                id: id.to_owned(),
                parent_id: header(headers, SESSION_PARENT_ID)?.map(|p| p.to_owned()),
                is_final,
                trigger: SessionTrigger::UserMessage,
            })
        }
    };
    let session = from_headers.or(body);
    if let Some(s) = &session {
        let len = s.id.as_str().len();
        if len == 0 || len > MAX_SESSION_ID {
            return Err(ApiError::invalid(format!(
                "a session id must be 1 to {MAX_SESSION_ID} bytes, got {len}"
            )));
        }
    }
    Ok(session)
}

#[cfg(test)]
mod tests;
