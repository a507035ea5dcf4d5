//! One rank's predicted requests, with their totals kept as they change: the load view reads a
//! rank's load once per candidate per selection, and summing every prediction there made a
//! selection cost grow with the requests in flight (BENCHMARKS.md, "Router hot path").

use std::collections::HashMap;

use kvroute_common::RequestId;

use super::Prediction;

/// What the predictions of one rank add to its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Totals {
    /// Prompt tokens of the predictions not yet prefilled.
    pub prefill_tokens: u64,
    pub blocks: u64,
    pub requests: u64,
}

/// Predictions by request id, and their [`Totals`].
#[derive(Debug, Default)]
pub(super) struct Predictions {
    by_request: HashMap<RequestId, Prediction>,
    totals: Totals,
}

impl Predictions {
    pub fn totals(&self) -> Totals {
        self.totals
    }

    pub fn len(&self) -> usize {
        self.by_request.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    pub fn contains_key(&self, request_id: &RequestId) -> bool {
        self.by_request.contains_key(request_id)
    }

    fn add(&mut self, p: &Prediction) {
        if !p.prefilled {
            self.totals.prefill_tokens += p.prefill_tokens;
        }
        self.totals.blocks += p.blocks;
        self.totals.requests += 1;
    }

    fn subtract(&mut self, p: &Prediction) {
        if !p.prefilled {
            self.totals.prefill_tokens -= p.prefill_tokens;
        }
        self.totals.blocks -= p.blocks;
        self.totals.requests -= 1;
    }

    /// Inserts or replaces; returns the replaced prediction.
    pub fn insert(&mut self, request_id: RequestId, prediction: Prediction) -> Option<Prediction> {
        self.add(&prediction);
        let old = self.by_request.insert(request_id, prediction);
        if let Some(old) = &old {
            self.subtract(old);
        }
        old
    }

    pub fn remove(&mut self, request_id: &RequestId) -> Option<Prediction> {
        let old = self.by_request.remove(request_id);
        if let Some(old) = &old {
            self.subtract(old);
        }
        old
    }

    /// The request's prompt is in the cache: it no longer counts as prefill.
    pub fn mark_prefilled(&mut self, request_id: &RequestId) {
        if let Some(p) = self.by_request.get_mut(request_id)
            && !p.prefilled
        {
            p.prefilled = true;
            self.totals.prefill_tokens -= p.prefill_tokens;
        }
    }

    pub fn retain(&mut self, keep: impl Fn(&Prediction) -> bool) {
        let mut totals = self.totals;
        self.by_request.retain(|_, p| {
            let kept = keep(p);
            if !kept {
                if !p.prefilled {
                    totals.prefill_tokens -= p.prefill_tokens;
                }
                totals.blocks -= p.blocks;
                totals.requests -= 1;
            }
            kept
        });
        self.totals = totals;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(prefill_tokens: u64, blocks: u64) -> Prediction {
        Prediction {
            prefill_tokens,
            blocks,
            added_ms: blocks,
            prefilled: false,
        }
    }

    /// The totals against a sum over the predictions, after every kind of change.
    #[test]
    fn totals_follow_every_change() {
        let id = |n: u128| RequestId::from_u128(n);
        let summed = |ps: &Predictions| {
            let mut t = Totals::default();
            for p in ps.by_request.values() {
                if !p.prefilled {
                    t.prefill_tokens += p.prefill_tokens;
                }
                t.blocks += p.blocks;
                t.requests += 1;
            }
            t
        };
        let mut ps = Predictions::default();
        for n in 1..=6 {
            ps.insert(id(n), p(100 * n as u64, n as u64));
            assert_eq!(ps.totals(), summed(&ps));
        }
        ps.insert(id(2), p(7, 70));
        assert_eq!(ps.totals(), summed(&ps));
        ps.mark_prefilled(&id(3));
        ps.mark_prefilled(&id(3));
        ps.mark_prefilled(&id(99));
        assert_eq!(ps.totals(), summed(&ps));
        assert!(ps.remove(&id(3)).is_some_and(|p| p.prefilled));
        assert!(ps.remove(&id(3)).is_none());
        assert_eq!(ps.totals(), summed(&ps));
        ps.retain(|p| p.added_ms % 2 == 0);
        assert_eq!(ps.totals(), summed(&ps));
        assert_eq!((ps.len(), ps.totals().requests), (3, 3));
        ps.retain(|_| false);
        assert_eq!(ps.totals(), Totals::default());
        assert!(ps.is_empty());
    }
}
