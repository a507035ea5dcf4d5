//! `kvroute-bridge` as a process for tests (in front of one engine), restartable with the same
//! flags, its `/metrics` on a free loopback port.

use anyhow::Context;

use crate::bins::kvroute_bin;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::TestEnv;

#[derive(Debug)]
pub struct BridgeProcess {
    pub name: String,
    pub http_port: u16,
    spec: Supervised,
    child: Option<ChildGuard>,
}

impl BridgeProcess {
    /// Starts `kvroute-bridge` with the environment's NATS and etcd flags and `flags` (the
    /// engine's among them); returns at once.
    pub fn start(env: &TestEnv, name: &str, flags: &[String]) -> anyhow::Result<Self> {
        let program = kvroute_bin("kvroute-bridge", "kvroute-bridge")?;
        let http_port = free_port();
        let mut args = env.server_args();
        args.extend(["--http-addr".into(), format!("127.0.0.1:{http_port}")]);
        args.extend(flags.iter().cloned());
        let log = env.nats.data_dir().join(format!("bridge-{name}.log"));
        let mut spec = Supervised::new(program, args, log);
        spec.env.push(("RUST_LOG".into(), "info".into()));
        let child = Some(spec.spawn()?);
        Ok(Self {
            name: name.into(),
            http_port,
            spec,
            child,
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.spec.log).unwrap_or_default()
    }

    /// The value of sample `name` (labels included, exactly as rendered); 0 when absent.
    pub fn metric(&self, name: &str) -> f64 {
        crate::http::metric_sample(self.http_port, name)
    }

    /// SIGKILL; returns once the process is gone.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        match self.child.take() {
            Some(c) => c.kill9(),
            None => Ok(()),
        }
    }

    /// Starts it again with the same flags.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9()?;
        self.child = Some(self.spec.spawn().context("restarting kvroute-bridge")?);
        Ok(())
    }
}
