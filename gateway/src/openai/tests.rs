use super::*;
use proptest::prelude::*;
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
    for body in [
        &b"{"[..],
        b"[1]",
        b"null",
        b"\xff",
        b"{\"model\": \"m\", \"prompt\": [1], \"user\": \"\xff\"}",
    ] {
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
    let forwarded = forwarded_body(body.to_string().as_bytes()).expect("an object");
    assert!(!forwarded.contains_key(EXTENSION));
    assert_eq!(forwarded["prompt"], "x", "the rest stays");

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

#[test]
fn token_id_lists_are_read_directly_and_anything_else_is_declined() {
    assert_eq!(
        token_id_list("[0, 7,\n 4294967295 ]"),
        Some(vec![0, 7, u32::MAX])
    );
    assert_eq!(token_id_list("[ ]"), Some(vec![]));
    for declined in [
        "[4294967296]",
        "[-1]",
        "[1.0]",
        "[1e2]",
        "[1,\"a\"]",
        "[[1]]",
        "\"1\"",
    ] {
        assert_eq!(token_id_list(declined), None, "{declined}");
    }
}

#[test]
fn a_repeated_key_takes_its_last_value_as_a_json_object_does() {
    let body = br#"{"model": 3, "prompt": [1, 2], "model": "m", "prompt": "x", "other": [1e400]}"#;
    let p = Parsed::from_body(Api::Completions, body, &HeaderMap::new()).expect("ok");
    assert_eq!(
        (p.model.as_str(), p.prompts),
        ("m", vec![Prompt::Text("x".into())])
    );
    // Written again (the extension goes), a body with such a number is refused.
    let body = br#"{"model": "m", "prompt": [1], "other": 1e400, "kvroute": {}}"#;
    let p = Parsed::from_body(Api::Completions, body, &HeaderMap::new()).expect("ok");
    assert!(p.edited);
    assert_eq!(forwarded_body(body).unwrap_err().status, 400);
    // A field the gateway reads holding a number beyond f64 is refused, as before.
    let body = br#"{"model": "m", "prompt": [1e400]}"#;
    let e = Parsed::from_body(Api::Completions, body, &HeaderMap::new()).unwrap_err();
    assert!(e.message.contains("not valid JSON"), "{}", e.message);
}

#[test]
fn chat_options_are_the_templating_fields_present() {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let p = parse(
        Api::Chat,
        json!({"model": "m", "messages": msgs, "tools": [{"type": "function"}],
               "add_generation_prompt": false, "temperature": 0.5}),
    )
    .expect("ok");
    let keys: Vec<&str> = p.chat_options.keys().map(String::as_str).collect();
    assert_eq!(keys, ["tools", "add_generation_prompt"]);
}

/// What `from_body` answers, comparable: the parse, or the error's status, param and message.
fn outcome(api: Api, body: &[u8]) -> String {
    match Parsed::from_body(api, body, &HeaderMap::new()) {
        Ok(p) => format!("{p:?}"),
        Err(e) => format!("{} {:?} {}", e.status, e.param, e.message),
    }
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (0u64..70_000).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-2.0f64..5.0).prop_map(Value::from),
        "[a-z ]{0,6}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            proptest::collection::vec((0u32..70_000).prop_map(Value::from), 0..8)
                .prop_map(Value::from),
            proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const KEYS: [&str; 12] = [
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "kvroute",
    "tools",
    "add_generation_prompt",
    "temperature",
    "n",
];

proptest::proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// A token-id list read straight into ids gives what reading it as a `Value` gives, and
    /// every other prompt is read as a `Value`: same prompts, same errors.
    #[test]
    fn the_fast_prompt_reading_agrees_with_the_value_reading(v in arb_json()) {
        for text in [v.to_string(), serde_json::to_string_pretty(&v).expect("text")] {
            let raw: Box<RawValue> = serde_json::from_str(&text).expect("raw");
            let fast = prompts(Some(&raw), text.as_bytes()).map_err(|e| (e.param, e.message));
            // The body's text read as a `Value`, as the gateway read every prompt before.
            let value: Value = serde_json::from_str(&text).expect("valid");
            let slow = prompts_of(Some(value)).map_err(|e| (e.param, e.message));
            prop_assert_eq!(fast, slow);
        }
    }

    /// A body with repeated keys and fields the gateway skips parses as the object a whole-body
    /// `Value` parse makes of it (the last of a repeated key wins).
    #[test]
    fn a_body_parses_as_its_value_does(
        fields in proptest::collection::vec((0..KEYS.len(), arb_json()), 0..8),
        model in proptest::option::of("[a-z]{1,4}"),
        chat in any::<bool>(),
    ) {
        let mut parts: Vec<String> = model
            .iter()
            .map(|m| format!("\"model\": {}", Value::from(m.as_str())))
            .collect();
        parts.extend(fields.iter().map(|(k, v)| format!("{}: {v}", Value::from(KEYS[*k]))));
        let text = format!("{{{}}}", parts.join(", "));
        let value: Value = serde_json::from_str(&text).expect("valid");
        let api = if chat { Api::Chat } else { Api::Completions };
        prop_assert_eq!(outcome(api, text.as_bytes()), outcome(api, value.to_string().as_bytes()));
    }
}
