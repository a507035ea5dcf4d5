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

/// The Python client retries as PROTOCOL.md says: with one of two routers stopped, its
/// selections still succeed (a retry reaches the router that answered last).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_selections_get_past_a_stopped_router() {
    use kvroute_common::Names;
    use kvroute_tests::{PromptWorker, RouterProcess, TestEnv, worker_card};

    let env = TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _worker = PromptWorker::start(&env, worker_card(&names, 1, "m"), 10)
        .await
        .unwrap();
    let _r1 = RouterProcess::start(&env, "r1", &[]).unwrap();
    let r2 = RouterProcess::start(&env, "r2", &[]).unwrap();
    r2.signal(nix::sys::signal::Signal::SIGSTOP).unwrap();
    let (url, ns) = (env.nats.url(), env.namespace.to_string());
    let out = tokio::task::spawn_blocking(move || {
        let script = workspace_root().join("examples/python/kvroute_client.py");
        Command::new("python3")
            .arg(script)
            .args(["--nats-url", &url, "--namespace", &ns, "--model", "m"])
            .args(["--count", "20", "--json"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    r2.signal(nix::sys::signal::Signal::SIGCONT).unwrap();
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    eprintln!("python client with a stopped router: {summary}");
    let attempts: Vec<u64> = serde_json::from_value(summary["attempts"].clone()).unwrap();
    // Until a router has answered this process, a selection can only guess (each of its 4
    // attempts finds the stopped router with probability 1/2, so it fails with 1/16); after
    // that a retry goes to the router that answered. Without retries about 10 would fail.
    assert!(summary["ok"].as_u64().unwrap() >= 18, "{summary}");
    assert!(
        attempts.iter().any(|a| *a > 1),
        "no selection met the stopped router: {summary}"
    );
}
