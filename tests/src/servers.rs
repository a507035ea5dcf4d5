//! Real `nats-server` (JetStream) and `etcd` for tests, each on free loopback ports with a
//! temporary data dir, stoppable and restartable on the same port and data dir.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute_common::Namespace;
use kvroute_common::config::{EtcdArgs, NatsArgs};
use tempfile::TempDir;

use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The repository root (where `.tools/` lives).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// Finds `name` via the environment variable `env`, then `.tools/bin/`, then `PATH`.
pub fn find_binary(name: &str, env: &str) -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        return Ok(PathBuf::from(path));
    }
    let local = workspace_root().join(".tools/bin").join(name);
    if local.is_file() {
        return Ok(local);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!("{name} not found: run scripts/install-deps (or set {env})")
}

fn wait_until(what: &str, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    while !ready() {
        if start.elapsed() > READY_TIMEOUT {
            bail!("{what} not ready after {READY_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    Ok(())
}

/// A `nats-server` with JetStream (or, for tests of that mistake, without). Dropping it stops
/// the server and deletes its data.
#[derive(Debug)]
pub struct NatsServer {
    pub port: u16,
    pub monitor_port: u16,
    jetstream: bool,
    spec: Supervised,
    child: Option<ChildGuard>,
    dir: TempDir,
}

impl NatsServer {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(true)
    }

    /// A server started without `--jetstream`, as a misconfigured deployment would be.
    pub fn start_without_jetstream() -> anyhow::Result<Self> {
        Self::start_with(false)
    }

    fn start_with(jetstream: bool) -> anyhow::Result<Self> {
        let bin = find_binary("nats-server", "KVROUTE_NATS_SERVER")?;
        let dir = tempfile::Builder::new().prefix("kvroute-nats-").tempdir()?;
        let port = free_port();
        let monitor_port = free_port();
        // A larger max_payload than the 1 MiB default, so tests can send kvroute messages above
        // kvroute's own size limits and check they are refused by kvroute, not by NATS. The
        // rest is compose.yaml's server configuration (docker/nats.conf: a client that stops
        // answering pings is dropped within 4-6 s).
        let deployed = std::fs::read_to_string(workspace_root().join("docker/nats.conf"))
            .context("reading docker/nats.conf")?;
        let conf = dir.path().join("nats.conf");
        std::fs::write(&conf, format!("{deployed}\nmax_payload: 8388608\n"))?;
        let mut args = vec![
            "--config".into(),
            conf.display().to_string(),
            "--addr".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--http_port".into(),
            monitor_port.to_string(),
            "--server_name".into(),
            format!("test-{port}"),
        ];
        if jetstream {
            args.extend([
                "--jetstream".into(),
                "--store_dir".into(),
                dir.path().join("js").display().to_string(),
            ]);
        }
        let spec = Supervised::new(bin, args, dir.path().join("nats.log"));
        let mut server = Self {
            port,
            monitor_port,
            jetstream,
            spec,
            child: None,
            dir,
        };
        server.restart()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn args(&self) -> NatsArgs {
        NatsArgs::plain(self.url())
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// Starts the server (again) on the same port and data dir; returns once JetStream (or,
    /// without it, the server) is up.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("nats-server on port {} is already running", self.port);
        }
        self.child = Some(self.spec.spawn()?);
        let monitor = self.monitor_port;
        let health = if self.jetstream {
            "/healthz?js-enabled-only=true"
        } else {
            "/healthz"
        };
        wait_until("nats-server", || {
            matches!(http_get(monitor, health), Some((200, _)))
        })
        .with_context(|| format!("nats-server log:\n{}", self.log()))
    }

    /// Clean shutdown (SIGTERM).
    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.stop(),
            None => Ok(()),
        }
    }

    /// Crash (SIGKILL).
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.kill9(),
            None => Ok(()),
        }
    }

    pub async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        self.args().connect("kvroute-test").await
    }
}

/// A single-member `etcd`. Dropping it stops the server and deletes its data.
#[derive(Debug)]
pub struct EtcdServer {
    pub client_port: u16,
    pub peer_port: u16,
    spec: Supervised,
    child: Option<ChildGuard>,
    dir: TempDir,
}

impl EtcdServer {
    pub fn start() -> anyhow::Result<Self> {
        let bin = find_binary("etcd", "KVROUTE_ETCD")?;
        let dir = tempfile::Builder::new().prefix("kvroute-etcd-").tempdir()?;
        let client_port = free_port();
        let peer_port = free_port();
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let args = vec![
            "--name".into(),
            "test".into(),
            "--data-dir".into(),
            dir.path().join("data").display().to_string(),
            "--listen-client-urls".into(),
            client.clone(),
            "--advertise-client-urls".into(),
            client,
            "--listen-peer-urls".into(),
            peer.clone(),
            "--initial-advertise-peer-urls".into(),
            peer.clone(),
            "--initial-cluster".into(),
            format!("test={peer}"),
            "--log-level".into(),
            "warn".into(),
        ];
        let spec = Supervised::new(bin, args, dir.path().join("etcd.log"));
        let mut server = Self {
            client_port,
            peer_port,
            spec,
            child: None,
            dir,
        };
        server.restart()?;
        Ok(server)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn args(&self) -> EtcdArgs {
        EtcdArgs::plain(self.endpoint())
    }

    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// Starts etcd (again) on the same ports and data dir; returns once it reports healthy.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("etcd on port {} is already running", self.client_port);
        }
        self.child = Some(self.spec.spawn()?);
        let port = self.client_port;
        wait_until(
            "etcd",
            || matches!(http_get(port, "/health"), Some((200, body)) if body.contains("true")),
        )
        .with_context(|| format!("etcd log:\n{}", self.log()))
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.stop(),
            None => Ok(()),
        }
    }

    pub fn kill9(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.kill9(),
            None => Ok(()),
        }
    }

    pub async fn connect(&self) -> anyhow::Result<etcd_client::Client> {
        self.args().connect().await
    }
}

/// Both servers and a namespace of the test's own.
#[derive(Debug)]
pub struct TestEnv {
    pub nats: NatsServer,
    pub etcd: EtcdServer,
    pub namespace: Namespace,
}

impl TestEnv {
    pub fn start() -> anyhow::Result<Self> {
        let nats = NatsServer::start()?;
        let etcd = EtcdServer::start()?;
        let suffix = format!("{:08x}", std::process::id() ^ nats.port as u32);
        let namespace = Namespace::new(format!("t{suffix}"))?;
        Ok(Self {
            nats,
            etcd,
            namespace,
        })
    }

    /// The flags every kvroute process takes to use this environment: `--namespace`,
    /// `--nats-url`, `--etcd-endpoints`.
    pub fn server_args(&self) -> Vec<String> {
        vec![
            "--namespace".into(),
            self.namespace.to_string(),
            "--nats-url".into(),
            self.nats.url(),
            "--etcd-endpoints".into(),
            self.etcd.endpoint(),
        ]
    }
}
