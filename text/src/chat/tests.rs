use serde_json::{Map, Value, json};

use super::{ChatInput, alias_reasoning, cut_after_final_message, render};
use crate::TextError;
use crate::template::{ChatTemplate, Limits};

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn run(template: &str, chat: &ChatInput<'_>) -> Result<String, TextError> {
    let t = ChatTemplate::compile(template, Limits::default()).unwrap();
    render(|_| Ok(&t), &[("bos_token".into(), "<s>".into())], chat)
}

#[test]
fn reasoning_is_aliased_as_transformers_does() {
    let mut m = obj(json!({"role": "assistant", "content": "c", "reasoning": "r"}));
    alias_reasoning(&mut m);
    assert_eq!(
        Value::Object(m).to_string(),
        r#"{"thinking":"r","role":"assistant","content":"c","reasoning":"r","reasoning_content":"r"}"#
    );
    let mut m = obj(json!({"role": "assistant", "thinking": "t", "reasoning_content": "rc"}));
    alias_reasoning(&mut m);
    assert_eq!(
        Value::Object(m).to_string(),
        r#"{"role":"assistant","thinking":"t","reasoning_content":"rc"}"#
    );
}

#[test]
fn continue_final_message_cuts_after_the_message() {
    assert_eq!(
        cut_after_final_message("A: hi CONTINUE_FINAL_MESSAGE_TAG <end>".into(), "hi").unwrap(),
        "A: hi "
    );
    assert_eq!(
        cut_after_final_message("A: hi CONTINUE_FINAL_MESSAGE_TAG<end>".into(), "hi ").unwrap(),
        "A: hi"
    );
    assert!(cut_after_final_message("A: <end>".into(), "hi").is_err());
}

#[test]
fn variables_reach_the_template() {
    let messages = [json!({"role": "user", "content": "x", "drop": null})];
    let kwargs = obj(json!({"flag": true, "bos_token": "<B>", "return_dict": false}));
    let chat = ChatInput {
        template_kwargs: Some(&kwargs),
        ..ChatInput::new(&messages)
    };
    let t = "{{ bos_token }}{{ flag }}{{ messages[0] | tojson }}{{ tools }}{{ documents }}{{ add_generation_prompt }}{{ return_dict is defined }}";
    assert_eq!(
        run(t, &chat).unwrap(),
        r#"<B>True{"role": "user", "content": "x"}NoneNoneTrueFalse"#
    );
}

#[test]
fn requests_that_cannot_render_are_refused() {
    let messages = [json!({"role": "user", "content": "x"})];
    let refuse = |chat: ChatInput<'_>| {
        run("{{ messages[0].content }}", &chat)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(refuse(ChatInput::new(&[])), "messages must not be empty");
    assert_eq!(
        refuse(ChatInput {
            continue_final_message: true,
            ..ChatInput::new(&messages)
        }),
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    );
    let kwargs = obj(json!({"tokenize": true}));
    assert_eq!(
        refuse(ChatInput {
            template_kwargs: Some(&kwargs),
            ..ChatInput::new(&messages)
        }),
        "chat_template_kwargs may not set \"tokenize\""
    );
    let tools = json!("nope");
    assert_eq!(
        refuse(ChatInput {
            tools: Some(&tools),
            ..ChatInput::new(&messages)
        }),
        "tools must be a list"
    );
    let chat = ChatInput {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatInput::new(&messages)
    };
    assert_eq!(
        run("{{ messages | length }}", &chat)
            .unwrap_err()
            .to_string(),
        "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template"
    );
}

#[test]
fn a_hostile_message_list_is_bounded() {
    let big = "x".repeat(1 << 20);
    let messages: Vec<Value> = (0..40)
        .map(|_| json!({"role": "user", "content": big}))
        .collect();
    let err = run(
        "{% for m in messages %}{% for n in messages %}{{ m.content }}{% endfor %}{% endfor %}",
        &ChatInput::new(&messages),
    )
    .unwrap_err();
    assert!(matches!(err, TextError::Input(_)), "{err:?}");
}
