//! Parity with the engines' own rendering: every case of `parity/cases.rs` is rendered by
//! tests/models/parity.py (vLLM's message preprocessing and the real transformers, pinned in
//! tests/models/requirements.txt, installed by scripts/install-deps) and by kvroute-text; the
//! text, the error (`raise_exception`'s message exactly), the token ids, the detected content
//! format, completion encodings and decodings must all be identical.

mod parity {
    pub mod cases;
}

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kvroute_text::{ChatInput, ChatTemplate, Limits, ModelText, TextError};
use serde_json::{Value, json};

use parity::cases;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn models() -> PathBuf {
    root().join("tests/models")
}

fn python(args: &[&Path]) -> std::process::Output {
    let out = Command::new("python3")
        .args(args)
        .output()
        .expect("python3 runs (scripts/install-deps installs transformers)");
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// transformers' results for `cases` on `model`.
fn reference(model: &str, cases: &[Value]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cases.json");
    std::fs::write(&path, serde_json::to_vec(cases).unwrap()).unwrap();
    let script = models().join("parity.py");
    let out = python(&[&script, &models().join(model), &path]);
    serde_json::from_slice(&out.stdout).expect("parity.py prints a JSON list")
}

/// kvroute-text's result for one case, in parity.py's shape.
fn ours(model: &ModelText, case: &Value) -> Value {
    let mut out = json!({"name": case["name"]});
    if let Some(messages) = case.get("messages").and_then(Value::as_array) {
        let template = case["template"].as_str().map(|t| {
            ChatTemplate::compile(t, Limits::default()).expect("the case's template compiles")
        });
        let chat = ChatInput {
            messages,
            tools: case.get("tools"),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap_or(true),
            continue_final_message: case["continue_final_message"].as_bool().unwrap_or(false),
            template_kwargs: case.get("kwargs").and_then(Value::as_object),
        };
        let selected = template.as_ref().or(model.chat_template());
        out["content_format"] = json!(match selected.map(ChatTemplate::content_format) {
            Some(kvroute_text::ContentFormat::OpenAi) => "openai",
            _ => "string",
        });
        let rendered = match &template {
            Some(t) => model.render_chat_with(t, &chat),
            None => model.render_chat(&chat),
        };
        match rendered {
            Ok(text) => {
                out["ids"] = json!(model.encode(&text, false).unwrap());
                out["text"] = json!(text);
                if template.is_none() {
                    assert_eq!(
                        model.chat_tokens(&chat).unwrap(),
                        serde_json::from_value::<Vec<u32>>(out["ids"].clone()).unwrap()
                    );
                }
            }
            Err(TextError::Template(msg)) => {
                out["error"] = json!(msg);
                out["error_kind"] = json!("template");
            }
            Err(e) => {
                out["error"] = json!(e.to_string());
                out["error_kind"] = json!("other");
            }
        }
    }
    if let Some(text) = case["completion"].as_str() {
        out["completion_ids"] = json!(model.encode(text, true).unwrap());
    }
    if let Some(ids) = case.get("decode") {
        let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
        out["decoded"] = json!(model.decode(&ids).unwrap());
    }
    out
}

/// The differences between transformers' result and ours, described.
fn compare(theirs: &Value, ours: &Value) -> Vec<String> {
    let mut diffs = Vec::new();
    for key in ["content_format", "text", "ids", "completion_ids", "decoded"] {
        if theirs.get(key) != ours.get(key) {
            diffs.push(format!(
                "{key}:\n    transformers: {}\n    kvroute:      {}",
                theirs[key], ours[key]
            ));
        }
    }
    if theirs.get("ids") != theirs.get("ids_via_text") {
        diffs.push(
            "transformers' apply_chat_template(tokenize=True) differs from encode(text)".into(),
        );
    }
    match (theirs.get("error"), ours.get("error")) {
        (None, None) => {}
        // raise_exception: the message must be the template's own, exactly.
        (Some(msg), Some(our)) if theirs["error_kind"] == "raise" => {
            if ours["error_kind"] != "template" || msg != our {
                diffs.push(format!(
                    "raise_exception: transformers {msg}, kvroute {our} ({})",
                    ours["error_kind"]
                ));
            }
        }
        (Some(_), Some(_)) => {} // both refuse; the wording differs
        (a, b) => diffs.push(format!("error: transformers {a:?}, kvroute {b:?}")),
    }
    diffs
}

#[test]
fn renders_and_tokenizes_as_transformers() {
    let mut failures = Vec::new();
    let (mut compared, mut refused) = (0, Vec::new());
    for (model_name, specific) in [
        ("chatml", cases::chatml()),
        ("llama3", cases::llama3()),
        ("parts", cases::parts()),
    ] {
        let mut all = cases::common();
        all.extend(specific);
        if model_name == "chatml" {
            all.extend(cases::templates());
        }
        let model = ModelText::load(model_name, &models().join(model_name)).unwrap();
        let theirs = reference(model_name, &all);
        assert_eq!(theirs.len(), all.len());
        for (case, theirs) in all.iter().zip(&theirs) {
            let ours = ours(&model, case);
            compared += 1;
            if theirs.get("error").is_some() {
                refused.push(format!("{model_name} / {}", case["name"]));
            }
            for diff in compare(theirs, &ours) {
                failures.push(format!("{model_name} / {}: {diff}", case["name"]));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!(
        "{compared} cases identical to transformers; refused by both: {}",
        refused.join(", ")
    );
}

/// The cases exercise what they claim: some raise, some continue, every model renders tools.
#[test]
fn the_cases_cover_errors_and_raises() {
    let theirs = reference("llama3", &cases::llama3());
    let raised: Vec<&str> = theirs
        .iter()
        .filter(|r| r["error_kind"] == "raise")
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(raised.len(), 3, "{raised:?}");
    let model = ModelText::load("llama3", &models().join("llama3")).unwrap();
    let messages = [
        json!({"role": "user", "content": "Hi"}),
        json!({"role": "narrator", "content": "x"}),
    ];
    assert_eq!(
        model.render_chat(&ChatInput::new(&messages)),
        Err(TextError::Template("Unknown message role: narrator".into()))
    );
}

#[test]
fn make_models_regenerates_the_committed_models_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    python(&[&models().join("make_models.py"), dir.path()]);
    let mut compared = 0;
    for model in ["chatml", "llama3", "parts"] {
        for entry in std::fs::read_dir(dir.path().join(model)).unwrap() {
            let fresh = entry.unwrap().path();
            let committed = models().join(model).join(fresh.file_name().unwrap());
            assert!(
                std::fs::read(&fresh).unwrap() == std::fs::read(&committed).unwrap(),
                "{} differs from what make_models.py writes: run python3 tests/models/make_models.py",
                committed.display()
            );
            compared += 1;
        }
    }
    assert_eq!(compared, 7);
}

/// Not a benchmark: how long one 8k-token prompt takes to tokenize here, for the record.
#[test]
fn tokenizing_an_8k_token_prompt() {
    let model = ModelText::load("chatml", &models().join("chatml")).unwrap();
    let turn = "The router picks the worker that already holds the longest prefix of the prompt's \
                KV-cache blocks, unless it is too busy; 42 blocks, 日本語, 🚀. ";
    let mut text = String::new();
    while model.encode(&text, false).unwrap().len() < 8192 {
        text.push_str(&turn.repeat(16));
    }
    let messages = [json!({"role": "user", "content": text})];
    let start = Instant::now();
    let rounds = 5;
    let mut n = 0;
    for _ in 0..rounds {
        n = model.chat_tokens(&ChatInput::new(&messages)).unwrap().len();
    }
    let per = start.elapsed() / rounds;
    println!(
        "chat_tokens of a {n}-token prompt ({} bytes): {per:?} per call (render + encode, {} build)",
        text.len(),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
}
