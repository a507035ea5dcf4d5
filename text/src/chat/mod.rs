//! A chat request into prompt text: vLLM's preprocessing (`conversation.rs`, `tools.rs`) and
//! transformers' `apply_chat_template` around the template (`render`): the template's
//! variables, `None`-valued message keys dropped, reasoning fields aliased, and
//! `continue_final_message`.

mod conversation;
mod tools;

use serde_json::{Map, Value};

use crate::TextError;
use crate::template::{ChatTemplate, py_strip};

/// One chat request's input, borrowed from the parsed request body.
#[derive(Debug, Clone, Copy)]
pub struct ChatInput<'a> {
    /// OpenAI chat messages as the client sent them.
    pub messages: &'a [Value],
    /// The request's `tools` (OpenAI function tools), if any.
    pub tools: Option<&'a Value>,
    /// Append the assistant's header (vLLM's default: true).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open, for the model to continue it.
    pub continue_final_message: bool,
    /// The request's `chat_template_kwargs`: extra template variables (`enable_thinking`, …).
    pub template_kwargs: Option<&'a Map<String, Value>>,
}

impl<'a> ChatInput<'a> {
    /// `messages` with the callers' defaults: a generation prompt, no tools, no kwargs.
    pub fn new(messages: &'a [Value]) -> Self {
        ChatInput {
            messages,
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: None,
        }
    }
}

/// transformers' marker for the end of the message to continue.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Keyword arguments of `apply_chat_template` itself: they never reach the template.
const APPLY_ARGS: [&str; 10] = [
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
];

/// Renders `chat`; `select` picks the template given whether there are tools (transformers
/// prefers a template named `tool_use` then).
pub(crate) fn render<'t>(
    select: impl FnOnce(bool) -> Result<&'t ChatTemplate, TextError>,
    special_tokens: &[(String, String)],
    chat: &ChatInput<'_>,
) -> Result<String, TextError> {
    if chat.messages.is_empty() {
        return Err(TextError::input("messages must not be empty"));
    }
    if chat.continue_final_message && chat.add_generation_prompt {
        return Err(TextError::input(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let empty = Map::new();
    let kwargs = chat.template_kwargs.unwrap_or(&empty);
    for key in ["chat_template", "tokenize", "messages", "conversation"] {
        if kwargs.contains_key(key) {
            return Err(TextError::input(format!(
                "chat_template_kwargs may not set {key:?}"
            )));
        }
    }
    // vLLM lets chat_template_kwargs.tools replace the request's tools, unchecked.
    let tools = match kwargs.get("tools").filter(|t| !t.is_null()) {
        Some(Value::Array(tools)) if tools.iter().all(Value::is_object) => Some(tools.clone()),
        Some(_) => {
            return Err(TextError::input(
                "chat_template_kwargs.tools must be a list of objects",
            ));
        }
        None => tools::canonical_tools(chat.tools)?,
    };
    let documents = match kwargs.get("documents").filter(|d| !d.is_null()) {
        Some(Value::Array(docs)) if docs.iter().all(Value::is_object) => Value::Array(docs.clone()),
        Some(_) => return Err(TextError::input("documents must be a list of objects")),
        None => Value::Null,
    };
    let template = select(tools.is_some())?;

    let mut messages = conversation::conversation(
        chat.messages,
        template.content_format(),
        template.mentions_developer(),
    )?;
    for m in &mut messages {
        m.retain(|_, v| !v.is_null());
        alias_reasoning(m);
    }
    let continued = if chat.continue_final_message {
        Some(mark_final_message(&mut messages, template.source())?)
    } else {
        None
    };

    let mut ctx = Map::new();
    for (name, token) in special_tokens {
        ctx.insert(name.clone(), Value::String(token.clone()));
    }
    for (key, value) in kwargs {
        if !APPLY_ARGS.contains(&key.as_str()) && key != "tools" && key != "documents" {
            ctx.insert(key.clone(), value.clone());
        }
    }
    ctx.insert(
        "messages".into(),
        Value::Array(messages.into_iter().map(Value::Object).collect()),
    );
    ctx.insert(
        "tools".into(),
        tools.map(Value::Array).unwrap_or(Value::Null),
    );
    ctx.insert("documents".into(), documents);
    ctx.insert(
        "add_generation_prompt".into(),
        Value::Bool(chat.add_generation_prompt),
    );
    let rendered = template.render(minijinja::Value::from(minijinja::value::Serde(
        Value::Object(ctx),
    )))?;
    match continued {
        Some(final_text) => cut_after_final_message(rendered, &final_text),
        None => Ok(rendered),
    }
}

/// transformers' `_alias_reasoning_fields`: the first of `reasoning_content`, `thinking`,
/// `reasoning` becomes `thinking` (first, unless present) and `reasoning_content` too.
fn alias_reasoning(m: &mut Map<String, Value>) {
    let Some(reasoning) = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k).filter(|v| !v.is_null()).cloned())
    else {
        return;
    };
    if !m.contains_key("thinking") {
        let rest = std::mem::take(m);
        m.insert("thinking".into(), reasoning.clone());
        m.extend(rest);
    }
    m.insert("reasoning_content".into(), reasoning);
}

/// Appends the tag to the final message's text (its last text part for a list); returns the
/// text as it was.
fn mark_final_message(
    messages: &mut [Map<String, Value>],
    source: &str,
) -> Result<String, TextError> {
    let last = messages
        .last_mut()
        .ok_or_else(|| TextError::input("messages must not be empty"))?;
    let Some(content) = last.get_mut("content") else {
        return Err(TextError::input(
            "continue_final_message is set but the final message has no \"content\" to continue!",
        ));
    };
    if !source.contains("content") {
        return Err(TextError::input(
            "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template",
        ));
    }
    let text = match content {
        Value::String(s) => s,
        Value::Array(parts) => parts
            .iter_mut()
            .rev()
            .find_map(|p| match p.get_mut("text") {
                Some(Value::String(s)) => Some(s),
                _ => None,
            })
            .ok_or_else(|| {
                TextError::input("continue_final_message is set but we could not find any text to continue in the final message!")
            })?,
        _ => return Err(TextError::input("the final message's content cannot be continued")),
    };
    let original = text.clone();
    text.push_str(CONTINUE_TAG);
    Ok(original)
}

/// Cuts the rendering at the tag, as transformers does.
fn cut_after_final_message(rendered: String, final_text: &str) -> Result<String, TextError> {
    let tag = CONTINUE_TAG.trim_end();
    let Some(at) = rendered
        .rfind(tag)
        .filter(|_| rendered.contains(py_strip(final_text)))
    else {
        return Err(TextError::Template(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template".into(),
        ));
    };
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_owned())
    } else {
        Ok(rendered[..at]
            .trim_end_matches(crate::template::is_py_space)
            .to_owned())
    }
}

#[cfg(test)]
mod tests;
