#![no_main]
//! The gateway's reading of OpenAI /v1/completions and /v1/chat/completions bodies (the first byte picks the API and whether kvroute's session headers are set from the input): a 400 ApiError or a parsed request true to the body.

use axum::http::{HeaderMap, HeaderValue};
use kvroute_gateway::openai::{Api, POLICY, Parsed, SESSION_FINAL, SESSION_ID};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let api = if mode & 1 == 0 {
        Api::Completions
    } else {
        Api::Chat
    };
    let mut headers = HeaderMap::new();
    if mode & 2 != 0 {
        let take = body.len().min(usize::from(mode >> 3));
        if let Ok(v) = HeaderValue::from_bytes(&body[..take]) {
            headers.insert(SESSION_ID, v.clone());
            headers.insert(POLICY, v);
        }
        if mode & 4 != 0 {
            headers.insert(SESSION_FINAL, HeaderValue::from_static("true"));
        }
    }
    match Parsed::from_body(api, body, &headers) {
        Ok(parsed) => {
            assert!(!parsed.model.is_empty());
            assert_eq!(parsed.api, api);
            assert!(!parsed.body.contains_key("kvroute"));
            // What the gateway forwards is itself a request it reads the same way.
            let forwarded = serde_json::to_vec(&parsed.body).expect("a JSON map serializes");
            let again = Parsed::from_body(api, &forwarded, &HeaderMap::new())
                .unwrap_or_else(|e| panic!("the forwarded body is refused: {e:?}"));
            assert!(!again.edited);
            assert_eq!(again.model, parsed.model);
            assert_eq!(again.prompts, parsed.prompts);
            assert_eq!(again.messages, parsed.messages);
            assert_eq!(again.stream, parsed.stream);
            assert_eq!(again.include_usage, parsed.include_usage);
            assert_eq!(again.max_tokens, parsed.max_tokens);
        }
        Err(e) => assert!(e.status.is_client_error(), "{e:?}"),
    }
});
