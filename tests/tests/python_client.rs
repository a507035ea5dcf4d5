//! The Python client in examples/python speaks the same protocol: its hashes equal ours and the
//! Rust decoder accepts its selection request.

use std::process::Command;

use kvroute_common::codec::decode;
use kvroute_common::hashing::{BlockHashes, seed_for_lora};
use kvroute_common::messages::{SelectRequest, SessionTrigger};
use kvroute_tests::workspace_root;

fn python(args: &[&str]) -> String {
    let script = workspace_root().join("examples/python/kvroute_client.py");
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs (scripts/install-deps installs its packages)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn python_hashes_equal_rust_hashes() {
    let vectors: serde_json::Value = serde_json::from_str(&python(&["--vectors"])).unwrap();
    let vectors = vectors.as_array().unwrap();
    assert_eq!(vectors.len(), 3);
    for v in vectors {
        let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
        let block_size = v["block_size"].as_u64().unwrap() as usize;
        let lora = v["lora_name"].as_str();
        let ours = BlockHashes::of_tokens(&tokens, block_size, lora);
        let theirs_local: Vec<u64> = serde_json::from_value(v["local"].clone()).unwrap();
        let theirs_seq: Vec<u64> = serde_json::from_value(v["sequence"].clone()).unwrap();
        assert_eq!(v["seed"].as_u64().unwrap(), seed_for_lora(lora));
        assert_eq!(ours.local, theirs_local);
        assert_eq!(ours.sequence, theirs_seq);
    }
}

#[test]
fn rust_decodes_the_python_select_request() {
    let hex = python(&["--encode-only", "--model", "llama"]);
    let bytes: Vec<u8> = (0..hex.trim().len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex.trim()[i..i + 2], 16).unwrap())
        .collect();
    let req: SelectRequest = decode(&bytes).unwrap();
    assert_eq!(req.model, "llama");
    assert_eq!(req.token_ids.as_ref().map(Vec::len), Some(256));
    assert!(req.request_id.is_some());
    let session = req.session.unwrap();
    assert_eq!(session.id, "s-1");
    assert_eq!(session.trigger, SessionTrigger::UserMessage);
}
