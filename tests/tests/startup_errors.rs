//! Startup errors of the real binaries: one line on stderr naming the cause, the flag or
//! variable and the address, and one table of exit statuses (0 ok, 1 runtime failure, 2 bad
//! usage or configuration, 4 NATS or etcd unreachable or NATS without JetStream).

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use kvroute_tests::{Exited, NatsServer, TestEnv, free_port, kvroute_bin, run_to_exit};

const LIMIT: Duration = Duration::from_secs(60);

/// Every binary, with the package it comes from.
const BINS: [(&str, &str); 11] = [
    ("kvroute-router", "kvroute-router"),
    ("kvroute-gateway", "kvroute-gateway"),
    ("kvroute-sim-custom", "kvroute-example-custom-policy"),
    ("kvroute-bridge", "kvroute-bridge"),
    ("kvroute-router-custom", "kvroute-example-custom-policy"),
    ("kvroute-indexer", "kvroute-indexer"),
    ("kvroute-mocker", "kvroute-mocker"),
    ("kvroute-replay", "kvroute-lab"),
    ("kvroute-sim", "kvroute-lab"),
    ("kvroute-tracegen", "kvroute-lab"),
    ("kvroute-probe", "kvroute-common"),
];

fn path(bin: &str) -> PathBuf {
    let package = BINS.iter().find(|(b, _)| *b == bin).map_or(bin, |(_, p)| p);
    kvroute_bin(package, bin).unwrap()
}

/// Runs `bin` to its end with logging off unless `env` sets `RUST_LOG`.
fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Exited {
    let mut vars = vec![("RUST_LOG", "off")];
    vars.extend_from_slice(env);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    run_to_exit(&path(bin), &args, &vars, LIMIT).unwrap()
}

/// The run printed exactly one line, `<bin>: error: ...`, and exited with `code`.
fn one_error_line(bin: &str, out: &Exited, code: i32) -> String {
    assert_eq!(out.code, code, "{bin}: {out:?}");
    let lines: Vec<&str> = out.stderr.trim_end().lines().collect();
    assert_eq!(lines.len(), 1, "{bin}: one line, no backtrace: {out:?}");
    let prefix = format!("{bin}: error: ");
    assert!(lines[0].starts_with(&prefix), "{bin}: {}", lines[0]);
    lines[0][prefix.len()..].to_owned()
}

/// A one-request Mooncake trace for the replay tool.
fn trace() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 4, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let path = path.display().to_string();
    (dir, path)
}

#[test]
fn every_binary_reports_bad_usage_in_one_line_with_status_2() {
    for (bin, _) in BINS {
        let out = run(bin, &["--no-such-flag"], &[]);
        let message = one_error_line(bin, &out, 2);
        assert!(message.contains("--no-such-flag"), "{bin}: {message}");
    }
    // A negative number for an unsigned flag is a range error naming the flag, not clap's
    // "unexpected argument '-5'".
    for (bin, flag) in [
        ("kvroute-router", "--max-in-flight"),
        ("kvroute-indexer", "--max-lag-ms"),
        ("kvroute-mocker", "--workers"),
        ("kvroute-bridge", "--load-interval-ms"),
        ("kvroute-replay", "--limit"),
        ("kvroute-sim", "--workers"),
        ("kvroute-sim-custom", "--workers"),
        ("kvroute-tracegen", "--sessions"),
        ("kvroute-gateway", "--upstream-idle-timeout-ms"),
    ] {
        let out = run(bin, &[flag, "-5"], &[]);
        assert_eq!(
            one_error_line(bin, &out, 2),
            format!("invalid configuration: {flag} -5: must not be negative")
        );
    }
    // A bad value from the environment names the variable.
    let out = run("kvroute-router", &[], &[("KVROUTE_MAX_IN_FLIGHT", "abc")]);
    assert_eq!(
        one_error_line("kvroute-router", &out, 2),
        "invalid configuration: KVROUTE_MAX_IN_FLIGHT=\"abc\" (for --max-in-flight): not a whole number"
    );
    let out = run("kvroute-indexer", &[], &[("KVROUTE_MAX_LAG_MS", "0")]);
    assert_eq!(
        one_error_line("kvroute-indexer", &out, 2),
        "invalid configuration: KVROUTE_MAX_LAG_MS (for --max-lag-ms): must be above 0"
    );
    let out = run("kvroute-probe", &[], &[]);
    assert!(one_error_line("kvroute-probe", &out, 2).starts_with("no URL given"));
    assert_eq!(run("kvroute-router", &["--help"], &[]).code, 0);
}

#[test]
fn every_binary_prints_its_own_name_and_version() {
    for (bin, _) in BINS {
        let out = run(bin, &["--version"], &[]);
        assert_eq!(out.code, 0, "{bin} --version: {out:?}");
        assert_eq!(
            out.stdout.trim_end(),
            format!("{bin} {}", env!("CARGO_PKG_VERSION")),
            "{bin} --version"
        );
    }
}

#[test]
fn booleans_take_1_and_0_and_empty_variables_mean_unset() {
    // Accepted: the process goes on to connect (and exits 4, NATS being unreachable).
    let nats = format!("nats://127.0.0.1:{}", free_port());
    let unreachable = ["--nats-url", &nats, "--nats-connect-timeout-ms", "200"];
    let out = run(
        "kvroute-indexer",
        &unreachable,
        &[("KVROUTE_PURGE_LOG", "0")],
    );
    assert_eq!(out.code, 4, "{out:?}");
    let out = run(
        "kvroute-mocker",
        &unreachable,
        &[("KVROUTE_MOCKER_RANDOM_WORKER_IDS", "1")],
    );
    assert_eq!(out.code, 4, "{out:?}");
    let out = run(
        "kvroute-router",
        &unreachable,
        &[
            ("KVROUTE_WORKER_SELECTION_POLICY", ""),
            ("KVROUTE_SEED", ""),
            ("KVROUTE_MAX_IN_FLIGHT", " "),
        ],
    );
    assert_eq!(out.code, 4, "empty variables are unset: {out:?}");
    // Refused, saying what is accepted.
    let out = run("kvroute-indexer", &[], &[("KVROUTE_PURGE_LOG", "maybe")]);
    assert_eq!(
        one_error_line("kvroute-indexer", &out, 2),
        "invalid configuration: KVROUTE_PURGE_LOG=\"maybe\" (for --purge-log): expected 1, 0, true or false"
    );
}

#[test]
fn policy_files_that_are_directories_or_empty_are_refused_by_router_and_sim() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.yaml");
    std::fs::write(&empty, "# nothing yet\n").unwrap();
    let unknown = dir.path().join("unknown.yaml");
    std::fs::write(
        &unknown,
        "worker_selection:\n  instances:\n    - {name: a, type: no-such-type}\n",
    )
    .unwrap();
    let (_trace_dir, trace) = trace();
    let dir_path = dir.path().display().to_string();
    for bin in ["kvroute-router", "kvroute-sim"] {
        let with = |file: &str| {
            let mut args = vec!["--policy-config", file];
            if bin == "kvroute-sim" {
                args.extend(["--trace", trace.as_str()]);
            }
            run(bin, &args, &[])
        };
        let message = one_error_line(bin, &with(&dir_path), 2);
        assert!(
            message.ends_with(&format!("{dir_path} is a directory, not a file")),
            "{bin}: {message}"
        );
        let message = one_error_line(bin, &with(empty.to_str().unwrap()), 2);
        assert!(
            message.contains("empty; expected a `worker_selection` mapping"),
            "{bin}: {message}"
        );
        // The same policy error is a bad configuration (2) in both.
        let message = one_error_line(bin, &with(unknown.to_str().unwrap()), 2);
        assert!(message.contains("no-such-type"), "{bin}: {message}");
    }
}

#[test]
fn unreachable_nats_is_retried_until_the_deadline_then_exits_4_naming_flag_and_url() {
    let port = free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let (_trace_dir, trace) = trace();
    for bin in [
        "kvroute-router",
        "kvroute-indexer",
        "kvroute-mocker",
        "kvroute-bridge",
        "kvroute-replay",
    ] {
        let mut args = vec!["--nats-url", &url, "--nats-connect-timeout-ms", "1000"];
        if bin == "kvroute-replay" {
            args.extend(["--trace", trace.as_str()]);
        } else if bin == "kvroute-bridge" {
            args.extend([
                "--engine",
                "vllm",
                "--engine-url",
                "http://127.0.0.1:9",
                "--zmq-endpoint",
                "tcp://127.0.0.1:9",
                "--http-addr",
                "127.0.0.1:0",
            ]);
        } else {
            args.extend(["--http-addr", "127.0.0.1:0"]);
        }
        let out = run(bin, &args, &[("RUST_LOG", "warn")]);
        assert_eq!(out.code, 4, "{bin}: {out:?}");
        assert!(
            out.elapsed >= Duration::from_millis(1000),
            "{bin} retried for the whole deadline: {out:?}"
        );
        let last = out.last_line();
        assert!(
            last.starts_with(&format!("{bin}: error: NATS at {url} unreachable")),
            "{bin}: {last}"
        );
        assert!(
            last.contains("(--nats-connect-timeout-ms)"),
            "{bin}: {last}"
        );
        let retries = out
            .stderr
            .lines()
            .filter(|l| l.contains("NATS unreachable; retrying") && l.contains(&url))
            .count();
        assert!(retries >= 2, "{bin}: each failure is logged: {out:?}");
        // Logs through a pipe carry no colour codes.
        assert!(!out.stderr.contains("\x1b["), "{bin}: {:?}", out.stderr);
    }
}

#[test]
fn unreachable_etcd_is_retried_until_the_deadline_then_exits_4_naming_flag_and_url() {
    let nats = NatsServer::start().unwrap();
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    for bin in ["kvroute-router", "kvroute-indexer", "kvroute-mocker"] {
        let args = [
            "--nats-url",
            &nats.url(),
            "--etcd-endpoints",
            &endpoint,
            "--etcd-connect-timeout-ms",
            "1000",
            "--http-addr",
            "127.0.0.1:0",
        ];
        let out = run(bin, &args, &[("RUST_LOG", "warn")]);
        assert_eq!(out.code, 4, "{bin}: {out:?}");
        assert!(out.elapsed >= Duration::from_millis(1000), "{bin}: {out:?}");
        assert!(out.elapsed < Duration::from_secs(15), "{bin}: {out:?}");
        let last = out.last_line();
        assert!(
            last.starts_with(&format!("{bin}: error: etcd at {endpoint} unreachable")),
            "{bin}: {last}"
        );
        assert!(
            last.contains("(--etcd-connect-timeout-ms)"),
            "{bin}: {last}"
        );
        assert!(
            out.stderr
                .lines()
                .filter(|l| l.contains("etcd unreachable; retrying") && l.contains(&endpoint))
                .count()
                >= 2,
            "{bin}: {out:?}"
        );
    }
}

#[test]
fn nats_without_jetstream_is_named_with_the_fix() {
    let nats = NatsServer::start_without_jetstream().unwrap();
    let etcd = format!("http://127.0.0.1:{}", free_port());
    for bin in ["kvroute-router", "kvroute-indexer", "kvroute-mocker"] {
        let args = [
            "--nats-url",
            &nats.url(),
            "--etcd-endpoints",
            &etcd,
            "--http-addr",
            "127.0.0.1:0",
        ];
        let out = run(bin, &args, &[]);
        assert_eq!(
            one_error_line(bin, &out, 4),
            format!(
                "NATS at {} has JetStream disabled: start nats-server with -js (or `jetstream {{}}` in its config)",
                nats.url()
            )
        );
    }
}

#[test]
fn refused_stream_and_bucket_replicas_name_their_flag_and_keep_the_cause() {
    let env = TestEnv::start().unwrap();
    let mut servers = env.server_args();
    servers.extend(["--http-addr".to_owned(), "127.0.0.1:0".to_owned()]);
    let with = |extra: &[&'static str]| {
        let mut args: Vec<&str> = servers.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        args
    };
    let out = run("kvroute-indexer", &with(&["--stream-replicas", "3"]), &[]);
    let message = one_error_line("kvroute-indexer", &out, 2);
    assert!(
        message.starts_with("--stream-replicas 3"),
        "names the flag: {message}"
    );
    assert!(
        message.contains(&format!(
            "NATS refused to create stream KVROUTE_{}_EVENTS",
            env.namespace
        )),
        "{message}"
    );
    assert!(
        message.contains("replicas > 1 not supported"),
        "keeps the server's cause: {message}"
    );
    let out = run(
        "kvroute-router",
        &with(&["--session-bucket-replicas", "3"]),
        &[],
    );
    let message = one_error_line("kvroute-router", &out, 2);
    assert!(
        message.starts_with(&format!(
            "--session-bucket-replicas 3: NATS refused to create bucket KVROUTE_{}_SESSIONS",
            env.namespace
        )),
        "{message}"
    );
    assert!(message.contains("replicas > 1 not supported"), "{message}");
    // Both are range-checked before connecting.
    for (bin, flag) in [
        ("kvroute-router", "--session-bucket-replicas"),
        ("kvroute-indexer", "--stream-replicas"),
    ] {
        let out = run(bin, &with(&[flag, "9"]), &[]);
        let message = one_error_line(bin, &out, 2);
        assert!(
            message.contains(&format!("{flag}: must be between 1 and 5")),
            "{bin}: {message}"
        );
    }
}

#[test]
fn an_http_address_in_use_names_the_flag_and_the_address() {
    let env = TestEnv::start().unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for bin in ["kvroute-router", "kvroute-indexer", "kvroute-mocker"] {
        let args = [
            "--namespace",
            env.namespace.as_str(),
            "--nats-url",
            &env.nats.url(),
            "--etcd-endpoints",
            &env.etcd.endpoint(),
            "--http-addr",
            &addr,
        ];
        let out = run(bin, &args, &[]);
        let message = one_error_line(bin, &out, 2);
        assert!(
            message.ends_with(&format!(
                "--http-addr {addr}: address already in use (another process listens there)"
            )),
            "{bin}: {message}"
        );
    }
}
