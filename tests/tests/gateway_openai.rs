//! The official `openai` Python client (pinned in tests/python/requirements.txt), unchanged,
//! against two `kvroute-gateway` replicas in front of mocker engines impersonating vLLM behind
//! kvroute-bridge, the gateway and the engines tokenizing with the same real tokenizer and chat
//! template (tests/models/chatml): completions and chat, streamed and not; conversations whose
//! every turn lands on the worker that holds the conversation so far; a session kept across the
//! two replicas; the client's own error classes. And a model that cannot be loaded stops the
//! gateway at startup with a message naming it.

use std::time::Duration;

use kvroute_tests::{
    GatewayStack, STACK_MODEL, TestEnv, kvroute_bin, model_dir, python_json, run_to_exit,
};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_unchanged_through_two_gateways() {
    let model = model_dir("chatml");
    let stack = GatewayStack::start(2, |c| {
        c.face.engine_tokenizer = Some(model.clone());
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "sk-test\n").unwrap();
    let flags = [
        "--model".to_owned(),
        format!("{STACK_MODEL}={}", model.display()),
        "--api-keys-file".to_owned(),
        keys.display().to_string(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let a = stack.gateway("a", &flags).unwrap();
    let b = stack.gateway("b", &flags).unwrap();
    let seen = python_json(
        "gateway_client.py",
        vec![
            "--base-url".into(),
            a.url("/v1"),
            "--base-url".into(),
            b.url("/v1"),
            "--model".into(),
            STACK_MODEL.into(),
            "--api-key".into(),
            "sk-test".into(),
        ],
    )
    .await;
    assert_eq!(seen["models"], json!([STACK_MODEL]));
    let c = &seen["completion"];
    assert_eq!(c["usage"]["completion_tokens"], 5, "{c}");
    assert_eq!(c["finish_reason"], "length");
    let cs = &seen["completion_stream"];
    assert_eq!(cs["usage"]["completion_tokens"], 5, "{cs}");
    assert_eq!(cs["usage"]["prompt_tokens"], c["usage"]["prompt_tokens"]);
    assert!(cs["chunks"].as_u64().unwrap() >= 2, "{cs}");
    let chat = &seen["chat"];
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["usage"]["completion_tokens"], 4, "{chat}");
    assert_eq!(seen["chat_stream"]["usage"]["completion_tokens"], 4);
    assert_eq!(seen["chat_stream"]["finish_reasons"], json!(["length"]));

    // Every turn of a conversation goes to the worker holding the conversation so far, and it
    // finds the earlier turns cached there: the gateway hashed the tokens the engine cached.
    let conversations = seen["conversations"].as_array().unwrap();
    assert_eq!(conversations.len(), 3);
    for (i, turns) in conversations.iter().enumerate() {
        let turns = turns.as_array().unwrap();
        let home = &turns[0]["worker"];
        for (t, turn) in turns.iter().enumerate() {
            assert_eq!(
                &turn["worker"], home,
                "conversation {i}, turn {t}: {turns:?}"
            );
            if t > 0 {
                let held = turn["overlap_blocks"].as_u64().unwrap();
                let before = turns[t - 1]["overlap_blocks"].as_u64().unwrap();
                assert!(
                    held > before,
                    "conversation {i}, turn {t}: the earlier turns are cached ({turns:?})"
                );
            }
        }
    }
    let session = seen["session_workers"].as_array().unwrap();
    assert!(
        session.windows(2).all(|w| w[0] == w[1]),
        "one worker across both gateways: {session:?}"
    );
    assert_eq!(
        seen["errors"]["unknown_model"],
        json!({"status": 404, "code": "model_not_found"})
    );
    assert_eq!(
        seen["errors"]["bad_key"],
        json!({"status": 401, "code": "invalid_api_key"})
    );
    let turns: f64 = [&a, &b]
        .iter()
        .map(|g| {
            g.metric("kvroute_gateway_requests_total{endpoint=\"chat\",model=\"m\",status=\"200\"}")
        })
        .sum();
    assert_eq!(turns, 14.0, "2 chats + 3 conversations x 4 turns");
    for g in [&a, &b] {
        assert_eq!(
            g.metric("kvroute_gateway_prompt_token_mismatches_total{model=\"m\"}"),
            0.0,
            "the engines tokenize as the gateway does"
        );
    }
}

/// Engines tokenizing with another tokenizer than the gateway's (here llama3's against
/// chatml's): the router hashes tokens the engines never cache, every overlap is 0, and only
/// the engines' `usage.prompt_tokens` shows it. The gateway counts each such answer, whole or
/// streamed with usage, and warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_tokenizes_otherwise_is_counted_as_a_mismatch() {
    let stack = GatewayStack::start(1, |c| {
        c.face.engine_tokenizer = Some(model_dir("llama3"));
    })
    .await
    .unwrap();
    let flag = format!("{STACK_MODEL}={}", model_dir("chatml").display());
    let gateway = stack.gateway("a", &["--model", &flag]).unwrap();
    let http = reqwest::Client::new();
    let messages =
        json!([{"role": "user", "content": "How many tokens is this prompt, by your count?"}]);
    let mismatches =
        || gateway.metric("kvroute_gateway_prompt_token_mismatches_total{model=\"m\"}");
    // The guard records at its drop, just after the body's end.
    let counted = |n: f64| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while mismatches() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {n}",
                mismatches()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let whole = http
        .post(gateway.url("/v1/chat/completions"))
        .json(&json!({"model": STACK_MODEL, "messages": messages, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(whole.status(), 200);
    let body: serde_json::Value = whole.json().await.unwrap();
    assert!(
        body["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
        "{body}"
    );
    counted(1.0).await;
    let streamed = http
        .post(gateway.url("/v1/chat/completions"))
        .json(&json!({
            "model": STACK_MODEL, "messages": messages, "max_tokens": 2, "stream": true,
            "stream_options": {"include_usage": true}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    let text = streamed.text().await.unwrap();
    assert!(text.contains("\"prompt_tokens\""), "{text}");
    counted(2.0).await;
    assert_eq!(mismatches(), 2.0);
    assert!(
        gateway.log().contains("tokenizes differently"),
        "warned once"
    );
}

#[test]
fn a_model_that_cannot_be_loaded_stops_startup_naming_it() {
    let env = TestEnv::start().unwrap();
    let bin = kvroute_bin("kvroute-gateway", "kvroute-gateway").unwrap();
    let empty = tempfile::tempdir().unwrap();
    for (value, names) in [
        (
            "m=/nonexistent/model".to_owned(),
            vec!["--model", "\"m\"", "/nonexistent/model"],
        ),
        (
            format!("broken={}", empty.path().display()),
            vec!["--model", "\"broken\"", "tokenizer.json"],
        ),
    ] {
        let mut args = env.server_args();
        args.extend([
            "--model".to_owned(),
            value.clone(),
            "--http-addr".into(),
            "127.0.0.1:0".into(),
        ]);
        let exited = run_to_exit(&bin, &args, &[], Duration::from_secs(20)).unwrap();
        assert_eq!(exited.code, 2, "bad configuration: {}", exited.stderr);
        let line = exited.last_line();
        for name in names {
            assert!(line.contains(name), "{value}: {line:?} names {name}");
        }
    }
}
