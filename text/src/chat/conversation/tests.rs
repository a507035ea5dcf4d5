use serde_json::{Value, json};

use super::conversation;
use crate::template::ContentFormat::{OpenAi, String as Str};

fn conv(messages: Value, format: crate::template::ContentFormat, knows_developer: bool) -> Value {
    let messages = messages.as_array().unwrap().clone();
    let out = conversation(&messages, format, knows_developer).unwrap();
    Value::Array(out.into_iter().map(Value::Object).collect())
}

#[test]
fn content_is_joined_for_string_templates_and_parts_for_openai_ones() {
    let m = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "refusal", "refusal": "c"}, {"type": "text"}]}]);
    assert_eq!(
        conv(m.clone(), Str, false),
        json!([{"role": "user", "content": "a\nb\nc"}])
    );
    assert_eq!(
        conv(m, OpenAi, false),
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}])
    );
    let m = json!([{"role": "user", "content": "s"}, {"role": "assistant", "content": null}]);
    assert_eq!(
        conv(m.clone(), Str, false),
        json!([{"role": "user", "content": "s"}, {"role": "assistant", "content": ""}])
    );
    assert_eq!(
        conv(m, OpenAi, false),
        json!([{"role": "user", "content": [{"type": "text", "text": "s"}]}, {"role": "assistant", "content": []}])
    );
}

#[test]
fn only_the_fields_vllm_reads_are_kept() {
    let m = json!([
        {"role": "assistant", "content": "x", "extra": 1, "name": "bot", "reasoning": "r",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "p"}, {"type": "text", "text": "q"}], "name": 5},
        {"role": "assistant", "content": "y", "tool_calls": []},
    ]);
    assert_eq!(
        conv(m, OpenAi, false),
        json!([
            {"role": "assistant", "content": [{"type": "text", "text": "x"}],
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
             "reasoning": "r", "reasoning_content": "r", "name": "bot"},
            {"role": "tool", "content": "p\nq", "tool_call_id": "1"},
            {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
        ])
    );
}

#[test]
fn developer_messages_become_one_system_message_unless_the_template_knows_them() {
    let m = json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "d", "tools": []}]);
    assert_eq!(
        conv(m.clone(), Str, false),
        json!([{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}])
    );
    assert_eq!(
        conv(m, Str, true)[2],
        json!({"role": "developer", "content": "d", "tools": []})
    );
}

#[test]
fn malformed_messages_are_input_errors_naming_the_message() {
    for (m, why) in [
        (json!([1]), "messages[0]: a message must be a JSON object"),
        (
            json!([{"content": "x"}]),
            "messages[0]: a message needs a role",
        ),
        (json!([{"role": 1}]), "messages[0]: role must be a string"),
        (
            json!([{"role": "user", "content": 5}]),
            "messages[0]: content must be a string, a list of content parts or null",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
            "messages[0]: content[0]: content parts of type \"image_url\" are not supported (text only)",
        ),
        (
            json!([{"role": "user", "content": [{"text": "no type"}]}]),
            "messages[0]: content[0]: a content part needs a type",
        ),
        (
            json!([{"role": "user", "content": "ok"}, {"role": "assistant", "tool_calls": [{"type": "code"}]}]),
            "messages[1]: chat completions only support assistant tool_calls of type 'function'.",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [1]}]),
            "messages[0]: assistant tool_calls entries must be objects.",
        ),
    ] {
        let messages = m.as_array().unwrap().clone();
        assert_eq!(
            conversation(&messages, Str, false).unwrap_err().to_string(),
            why
        );
    }
}
