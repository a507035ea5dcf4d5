//! kvroute's own binaries for tests: built once per test process (a no-op when up to date)
//! and run under the harness supervisor, so they can be killed (-9) and restarted.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::{TestEnv, workspace_root};

/// Path of workspace binary `name` (from package `package`), building it if needed.
///
/// `scripts/test` builds every binary before the suite and names their directory in
/// `KVROUTE_TEST_BIN_DIR`, so tests do not each run cargo (whose feature selection differs from the test build's and
/// would relink the binaries over and over).
pub fn kvroute_bin(package: &str, name: &str) -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let target = BUILT
        .get_or_init(|| {
            // scripts/test's build (its profile and target directory), already made.
            if let Some(dir) = std::env::var_os("KVROUTE_TEST_BIN_DIR") {
                return Ok(PathBuf::from(dir));
            }
            let dir = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| workspace_root().join("target"));
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let out = Command::new(cargo)
                .current_dir(workspace_root())
                // Exactly what scripts/test runs first, so this is a no-op there (other
                // package selections would unify features differently and rebuild).
                .args(["build", "--quiet", "--workspace", "--bins"])
                .output()
                .map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr).into_owned());
            }
            Ok(dir.join("debug"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("building kvroute binaries: {e}"))?;
    let path = target.join(name);
    if !path.is_file() {
        bail!("{} not built (package {package})", path.display());
    }
    Ok(path)
}

/// Path of binary `name` next to the running executable, for release bench tools that start
/// the release builds of kvroute's binaries (built beforehand; never built here).
pub fn sibling_bin(package: &str, name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running executable")?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        let profile = exe
            .parent()
            .and_then(|d| d.file_name())
            .and_then(|d| d.to_str())
            .unwrap_or("release");
        let flag = if profile == "release" {
            " --release"
        } else {
            ""
        };
        bail!(
            "{} not found: build it first (cargo build{flag} -p {package} --bin {name})",
            path.display()
        );
    }
    Ok(path)
}

/// A `kvroute-indexer` process against a [`TestEnv`].
#[derive(Debug)]
pub struct IndexerProcess {
    pub replica_id: String,
    pub http_port: u16,
    spec: Supervised,
    child: Option<ChildGuard>,
}

impl IndexerProcess {
    /// Starts a replica with `extra` flags (e.g. `--snapshot-every-messages 50`).
    pub fn start(env: &TestEnv, replica_id: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let bin = kvroute_bin("kvroute-indexer", "kvroute-indexer")?;
        Self::start_program(env, bin, replica_id, extra)
    }

    /// [`IndexerProcess::start`] reaching etcd at `etcd_endpoint` (e.g. through a proxy the
    /// test can cut) instead of the environment's etcd directly.
    pub fn start_with_etcd(
        env: &TestEnv,
        replica_id: &str,
        etcd_endpoint: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let bin = kvroute_bin("kvroute-indexer", "kvroute-indexer")?;
        Self::start_inner(env, bin, replica_id, etcd_endpoint.to_owned(), extra)
    }

    /// [`IndexerProcess::start`] with the binary at `bin` (e.g. a release build).
    pub fn start_program(
        env: &TestEnv,
        bin: PathBuf,
        replica_id: &str,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_inner(env, bin, replica_id, env.etcd.endpoint(), extra)
    }

    fn start_inner(
        env: &TestEnv,
        bin: PathBuf,
        replica_id: &str,
        etcd_endpoint: String,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let http_port = free_port();
        let mut args: Vec<String> = vec![
            "--namespace".into(),
            env.namespace.to_string(),
            "--nats-url".into(),
            env.nats.url(),
            "--etcd-endpoints".into(),
            etcd_endpoint,
            "--replica-id".into(),
            replica_id.into(),
            "--http-addr".into(),
            format!("127.0.0.1:{http_port}"),
            "--leader-ttl-secs".into(),
            "2".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = env
            .nats
            .data_dir()
            .join(format!("indexer-{replica_id}.log"));
        let mut spec = Supervised::new(bin, args, log);
        spec.env.push(("RUST_LOG".into(), "info".into()));
        let child = Some(spec.spawn()?);
        let p = Self {
            replica_id: replica_id.into(),
            http_port,
            spec,
            child,
        };
        p.wait_http()?;
        Ok(p)
    }

    fn wait_http(&self) -> anyhow::Result<()> {
        let start = Instant::now();
        while http_get(self.http_port, "/healthz").is_none() {
            if !self.child.as_ref().is_some_and(ChildGuard::is_running) {
                bail!("indexer {} exited:\n{}", self.replica_id, self.log());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!(
                    "indexer {} did not come up:\n{}",
                    self.replica_id,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Ok(())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    /// `/readyz` is 200.
    pub fn is_ready(&self) -> bool {
        matches!(http_get(self.http_port, "/readyz"), Some((200, _)))
    }

    /// `/status` as JSON.
    pub fn status(&self) -> anyhow::Result<serde_json::Value> {
        let (code, body) = http_get(self.http_port, "/status").context("indexer unreachable")?;
        anyhow::ensure!(code == 200, "status {code}: {body}");
        Ok(serde_json::from_str(&body)?)
    }

    /// (applied sequence, digest).
    pub fn position(&self) -> anyhow::Result<(u64, u64)> {
        let s = self.status()?;
        Ok((
            s["applied_seq"].as_u64().context("applied_seq")?,
            s["digest"]
                .as_str()
                .and_then(kvroute_common::messages::parse_digest_hex)
                .context("digest")?,
        ))
    }

    /// The value of the sample `name` (exactly, labels included): see
    /// [`crate::metric_sample`] (0 for a declared family's absent sample; panics on an
    /// undeclared family or a silent process).
    pub fn metric(&self, name: &str) -> f64 {
        crate::http::metric_sample(self.http_port, name)
    }

    /// [`IndexerProcess::metric`], `None` while the process does not answer.
    pub fn metric_if_up(&self, name: &str) -> Option<f64> {
        crate::http::metric_sample_if_up(self.http_port, name)
    }

    pub fn kill9(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(c) => c.kill9(),
            None => Ok(()),
        }
    }

    /// Sends `signal` to the indexer process (SIGSTOP freezes it like a hung machine).
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> anyhow::Result<()> {
        self.child.as_ref().context("not running")?.signal(signal)
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(c) => c.stop(),
            None => Ok(()),
        }
    }

    /// Starts the process again with the same flags (same id and port).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.child.is_none(), "still running");
        self.child = Some(self.spec.spawn()?);
        self.wait_http()
    }
}
