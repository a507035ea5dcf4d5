//! Maps wall-clock time onto an engine's simulated time: simulated = elapsed wall × speedup.
//! Uses tokio's clock, so tests can pause it.

use std::time::Duration;

use tokio::time::Instant;

/// The simulated clock of one worker, started when the worker (or its cache reset) started.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    start: Instant,
    speedup: f64,
}

impl SimClock {
    /// `speedup` simulated seconds per wall second (validated positive by the config).
    pub fn start(speedup: f64) -> Self {
        Self {
            start: Instant::now(),
            speedup,
        }
    }

    /// Simulated time now.
    pub fn now(&self) -> Duration {
        self.sim_at(Instant::now())
    }

    /// Simulated time at wall instant `at` (zero before the start).
    pub fn sim_at(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.start)
            .mul_f64(self.speedup)
    }

    /// The wall instant at which simulated time reaches `sim`, rounded up so that
    /// `self.sim_at(self.wall_at(sim)) >= sim`.
    pub fn wall_at(&self, sim: Duration) -> Instant {
        let wall = sim.div_f64(self.speedup) + Duration::from_nanos(1);
        self.start + wall
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn wall_and_sim_agree() {
        let clock = SimClock::start(50.0);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(clock.now(), Duration::from_secs(1));
        let at = clock.wall_at(Duration::from_millis(1500));
        assert!(clock.sim_at(at) >= Duration::from_millis(1500));
        assert!(clock.sim_at(at) < Duration::from_millis(1501));
    }
}
