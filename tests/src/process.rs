//! Child processes that cannot outlive the test: each runs under a tiny shell supervisor that
//! kills it when our end of its stdin pipe closes, which happens even when the test process
//! is killed with SIGKILL.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const SUPERVISOR: &str = r#"
"$@" >>"$KVROUTE_HARNESS_LOG" 2>&1 &
child=$!
echo "$child"
read -r _ignored
kill -TERM "$child" 2>/dev/null
( sleep 3; kill -KILL "$child" 2>/dev/null ) &
killer=$!
wait "$child"
kill "$killer" 2>/dev/null
exit 0
"#;

/// A program and its arguments, restartable with the same arguments.
#[derive(Debug, Clone)]
pub struct Supervised {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log: PathBuf,
}

/// A running supervised child. Dropping it stops the child (SIGTERM, then SIGKILL after 3 s).
#[derive(Debug)]
pub struct ChildGuard {
    supervisor: Child,
    stdin: Option<ChildStdin>,
    pid: Pid,
}

impl Supervised {
    pub fn new(program: impl Into<PathBuf>, args: Vec<String>, log: impl AsRef<Path>) -> Self {
        Self {
            program: program.into(),
            args,
            env: Vec::new(),
            log: log.as_ref().to_owned(),
        }
    }

    pub fn spawn(&self) -> anyhow::Result<ChildGuard> {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(SUPERVISOR)
            .arg("kvroute-harness")
            .arg(&self.program)
            .args(&self.args)
            .env("KVROUTE_HARNESS_LOG", &self.log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut supervisor = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.program.display()))?;
        let stdout = supervisor.stdout.take().context("supervisor stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let pid: i32 = line
            .trim()
            .parse()
            .with_context(|| format!("supervisor printed {line:?}"))?;
        let stdin = supervisor.stdin.take();
        Ok(ChildGuard {
            supervisor,
            stdin,
            pid: Pid::from_raw(pid),
        })
    }
}

impl ChildGuard {
    pub fn pid(&self) -> i32 {
        self.pid.as_raw()
    }

    /// Whether the child is still running (a zombie counts as gone).
    pub fn is_running(&self) -> bool {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            // The state follows the parenthesised command name.
            Ok(stat) => {
                !matches!(stat.rsplit(')').next().map(str::trim_start), Some(s) if s.starts_with('Z'))
            }
            Err(_) => false,
        }
    }

    /// Sends `signal` to the child itself (e.g. SIGSTOP to freeze it).
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        kill(self.pid, signal).with_context(|| format!("signalling pid {}", self.pid))
    }

    /// SIGKILL, like a machine dying; returns once the process is gone.
    pub fn kill9(mut self) -> anyhow::Result<()> {
        let _ = kill(self.pid, Signal::SIGKILL);
        self.reap()
    }

    /// SIGTERM and wait for a clean exit (SIGKILL after 3 s); returns once it is gone.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.reap()
    }

    fn reap(&mut self) -> anyhow::Result<()> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"stop\n");
        }
        self.supervisor
            .wait()
            .context("waiting for the supervisor")?;
        if self.is_running() {
            bail!("pid {} survived its supervisor", self.pid);
        }
        Ok(())
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.reap();
    }
}

/// How a process that ran to its end ended.
#[derive(Debug, Clone)]
pub struct Exited {
    /// The exit status (-1: killed by a signal).
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Exited {
    /// stderr's last line (where kvroute's binaries put their error).
    pub fn last_line(&self) -> &str {
        self.stderr.trim_end().lines().last().unwrap_or("")
    }
}

/// Runs `program` with `args` and extra environment variables `env` (an empty value sets the
/// variable to the empty string) until it exits (killed after `limit`), capturing its output
/// through pipes.
pub fn run_to_exit(
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    limit: Duration,
) -> anyhow::Result<Exited> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{} did not exit within {limit:?}", program.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = started.elapsed();
    Ok(Exited {
        code: status.code().unwrap_or(-1),
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
        elapsed,
    })
}
