//! Loading model folders: the committed test models, load_dir, and folders that cannot load.

use std::path::{Path, PathBuf};

use kvroute_text::{ChatInput, ContentFormat, ModelText, TextError, load_dir};
use serde_json::json;

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models")
}

#[test]
fn model_text_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<ModelText>();
}

#[test]
fn loads_every_committed_model_with_its_special_tokens() {
    let loaded = load_dir(&models()).unwrap();
    let names: Vec<&str> = loaded.iter().map(ModelText::name).collect();
    assert_eq!(names, ["chatml", "llama3", "parts"]);
    let [chatml, llama3, parts] = &loaded[..] else {
        unreachable!()
    };
    assert_eq!(
        (chatml.bos_token(), chatml.eos_token()),
        (None, Some("<|im_end|>"))
    );
    assert_eq!(
        (llama3.bos_token(), llama3.eos_token()),
        (Some("<|begin_of_text|>"), Some("<|eot_id|>"))
    );
    assert_eq!(
        (parts.bos_token(), parts.eos_token()),
        (Some("<bos>"), Some("<eos>"))
    );
    assert!(
        parts
            .special_tokens()
            .any(|t| t == ("boi_token", "<start_of_image>"))
    );
    assert_eq!(
        parts.chat_template().unwrap().content_format(),
        ContentFormat::OpenAi
    );
    // The post-processor adds a BOS to completions, never to chat prompts.
    let hi = llama3.encode("hi", false).unwrap();
    assert_eq!(llama3.encode("hi", true).unwrap()[1..], hi[..]);
    assert_eq!(
        llama3
            .decode(&llama3.encode("<|eot_id|>hi <think>", true).unwrap())
            .unwrap(),
        "hi <think>"
    );
}

fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        models().join("chatml/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

#[test]
fn a_model_without_a_chat_template_loads_and_refuses_chats() {
    let dir = folder(&[(
        "tokenizer_config.json",
        r#"{"eos_token": {"content": "<|endoftext|>"}}"#,
    )]);
    let model = ModelText::load("plain", dir.path()).unwrap();
    assert_eq!(model.eos_token(), Some("<|endoftext|>"));
    let messages = [json!({"role": "user", "content": "hi"})];
    assert_eq!(
        model.render_chat(&ChatInput::new(&messages)),
        Err(TextError::NoChatTemplate)
    );
    assert_eq!(
        model.chat_tokens(&ChatInput::new(&messages)),
        Err(TextError::NoChatTemplate)
    );
    assert!(!model.encode("hi", true).unwrap().is_empty());
}

#[test]
fn a_template_file_replaces_the_configs_and_new_special_tokens_are_added() {
    let dir = folder(&[
        (
            "tokenizer_config.json",
            r#"{"chat_template": "config", "image_token": "<new-image>", "extra_special_tokens": ["<x1>"]}"#,
        ),
        (
            "chat_template.jinja",
            "{{ image_token }}{{ messages[0].content }}",
        ),
    ]);
    let model = ModelText::load("m", dir.path()).unwrap();
    let messages = [json!({"role": "user", "content": "hi"})];
    assert_eq!(
        model.render_chat(&ChatInput::new(&messages)).unwrap(),
        "<new-image>hi"
    );
    // transformers adds the special tokens tokenizer.json lacks: each is one token.
    assert_eq!(model.encode("<new-image><x1>", false).unwrap().len(), 2);
    assert_eq!(
        model
            .decode(&model.encode("a<x1>b", false).unwrap())
            .unwrap(),
        "ab"
    );
}

#[test]
fn load_errors_name_the_model_the_file_and_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelText::load("m", dir.path()).unwrap_err();
    let path = dir.path().join("tokenizer.json");
    assert_eq!(
        err.to_string(),
        format!(
            "model \"m\": {}: cannot be read: No such file or directory",
            path.display()
        )
    );

    std::fs::write(&path, "{}").unwrap();
    let err = ModelText::load("m", dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json: is not a tokenizer"), "{err}");

    for (config, why) in [
        ("[", "tokenizer_config.json: is not valid JSON"),
        (
            r#"{"bos_token": 3}"#,
            "tokenizer_config.json: field bos_token: must be a string, null or an AddedToken object",
        ),
        (
            r#"{"chat_template": 3}"#,
            "field chat_template: must be a string or a list of named templates",
        ),
        (
            r#"{"chat_template": "{% for %}"}"#,
            "chat template \"default\" does not compile: chat template error: syntax error",
        ),
    ] {
        let dir = folder(&[("tokenizer_config.json", config)]);
        let err = ModelText::load("m", dir.path()).unwrap_err().to_string();
        assert!(
            err.starts_with("model \"m\": ") && err.contains(why),
            "{err}"
        );
    }
    let err = load_dir(Path::new("/nonexistent-models"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "/nonexistent-models: cannot be read: No such file or directory"
    );
}

/// The segment cache ([`ModelText::encode`] piece by piece between added tokens) gives the ids
/// the whole text gives — which `parity.rs` ties to transformers — on a conversation growing
/// turn by turn (later turns find their earlier messages cached), for every committed model
/// whose tokenizer allows it; and it does find them cached.
#[test]
fn conversations_encode_piece_by_piece_as_the_whole_text() {
    let words = [
        "router",
        "prefix",
        "KV-cache",
        "blocks",
        "日本語",
        "🚀",
        "  spaced",
        "\n",
        "\t",
        "x",
        "Hello,",
        "world.",
        "<|im_start",
        "|>",
        "<s>",
        "é",
        "42",
        "'s",
        "don't",
        " ",
    ];
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as usize
    };
    let mut cached = 0;
    for model in load_dir(&models()).unwrap() {
        let Ok(before) = model.segment_cache() else {
            println!(
                "{}: no segment cache ({:?})",
                model.name(),
                model.segment_cache()
            );
            continue;
        };
        cached += 1;
        let mut messages = Vec::new();
        for turn in 0..12 {
            let len = 20 + next(300);
            let content: Vec<&str> = (0..len).map(|_| words[next(words.len())]).collect();
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": content.join(" ")}));
            let Ok(text) = model.render_chat(&ChatInput::new(&messages)) else {
                continue;
            };
            for add_special_tokens in [false, true] {
                assert_eq!(
                    model.encode(&text, add_special_tokens).unwrap(),
                    model.encode_whole(&text, add_special_tokens).unwrap(),
                    "{} turn {turn}: {text:?}",
                    model.name()
                );
            }
            // The same text again: every long piece from the cache.
            assert_eq!(
                model.encode(&text, false).unwrap(),
                model.encode_whole(&text, false).unwrap()
            );
        }
        let after = model.segment_cache().unwrap();
        assert!(!after.disabled, "{}: a check disagreed", model.name());
        assert!(
            after.hits > before.hits + 10 && after.misses > 0 && after.bytes > 0,
            "{}: {after:?}",
            model.name()
        );
        // With the cache off, the same ids.
        let off = ModelText::load(model.name(), &models().join(model.name()))
            .unwrap()
            .with_segment_cache(0);
        assert!(off.segment_cache().is_err());
        let text = model.render_chat(&ChatInput::new(&messages)).unwrap();
        assert_eq!(
            off.encode(&text, false).unwrap(),
            model.encode(&text, false).unwrap()
        );
    }
    assert!(cached >= 1, "no committed model has a segment cache");
}

/// Tokenizers whose rules look across a piece's edge get no segment cache: an added token
/// that strips the spaces beside it (refused by its flags), and a pre-tokenizer that adds its
/// prefix only at the text's start (refused by the load-time probes); both still encode as
/// the whole text does.
#[test]
fn tokenizers_that_look_across_pieces_get_no_segment_cache() {
    let chatml: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(models().join("chatml/tokenizer.json")).unwrap(),
    )
    .unwrap();
    let mut lstrip = chatml.clone();
    lstrip["added_tokens"][1]["lstrip"] = json!(true);
    let mut first_only = chatml.clone();
    // Metaspace's "▁" prefix at the text's start only, then the byte-level vocabulary's bytes.
    first_only["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
    ]});
    for (name, tokenizer, why) in [
        ("lstrip", lstrip, "lstrip"),
        ("first-only", first_only, "probe"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let model = ModelText::load(name, dir.path()).unwrap();
        let reason = model.segment_cache().unwrap_err();
        assert!(reason.contains(why), "{name}: {reason}");
        println!("{name}: no segment cache: {reason}");
        let text = format!(
            "{}<|im_start|>user\n{} x<|im_end|>",
            "a b ".repeat(100),
            "c d ".repeat(100)
        );
        assert_eq!(
            model.encode(&text, false).unwrap(),
            model.encode_whole(&text, false).unwrap()
        );
    }
}
