//! CPU placement and accounting for the benchmarks: pin a process (every thread) or the calling
//! thread to one core, and read CPU time per process (`getrusage`, `/proc/<pid>/stat`) and per
//! thread (`/proc/<pid>/task/<tid>/schedstat`, nanoseconds).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use nix::sched::{CpuSet, sched_setaffinity};
use nix::sys::resource::{UsageWho, getrusage};
use nix::unistd::Pid;

/// Cores this machine has online.
pub fn online_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

fn cpu_set(cpu: usize) -> nix::Result<CpuSet> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    Ok(set)
}

/// Pins the calling thread to `cpu`; threads it spawns afterwards inherit the placement (so
/// call it first thing in `main` to pin the whole process).
pub fn pin_current_thread(cpu: usize) -> anyhow::Result<()> {
    sched_setaffinity(Pid::from_raw(0), &cpu_set(cpu)?)
        .with_context(|| format!("pinning to CPU {cpu}"))
}

/// Pins every current thread of process `pid` to `cpu` (threads they spawn later inherit it).
pub fn pin_process(pid: i32, cpu: usize) -> anyhow::Result<()> {
    let set = cpu_set(cpu)?;
    for tid in tasks(pid)? {
        // A thread may end meanwhile.
        let _ = sched_setaffinity(Pid::from_raw(tid), &set);
    }
    Ok(())
}

/// Pins thread `tid` of this process to `cpu`.
pub fn pin_thread(tid: i32, cpu: usize) -> anyhow::Result<()> {
    sched_setaffinity(Pid::from_raw(tid), &cpu_set(cpu)?)
        .with_context(|| format!("pinning thread {tid} to CPU {cpu}"))
}

/// Lets every current thread of process `pid` run on every online CPU again.
pub fn unpin_process(pid: i32) -> anyhow::Result<()> {
    let mut set = CpuSet::new();
    for cpu in 0..CpuSet::count() {
        // CPUs beyond the machine's are refused as a whole set, so only online ones.
        if std::path::Path::new(&format!("/sys/devices/system/cpu/cpu{cpu}")).exists() {
            set.set(cpu)?;
        }
    }
    for tid in tasks(pid)? {
        let _ = sched_setaffinity(Pid::from_raw(tid), &set);
    }
    Ok(())
}

fn tasks(pid: i32) -> anyhow::Result<Vec<i32>> {
    let dir = format!("/proc/{pid}/task");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        if let Some(tid) = entry?.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(tid);
        }
    }
    Ok(out)
}

/// User + system CPU time of this process, all threads (`getrusage(RUSAGE_SELF)`).
pub fn process_cpu() -> Duration {
    let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) else {
        return Duration::ZERO;
    };
    let us = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
    Duration::from_micros(us(u.user_time()) + us(u.system_time()))
}

/// User + system CPU time of another process (`/proc/<pid>/stat`, clock ticks of 10 ms).
pub fn pid_cpu(pid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// One thread's name (`comm`) and CPU time so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCpu {
    pub name: String,
    pub cpu: Duration,
}

/// CPU time of every current thread of this process, by thread id (the scheduler's own
/// nanosecond count: `/proc/self/task/<tid>/schedstat`).
pub fn threads_cpu() -> BTreeMap<i32, ThreadCpu> {
    let mut out = BTreeMap::new();
    let Ok(tids) = tasks(std::process::id() as i32) else {
        return out;
    };
    for tid in tids {
        let base = format!("/proc/self/task/{tid}");
        let Ok(sched) = std::fs::read_to_string(format!("{base}/schedstat")) else {
            continue;
        };
        let Some(ns) = sched.split_whitespace().next().and_then(|v| v.parse().ok()) else {
            continue;
        };
        let name = std::fs::read_to_string(format!("{base}/comm")).unwrap_or_default();
        out.insert(
            tid,
            ThreadCpu {
                name: name.trim().to_owned(),
                cpu: Duration::from_nanos(ns),
            },
        );
    }
    out
}

/// The calling thread's id (to tell its CPU time apart in [`threads_cpu`]).
pub fn current_tid() -> i32 {
    nix::unistd::gettid().as_raw()
}

/// The calling thread's CPU time so far (read it before the thread ends: its `/proc` entry goes
/// with it).
pub fn current_thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .map_or(Duration::ZERO, Duration::from_nanos)
}
