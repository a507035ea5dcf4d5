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
