//! When an engine is registered: the pure rule the supervisor applies to each health probe.
//!
//! A healthy engine that is not registered is registered; `failures_limit` consecutive failed
//! probes deregister it. An engine that was deemed down (that many failures in a row, whether
//! or not it was registered) may have restarted with an empty cache, so its next registration
//! says so (`was_down`), and the relay checks the engine's incarnation
//! ([`crate::relay::Relay::check_incarnation`]). The shell carries out the [`Action`] and keeps the returned state if it
//! succeeded; a registration can fail (facts missing, NATS or etcd errors), and then the shell
//! keeps [`HealthState::registration_failed`], so the rule asks again at the next probe.

/// Where an engine stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HealthState {
    pub registered: bool,
    /// Consecutive failed probes.
    pub failures: u32,
    /// The engine was deemed down since its last registration: it may have restarted (its
    /// next registration checks its incarnation).
    pub restarted: bool,
}

impl HealthState {
    /// The state to keep when the registration [`step`] asked for failed: the probe still
    /// succeeded (the failure run is over), but the engine is not registered, and a restart
    /// seen before still makes the next registration a new incarnation.
    pub fn registration_failed(self) -> Self {
        Self {
            failures: 0,
            ..self
        }
    }
}

/// What the shell does after a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Nothing,
    /// Register the engine (a new `WorkerAgent`); `was_down`: it was deemed down since its last registration,
    /// so the relay checks whether it kept its cache.
    Register {
        was_down: bool,
    },
    /// Deregister it (revoke the lease, stop load and requests).
    Deregister,
}

/// The next state and action after a probe (`probe_ok`: `/health` answered 200).
pub fn step(state: HealthState, probe_ok: bool, failures_limit: u32) -> (HealthState, Action) {
    let limit = failures_limit.max(1);
    if probe_ok {
        let next = HealthState {
            registered: true,
            failures: 0,
            restarted: false,
        };
        let action = if state.registered {
            Action::Nothing
        } else {
            Action::Register {
                was_down: state.restarted,
            }
        };
        return (next, action);
    }
    let failures = state.failures.saturating_add(1);
    let down = failures >= limit;
    let next = HealthState {
        registered: state.registered && !down,
        failures,
        restarted: state.restarted || down,
    };
    let action = if state.registered && down {
        Action::Deregister
    } else {
        Action::Nothing
    };
    (next, action)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a seeded sequence without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn chance(&mut self, percent: u64) -> bool {
            self.next() % 100 < percent
        }
    }

    /// The naive model: the whole probe history, judged from scratch at each probe.
    #[derive(Default)]
    struct Model {
        probes: Vec<bool>,
        registered: bool,
        /// The probe at which the last registration was carried out.
        registered_at: Option<usize>,
    }

    impl Model {
        fn trailing_failures(&self) -> usize {
            self.probes.iter().rev().take_while(|ok| !**ok).count()
        }

        /// `limit` failures in a row since the last registration (or the start).
        fn down_since_registration(&self, limit: usize) -> bool {
            let from = self.registered_at.map_or(0, |i| i + 1);
            self.probes[from..]
                .windows(limit)
                .any(|w| w.iter().all(|ok| !ok))
        }
    }

    type Step = fn(HealthState, bool, u32) -> (HealthState, Action);
    type Trace = Vec<(bool, Action)>;

    /// Drives `step` with a seeded probe sequence against the model; the first disagreement
    /// is an error naming the seed, the probe and the trace up to it.
    fn run(step: Step, seed: u64, limit: u32, steps: usize) -> Result<Trace, String> {
        let mut rng = Rng(seed);
        let mut state = HealthState::default();
        let mut model = Model::default();
        let mut trace = Vec::new();
        // Phases of mostly-healthy and mostly-failing engines, so long runs of both occur.
        let mut failing = false;
        for i in 0..steps {
            if rng.chance(8) {
                failing = !failing;
            }
            let ok = rng.chance(if failing { 10 } else { 90 });
            let expected = if ok && !model.registered {
                Action::Register {
                    was_down: model.down_since_registration(limit as usize),
                }
            } else if !ok && model.registered && model.trailing_failures() + 1 == limit as usize {
                Action::Deregister
            } else {
                Action::Nothing
            };
            model.probes.push(ok);
            let (next, action) = step(state, ok, limit);
            trace.push((ok, action));
            if action != expected {
                return Err(format!(
                    "seed {seed} limit {limit} probe {i}: {action:?}, expected {expected:?}; probes and actions: {trace:?}"
                ));
            }
            // The shell: registrations fail now and then (missing facts, etcd down), and then
            // it keeps `registration_failed()`.
            let carried_out = !matches!(action, Action::Register { .. }) || !rng.chance(20);
            if !carried_out {
                state = state.registration_failed();
                continue;
            }
            state = next;
            match action {
                Action::Register { .. } => {
                    model.registered = true;
                    model.registered_at = Some(i);
                }
                Action::Deregister => model.registered = false,
                Action::Nothing => {}
            }
            if state.registered != model.registered {
                return Err(format!(
                    "seed {seed} probe {i}: registered {}",
                    state.registered
                ));
            }
        }
        Ok(trace)
    }

    fn run_all(step: Step) -> Result<Trace, String> {
        let mut all = Vec::new();
        for seed in 0..300 {
            for limit in [1, 2, 3, 5] {
                all.extend(run(step, seed, limit, 400)?);
            }
        }
        Ok(all)
    }

    #[test]
    fn seeded_probe_sequences_match_the_naive_model() {
        let trace = run_all(step).unwrap_or_else(|e| panic!("{e}"));
        // The sequences exercise every transition.
        let count = |a: Action| trace.iter().filter(|(_, x)| *x == a).count();
        assert!(count(Action::Deregister) > 100);
        for was_down in [false, true] {
            assert!(count(Action::Register { was_down }) > 100);
        }
    }

    #[test]
    fn the_model_catches_broken_rules() {
        fn forgets_restarts(s: HealthState, ok: bool, limit: u32) -> (HealthState, Action) {
            let (next, a) = step(s, ok, limit);
            (
                HealthState {
                    restarted: false,
                    ..next
                },
                a,
            )
        }
        fn off_by_one(s: HealthState, ok: bool, limit: u32) -> (HealthState, Action) {
            step(s, ok, limit + 1)
        }
        fn counts_across_successes(s: HealthState, ok: bool, limit: u32) -> (HealthState, Action) {
            let (next, a) = step(s, ok, limit);
            let failures = if ok { s.failures } else { next.failures };
            (HealthState { failures, ..next }, a)
        }
        for broken in [
            forgets_restarts as Step,
            off_by_one,
            counts_across_successes,
        ] {
            assert!(run_all(broken).is_err());
        }
    }

    #[test]
    fn a_flapping_engine_stays_registered_below_the_limit() {
        let mut s = HealthState::default();
        let mut actions = Vec::new();
        for ok in [true, false, false, true, false, false, true] {
            let (next, a) = step(s, ok, 3);
            s = next;
            actions.push(a);
        }
        assert_eq!(actions[0], Action::Register { was_down: false });
        assert!(actions[1..].iter().all(|a| *a == Action::Nothing));
        assert!(s.registered);
    }

    #[test]
    fn down_then_up_is_a_was_down_even_if_never_registered() {
        let mut s = HealthState::default();
        for _ in 0..3 {
            s = step(s, false, 3).0;
        }
        assert!(s.restarted && !s.registered);
        let (s2, a) = step(s, true, 3);
        assert_eq!(a, Action::Register { was_down: true });
        assert!(!s2.restarted);
        // Registration failed: the next success asks again, still as a new incarnation, and
        // the failure run starts afresh.
        let kept = s.registration_failed();
        assert_eq!(kept.failures, 0);
        assert_eq!(step(kept, true, 3).1, Action::Register { was_down: true });
        assert_eq!(step(kept, false, 3).1, Action::Nothing);
        // Registered and failing: deregistered exactly at the limit, once.
        let mut s = s2;
        let mut actions = Vec::new();
        for _ in 0..5 {
            let (next, a) = step(s, false, 3);
            s = next;
            actions.push(a);
        }
        use Action::*;
        assert_eq!(actions, [Nothing, Nothing, Deregister, Nothing, Nothing]);
        assert_eq!(
            step(HealthState::default(), false, 0).1,
            Nothing,
            "limit 0 acts as 1"
        );
    }
}
