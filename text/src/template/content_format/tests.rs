use super::{ContentFormat, detect};

#[test]
fn string_templates() {
    for t in [
        "{% for message in messages %}{{ message['content'] }}{% endfor %}",
        "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}",
        "no tags at all",
        "{% for message in messages %}{% for p in other.content %}{% endfor %}{% endfor %}",
        // A tuple target over the messages: vLLM's AST walk gives up, and says "string".
        "{% for i, m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
        "{% for message in messages %}{% for p in message.content + [] %}{% endfor %}{% endfor %}",
        "{% macro render(c) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}{{ render(m.role) }}{% endfor %}",
    ] {
        assert_eq!(detect(t), ContentFormat::String, "{t}");
    }
}

#[test]
fn openai_templates() {
    for t in [
        "{% for message in messages %}{% for content in message['content'] %}{% endfor %}{% endfor %}",
        "{%- for message in messages -%}{%- for part in message.content | selectattr('type', 'equalto', 'text') -%}{%- endfor -%}{%- endfor -%}",
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
        "{% set a = messages %}{% set b = a | list %}{% for m in b if m.role != 'system' %}{% for p in m[\"content\"][1:] %}{% endfor %}{% endfor %}",
        "{% for content in content %}{% endfor %}",
        "{% macro render(c, role='user') %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ render(m.content) }}{% endfor %}",
        "{% macro render(role, c=none) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}{{ render('x', c=m['content']) }}{% endfor %}",
        "{# {% for nothing %} #}{% raw %}{% for %}{% endraw %}{% for m in messages %}{% for p in (m.content) %}{% endfor %}{% endfor %}",
    ] {
        assert_eq!(detect(t), ContentFormat::OpenAi, "{t}");
    }
}

#[test]
fn the_test_models_templates() {
    let models = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models/templates");
    let read = |f: &str| std::fs::read_to_string(format!("{models}/{f}")).unwrap();
    assert_eq!(detect(&read("chatml.jinja")), ContentFormat::String);
    assert_eq!(detect(&read("llama3.jinja")), ContentFormat::String);
    assert_eq!(detect(&read("parts.jinja")), ContentFormat::OpenAi);
}

#[test]
fn truncated_and_odd_templates_never_panic() {
    let models = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models/templates");
    let source = std::fs::read_to_string(format!("{models}/chatml.jinja")).unwrap()
        + "{{ 'é' ~ x }}{% set a, b = messages %}{%}{{}}";
    for end in (0..source.len()).filter(|&i| source.is_char_boundary(i)) {
        let _ = detect(&source[..end]);
        let _ = detect(&source[end..]);
    }
}
