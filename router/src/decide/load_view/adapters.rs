//! LoRA adapter residency, predicted the way engines keep adapters: each rank's slots are an
//! LRU cache (vLLM's GPU adapter slots). An adapter is touched when a decision sends it to a
//! rank (every replica applies every decision, so replicas agree) and when a report lists it
//! as loaded; the rank's `max_loaded` most recently touched adapters count as resident. The
//! reports alone would not do: vLLM's `lora_requests_info` lists only the adapters of running
//! requests, so an idle adapter still resident in its slot vanishes from them. A report's
//! `waiting` adapters and `max_loaded` are taken as they are. Pure: time comes in as `now_ms`.

use kvroute_common::WorkerId;
use kvroute_common::messages::{AdapterSlots, Decision, WorkerLoad};

use crate::signals::AdapterAffinity;
use crate::worker::WorkerRank;

/// Adapters remembered per rank (the least recently touched go first beyond it).
const MAX_TOUCHED_PER_RANK: usize = AdapterSlots::MAX_NAMES;

#[derive(Debug, Default)]
struct RankAdapters {
    /// The last report's slots; `None` until a report carries them.
    reported: Option<AdapterSlots>,
    /// Adapters by when they were last touched, most recent last.
    touched: Vec<(String, u64)>,
}

impl RankAdapters {
    fn touch(&mut self, name: &str, now_ms: u64) {
        match self.touched.iter().position(|(a, _)| a == name) {
            Some(i) => {
                let mut entry = self.touched.remove(i);
                entry.1 = entry.1.max(now_ms);
                self.touched.push(entry);
            }
            None => {
                if self.touched.len() == MAX_TOUCHED_PER_RANK {
                    self.touched.remove(0);
                }
                self.touched.push((name.to_owned(), now_ms));
            }
        }
    }

    /// Slots, when known (0: unbounded).
    fn slots(&self) -> usize {
        self.reported.as_ref().map_or(0, |r| r.max_loaded as usize)
    }

    /// The adapters counted as resident: the most recently touched, as many as the slots.
    fn resident(&self) -> &[(String, u64)] {
        let keep = match self.slots() {
            0 => self.touched.len(),
            n => n.min(self.touched.len()),
        };
        &self.touched[self.touched.len() - keep..]
    }
}

/// Adapter residency per rank (see the module docs).
#[derive(Debug)]
pub struct AdapterView {
    max_age_ms: u64,
    ranks: hashbrown::HashMap<WorkerRank, RankAdapters>,
}

impl AdapterView {
    /// Adapters not touched for `max_age_ms` are forgotten.
    pub fn new(max_age_ms: u64) -> Self {
        Self {
            max_age_ms,
            ranks: hashbrown::HashMap::new(),
        }
    }

    /// How rank `rank` stands for adapter `name`; `None` when the rank reports no adapter
    /// slots and no decision sent it an adapter (nothing is known).
    pub fn affinity(&self, rank: WorkerRank, name: &str) -> Option<AdapterAffinity> {
        let r = self.ranks.get(&rank)?;
        let resident = r.resident();
        if resident.iter().any(|(a, _)| a == name) {
            return Some(AdapterAffinity::Loaded);
        }
        let reported = r.reported.as_ref()?;
        if reported.waiting.iter().any(|a| a == name) {
            return Some(AdapterAffinity::Waiting);
        }
        let slots = r.slots();
        Some(if slots == 0 || resident.len() < slots {
            AdapterAffinity::FreeSlot
        } else {
            AdapterAffinity::Full
        })
    }

    /// The adapter slots `rank` last reported; `None` when it reported none (or 0).
    pub fn slots(&self, rank: WorkerRank) -> Option<u32> {
        let n = self.ranks.get(&rank)?.slots();
        (n > 0).then_some(n as u32)
    }

    /// A decision touches its adapter on its rank (and its decode hop's).
    pub fn record(&mut self, d: &Decision, now_ms: u64) {
        let Some(name) = d.lora_name.as_deref().filter(|n| !n.is_empty()) else {
            return;
        };
        self.ranks
            .entry(WorkerRank::new(d.worker_id, d.dp_rank))
            .or_default()
            .touch(name, now_ms);
        if let Some(hop) = &d.decode {
            self.ranks
                .entry(WorkerRank::new(hop.worker_id, hop.dp_rank))
                .or_default()
                .touch(name, now_ms);
        }
    }

    /// Takes a report's slots: its loaded adapters are touched, its waiting ones and slot
    /// count replace the last report's. A report without slots changes nothing.
    pub fn report(&mut self, report: &WorkerLoad, now_ms: u64) {
        let Some(slots) = &report.adapters else {
            return;
        };
        let r = self
            .ranks
            .entry(WorkerRank::new(report.worker_id, report.dp_rank))
            .or_default();
        for name in slots.loaded.iter().take(MAX_TOUCHED_PER_RANK) {
            r.touch(name, now_ms);
        }
        r.reported = Some(slots.clone());
    }

    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.ranks.retain(|rank, _| rank.worker_id != worker_id);
    }

    /// Forgets adapters untouched for the maximum age, and ranks with nothing left.
    pub fn expire(&mut self, now_ms: u64) {
        let max_age = self.max_age_ms;
        self.ranks.retain(|_, r| {
            r.touched
                .retain(|(_, at)| now_ms.saturating_sub(*at) <= max_age);
            r.reported.is_some() || !r.touched.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::AdapterSlots;

    use super::*;
    use crate::signals::AdapterAffinity::{FreeSlot, Full, Loaded, Waiting};

    fn report(worker_id: u64, loaded: &[&str], waiting: &[&str], max: u32) -> WorkerLoad {
        WorkerLoad {
            adapters: Some(AdapterSlots {
                loaded: loaded.iter().map(|s| s.to_string()).collect(),
                waiting: waiting.iter().map(|s| s.to_string()).collect(),
                max_loaded: max,
            }),
            ..crate::testing::idle_report(worker_id)
        }
    }

    fn decision(worker_id: u64, lora: Option<&str>) -> Decision {
        let mut d = crate::testing::decision(worker_id, uuid::Uuid::new_v4(), 4, 64);
        d.lora_name = lora.map(str::to_owned);
        d
    }

    const W1: WorkerRank = WorkerRank {
        worker_id: 1,
        dp_rank: 0,
    };

    #[test]
    fn reports_say_loaded_waiting_free_or_full() {
        let mut view = AdapterView::new(60_000);
        assert_eq!(view.affinity(W1, "a"), None, "nothing known");
        view.report(&report(1, &["a", "b"], &["c"], 3), 0);
        assert_eq!(view.affinity(W1, "a"), Some(Loaded));
        assert_eq!(view.affinity(W1, "c"), Some(Waiting));
        assert_eq!(view.affinity(W1, "d"), Some(FreeSlot));
        view.report(&report(1, &["a", "b", "e"], &[], 3), 10);
        assert_eq!(view.affinity(W1, "d"), Some(Full));
        assert_eq!(view.affinity(W1, "c"), Some(Full));
        // A report without adapter slots changes nothing.
        view.report(&crate::testing::idle_report(1), 20);
        assert_eq!(view.affinity(W1, "a"), Some(Loaded));
    }

    #[test]
    fn slots_are_an_lru_of_decisions_and_reports() {
        let mut view = AdapterView::new(60_000);
        view.report(&report(1, &["a"], &[], 2), 0);
        view.record(&decision(1, Some("x")), 100);
        view.record(&decision(1, None), 100);
        assert_eq!(view.affinity(W1, "x"), Some(Loaded));
        assert_eq!(view.affinity(W1, "a"), Some(Loaded));
        // a and x fill both slots.
        assert_eq!(view.affinity(W1, "y"), Some(Full));
        // vLLM lists only running requests' adapters: an empty report evicts nothing.
        view.report(&report(1, &[], &[], 2), 600);
        assert_eq!(view.affinity(W1, "x"), Some(Loaded));
        // y evicts the least recently used, a.
        view.record(&decision(1, Some("y")), 700);
        assert_eq!(view.affinity(W1, "a"), Some(Full));
        assert_eq!(view.affinity(W1, "x"), Some(Loaded));
        // A report of a running touches it: x is now the least recent.
        view.report(&report(1, &["a"], &[], 2), 800);
        assert_eq!(view.affinity(W1, "x"), Some(Full));
        assert_eq!(view.affinity(W1, "y"), Some(Loaded));
        // A decode hop's worker gets the adapter too.
        let mut paired = decision(1, Some("z"));
        paired.decode = Some(kvroute_common::messages::DecodeHop {
            decision_id: uuid::Uuid::new_v4(),
            worker_id: 2,
            dp_rank: 0,
            request_subject: String::new(),
            cost: Default::default(),
            policy: String::new(),
            bootstrap_room: 0,
        });
        view.record(&paired, 1_300);
        let w2 = WorkerRank::new(2, 0);
        assert_eq!(view.affinity(w2, "z"), Some(Loaded));
        assert_eq!(view.affinity(w2, "q"), None, "no report: slots unknown");
    }

    #[test]
    fn adapters_age_out_and_departed_workers_go() {
        let mut view = AdapterView::new(5_000);
        view.record(&decision(1, Some("x")), 0);
        view.record(&decision(2, Some("x")), 0);
        view.expire(4_000);
        assert_eq!(view.affinity(W1, "x"), Some(Loaded));
        view.expire(5_001);
        assert_eq!(view.affinity(W1, "x"), None);
        view.report(&report(1, &["a"], &[], 2), 6_000);
        view.remove_worker(1);
        assert_eq!(view.affinity(W1, "a"), None);
    }
}
