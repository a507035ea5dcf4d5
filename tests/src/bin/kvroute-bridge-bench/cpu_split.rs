//! Whose CPU a phase used: the engine side (the PUB's sending thread and its libzmq threads),
//! the bench's coordinating main thread, and every other thread of the process — the bridge's
//! (the relay's rank thread and libzmq threads, the runtime running the publisher and the
//! NATS client).

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_tests::cpu::{self, ThreadCpu};

use crate::engine_pub::Sender;

/// CPU used during a phase.
#[derive(Debug, Default)]
pub struct CpuSplit {
    /// The whole process (`getrusage`).
    pub process: Duration,
    pub engine_side: Duration,
    pub main: Duration,
    pub nats_server: Duration,
    /// The bridge's threads, by name.
    pub bridge: BTreeMap<String, Duration>,
}

impl CpuSplit {
    pub fn bridge_total(&self) -> Duration {
        self.process
            .saturating_sub(self.engine_side)
            .saturating_sub(self.main)
    }
}

/// Which threads are which.
#[derive(Debug, Clone)]
pub struct Threads {
    pub main: i32,
    /// The engine side's libzmq context threads.
    pub engine: Vec<i32>,
    pub nats_pid: Option<i32>,
}

/// CPU counters at one moment.
#[derive(Debug)]
pub struct CpuMark {
    process: Duration,
    threads: BTreeMap<i32, ThreadCpu>,
    nats: Option<Duration>,
}

pub fn mark(threads: &Threads) -> CpuMark {
    CpuMark {
        process: cpu::process_cpu(),
        threads: cpu::threads_cpu(),
        nats: threads.nats_pid.and_then(cpu::pid_cpu),
    }
}

/// What was used between `before` and `after`; `sender` ended before `after` was taken.
pub fn split(before: &CpuMark, after: &CpuMark, who: &Threads, sender: Sender) -> CpuSplit {
    let mut out = CpuSplit {
        process: after.process.saturating_sub(before.process),
        engine_side: sender.cpu,
        nats_server: after
            .nats
            .zip(before.nats)
            .map_or(Duration::ZERO, |(a, b)| a.saturating_sub(b)),
        ..Default::default()
    };
    let main_name = after.threads.get(&who.main).map(|t| &t.name);
    for (tid, t) in &after.threads {
        let d = t
            .cpu
            .saturating_sub(before.threads.get(tid).map_or(Duration::ZERO, |b| b.cpu));
        if *tid == sender.tid {
            // Counted by the thread itself.
        } else if who.engine.contains(tid) {
            out.engine_side += d;
        } else if *tid == who.main {
            out.main += d;
        } else if Some(&t.name) == main_name {
            // Unnamed threads carry the name of the thread that started them: here, the relay's
            // libzmq I/O and reaper threads (its context starts them with its socket).
            *out.bridge.entry("relay libzmq".into()).or_default() += d;
        } else {
            *out.bridge.entry(t.name.clone()).or_default() += d;
        }
    }
    out
}
