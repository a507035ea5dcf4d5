//! The Python client in examples/python speaks the same protocol: its hashes equal ours, the
//! Rust decoder accepts its selection request, PROTOCOL.md shows its code and command line as
//! they are, and against real routers it retries, fails in one line (no router, an error
//! reply) and keeps a session on one worker.

use std::process::{Command, Output};

use kvroute_common::codec::decode;
use kvroute_common::hashing::{BlockHashes, seed_for_lora};
use kvroute_common::messages::BindingState;
use kvroute_common::messages::{SelectRequest, SessionTrigger};
use kvroute_router::service::metrics as rm;
use kvroute_tests::labelled;
use kvroute_tests::workspace_root;

fn script() -> std::path::PathBuf {
    workspace_root().join("examples/python/kvroute_client.py")
}

/// Runs the client (blocking): its exit status and output.
fn run_python(args: &[String]) -> Output {
    Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3 runs (scripts/install-deps installs its packages)")
}

fn python(args: &[&str]) -> String {
    let out = run_python(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs the client off the async runtime against `env` (NATS URL and namespace given).
async fn python_against(env: &kvroute_tests::TestEnv, args: &[&str]) -> Output {
    let mut all = vec![
        "--nats-url".to_owned(),
        env.nats.url(),
        "--namespace".to_owned(),
        env.namespace.to_string(),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    tokio::task::spawn_blocking(move || run_python(&all))
        .await
        .unwrap()
}

fn stderr_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// PROTOCOL.md's Python block is the script's `select_once`, character for character; its
/// command line is the script's own usage line; the default model is the mocker's.
#[test]
fn protocol_md_shows_the_scripts_code_and_command() {
    let protocol = std::fs::read_to_string(workspace_root().join("PROTOCOL.md")).unwrap();
    let code = std::fs::read_to_string(script()).unwrap();
    let section = &protocol[protocol
        .find("## A client in another language")
        .expect("PROTOCOL.md has the section")..];
    let start = section.find("```python\n").expect("a python block") + "```python\n".len();
    let block = &section[start..start + section[start..].find("\n```").unwrap()];
    assert!(block.starts_with("async def select_once("), "{block}");
    assert!(
        code.contains(&format!("\n{block}\n")),
        "PROTOCOL.md's block is not the script's code:\n{block}"
    );
    assert!(block.contains("\"session\""), "the snippet sends a session");
    let usage = code
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("python3 examples/python/kvroute_client.py --nats-url"))
        .expect("the script's usage line");
    assert!(usage.contains("--namespace") && usage.contains("--session-id"));
    assert!(
        section.contains(&format!("\n{usage}\n")),
        "PROTOCOL.md's command is not the script's: {usage}"
    );
    let model = kvroute_mocker::fleet::FleetConfig::default().model;
    assert!(
        code.contains(&format!("p.add_argument(\"--model\", default=\"{model}\"")),
        "the script's default model is not the mocker's {model:?}"
    );
    assert!(usage.contains(&format!("--model {model}")), "{usage}");
}

/// Nobody listening: exit status 1 and one line on stderr, no traceback (with and without
/// retries, and without a NATS server at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_router_the_client_fails_in_one_line() {
    let env = kvroute_tests::TestEnv::start().unwrap();
    for extra in [&[][..], &["--once"][..], &["--json"][..]] {
        let out = python_against(&env, extra).await;
        let lines = stderr_lines(&out);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {lines:?}");
        assert_eq!(lines.len(), 1, "{extra:?}: {lines:?}");
        assert!(!lines[0].contains("Traceback"), "{lines:?}");
        assert!(
            lines[0].contains("no router answered") || lines[0].contains("failed: no_answer 1"),
            "{lines:?}"
        );
    }
    let port = kvroute_tests::free_port();
    let out = tokio::task::spawn_blocking(move || {
        run_python(&["--nats-url".into(), format!("nats://127.0.0.1:{port}")])
    })
    .await
    .unwrap();
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(1), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("cannot connect to NATS"), "{lines:?}");
    // Without --nats-url the client reads KVROUTE_NATS_URL, as kvroute's processes do.
    let url = format!("nats://127.0.0.1:{}", kvroute_tests::free_port());
    let env_url = url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script())
            .env("KVROUTE_NATS_URL", env_url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(1), "{lines:?}");
    assert!(
        lines[0].contains(&format!("cannot connect to NATS at {url}")),
        "{lines:?}"
    );
}

/// An error reply fails the client (status 1, the code and message on stderr); a session is
/// sent, bound on its first selection and kept on the next ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_replies_fail_and_a_session_is_sent_and_bound() {
    use kvroute_common::Names;
    use kvroute_tests::{PromptWorker, RouterProcess, worker_card};

    let env = kvroute_tests::TestEnv::start().unwrap();
    let names = Names::new(&env.namespace);
    let _w1 = PromptWorker::start(&env, worker_card(&names, 1, "m"), 10)
        .await
        .unwrap();
    let _w2 = PromptWorker::start(&env, worker_card(&names, 2, "m"), 10)
        .await
        .unwrap();
    let router = RouterProcess::start(&env, "r1", &[]).unwrap();

    let out = python_against(&env, &["--model", "nope"]).await;
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(1), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("kvroute_client: error no_workers: "),
        "{lines:?}"
    );

    let args = ["--model", "m", "--session-id", "chat-42", "--count", "3"];
    let out = python_against(&env, &[&args[..], &["--json"]].concat()).await;
    assert!(out.status.success(), "{:?}", stderr_lines(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["ok"], 3, "{summary}");
    assert_eq!(
        summary["bindings"],
        serde_json::json!(["new", "kept", "kept"]),
        "{summary}"
    );
    let workers = summary["workers"].as_array().unwrap();
    assert!(workers.iter().all(|w| w == &workers[0]), "{summary}");
    assert_eq!(
        router.metric(&labelled(rm::labels::SESSIONS, BindingState::Kept.as_str())),
        2.0
    );
    // The session's last selection releases the binding.
    let last = ["--model", "m", "--session-id", "chat-42", "--session-final"];
    let out = python_against(&env, &[&last[..], &["--json"]].concat()).await;
    assert!(out.status.success(), "{:?}", stderr_lines(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        summary["bindings"],
        serde_json::json!(["released"]),
        "{summary}"
    );
    assert_eq!(summary["workers"][0], workers[0], "{summary}");
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
        Command::new("python3")
            .arg(script())
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
