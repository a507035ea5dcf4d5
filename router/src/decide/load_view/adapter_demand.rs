//! LoRA adapter demand, for placement: each adapter's share of its model's recent adapter
//! requests, counted from decisions (every replica applies every decision, so replicas agree)
//! with exponential decay. The share placement reads is held: it rises at once and falls only
//! once its peak is `hold_ms` old, so an adapter's replica count does not flap with each quiet
//! spell (a shrink moves the adapter's requests to fewer ranks; a flap would load it again).
//! Pure: time comes in as `now_ms`.

/// A count decaying by half every `half_life_ms`.
#[derive(Debug, Clone, Copy, Default)]
struct Decayed {
    value: f64,
    at_ms: u64,
}

impl Decayed {
    fn at(self, now_ms: u64, half_life_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(self.at_ms) as f64;
        self.value * (-age / half_life_ms as f64).exp2()
    }

    fn add(&mut self, now_ms: u64, half_life_ms: u64) {
        let now_ms = now_ms.max(self.at_ms);
        self.value = self.at(now_ms, half_life_ms) + 1.0;
        self.at_ms = now_ms;
    }
}

#[derive(Debug, Default)]
struct Adapter {
    demand: Decayed,
    peak_share: f64,
    peak_at_ms: u64,
}

#[derive(Debug, Default)]
struct Model {
    total: Decayed,
    adapters: hashbrown::HashMap<String, Adapter>,
}

/// Per model, each adapter's decayed request count and held share (see the module docs).
#[derive(Debug)]
pub struct AdapterDemand {
    half_life_ms: u64,
    hold_ms: u64,
    models: hashbrown::HashMap<String, Model>,
}

/// Adapters a model remembers; beyond it the least demanded goes.
const MAX_ADAPTERS_PER_MODEL: usize = 4096;

impl AdapterDemand {
    /// Demand halves every `half_life_ms` (≥ 1); a share's peak holds for `hold_ms`.
    pub fn new(half_life_ms: u64, hold_ms: u64) -> Self {
        Self {
            half_life_ms: half_life_ms.max(1),
            hold_ms,
            models: hashbrown::HashMap::new(),
        }
    }

    /// A request of `model` naming adapter `name` was decided at `now_ms`.
    pub fn record(&mut self, model: &str, name: &str, now_ms: u64) {
        let hl = self.half_life_ms;
        let m = match self.models.get_mut(model) {
            Some(m) => m,
            None => self.models.entry(model.to_owned()).or_default(),
        };
        // A decision dated before the model's last one counts at the last one's time.
        let now_ms = now_ms.max(m.total.at_ms);
        m.total.add(now_ms, hl);
        if !m.adapters.contains_key(name) && m.adapters.len() >= MAX_ADAPTERS_PER_MODEL {
            let least = m
                .adapters
                .iter()
                .min_by(|a, b| {
                    a.1.demand
                        .at(now_ms, hl)
                        .total_cmp(&b.1.demand.at(now_ms, hl))
                })
                .map(|(k, _)| k.clone());
            if let Some(least) = least {
                m.adapters.remove(&least);
            }
        }
        let a = match m.adapters.get_mut(name) {
            Some(a) => a,
            None => m.adapters.entry(name.to_owned()).or_default(),
        };
        a.demand.add(now_ms, hl);
        let share = a.demand.at(now_ms, hl) / m.total.at(now_ms, hl).max(f64::MIN_POSITIVE);
        if share >= a.peak_share || now_ms.saturating_sub(a.peak_at_ms) >= self.hold_ms {
            a.peak_share = share;
            a.peak_at_ms = now_ms.max(a.peak_at_ms);
        }
    }

    /// Adapter `name`'s share of `model`'s recent adapter requests, in [0, 1]: its peak while
    /// the peak is younger than the hold, else the share now. 0 for an adapter never decided.
    pub fn share(&self, model: &str, name: &str, now_ms: u64) -> f64 {
        let Some(m) = self.models.get(model) else {
            return 0.0;
        };
        let Some(a) = m.adapters.get(name) else {
            return 0.0;
        };
        let hl = self.half_life_ms;
        let total = m.total.at(now_ms, hl);
        let now = if total > 0.0 {
            (a.demand.at(now_ms, hl) / total).min(1.0)
        } else {
            0.0
        };
        if now_ms.saturating_sub(a.peak_at_ms) < self.hold_ms {
            now.max(a.peak_share)
        } else {
            now
        }
    }

    /// Forgets adapters whose demand has decayed below a hundredth of a request and whose
    /// peak has passed its hold, and models with none left.
    pub fn expire(&mut self, now_ms: u64) {
        let (hl, hold) = (self.half_life_ms, self.hold_ms);
        self.models.retain(|_, m| {
            m.adapters.retain(|_, a| {
                a.demand.at(now_ms, hl) >= 0.01 || now_ms.saturating_sub(a.peak_at_ms) < hold
            });
            !m.adapters.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_demand_and_decay() {
        let mut d = AdapterDemand::new(10_000, 0);
        for t in 0..30 {
            d.record("m", "hot", t * 10);
            if t % 3 == 0 {
                d.record("m", "cold", t * 10);
            }
        }
        let hot = d.share("m", "hot", 300);
        let cold = d.share("m", "cold", 300);
        assert!((hot - 0.75).abs() < 0.01, "{hot}");
        assert!((cold - 0.25).abs() < 0.01, "{cold}");
        assert_eq!(d.share("m", "never", 300), 0.0);
        assert_eq!(d.share("other", "hot", 300), 0.0);
        // Only cold is asked for from now on: after five half-lives it dominates.
        for t in 0..50 {
            d.record("m", "cold", 1_000 + t * 1_000);
        }
        assert!(d.share("m", "cold", 50_000) > 0.9);
        assert!(d.share("m", "hot", 50_000) < 0.1);
    }

    #[test]
    fn a_peak_holds_then_falls() {
        let mut d = AdapterDemand::new(1_000, 60_000);
        for t in 0..10 {
            d.record("m", "a", t);
        }
        assert!(d.share("m", "a", 10) > 0.99);
        // Another adapter takes over: a's share now is small, but its peak holds.
        for t in 0..20 {
            d.record("m", "b", 10_000 + t * 100);
        }
        assert!(d.share("m", "a", 12_000) > 0.99, "held");
        assert!(d.share("m", "a", 70_000) < 0.01, "the hold is over");
        // A lower share recorded after the hold replaces the peak.
        for _ in 0..3 {
            d.record("m", "b", 70_000);
        }
        d.record("m", "a", 70_000);
        let s = d.share("m", "a", 70_000);
        assert!((s - 0.25).abs() < 0.01, "{s}");
    }

    #[test]
    fn idle_adapters_are_forgotten() {
        let mut d = AdapterDemand::new(1_000, 5_000);
        d.record("m", "a", 0);
        d.expire(5_000);
        assert!(d.share("m", "a", 5_000) > 0.0, "held");
        d.expire(7_000);
        assert_eq!(d.share("m", "a", 7_000), 0.0);
        assert!(d.models.is_empty());
    }

    #[test]
    fn out_of_order_decisions_count_once_each() {
        let mut d = AdapterDemand::new(1_000, 0);
        d.record("m", "a", 1_000);
        d.record("m", "b", 500);
        let (a, b) = (d.share("m", "a", 1_000), d.share("m", "b", 1_000));
        assert!((a - 0.5).abs() < 1e-9 && (b - 0.5).abs() < 1e-9, "{a} {b}");
    }
}
