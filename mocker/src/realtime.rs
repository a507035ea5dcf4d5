//! The engine on real time, one driver for both shells (the kvroute-native fleet's workers and
//! the engine face's ranks): [`SimClock`] maps wall-clock time onto the engine's simulated time
//! (simulated = elapsed wall × speedup), [`RealTimeEngine`] submits and advances at the
//! simulated now and says when the engine next wants to run, and [`sleep_until`] waits for
//! that. The shells' loops only differ in what else they wait for. Uses tokio's clock, so tests
//! can pause it.

use std::time::Duration;

use tokio::time::Instant;

use crate::engine::{Engine, Ready, SimRequest, SubmitError};

/// An engine driven by a [`SimClock`]: submissions and advances happen at the simulated now.
#[derive(Debug)]
pub struct RealTimeEngine {
    engine: Engine,
    clock: SimClock,
    speedup: f64,
}

impl RealTimeEngine {
    /// `engine` on a clock started now, `speedup` simulated seconds per wall second.
    pub fn start(engine: Engine, speedup: f64) -> Self {
        Self {
            engine,
            clock: SimClock::start(speedup),
            speedup,
        }
    }

    /// A fresh `engine` on a clock started now (a cache reset).
    pub fn restart(&mut self, engine: Engine) {
        *self = Self::start(engine, self.speedup);
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Submits `request` at the simulated now.
    pub fn submit(&mut self, request: SimRequest) -> Result<(), SubmitError> {
        let now = self.clock.now();
        self.engine.submit(request, now)
    }

    /// Runs the engine up to the simulated now.
    pub fn advance(&mut self) -> Ready {
        let now = self.clock.now();
        self.engine.advance_to(now)
    }

    /// The wall instant at which the engine next has work due (`None`: idle until something is
    /// submitted).
    pub fn wake_at(&self) -> Option<Instant> {
        self.engine.next_wakeup().map(|sim| self.clock.wall_at(sim))
    }
}

/// Sleeps until `at`, forever if `None` (an idle engine: another branch of the select wakes it).
pub async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

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
