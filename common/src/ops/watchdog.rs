//! Noticing that this process has fallen behind on the requests of a queue group, so it can
//! step out until it has caught up (a stalled member otherwise keeps receiving its share until
//! the NATS server drops its connection). Two measures: the lateness of a periodic timer (a
//! stopped, starved or blocked runtime) and the age of the oldest request in flight (a stuck
//! handler). [`Watchdog`] is the pure rule; [`spawn_watchdog`] measures and decides whether
//! the process should be in its group: ready and not lagging.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{CounterVec, Gauge};

/// How often the shell measures.
pub const WATCHDOG_TICK: Duration = Duration::from_millis(100);

/// When to step out and when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// Lagging once the timer lateness or the oldest request in flight exceeds this.
    pub max_lag: Duration,
    /// Caught up once both stayed at or below half of `max_lag` for this long.
    pub rejoin_after: Duration,
}

impl WatchdogConfig {
    /// `max_lag`, rejoining after the same time of calm.
    pub fn new(max_lag: Duration) -> Self {
        Self {
            max_lag,
            rejoin_after: max_lag,
        }
    }
}

/// A change of state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    FellBehind { lag: Duration },
    CaughtUp,
}

/// The pure rule: fed the measured lag at (monotonic) times, says when the state changes.
#[derive(Debug, Clone)]
pub struct Watchdog {
    config: WatchdogConfig,
    lagging: bool,
    calm_since: Option<Duration>,
}

impl Watchdog {
    pub fn new(config: WatchdogConfig) -> Self {
        Self {
            config,
            lagging: false,
            calm_since: None,
        }
    }

    pub fn is_lagging(&self) -> bool {
        self.lagging
    }

    /// `lag` measured at `now` (any monotonic origin).
    pub fn observe(&mut self, now: Duration, lag: Duration) -> Option<Change> {
        if lag > self.config.max_lag {
            self.calm_since = None;
            if !self.lagging {
                self.lagging = true;
                return Some(Change::FellBehind { lag });
            }
            return None;
        }
        if !self.lagging {
            return None;
        }
        if lag > self.config.max_lag / 2 {
            self.calm_since = None;
            return None;
        }
        let since = *self.calm_since.get_or_insert(now);
        if now.saturating_sub(since) >= self.config.rejoin_after {
            self.lagging = false;
            self.calm_since = None;
            return Some(Change::CaughtUp);
        }
        None
    }
}

/// Requests being handled, with their start times.
#[derive(Debug, Default)]
pub struct InFlight {
    next: AtomicU64,
    started: Mutex<BTreeMap<u64, Instant>>,
}

/// One request in flight; dropping it ends it.
#[derive(Debug)]
pub struct InFlightGuard {
    owner: Arc<InFlight>,
    id: u64,
}

impl InFlight {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A request starts now.
    pub fn enter(self: &Arc<Self>) -> InFlightGuard {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Instant::now());
        InFlightGuard {
            owner: self.clone(),
            id,
        }
    }

    /// Age of the oldest request in flight at `now` (zero when none).
    pub fn oldest_age(&self, now: Instant) -> Duration {
        // Ids increase with start time, so the first entry is the oldest.
        self.lock()
            .first_key_value()
            .map_or(Duration::ZERO, |(_, at)| now.saturating_duration_since(*at))
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Instant>> {
        self.started.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.owner.lock().remove(&self.id);
    }
}

/// One measurement, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// How late the watchdog's own timer fired.
    pub loop_lag: Duration,
    pub oldest_in_flight: Duration,
    pub lagging: bool,
    /// Whether the process should be in its queue group now: ready and not lagging.
    pub serve: bool,
    pub change: Option<Change>,
}

/// Measures every [`WATCHDOG_TICK`]; the returned receiver says whether the process should be
/// in its queue group (`ready()` and not lagging). `observe` sees every sample (metrics, logs).
pub fn spawn_watchdog(
    config: WatchdogConfig,
    in_flight: Arc<InFlight>,
    ready: impl Fn() -> bool + Send + 'static,
    mut observe: impl FnMut(&Sample) + Send + 'static,
) -> (watch::Receiver<bool>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let origin = Instant::now();
        let mut dog = Watchdog::new(config);
        loop {
            let before = Instant::now();
            tokio::time::sleep(WATCHDOG_TICK).await;
            let now = Instant::now();
            let loop_lag = now.duration_since(before).saturating_sub(WATCHDOG_TICK);
            let oldest_in_flight = in_flight.oldest_age(now);
            let change = dog.observe(now.duration_since(origin), loop_lag.max(oldest_in_flight));
            let serve = ready() && !dog.is_lagging();
            observe(&Sample {
                loop_lag,
                oldest_in_flight,
                lagging: dog.is_lagging(),
                serve,
                change,
            });
            tx.send_if_modified(|s| std::mem::replace(s, serve) != serve);
            if tx.is_closed() {
                return;
            }
        }
    });
    (rx, task)
}

/// The reasons of a queue-group leave (the `reason` label of each process's leaves metric).
pub const LEFT_LAGGING: &str = "lagging";
pub const LEFT_NOT_READY: &str = "not_ready";

/// Every leave reason: the values of a process's [`WatchdogMetrics::leaves`] family.
pub fn leave_reasons() -> Vec<&'static str> {
    vec![LEFT_LAGGING, LEFT_NOT_READY]
}

/// The series a watchdog's samples update (each process registers its own names).
#[derive(Debug, Clone)]
pub struct WatchdogMetrics {
    /// The last measure, in milliseconds: timer lateness or the oldest request in flight.
    pub lag_ms: Arc<Gauge>,
    /// 1 while behind.
    pub lagging: Arc<Gauge>,
    /// Times the process left its queue group, by reason (`lagging`, `not_ready`).
    pub leaves: Arc<CounterVec>,
}

/// An `observe` for [`spawn_watchdog`]: updates `metrics` and logs every change, naming the
/// queue group (`what`: "select", "query").
pub fn watchdog_observer(
    what: &'static str,
    metrics: WatchdogMetrics,
) -> impl FnMut(&Sample) + Send + 'static {
    let mut serving = false;
    move |sample: &Sample| {
        let lag = sample.loop_lag.max(sample.oldest_in_flight);
        metrics.lag_ms.set(lag.as_millis() as i64);
        metrics.lagging.set(i64::from(sample.lagging));
        match sample.change {
            Some(Change::FellBehind { lag }) => tracing::warn!(
                lag_ms = lag.as_millis() as u64,
                loop_lag_ms = sample.loop_lag.as_millis() as u64,
                oldest_in_flight_ms = sample.oldest_in_flight.as_millis() as u64,
                "falling behind on requests; leaving the {what} queue group until caught up"
            ),
            Some(Change::CaughtUp) => {
                tracing::info!("caught up; rejoining the {what} queue group")
            }
            None => {}
        }
        if serving && !sample.serve {
            metrics.leaves.inc(if sample.lagging {
                LEFT_LAGGING
            } else {
                LEFT_NOT_READY
            });
        }
        serving = sample.serve;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn dog() -> Watchdog {
        Watchdog::new(WatchdogConfig {
            max_lag: 1000 * MS,
            rejoin_after: 500 * MS,
        })
    }

    #[test]
    fn a_long_stall_steps_out_and_calm_brings_it_back() {
        let mut d = dog();
        assert_eq!(d.observe(100 * MS, 20 * MS), None);
        assert_eq!(
            d.observe(200 * MS, 1000 * MS),
            None,
            "at the limit is not behind"
        );
        assert_eq!(
            d.observe(30_200 * MS, 30_000 * MS),
            Some(Change::FellBehind { lag: 30_000 * MS })
        );
        assert!(d.is_lagging());
        assert_eq!(d.observe(30_300 * MS, 2000 * MS), None);
        // Calm (at most half the limit) must last `rejoin_after`.
        assert_eq!(d.observe(30_400 * MS, 10 * MS), None);
        assert_eq!(d.observe(30_800 * MS, 500 * MS), None);
        assert_eq!(d.observe(30_900 * MS, 10 * MS), Some(Change::CaughtUp));
        assert!(!d.is_lagging());
    }

    #[test]
    fn lag_above_half_the_limit_restarts_the_calm_period() {
        let mut d = dog();
        d.observe(Duration::ZERO, 5000 * MS);
        assert_eq!(d.observe(100 * MS, Duration::ZERO), None);
        assert_eq!(d.observe(400 * MS, 600 * MS), None, "not calm");
        assert_eq!(d.observe(500 * MS, Duration::ZERO), None);
        assert_eq!(
            d.observe(900 * MS, Duration::ZERO),
            None,
            "only 400 ms calm"
        );
        assert_eq!(d.observe(1000 * MS, Duration::ZERO), Some(Change::CaughtUp));
    }

    #[test]
    fn in_flight_reports_its_oldest_request() {
        let f = InFlight::new();
        assert_eq!(f.oldest_age(Instant::now()), Duration::ZERO);
        let first = f.enter();
        std::thread::sleep(5 * MS);
        let second = f.enter();
        let now = Instant::now();
        assert!(f.oldest_age(now) >= 5 * MS);
        drop(first);
        assert!(f.oldest_age(now) < 5 * MS);
        assert_eq!(f.len(), 1);
        drop(second);
        assert!(f.is_empty());
    }
}
