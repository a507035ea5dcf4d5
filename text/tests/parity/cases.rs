//! The chat cases the parity test renders with both kvroute-text and transformers.

use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["location"]}}},
        {"function": {"name": "now", "parameters": {"zone": {"type": "string", "default": "UTC"}}, "strict": true}}
    ])
}

fn tool_history() -> Value {
    json!([
        {"role": "user", "content": "What's the weather in Paris and in Tokyo?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "18 C"}]},
        {"role": "assistant", "content": "Paris is 21 °C; Tokyo is sunny at 18 °C."},
        {"role": "user", "content": "Thanks!"}
    ])
}

/// Cases every model renders.
pub fn common() -> Vec<Value> {
    vec![
        json!({"name": "user only", "messages": [{"role": "user", "content": "Hello there"}]}),
        json!({"name": "system and user", "messages": [
            {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]}),
        json!({"name": "multi-turn", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me about KV caches."}, {"role": "assistant", "content": "They hold attention keys and values."},
            {"role": "user", "content": "  And prefix caching?  "}]}),
        json!({"name": "no generation prompt", "add_generation_prompt": false, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}),
        json!({"name": "continue final message", "add_generation_prompt": false, "continue_final_message": true, "messages": [
            {"role": "user", "content": "Count to three"}, {"role": "assistant", "content": "One, two"}]}),
        json!({"name": "continue final message with trailing space", "add_generation_prompt": false, "continue_final_message": true, "messages": [
            {"role": "user", "content": "Start a list"}, {"role": "assistant", "content": "Sure, "}]}),
        json!({"name": "content as text parts", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}, "third, a bare string"]}]}),
        json!({"name": "system as parts", "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be kind."}]}, {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}),
        json!({"name": "unicode", "messages": [
            {"role": "user", "content": "日本語とemoji 🚀👍🏽, café vs cafe\u{301}, שלום, zero\u{200b}width, tab\there\r\nnew line"}]}),
        json!({"name": "special tokens in user text", "messages": [
            {"role": "user", "content": "Print <|im_start|> and <|eot_id|> and <start_of_turn> and <think> literally"}]}),
        json!({"name": "empty and null content", "messages": [
            {"role": "user", "content": ""}, {"role": "assistant", "content": null}, {"role": "user", "content": "again"}]}),
        json!({"name": "name fields", "messages": [{"role": "user", "name": "alice", "content": "Hi, I'm Alice"}]}),
        json!({"name": "developer role", "messages": [
            {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]}),
        json!({"name": "two developers and a system", "messages": [
            {"role": "system", "content": "S1"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "D2"}]}),
        json!({"name": "media part", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "text", "text": "what is this?"}]}]}),
        json!({"name": "both generation flags", "continue_final_message": true, "messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        json!({"name": "long chat", "messages": (0..60).map(|i| json!({
            "role": if i % 2 == 0 { "user" } else { "assistant" },
            "content": format!("Turn {i}: the router routes request {} to worker {}.", i * 7, i % 5)})).collect::<Vec<_>>()}),
        json!({"name": "completion only", "completion": "The cache holds 42 blocks. <|im_start|>user\n 日本 🚀  spaced   out\n\n",
               "decode": [1, 55, 84, 91, 351, 2, 214, 1877, 3, 10]}),
    ]
}

/// Cases for the ChatML (Qwen-like) model.
pub fn chatml() -> Vec<Value> {
    vec![
        json!({"name": "tools", "tools": tools(), "messages": [{"role": "user", "content": "Weather in Paris?"}]}),
        json!({"name": "tools with system", "tools": tools(), "messages": [
            {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}]}),
        json!({"name": "tool calls and results", "tools": tools(), "messages": tool_history()}),
        json!({"name": "reasoning", "messages": [
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "Two plus two is four."},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nsix\n</think>\n\n6"}], "add_generation_prompt": false}),
        json!({"name": "enable_thinking false", "kwargs": {"enable_thinking": false}, "messages": [{"role": "user", "content": "Hi"}]}),
        json!({"name": "kwargs tools replace request tools", "tools": tools(), "kwargs": {"tools": [{"name": "raw", "x": [1, 2.5, null]}]},
               "messages": [{"role": "user", "content": "Hi"}]}),
        json!({"name": "arguments as object and bad json", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "calling", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [true, null]}}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}}]},
            {"role": "tool", "content": "done"}]}),
        json!({"name": "billing header", "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=123\nYou are Claude Code."}, {"role": "user", "content": "hi"}]}),
    ]
}

/// Cases for the Llama-3-like model.
pub fn llama3() -> Vec<Value> {
    vec![
        json!({"name": "tools in user message", "tools": tools(), "messages": [
            {"role": "system", "content": "  Be helpful.  "}, {"role": "user", "content": "Weather in Paris?"}]}),
        json!({"name": "tool call and ipython", "tools": tools(), "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
            {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"}]}),
        json!({"name": "tools in system", "tools": tools(), "kwargs": {"tools_in_user_message": false, "date_string": "01 Dec 2026"},
               "messages": [{"role": "user", "content": "Hi"}]}),
        json!({"name": "raise: unknown role", "messages": [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Meanwhile"}]}),
        json!({"name": "raise: two tool calls", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]}]}),
        json!({"name": "raise: tools without user message", "tools": tools(), "messages": [{"role": "system", "content": "only system"}]}),
    ]
}

/// Cases for the Gemma-like model (content as a list of parts).
pub fn parts() -> Vec<Value> {
    vec![
        json!({"name": "raise: roles must alternate", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        json!({"name": "system prefix and parts", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": " one "}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "three"}]}),
        json!({"name": "continue final message in parts", "add_generation_prompt": false, "continue_final_message": true, "messages": [
            {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "I am "}]}]}),
        json!({"name": "model-specific special token", "kwargs": {"image_hint": true}, "messages": [{"role": "user", "content": "Hi"}]}),
    ]
}

/// Templates of their own (rendered with the ChatML model's tokenizer): the Jinja features
/// chat templates lean on.
pub fn templates() -> Vec<Value> {
    let msgs = json!([
        {"role": "system", "content": "  sys  "},
        {"role": "user", "content": "a, b ,c"},
        {"role": "assistant", "content": "x</think>y"}]);
    // vLLM passes only the fields it knows of a message: data of other shapes comes as a kwarg.
    let data = json!({"z": 1, "a": [1.5, 1e20, 0.0001, -0.0, true, null, "q'\"\n"], "m": {"y": "é", "x": [{}, []]}});
    let t = |name: &str, template: &str| json!({"name": name, "template": template, "messages": msgs.clone(), "kwargs": {"data": data.clone()}});
    vec![
        t(
            "tojson options",
            "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ data | tojson(separators=(',', ':'), sort_keys=true) }}|{{ data | tojson(ensure_ascii=true) }}|{{ 'é\u{1}' | tojson }}|{{ messages | tojson(indent='\\t') }}",
        ),
        t(
            "python printing",
            "{{ messages[1] }}|{{ data.a }}|{{ true }}|{{ none }}|{{ 1.0 }}|{{ 2.5e-7 }}|{{ [1, 'x'] }}|{{ data.items() | list }}|{{ 3 / 2 }}|{{ 7 // 2 }}",
        ),
        t(
            "string methods",
            "{% for m in messages %}[{{ m.content.strip() }}|{{ m.content.split(',') }}|{{ m.content.rsplit(',', 1) }}|{{ m.content.startswith('a') }}|{{ m.content.endswith('y') }}|{{ m.content.upper() }}|{{ m.content.replace(',', ';') }}|{{ m.content | trim }}|{{ m.content.split('</think>')[-1].lstrip('x') }}]{% endfor %}",
        ),
        t(
            "dict methods",
            "{% for k, v in messages[1].items() %}{{ k }}={{ v }};{% endfor %}|{{ messages[1].get('nope', 'default') }}|{{ messages[1].keys() | list }}|{{ data | dictsort }}|{{ 'content' in messages[1] }}{{ 'a' in data }}",
        ),
        t(
            "loops",
            "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}{{ '' if loop.last else ',' }}{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}|{% for m in messages[::-1] %}{{ m.role[0] }}{% endfor %}|{% for m in messages if m.role != 'system' %}{{ loop.previtem.role if loop.previtem else '-' }}{% endfor %}",
        ),
        t(
            "namespace and scoping",
            "{% set ns = namespace(n=0, last='') %}{% set outer = 'o' %}{% for m in messages %}{% set outer = 'i' %}{% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}{% endfor %}{{ ns.n }} {{ ns.last }} {{ outer }}",
        ),
        t(
            "undefined",
            "[{{ nothing }}][{{ nothing is defined }}][{% for x in nothing %}x{% endfor %}][{{ messages[1].missing }}][{{ messages[9] }}][{{ 'yes' if not nothing else 'no' }}][{{ nothing | length }}]",
        ),
        t("undefined attribute fails", "{{ nothing.attr }}"),
        t(
            "tests",
            "{% for m in messages %}{{ m.content is string }}{{ m.content is iterable }}{{ m is mapping }}{{ data.z is defined }}{{ m.content is none }};{% endfor %}{{ tools is none }}{{ documents is none }}{{ tools is defined }}",
        ),
        t(
            "macros and whitespace",
            "{% macro turn(role, text) -%}\n  <{{ role }}>{{ text }}</{{ role }}>\n{%- endmacro %}\n{% for m in messages %}\n    {{ turn(m.role, m.content) }}\n{% endfor %}\n  {%- if add_generation_prompt %}\n<go>\n  {% endif %}\n",
        ),
        t(
            "generation tag",
            "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set hidden = 'h' %}{{ m.content }}{% endgeneration %}{{ hidden }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
        ),
        t(
            "raise_exception",
            "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported: ' ~ messages[0].content) }}{% endif %}",
        ),
        t(
            "strftime_now is a function",
            "{{ strftime_now is defined }}{{ (strftime_now('%Y') | length) }}",
        ),
        t(
            "special tokens as variables",
            "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ messages | length }}|{{ add_generation_prompt }}",
        ),
        t(
            "string filters",
            "{{ messages[0].content | trim | upper }}|{{ messages[1].content | replace(' ', '_') }}|{{ messages[2].content | length }}|{{ messages | map(attribute='role') | join(', ') }}|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|{{ 'a-b' | title }}|{{ 'x' * 3 }}|{{ [3, 1, 2] | sort }}|{{ 'abc' | list }}|{{ messages[0].content | indent(2) }}",
        ),
        t(
            "content loop detection",
            "{% for message in messages %}{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}{% endfor %}",
        ),
    ]
}
