//! Where the CPU went during a phase: per process (`/proc/<pid>/stat`) or per group of this
//! process's threads (by name, `schedstat`), and each core's busy share from `/proc/stat`
//! (every process on the machine, so other users' load shows too).

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_tests::cpu;

/// Whose CPU one account counts.
#[derive(Debug, Clone)]
pub enum Source {
    /// Other processes (their threads, live and ended).
    Pids(Vec<i32>),
    /// This process's threads whose name starts with `prefix`, and those of `tids`.
    Threads {
        prefix: &'static str,
        tids: Vec<i32>,
    },
}

/// The accounts read at each snapshot, by name.
#[derive(Debug, Clone, Default)]
pub struct Accounts {
    parts: Vec<(String, Source)>,
}

/// CPU used so far, by account, and each core's ticks.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    pub by_part: BTreeMap<String, Duration>,
    /// Per core: (busy ticks, all ticks).
    pub cores: Vec<(u64, u64)>,
}

impl Accounts {
    pub fn add(&mut self, name: &str, source: Source) {
        self.parts.push((name.to_owned(), source));
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().map(|(n, _)| n.as_str())
    }

    pub fn read(&self) -> Reading {
        let threads = cpu::threads_cpu();
        let by_part = self
            .parts
            .iter()
            .map(|(name, source)| {
                let used = match source {
                    Source::Pids(pids) => pids.iter().filter_map(|p| cpu::pid_cpu(*p)).sum(),
                    Source::Threads { prefix, tids } => threads
                        .iter()
                        .filter(|(tid, t)| t.name.starts_with(prefix) || tids.contains(tid))
                        .map(|(_, t)| t.cpu)
                        .sum(),
                };
                (name.clone(), used)
            })
            .collect();
        Reading {
            by_part,
            cores: core_ticks(),
        }
    }
}

impl Reading {
    /// CPU each account used since `before`.
    pub fn since(&self, before: &Reading) -> BTreeMap<String, Duration> {
        self.by_part
            .iter()
            .map(|(k, v)| {
                let old = before.by_part.get(k).copied().unwrap_or_default();
                (k.clone(), v.saturating_sub(old))
            })
            .collect()
    }

    /// Each core's busy share since `before` (0..=1).
    pub fn busy_since(&self, before: &Reading) -> Vec<f64> {
        self.cores
            .iter()
            .zip(&before.cores)
            .map(|((b1, t1), (b0, t0))| {
                let total = t1.saturating_sub(*t0);
                if total == 0 {
                    0.0
                } else {
                    b1.saturating_sub(*b0) as f64 / total as f64
                }
            })
            .collect()
    }
}

/// `/proc/stat`'s per-core (busy, total) ticks: busy is all but idle and iowait.
fn core_ticks() -> Vec<(u64, u64)> {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Vec::new();
    };
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let f: Vec<u64> = l
                .split_whitespace()
                .skip(1)
                .take(8)
                .filter_map(|v| v.parse().ok())
                .collect();
            let total: u64 = f.iter().sum();
            let idle = f.get(3).copied().unwrap_or(0) + f.get(4).copied().unwrap_or(0);
            (total.saturating_sub(idle), total)
        })
        .collect()
}
