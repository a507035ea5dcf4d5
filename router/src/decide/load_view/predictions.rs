//! One rank's predicted requests, with their totals kept as they change: the load view reads a
//! rank's load once per candidate per selection, and summing every prediction there made a
//! selection cost grow with the requests in flight (BENCHMARKS.md, "Router hot path"). With the
//! prefill decay on, the predictions still in prefill are also kept in decision order, and the
//! oldest of them is at hand.

use std::collections::{BTreeMap, HashMap};

use kvroute_common::RequestId;
use kvroute_common::messages::Decision;

/// One decision's predicted load on its rank, until its lifecycle or a report releases it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prediction {
    pub prefill_tokens: u64,
    pub blocks: u64,
    pub added_ms: u64,
    pub prefilled: bool,
    /// Tokens generated, as the last `progress` event said (output blocks only).
    pub output_tokens: u64,
    /// What they count ([`super::models::output_milliblocks`]).
    pub output_milliblocks: u64,
}

impl Prediction {
    pub fn of(d: &Decision, added_ms: u64) -> Self {
        Self {
            prefill_tokens: d.prefill_tokens,
            blocks: u64::from(d.request_blocks),
            added_ms,
            prefilled: false,
            output_tokens: 0,
            output_milliblocks: 0,
        }
    }
}

/// What the predictions of one rank add to its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Totals {
    /// Prompt tokens of the predictions not yet prefilled.
    pub prefill_tokens: u64,
    pub blocks: u64,
    pub requests: u64,
    /// Output blocks, weighted, in thousandths of a block (0 unless output blocks are tracked).
    pub output_milliblocks: u64,
}

/// The oldest prediction still in prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Oldest {
    pub added_ms: u64,
    pub prefill_tokens: u64,
}

/// Predictions by request id, and their [`Totals`].
#[derive(Debug, Default)]
pub(super) struct Predictions {
    by_request: HashMap<RequestId, Prediction>,
    totals: Totals,
    /// The predictions not yet prefilled by (time added, id), with their prompt tokens; kept
    /// only for the prefill decay.
    in_prefill: Option<BTreeMap<(u64, RequestId), u64>>,
    /// The first of `in_prefill`, so a read costs no tree descent.
    oldest: Option<Oldest>,
}

impl Predictions {
    /// `order_prefills`: keep the predictions in prefill in order (for [`Predictions::oldest`]).
    pub fn new(order_prefills: bool) -> Self {
        Self {
            in_prefill: order_prefills.then(BTreeMap::new),
            ..Self::default()
        }
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// The oldest prediction still in prefill (only when ordering them).
    pub fn oldest(&self) -> Option<Oldest> {
        self.oldest
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

    fn add(&mut self, id: RequestId, p: &Prediction) {
        if !p.prefilled {
            self.totals.prefill_tokens += p.prefill_tokens;
            if let Some(order) = &mut self.in_prefill {
                order.insert((p.added_ms, id), p.prefill_tokens);
            }
        }
        self.totals.blocks += p.blocks;
        self.totals.requests += 1;
        self.totals.output_milliblocks += p.output_milliblocks;
    }

    fn subtract(&mut self, id: RequestId, p: &Prediction) {
        if !p.prefilled {
            self.totals.prefill_tokens -= p.prefill_tokens;
            if let Some(order) = &mut self.in_prefill {
                order.remove(&(p.added_ms, id));
            }
        }
        self.totals.blocks -= p.blocks;
        self.totals.requests -= 1;
        self.totals.output_milliblocks -= p.output_milliblocks;
    }

    fn update_oldest(&mut self) {
        self.oldest = self.in_prefill.as_ref().and_then(|order| {
            order
                .first_key_value()
                .map(|(&(added_ms, _), &prefill_tokens)| Oldest {
                    added_ms,
                    prefill_tokens,
                })
        });
    }

    /// Inserts or replaces; returns the replaced prediction.
    pub fn insert(&mut self, request_id: RequestId, prediction: Prediction) -> Option<Prediction> {
        let old = self.by_request.insert(request_id, prediction);
        if let Some(old) = &old {
            self.subtract(request_id, old);
        }
        self.add(request_id, &prediction);
        self.update_oldest();
        old
    }

    pub fn remove(&mut self, request_id: &RequestId) -> Option<Prediction> {
        let old = self.by_request.remove(request_id);
        if let Some(old) = &old {
            self.subtract(*request_id, old);
            self.update_oldest();
        }
        old
    }

    /// The request's prompt is in the cache: it no longer counts as prefill.
    pub fn mark_prefilled(&mut self, request_id: &RequestId) {
        if let Some(p) = self.by_request.get(request_id).copied()
            && !p.prefilled
        {
            self.insert(
                *request_id,
                Prediction {
                    prefilled: true,
                    ..p
                },
            );
        }
    }

    /// The request has generated `output_tokens`, which count `output_milliblocks`; an older
    /// progress report (fewer tokens) changes nothing. Returns whether the request is here.
    pub fn progress(
        &mut self,
        request_id: &RequestId,
        output_tokens: u64,
        output_milliblocks: u64,
    ) -> bool {
        let Some(p) = self.by_request.get_mut(request_id) else {
            return false;
        };
        if output_tokens > p.output_tokens {
            p.output_tokens = output_tokens;
            self.totals.output_milliblocks =
                self.totals.output_milliblocks - p.output_milliblocks + output_milliblocks;
            p.output_milliblocks = output_milliblocks;
        }
        true
    }

    pub fn retain(&mut self, keep: impl Fn(&Prediction) -> bool) {
        let Self {
            by_request,
            totals,
            in_prefill,
            ..
        } = self;
        by_request.retain(|id, p| {
            let kept = keep(p);
            if !kept {
                if !p.prefilled {
                    totals.prefill_tokens -= p.prefill_tokens;
                    if let Some(order) = in_prefill.as_mut() {
                        order.remove(&(p.added_ms, *id));
                    }
                }
                totals.blocks -= p.blocks;
                totals.requests -= 1;
                totals.output_milliblocks -= p.output_milliblocks;
            }
            kept
        });
        self.update_oldest();
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
            output_tokens: 0,
            output_milliblocks: 0,
        }
    }

    /// The totals and the oldest prediction in prefill against a pass over the predictions,
    /// after every kind of change.
    #[test]
    fn totals_follow_every_change() {
        let id = |n: u128| RequestId::from_u128(n);
        let check = |ps: &Predictions| {
            let mut t = Totals::default();
            let mut oldest: Option<(u64, RequestId, u64)> = None;
            for (id, p) in &ps.by_request {
                if !p.prefilled {
                    t.prefill_tokens += p.prefill_tokens;
                    if oldest.is_none_or(|(at, o, _)| (p.added_ms, *id) < (at, o)) {
                        oldest = Some((p.added_ms, *id, p.prefill_tokens));
                    }
                }
                t.blocks += p.blocks;
                t.requests += 1;
                t.output_milliblocks += p.output_milliblocks;
            }
            assert_eq!(ps.totals(), t);
            let oldest = oldest.map(|(added_ms, _, prefill_tokens)| Oldest {
                added_ms,
                prefill_tokens,
            });
            assert_eq!(ps.oldest(), oldest);
        };
        let mut ps = Predictions::new(true);
        for n in 1..=6 {
            ps.insert(id(n), p(100 * n as u64, n as u64));
            check(&ps);
        }
        ps.insert(id(2), p(7, 70));
        check(&ps);
        ps.mark_prefilled(&id(1));
        ps.mark_prefilled(&id(3));
        ps.mark_prefilled(&id(3));
        ps.mark_prefilled(&id(99));
        check(&ps);
        assert!(ps.progress(&id(4), 64, 1000));
        assert!(ps.progress(&id(4), 128, 1500));
        assert!(ps.progress(&id(4), 100, 9000), "older progress is ignored");
        assert!(!ps.progress(&id(99), 64, 1000));
        check(&ps);
        assert_eq!(ps.totals().output_milliblocks, 1500);
        assert!(ps.remove(&id(3)).is_some_and(|p| p.prefilled));
        assert!(ps.remove(&id(3)).is_none());
        check(&ps);
        ps.retain(|p| p.added_ms % 2 == 0);
        check(&ps);
        assert_eq!((ps.len(), ps.totals().requests), (3, 3));
        ps.retain(|_| false);
        check(&ps);
        assert_eq!(ps.totals(), Totals::default());
        assert!(ps.is_empty());
    }

    #[test]
    fn without_ordering_there_is_no_oldest() {
        let mut ps = Predictions::new(false);
        ps.insert(RequestId::from_u128(1), p(100, 1));
        assert_eq!(ps.oldest(), None);
        assert_eq!(ps.totals().prefill_tokens, 100);
    }
}
