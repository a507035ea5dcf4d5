//! Real `nats-server` (JetStream) and `etcd` for tests, each on free loopback ports with a
//! temporary data dir, stoppable and restartable on the same port and data dir; secure
//! variants run with TLS and per-role users ([`TestEnv::start_secure`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute_common::Namespace;
use kvroute_common::config::{EtcdArgs, NatsArgs, TlsFiles};
use tempfile::TempDir;

use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::secrets::Secrets;

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

/// What both test servers share: a supervised process, its temporary data dir (deleted on
/// drop) and log, and the HTTP health check that says it is up.
#[derive(Debug)]
struct ServerProcess {
    what: &'static str,
    spec: Supervised,
    child: Option<ChildGuard>,
    dir: TempDir,
    /// Plain-HTTP port and path of the health check, and what its 200 body must contain.
    health: (u16, &'static str, &'static str),
}

impl ServerProcess {
    fn new(
        what: &'static str,
        bin: PathBuf,
        args: Vec<String>,
        dir: TempDir,
        health: (u16, &'static str, &'static str),
    ) -> Self {
        let spec = Supervised::new(bin, args, dir.path().join(format!("{what}.log")));
        Self {
            what,
            spec,
            child: None,
            dir,
            health,
        }
    }

    fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// Starts the process (again, same arguments and data dir); returns once healthy.
    fn restart(&mut self) -> anyhow::Result<()> {
        self.spawn()?;
        self.wait_healthy()
    }

    /// Starts the process without waiting for it to be healthy (the members of a cluster are
    /// healthy only once enough of them run).
    fn spawn(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            bail!("{} is already running", self.what);
        }
        self.child = Some(self.spec.spawn()?);
        Ok(())
    }

    fn wait_healthy(&self) -> anyhow::Result<()> {
        let (port, path, body_has) = self.health;
        wait_until(
            self.what,
            || matches!(http_get(port, path), Some((200, body)) if body.contains(body_has)),
        )
        .with_context(|| format!("{} log:\n{}", self.what, self.log()))
    }

    /// Clean shutdown (SIGTERM).
    fn stop(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.stop(),
            None => Ok(()),
        }
    }

    /// Crash (SIGKILL).
    fn kill9(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(child) => child.kill9(),
            None => Ok(()),
        }
    }
}

/// A `nats-server` with JetStream (or, for tests of that mistake, without), optionally with
/// TLS and the users and permissions of a [`Secrets`]. Dropping it stops the server and
/// deletes its data.
#[derive(Debug)]
pub struct NatsServer {
    pub port: u16,
    pub monitor_port: u16,
    /// The CA that signed the server's certificate, when it requires TLS.
    tls_ca: Option<PathBuf>,
    server: ServerProcess,
}

impl NatsServer {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(true, None)
    }

    /// A server started without `--jetstream`, as a misconfigured deployment would be.
    pub fn start_without_jetstream() -> anyhow::Result<Self> {
        Self::start_with(false, None)
    }

    /// A server that requires TLS (the certificate of `secrets`) and a user of `secrets`, each
    /// with its role's permissions (scripts/gen-auth's nats-auth.conf).
    pub fn start_secure(secrets: &Secrets) -> anyhow::Result<Self> {
        Self::start_with(true, Some(secrets))
    }

    fn start_with(jetstream: bool, secrets: Option<&Secrets>) -> anyhow::Result<Self> {
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
        let auth = match secrets {
            Some(s) => std::fs::read_to_string(s.path("nats-auth.conf"))
                .context("reading nats-auth.conf")?,
            None => String::new(),
        };
        let conf = dir.path().join("nats.conf");
        std::fs::write(&conf, format!("{deployed}\nmax_payload: 8388608\n{auth}"))?;
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
        let health = if jetstream {
            "/healthz?js-enabled-only=true"
        } else {
            "/healthz"
        };
        let mut server = Self {
            port,
            monitor_port,
            tls_ca: secrets.map(|s| s.path("ca.pem")),
            server: ServerProcess::new("nats", bin, args, dir, (monitor_port, health, "")),
        };
        server.restart()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Settings to reach the server: with its CA when it requires TLS, without a user.
    pub fn args(&self) -> NatsArgs {
        let mut args = NatsArgs::plain(self.url());
        if let Some(ca) = &self.tls_ca {
            args.tls = TlsFiles::with_ca(ca);
        }
        args
    }

    pub fn data_dir(&self) -> &Path {
        self.server.dir.path()
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.server.pid()
    }

    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Starts the server (again) on the same port and data dir; returns once JetStream (or,
    /// without it, the server) is up.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.server.restart()
    }

    /// Clean shutdown (SIGTERM).
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.server.stop()
    }

    /// Crash (SIGKILL).
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        self.server.kill9()
    }

    pub async fn connect(&self) -> anyhow::Result<async_nats::Client> {
        self.args().connect("kvroute-test").await
    }
}

/// A single-member `etcd` (or one member of an [`EtcdCluster`]), optionally with TLS (client
/// and peer URLs) and the users and roles of a [`Secrets`] (auth enabled). Dropping it stops
/// the server and deletes its data.
#[derive(Debug)]
pub struct EtcdServer {
    pub client_port: u16,
    pub peer_port: u16,
    tls_ca: Option<PathBuf>,
    server: ServerProcess,
}

impl EtcdServer {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(None)
    }

    /// etcd on TLS (client and peer URLs, the certificate of `secrets`) with `secrets`'s
    /// users and roles (etcd-rbac.sh) and authentication enabled.
    pub fn start_secure(secrets: &Secrets) -> anyhow::Result<Self> {
        let server = Self::start_with(Some(secrets))?;
        let ctl = Command::new("sh")
            .arg(secrets.path("etcd-rbac.sh"))
            .env("ETCDCTL_API", "3")
            .env("ETCDCTL_ENDPOINTS", server.endpoint())
            .env("ETCDCTL_CACERT", secrets.path("ca.pem"))
            .output()
            .context("running etcd-rbac.sh (etcdctl)")?;
        if !ctl.status.success() {
            bail!(
                "etcd-rbac.sh failed: {}",
                String::from_utf8_lossy(&ctl.stderr)
            );
        }
        Ok(server)
    }

    fn start_with(secrets: Option<&Secrets>) -> anyhow::Result<Self> {
        let peer_port = free_port();
        let scheme = if secrets.is_some() { "https" } else { "http" };
        let initial_cluster = format!("test={scheme}://127.0.0.1:{peer_port}");
        let mut server = Self::member("test", peer_port, &initial_cluster, secrets)?;
        server.restart()?;
        Ok(server)
    }

    /// Member `name` of the cluster `initial_cluster` (`name=peer-url,...`), with its peer
    /// URL on `peer_port`; not started yet.
    fn member(
        name: &str,
        peer_port: u16,
        initial_cluster: &str,
        secrets: Option<&Secrets>,
    ) -> anyhow::Result<Self> {
        let bin = find_binary("etcd", "KVROUTE_ETCD")?;
        let dir = tempfile::Builder::new().prefix("kvroute-etcd-").tempdir()?;
        let client_port = free_port();
        let metrics_port = free_port();
        let scheme = if secrets.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{client_port}");
        let peer = format!("{scheme}://127.0.0.1:{peer_port}");
        let mut args = vec![
            "--name".into(),
            name.into(),
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
            initial_cluster.into(),
            // /health in plain HTTP whatever the client URLs' scheme.
            "--listen-metrics-urls".into(),
            format!("http://127.0.0.1:{metrics_port}"),
            "--log-level".into(),
            "warn".into(),
        ];
        if let Some(s) = secrets {
            args.extend(etcd_tls_flags(s));
        }
        Ok(Self {
            client_port,
            peer_port,
            tls_ca: secrets.map(|s| s.path("ca.pem")),
            server: ServerProcess::new("etcd", bin, args, dir, (metrics_port, "/health", "true")),
        })
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Settings to reach etcd: with its CA when it uses TLS, without a user.
    pub fn args(&self) -> EtcdArgs {
        let mut args = EtcdArgs::plain(self.endpoint());
        if let Some(ca) = &self.tls_ca {
            args.tls = TlsFiles::with_ca(ca);
        }
        args
    }

    pub fn data_dir(&self) -> &Path {
        self.server.dir.path()
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.server.pid()
    }

    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Starts etcd (again) on the same ports and data dir; returns once it reports healthy.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.server.restart()
    }

    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.server.stop()
    }

    pub fn kill9(&mut self) -> anyhow::Result<()> {
        self.server.kill9()
    }

    pub async fn connect(&self) -> anyhow::Result<etcd_client::Client> {
        self.args().connect().await
    }
}

/// A plain etcd cluster of several members on loopback ports, each stoppable, killable and
/// restartable on its own (a member's [`EtcdServer`]). Dropping it stops every member and
/// deletes their data.
#[derive(Debug)]
pub struct EtcdCluster {
    pub members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts `size` members; returns once every one reports healthy (a leader elected).
    pub fn start(size: usize) -> anyhow::Result<Self> {
        let names: Vec<String> = (1..=size).map(|i| format!("member-{i}")).collect();
        let peer_ports: Vec<u16> = names.iter().map(|_| free_port()).collect();
        let initial_cluster = names
            .iter()
            .zip(&peer_ports)
            .map(|(name, port)| format!("{name}=http://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::with_capacity(size);
        for (name, port) in names.iter().zip(&peer_ports) {
            members.push(EtcdServer::member(name, *port, &initial_cluster, None)?);
        }
        // All running before any can be healthy: one member alone has no quorum.
        for member in &mut members {
            member.server.spawn()?;
        }
        for member in &members {
            member
                .server
                .wait_healthy()
                .with_context(|| format!("etcd member log:\n{}", member.log()))?;
        }
        Ok(Self { members })
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdServer::endpoint).collect()
    }

    /// Settings to reach the cluster through every member (as kvroute's processes do).
    pub fn args(&self) -> EtcdArgs {
        self.args_of(&(0..self.members.len()).collect::<Vec<_>>())
    }

    /// Settings to reach the cluster through the members at `indexes` only.
    pub fn args_of(&self, indexes: &[usize]) -> EtcdArgs {
        let mut args = EtcdArgs::plain(String::new());
        args.endpoints = indexes
            .iter()
            .map(|&i| self.members[i].endpoint())
            .collect();
        args
    }
}

/// etcd's TLS flags: the server certificate on client and peer URLs, and mutual TLS between
/// members. (No client CA: with `--trusted-ca-file`, etcd 3.4 demands client certificates;
/// clients authenticate with their user and password.)
fn etcd_tls_flags(secrets: &Secrets) -> Vec<String> {
    let cert = secrets.path("etcd-server.pem").display().to_string();
    let key = secrets.path("etcd-server.key").display().to_string();
    let ca = secrets.path("ca.pem").display().to_string();
    vec![
        format!("--cert-file={cert}"),
        format!("--key-file={key}"),
        format!("--peer-cert-file={cert}"),
        format!("--peer-key-file={key}"),
        format!("--peer-trusted-ca-file={ca}"),
        "--peer-client-cert-auth".into(),
    ]
}

/// Both servers and a namespace of the test's own.
#[derive(Debug)]
pub struct TestEnv {
    pub nats: NatsServer,
    pub etcd: EtcdServer,
    pub namespace: Namespace,
    /// The identities of a secure environment.
    pub secrets: Option<Secrets>,
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
            secrets: None,
        })
    }

    /// Both servers with TLS and authentication: scripts/gen-auth's identities for
    /// `workers` (identity name, its worker ids) and one of each other role (`indexer-1`,
    /// `router-1`, `gateway-1`, `client-1`, `operator-1`).
    pub fn start_secure(workers: &[(&str, &[u64])]) -> anyhow::Result<Self> {
        let namespace =
            Namespace::new(format!("s{:08x}", std::process::id() ^ free_port() as u32))?;
        let secrets = Secrets::generate(&namespace, workers)?;
        let nats = NatsServer::start_secure(&secrets)?;
        let etcd = EtcdServer::start_secure(&secrets)?;
        Ok(Self {
            nats,
            etcd,
            namespace,
            secrets: Some(secrets),
        })
    }

    fn secrets(&self) -> &Secrets {
        self.secrets
            .as_ref()
            .expect("a secure environment (TestEnv::start_secure)")
    }

    /// The flags that make a process `user` (NATS and etcd user, password, CA, inbox prefix).
    pub fn identity_args(&self, user: &str) -> Vec<String> {
        self.secrets().flags(user)
    }

    /// NATS settings of identity `user`.
    pub fn nats_args_as(&self, user: &str) -> NatsArgs {
        let mut args = self.nats.args();
        self.secrets().apply_nats(user, &mut args);
        args
    }

    /// etcd settings of identity `user`.
    pub fn etcd_args_as(&self, user: &str) -> EtcdArgs {
        let mut args = self.etcd.args();
        self.secrets().apply_etcd(user, &mut args);
        args
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
