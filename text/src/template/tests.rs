use minijinja::value::Value;

use super::{ChatTemplate, ContentFormat, Limits, rewrite_generation_tags};
use crate::TextError;

fn render(source: &str, ctx: serde_json::Value) -> Result<String, TextError> {
    ChatTemplate::compile(source, Limits::default())?
        .render(Value::from(minijinja::value::Serde(ctx)))
}

#[test]
fn blocks_are_trimmed_as_transformers_configures_jinja() {
    let t = "{% for x in xs %}\n    {% if x %}\n[{{ x }}]\n    {% endif %}\n{% endfor %}\n";
    assert_eq!(
        render(t, serde_json::json!({"xs": [1, 0, 2]})).unwrap(),
        "[1]\n[2]\n"
    );
}

#[test]
fn raise_exception_gives_its_message() {
    let t = "{% macro check(r) %}{% if r != 'user' %}{{ raise_exception('bad role: ' ~ r) }}{% endif %}{% endmacro %}{{ check(role) }}";
    assert_eq!(
        render(t, serde_json::json!({"role": "bot"})),
        Err(TextError::Template("bad role: bot".into()))
    );
}

#[test]
fn other_template_failures_say_where() {
    let err = render("line one\n{{ nothing.attr }}", serde_json::json!({})).unwrap_err();
    let TextError::Template(msg) = err else {
        panic!("{err:?}")
    };
    assert!(
        msg.starts_with("chat template error: undefined value"),
        "{msg}"
    );
    assert!(msg.ends_with("(line 2)"), "{msg}");
    let err = ChatTemplate::compile("{% for %}", Limits::default()).unwrap_err();
    assert!(err.to_string().contains("syntax error"), "{err}");
}

#[test]
fn fuel_and_output_bound_a_rendering() {
    let looping =
        "{% for a in range(1000) %}{% for b in range(1000) %}{{ b }}{% endfor %}{% endfor %}";
    let small = Limits {
        fuel: 100_000,
        max_output_bytes: 1 << 30,
    };
    let err = ChatTemplate::compile(looping, small)
        .unwrap()
        .render(Value::from(()))
        .unwrap_err();
    assert_eq!(
        err,
        TextError::Input("the chat is too large to render (template step limit reached)".into())
    );
    let tight = Limits {
        fuel: u64::MAX,
        max_output_bytes: 1000,
    };
    let err = ChatTemplate::compile("{{ 'x' * 5000 }}", tight)
        .unwrap()
        .render(Value::from(()))
        .unwrap_err();
    assert_eq!(
        err,
        TextError::Input("the rendered chat would exceed 1000 bytes".into())
    );
}

#[test]
fn generation_blocks_render_their_body_in_a_scope() {
    assert_eq!(
        rewrite_generation_tags(
            "a{%- generation -%}b{% endgeneration %}{%generation%}{%+ endgeneration +%}{% if generation %}"
        ),
        "a{%- with -%}b{% endwith %}{%with%}{%+ endwith +%}{% if generation %}"
    );
    assert_eq!(rewrite_generation_tags("{%}x%}{%"), "{%}x%}{%");
    assert!(ChatTemplate::compile("{%}", Limits::default()).is_err());
    let t = "{% generation %}{% set x = 1 %}[{{ text }}]{% endgeneration %}{{ x }}";
    assert_eq!(
        render(t, serde_json::json!({"text": "hi"})).unwrap(),
        "[hi]"
    );
}

#[test]
fn values_print_as_python_and_tojson_as_json_dumps() {
    let t = "{{ v }} {{ v | tojson }} {{ v | tojson(indent=1, sort_keys=true) }} {{ 1e16 }} {{ 'é' | tojson(true) }}";
    let out = render(
        t,
        serde_json::json!({"v": {"b": [true, null, 1.5], "a": "x"}}),
    )
    .unwrap();
    assert_eq!(
        out,
        "{'b': [True, None, 1.5], 'a': 'x'} {\"b\": [true, null, 1.5], \"a\": \"x\"} {\n \"a\": \"x\",\n \"b\": [\n  true,\n  null,\n  1.5\n ]\n} 1e+16 \"\\u00e9\""
    );
    assert!(render("{{ x | tojson }}", serde_json::json!({})).is_err());
    assert!(render("{{ 1 | tojson(indent=1, wat=2) }}", serde_json::json!({})).is_err());
}

#[test]
fn python_methods_work() {
    let t = "{{ s.strip() }}|{{ s.rsplit(',', 1) }}|{{ s.removeprefix('\u{1f} a') }}|{{ s.partition(',') }}|{{ d.items() | list }}|{{ d.get('k') }}";
    let out = render(t, serde_json::json!({"s": "\u{1f} a,b,c ", "d": {"k": 1}})).unwrap();
    assert_eq!(
        out,
        "a,b,c|['\\x1f a,b', 'c ']|,b,c |('\\x1f a', ',', 'b,c ')|[('k', 1)]|1"
    );
}

#[test]
fn detects_the_content_format_and_the_developer_role() {
    let t = ChatTemplate::compile(
        "{% for m in messages %}{% for p in m.content %}{% endfor %}'developer'{% endfor %}",
        Limits::default(),
    )
    .unwrap();
    assert_eq!(t.content_format(), ContentFormat::OpenAi);
    assert!(t.mentions_developer());
    let t = ChatTemplate::compile("{{ messages[0].content }}", Limits::default()).unwrap();
    assert_eq!(t.content_format(), ContentFormat::String);
    assert!(!t.mentions_developer());
}
