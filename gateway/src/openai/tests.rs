use super::*;
use serde_json::json;

fn parse(api: Api, body: Value) -> Result<Parsed, ApiError> {
    Parsed::from_body(api, body.to_string().as_bytes(), &HeaderMap::new())
}

fn param_of(api: Api, body: Value) -> Option<&'static str> {
    parse(api, body).unwrap_err().param
}

#[test]
fn completions_prompts_in_every_form() {
    let p = parse(Api::Completions, json!({"model": "m", "prompt": "hi"})).expect("ok");
    assert_eq!(p.prompts, [Prompt::Text("hi".into())]);
    let p = parse(Api::Completions, json!({"model": "m", "prompt": [1, 2]})).expect("ok");
    assert_eq!(p.prompts, [Prompt::Tokens(vec![1, 2])]);
    let p = parse(
        Api::Completions,
        json!({"model": "m", "prompt": ["a", [3]], "max_tokens": 7, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .expect("ok");
    assert_eq!(p.prompts.len(), 2);
    assert_eq!(p.max_tokens, Some(7));
    assert!(p.stream && p.include_usage);
    assert!(!p.edited);
}

#[test]
fn wrong_types_name_the_field() {
    let c = Api::Completions;
    assert_eq!(param_of(c, json!({"prompt": "x"})), Some("model"));
    assert_eq!(
        param_of(c, json!({"model": 3, "prompt": "x"})),
        Some("model")
    );
    assert_eq!(param_of(c, json!({"model": "m"})), Some("prompt"));
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": 5})),
        Some("prompt")
    );
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": [-1]})),
        Some("prompt")
    );
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": []})),
        Some("prompt")
    );
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": ""})),
        Some("prompt")
    );
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": "x", "max_tokens": "9"})),
        Some("max_tokens")
    );
    assert_eq!(
        param_of(c, json!({"model": "m", "prompt": "x", "stream": "yes"})),
        Some("stream")
    );
    let chat = Api::Chat;
    assert_eq!(param_of(chat, json!({"model": "m"})), Some("messages"));
    assert_eq!(
        param_of(chat, json!({"model": "m", "messages": []})),
        Some("messages")
    );
    assert_eq!(
        param_of(chat, json!({"model": "m", "messages": [{"content": "x"}]})),
        Some("messages")
    );
    assert_eq!(
        param_of(
            chat,
            json!({"model": "m", "messages": [{"role": "user", "content": 1}]})
        ),
        Some("messages")
    );
}

#[test]
fn malformed_json_and_non_objects_are_refused() {
    for body in [&b"{"[..], b"[1]", b"null", b"\xff"] {
        let e = Parsed::from_body(Api::Chat, body, &HeaderMap::new()).unwrap_err();
        assert_eq!(e.status, 400);
    }
}

#[test]
fn chat_takes_max_completion_tokens_first() {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let p = parse(
        Api::Chat,
        json!({"model": "m", "messages": msgs, "max_tokens": 5, "max_completion_tokens": 9}),
    )
    .expect("ok");
    assert_eq!(p.max_tokens, Some(9));
    assert_eq!(p.messages.len(), 1);
}

#[test]
fn sessions_from_headers_win_over_the_body_extension() {
    let body = json!({"model": "m", "prompt": "x",
        "kvroute": {"session": {"id": "body", "final": true}, "policy": "round-robin"}});
    let p = parse(Api::Completions, body.clone()).expect("ok");
    let s = p.session.expect("session");
    assert_eq!(s.id, "body");
    assert!(s.is_final);
    assert_eq!(p.policy.as_deref(), Some("round-robin"));
    assert!(p.edited, "the extension is removed from the forwarded body");
    assert!(!p.body.contains_key(EXTENSION));

    let mut h = HeaderMap::new();
    h.insert(SESSION_ID, "hdr".parse().expect("value"));
    h.insert(SESSION_PARENT_ID, "root".parse().expect("value"));
    h.insert(SESSION_FINAL, "0".parse().expect("value"));
    h.insert(POLICY, "least-busy".parse().expect("value"));
    let p = Parsed::from_body(Api::Completions, body.to_string().as_bytes(), &h).expect("ok");
    let s = p.session.expect("session");
    assert_eq!(
        (s.id.as_str(), s.parent_id.as_deref()),
        ("hdr", Some("root"))
    );
    assert!(!s.is_final);
    assert_eq!(p.policy.as_deref(), Some("least-busy"));

    h.insert(SESSION_FINAL, "maybe".parse().expect("value"));
    assert!(Parsed::from_body(Api::Completions, body.to_string().as_bytes(), &h).is_err());
    let long =
        json!({"model": "m", "prompt": "x", "kvroute": {"session": {"id": "s".repeat(300)}}});
    assert!(parse(Api::Completions, long).is_err());
    let bad = json!({"model": "m", "prompt": "x", "kvroute": {"session": 3}});
    assert_eq!(param_of(Api::Completions, bad), Some(EXTENSION));
}

#[test]
fn session_headers_without_the_session_id_are_refused_naming_the_header() {
    let body = json!({"model": "m", "prompt": "x",
        "kvroute": {"session": {"id": "body"}}})
    .to_string();
    for (alone, value) in [(SESSION_PARENT_ID, "root"), (SESSION_FINAL, "1")] {
        let mut h = HeaderMap::new();
        h.insert(alone, value.parse().expect("value"));
        let e = Parsed::from_body(Api::Completions, body.as_bytes(), &h).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message.contains(alone) && e.message.contains(SESSION_ID),
            "{}",
            e.message
        );
        h.insert(SESSION_ID, "hdr".parse().expect("value"));
        let p = Parsed::from_body(Api::Completions, body.as_bytes(), &h).expect("with the id");
        assert_eq!(p.session.expect("session").id, "hdr");
    }
}

#[test]
fn prompt_errors_name_the_field_of_the_endpoint() {
    assert_eq!(Api::Completions.prompt_field(), "prompt");
    assert_eq!(Api::Chat.prompt_field(), "messages");
}
