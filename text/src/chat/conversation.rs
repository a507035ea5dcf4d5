//! OpenAI chat messages into the conversation a template sees, as vLLM builds it
//! (`parse_chat_messages` and `_postprocess_messages` in vllm/renderers/chat_utils.py,
//! `_convert_developer_to_system` in vllm/renderers/hf.py): each message rebuilt from the
//! fields vLLM reads, content as a string or a list of parts per the template's format,
//! tool-call arguments parsed from JSON.

use serde_json::{Map, Value, json};

use crate::TextError;
use crate::template::ContentFormat;

/// vLLM's text part types, and the field each keeps its text in.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// The line Claude Code puts first in a system message, different on every request; vLLM drops
/// it from system text parts so the prompt's prefix stays cacheable.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The conversation for a template of `format`; `knows_developer`: the template mentions the
/// `developer` role (else developer messages become system messages, merged into one first).
pub(crate) fn conversation(
    messages: &[Value],
    format: ContentFormat,
    knows_developer: bool,
) -> Result<Vec<Map<String, Value>>, TextError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        out.push(
            message_of(message, format)
                .map_err(|e| TextError::input(format!("messages[{i}]: {e}")))?,
        );
    }
    let has_developer = out.iter().any(|m| role(m) == "developer");
    if has_developer && !knows_developer {
        out = developer_to_system(out);
    }
    Ok(out)
}

fn role(m: &Map<String, Value>) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or_default()
}

fn message_of(message: &Value, format: ContentFormat) -> Result<Map<String, Value>, String> {
    let message = message
        .as_object()
        .ok_or("a message must be a JSON object")?;
    let role = match message.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => return Err("role must be a string".into()),
        None => return Err("a message needs a role".into()),
    };
    let mut parts: Vec<Value> = match message.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(parts)) => parts.clone(),
        Some(_) => return Err("content must be a string, a list of content parts or null".into()),
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let mut texts = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        if let Some(text) = part_text(part).map_err(|e| format!("content[{j}]: {e}"))? {
            texts.push(text);
        }
    }
    let content = match format {
        ContentFormat::String => Value::String(texts.join("\n")),
        ContentFormat::OpenAi => texts
            .into_iter()
            .map(|t| json!({"type": "text", "text": t}))
            .collect(),
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.to_owned()));
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
                let calls = tool_calls(calls)?;
                // An empty list is dropped, keeping templates on the plain assistant path.
                if calls.as_array().is_some_and(|c| !c.is_empty()) {
                    out.insert("tool_calls".into(), calls);
                }
            }
            if let Some(reasoning) = message.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".into(), reasoning.clone());
                out.insert("reasoning_content".into(), reasoning.clone());
            }
        }
        "tool" => {
            if let Some(id) = message.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
            // A tool result sent as text parts reaches every template as one string.
            if let Some(Value::Array(parts)) = out.get("content") {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect();
                out.insert("content".into(), Value::String(texts.join("\n")));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Value::String(s)) = message.get(key) {
            out.insert(key.into(), Value::String(s.clone()));
        }
    }
    if role == "developer" {
        out.insert(
            "tools".into(),
            message.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(out)
}

/// A part's text, `None` for a part vLLM skips (a text part without text), an error for media
/// (kvroute routes text only: an image's tokens are the engine's processor's to make).
fn part_text(part: &Value) -> Result<Option<String>, String> {
    let obj = match part {
        Value::String(s) => return Ok(Some(s.clone())),
        Value::Object(obj) => obj,
        _ => return Err("a content part must be a string or an object".into()),
    };
    let kind = obj.get("type").and_then(Value::as_str);
    if let Some((_, field)) = TEXT_PARTS.iter().find(|(t, _)| Some(*t) == kind) {
        return match obj.get(*field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("{field} must be a string")),
        };
    }
    match kind {
        Some(kind) => Err(format!(
            "content parts of type {kind:?} are not supported (text only)"
        )),
        None => Err("a content part needs a type".into()),
    }
}

fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for mut part in parts {
        let text = match &part {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => {
                o.get("text").and_then(Value::as_str).map(str::to_owned)
            }
            _ => None,
        };
        match text {
            Some(t) if t.starts_with(BILLING_HEADER) => {
                let rest = t.split_once('\n').map(|(_, r)| r).unwrap_or("");
                if rest.is_empty() {
                    continue;
                }
                match &mut part {
                    Value::Object(o) => {
                        o.insert("text".into(), Value::String(rest.to_owned()));
                    }
                    _ => part = Value::String(rest.to_owned()),
                }
                out.push(part);
            }
            _ => out.push(part),
        }
    }
    out
}

/// An assistant's tool calls: each call's `function.arguments` becomes an object (a JSON string is parsed; anything that is
/// not an object, or does not parse, becomes `{}`).
fn tool_calls(calls: &Value) -> Result<Value, String> {
    let Value::Array(calls) = calls else {
        return Err("tool_calls must be a list".into());
    };
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let Value::Object(call) = call else {
            return Err("assistant tool_calls entries must be objects.".into());
        };
        let mut call = call.clone();
        let is_function = call
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("function")
            == "function";
        let Some(Value::Object(function)) = call.get_mut("function").filter(|_| is_function) else {
            return Err(
                "chat completions only support assistant tool_calls of type 'function'.".into(),
            );
        };
        let arguments = match function.get("arguments") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(o)) => Value::Object(o),
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        function.insert("arguments".into(), arguments);
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

/// vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`.
fn developer_to_system(conversation: Vec<Map<String, Value>>) -> Vec<Map<String, Value>> {
    let conversation: Vec<Map<String, Value>> = conversation
        .into_iter()
        .map(|mut m| {
            if role(&m) == "developer" {
                m.insert("role".into(), Value::String("system".into()));
                m.remove("tools");
            }
            m
        })
        .collect();
    let mut system = Vec::new();
    let mut others = Vec::new();
    let mut merge = false;
    for (i, m) in conversation.iter().enumerate() {
        if role(m) != "system" {
            others.push(m.clone());
            continue;
        }
        merge |= i > 0 || !system.is_empty();
        let text = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| match p {
                    Value::String(s) => Some(s.as_str()),
                    p => p.get("text").and_then(Value::as_str),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            system.push(text);
        }
    }
    if !merge {
        return conversation;
    }
    let mut merged = Map::new();
    merged.insert("role".into(), Value::String("system".into()));
    merged.insert("content".into(), Value::String(system.join("\n\n")));
    std::iter::once(merged).chain(others).collect()
}

#[cfg(test)]
mod tests;
