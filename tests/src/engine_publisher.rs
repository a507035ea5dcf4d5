//! vLLM's and SGLang's own KV-event publishers (their wheels' `kv_events.py`, extracted by
//! `scripts/install-deps`), run by `tests/engines/engine_publisher.py` under the harness
//! supervisor and driven with its JSON-lines protocol through two FIFOs (the supervisor keeps
//! the child's stdin and stdout for itself). See tests/engines/README.md.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::stat::Mode;
use nix::unistd::mkfifo;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::ports::free_port;
use crate::process::{ChildGuard, Supervised};
use crate::servers::workspace_root;

/// The driver binds every rank and answers `ready` well within this (Python starts in ~0.3 s).
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// A command's reply; a publish waits for the engine's thread to send (10 s at most).
const REPLY_TIMEOUT: Duration = Duration::from_secs(15);

/// An engine whose publisher the driver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// vLLM 0.32.
    Vllm,
    /// vLLM 0.34 (`BlockStored.lookahead_token_ids`).
    Vllm034,
    Sglang,
}

impl Engine {
    pub const ALL: [Engine; 3] = [Engine::Vllm, Engine::Vllm034, Engine::Sglang];

    /// The driver's `--engine` value (also the folder of the wheel's files in `.tools/engines`).
    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Vllm034 => "vllm-0.34",
            Engine::Sglang => "sglang",
        }
    }
}

/// How to start the engine's publishers.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub engine: Engine,
    /// Data-parallel ranks: one publisher each, rank r on port base + r.
    pub dp_size: u16,
    /// Host part of the PUB endpoint: `*` (the engines' default form, `tcp://*:5557`) makes
    /// both engines bind; a concrete host such as `127.0.0.1` makes them connect to it.
    pub pub_host: String,
    /// Whether to give the engine a replay endpoint (`tcp://127.0.0.1:R`, rank r on R + r).
    pub replay: bool,
    pub topic: String,
    /// Batches each rank keeps for replay (both engines default to 10 000).
    pub buffer_steps: u32,
}

impl EngineOptions {
    /// Two ranks binding `tcp://*:P`, with replay, topic "" and the engines' buffer size.
    pub fn new(engine: Engine) -> Self {
        Self {
            engine,
            dp_size: 2,
            pub_host: "*".into(),
            replay: true,
            topic: String::new(),
            buffer_steps: 10_000,
        }
    }
}

/// One rank's sockets, as the engine's own offset logic computed them.
#[derive(Debug, Clone)]
pub struct RankEndpoints {
    pub rank: u16,
    /// The PUB endpoint the engine was configured with, e.g. `tcp://*:5558`.
    pub endpoint: String,
    /// The same port on loopback: where a subscriber connects (or binds, when the engine
    /// connects).
    pub local: String,
    /// Whether the engine bound its PUB socket (else it connected to `endpoint`).
    pub binds: bool,
    /// The replay ROUTER, which both engines always bind.
    pub replay: Option<String>,
}

/// A running driver with one engine publisher per rank. Dropping it quits the driver.
#[derive(Debug)]
pub struct EnginePublisher {
    pub options: EngineOptions,
    /// The driver's `info` reply: module paths, per-rank endpoints, engine details.
    pub info: Value,
    endpoints: Vec<RankEndpoints>,
    commands: Option<File>,
    replies: Receiver<String>,
    child: Option<ChildGuard>,
    log: PathBuf,
    replies_fifo: PathBuf,
    _dir: TempDir,
}

impl EnginePublisher {
    /// Starts the driver on free ports; returns once every rank's publisher is bound.
    pub fn start(options: EngineOptions) -> anyhow::Result<Self> {
        let ranks = options.dp_size;
        let pub_base = free_port_range(ranks, &[]);
        let replay_base = options
            .replay
            .then(|| free_port_range(ranks, &[(pub_base, ranks)]));
        let dir = tempfile::Builder::new()
            .prefix("kvroute-engine-")
            .tempdir()?;
        let commands_fifo = dir.path().join("commands");
        let replies_fifo = dir.path().join("replies");
        for fifo in [&commands_fifo, &replies_fifo] {
            mkfifo(fifo, Mode::S_IRUSR | Mode::S_IWUSR)
                .with_context(|| format!("mkfifo {}", fifo.display()))?;
        }
        let script = workspace_root().join("tests/engines/engine_publisher.py");
        let mut args = vec![
            "-c".to_owned(),
            r#"exec python3 "$0" "$@" <"$KVROUTE_ENGINE_COMMANDS" >"$KVROUTE_ENGINE_REPLIES""#
                .to_owned(),
            script.display().to_string(),
            "--engine".into(),
            options.engine.name().into(),
            "--endpoint".into(),
            format!("tcp://{}:{pub_base}", options.pub_host),
            "--dp-size".into(),
            ranks.to_string(),
            "--topic".into(),
            options.topic.clone(),
            "--buffer-steps".into(),
            options.buffer_steps.to_string(),
        ];
        if let Some(base) = replay_base {
            args.extend([
                "--replay-endpoint".into(),
                format!("tcp://127.0.0.1:{base}"),
            ]);
        }
        let log = dir.path().join("driver.log");
        let mut spec = Supervised::new("sh", args, &log);
        spec.env = vec![
            (
                "KVROUTE_ENGINE_COMMANDS".into(),
                commands_fifo.display().to_string(),
            ),
            (
                "KVROUTE_ENGINE_REPLIES".into(),
                replies_fifo.display().to_string(),
            ),
        ];
        let child = spec.spawn()?;
        let replies = read_lines(replies_fifo.clone());
        let mut publisher = Self {
            options,
            info: Value::Null,
            endpoints: Vec::new(),
            commands: None,
            replies,
            child: Some(child),
            log,
            replies_fifo,
            _dir: dir,
        };
        publisher.commands = Some(publisher.open_commands(&commands_fifo)?);
        publisher.wait_ready()?;
        publisher.info = publisher.command(json!({"op": "info"}))?;
        publisher.endpoints = publisher.parse_endpoints()?;
        Ok(publisher)
    }

    /// Every rank's endpoints, rank 0 first.
    pub fn endpoints(&self) -> &[RankEndpoints] {
        &self.endpoints
    }

    /// Publishes one `KVEventBatch` of `events` (the driver's JSON events) on `rank`, once it
    /// has left the engine's publisher thread; returns the sequence number the engine gave it.
    pub fn publish(&mut self, rank: u16, events: Value) -> anyhow::Result<u64> {
        let reply = self.command(json!({"op": "publish", "rank": rank, "events": events}))?;
        reply["seq"]
            .as_u64()
            .with_context(|| format!("publish reply without a seq: {reply}"))
    }

    /// `rank`'s next batch reaches the replay buffer but not the PUB socket.
    pub fn drop_next(&mut self, rank: u16) -> anyhow::Result<()> {
        self.command(json!({"op": "drop_next", "rank": rank}))
            .map(drop)
    }

    /// `rank`'s next replay answer leaves out batches `seqs` (as the replay socket's high-water
    /// mark drops messages) and still ends with the end marker.
    pub fn drop_replay(&mut self, rank: u16, seqs: &[u64]) -> anyhow::Result<()> {
        self.command(json!({"op": "drop_replay", "rank": rank, "seqs": seqs}))
            .map(drop)
    }

    /// Shuts every publisher down and starts new ones on the same endpoints (sequence numbers
    /// start at 0 again, as in a new engine process); returns once they are bound.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.command(json!({"op": "restart"})).map(drop)
    }

    /// Sends one command; its reply if `ok`, else an error with the driver's message.
    pub fn command(&mut self, command: Value) -> anyhow::Result<Value> {
        let reply = self.request(&command)?;
        if reply["ok"] != Value::Bool(true) {
            bail!("driver refused {command}: {}", reply["error"]);
        }
        Ok(reply)
    }

    /// Sends one command and returns the driver's reply, `ok` or not.
    pub fn request(&mut self, command: &Value) -> anyhow::Result<Value> {
        let commands = self.commands.as_mut().context("driver stopped")?;
        writeln!(commands, "{command}")
            .and_then(|()| commands.flush())
            .with_context(|| format!("sending {command}; driver log:\n{}", self.log()))?;
        let line = self.next_line(REPLY_TIMEOUT, &command.to_string())?;
        serde_json::from_str(&line).with_context(|| format!("driver replied {line:?}"))
    }

    /// The driver's stderr: the engines' own log lines and any traceback.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn open_commands(&self, fifo: &Path) -> anyhow::Result<File> {
        // A non-blocking open for writing fails (ENXIO) until the driver's shell opens the
        // FIFO for reading; a blocking one would hang if the driver never starts.
        let start = Instant::now();
        loop {
            match OpenOptions::new()
                .write(true)
                .custom_flags(nix::libc::O_NONBLOCK)
                .open(fifo)
            {
                // The reader is there: a blocking handle opens at once.
                Ok(_probe) => return Ok(OpenOptions::new().write(true).open(fifo)?),
                Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => {}
                Err(e) => return Err(e).context("opening the driver's command FIFO"),
            }
            let running = self.child.as_ref().is_some_and(ChildGuard::is_running);
            if !running || start.elapsed() > READY_TIMEOUT {
                bail!(
                    "the driver never opened its commands; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let line = self.next_line(READY_TIMEOUT, "ready")?;
        if line != "ready" {
            bail!(
                "the driver said {line:?} instead of ready; its log:\n{}",
                self.log()
            );
        }
        Ok(())
    }

    fn next_line(&mut self, timeout: Duration, waiting_for: &str) -> anyhow::Result<String> {
        match self.replies.recv_timeout(timeout) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => bail!(
                "no answer to {waiting_for} within {timeout:?}; driver log:\n{}",
                self.log()
            ),
            Err(RecvTimeoutError::Disconnected) => bail!(
                "the driver exited while we waited for {waiting_for}; its log:\n{}",
                self.log()
            ),
        }
    }

    fn parse_endpoints(&self) -> anyhow::Result<Vec<RankEndpoints>> {
        let ranks = self.info["ranks"]
            .as_array()
            .with_context(|| format!("info without ranks: {}", self.info))?;
        ranks
            .iter()
            .map(|r| {
                let endpoint = r["endpoint"].as_str().context("rank without endpoint")?;
                let port = endpoint.rsplit(':').next().unwrap_or_default();
                Ok(RankEndpoints {
                    rank: r["rank"].as_u64().context("rank without number")? as u16,
                    endpoint: endpoint.to_owned(),
                    local: format!("tcp://127.0.0.1:{port}"),
                    binds: r["binds"].as_bool().context("rank without binds")?,
                    replay: r["replay_endpoint"].as_str().map(str::to_owned),
                })
            })
            .collect()
    }
}

impl Drop for EnginePublisher {
    fn drop(&mut self) {
        // Ask the driver to quit (it also quits on end of input), give it a moment to shut its
        // publishers down, then let the guard stop whatever is left.
        if let Some(mut commands) = self.commands.take() {
            let _ = writeln!(commands, "{}", json!({"op": "quit"}));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            if self.replies.recv_timeout(left).is_err() {
                break;
            }
        }
        self.child.take();
        // A reader thread still waiting for the driver to open its replies: a writer that
        // comes and goes hands it end of file.
        let _ = OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(&self.replies_fifo);
    }
}

/// Lines from `fifo` on a channel, read by a thread (it opens the FIFO once the driver's
/// shell opens it for writing); the channel disconnects at the driver's end of output.
fn read_lines(fifo: PathBuf) -> Receiver<String> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let Ok(file) = File::open(&fifo) else { return };
        for line in BufReader::new(file).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// A base port such that `base..base + count` was free on every interface a moment ago and
/// overlaps none of the `taken` ranges (`(base, count)`).
fn free_port_range(count: u16, taken: &[(u16, u16)]) -> u16 {
    loop {
        let base = free_port();
        let Some(end) = base.checked_add(count) else {
            continue;
        };
        let overlaps = taken
            .iter()
            .any(|&(b, n)| base < b.saturating_add(n) && b < end);
        let free = (base..end).all(|port| TcpListener::bind(("0.0.0.0", port)).is_ok());
        if !overlaps && free {
            return base;
        }
    }
}
