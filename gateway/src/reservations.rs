//! Reservations of `POST /v1/select_and_reserve`: a decision whose load the routers charge until
//! the caller releases it, or until it expires. Pure: time comes in as `now_ms`.
//!
//! A disaggregated selection reserves each hop apart: both share the request id, so a
//! reservation is keyed by request and worker.
//!
//! A reservation id names its request, worker and rank (`rsv_<request>_<worker hex>_<rank>`),
//! so any gateway replica can act on it: the replica that made it holds it in this table and
//! publishes `finished` when it expires; a release or `prefill_complete` reaching another
//! replica publishes the lifecycle event from the id alone (the holder's later `finished` at
//! expiry then finds the request already gone — harmless). Load is freed by lifecycle events,
//! which every router replica applies; a holder that dies before the expiry leaves the charge
//! to the routers' own prediction age limit.

use std::collections::{BTreeSet, HashMap};

use kvroute_common::{DpRank, RequestId, WorkerId};
use uuid::Uuid;

/// What a reservation charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub request_id: RequestId,
    pub worker_id: WorkerId,
    pub dp_rank: DpRank,
}

impl Reserved {
    /// The reservation id.
    pub fn id(&self) -> String {
        format!(
            "rsv_{}_{:x}_{}",
            self.request_id.simple(),
            self.worker_id,
            self.dp_rank
        )
    }

    /// Reads a reservation id.
    pub fn parse(id: &str) -> Option<Self> {
        let rest = id.strip_prefix("rsv_")?;
        let mut parts = rest.split('_');
        let request = Uuid::try_parse(parts.next()?).ok()?;
        let worker = u64::from_str_radix(parts.next()?, 16).ok()?;
        let rank = parts.next()?.parse::<DpRank>().ok()?;
        if parts.next().is_some() {
            return None;
        }
        let parsed = Self {
            request_id: request,
            worker_id: worker,
            dp_rank: rank,
        };
        // Only the canonical spelling (no leading zeros, lowercase).
        (parsed.id() == id).then_some(parsed)
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    reserved: Reserved,
    expires_ms: u64,
    prefilled: bool,
}

/// A reservation's request and worker.
type Key = (RequestId, WorkerId);

fn key(r: &Reserved) -> Key {
    (r.request_id, r.worker_id)
}

/// The table is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

/// The reservations this replica holds.
#[derive(Debug)]
pub struct Reservations {
    ttl_ms: u64,
    max: usize,
    entries: HashMap<Key, Entry>,
    by_expiry: BTreeSet<(u64, Key)>,
}

impl Reservations {
    pub fn new(ttl_ms: u64, max: usize) -> Self {
        Self {
            ttl_ms,
            max,
            entries: HashMap::new(),
            by_expiry: BTreeSet::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Holds `reserved` until `now_ms + ttl`; returns when it expires.
    pub fn insert(&mut self, reserved: Reserved, now_ms: u64) -> Result<u64, Full> {
        if let Some(e) = self.entries.get(&key(&reserved)) {
            return Ok(e.expires_ms); // the same request reserved again (a client retry)
        }
        if self.entries.len() >= self.max {
            return Err(Full);
        }
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        self.entries.insert(
            key(&reserved),
            Entry {
                reserved,
                expires_ms,
                prefilled: false,
            },
        );
        self.by_expiry.insert((expires_ms, key(&reserved)));
        Ok(expires_ms)
    }

    /// Marks the prompt prefilled. `false`: not held here (released, expired or another
    /// replica's), or already marked — the caller need not publish again.
    pub fn prefill_complete(&mut self, reserved: &Reserved) -> bool {
        match self.entries.get_mut(&key(reserved)) {
            Some(e) if e.reserved == *reserved && !e.prefilled => {
                e.prefilled = true;
                true
            }
            _ => false,
        }
    }

    /// Whether this replica holds `reserved`.
    pub fn holds(&self, reserved: &Reserved) -> bool {
        self.entries
            .get(&key(reserved))
            .is_some_and(|e| e.reserved == *reserved)
    }

    /// Lets go of `reserved`; `true` if it was held here.
    pub fn release(&mut self, reserved: &Reserved) -> bool {
        match self.entries.get(&key(reserved)) {
            Some(e) if e.reserved == *reserved => {
                let due = (e.expires_ms, key(reserved));
                self.entries.remove(&key(reserved));
                self.by_expiry.remove(&due);
                true
            }
            _ => false,
        }
    }

    /// Removes and returns every reservation due at `now_ms`.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Reserved> {
        let mut out = Vec::new();
        while let Some(&(at, id)) = self.by_expiry.first() {
            if at > now_ms {
                break;
            }
            self.by_expiry.pop_first();
            if let Some(e) = self.entries.remove(&id) {
                out.push(e.reserved);
            }
        }
        out
    }

    /// When the next reservation expires.
    pub fn next_expiry(&self) -> Option<u64> {
        self.by_expiry.first().map(|(at, _)| *at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reserved(n: u128, worker: u64) -> Reserved {
        Reserved {
            request_id: Uuid::from_u128(n),
            worker_id: worker,
            dp_rank: (n % 3) as u32,
        }
    }

    #[test]
    fn ids_round_trip_and_only_canonical_ones_parse() {
        let r = reserved(0xabc, 0xdead_beef);
        let id = r.id();
        assert_eq!(Reserved::parse(&id), Some(r));
        for bad in [
            "",
            "rsv_",
            "rsv_zz_1_0",
            &id.replace("rsv_", "res_"),
            &format!("{id}_9"),
            &id.to_uppercase(),
        ] {
            assert_eq!(Reserved::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn reservations_expire_unless_released() {
        let mut t = Reservations::new(1000, 10);
        let (a, b) = (reserved(1, 1), reserved(2, 2));
        assert_eq!(t.insert(a, 0), Ok(1000));
        assert_eq!(t.insert(b, 500), Ok(1500));
        assert_eq!(t.insert(a, 700), Ok(1000), "a retry keeps the first expiry");
        assert!(t.prefill_complete(&a));
        assert!(!t.prefill_complete(&a), "once");
        assert!(t.expire(999).is_empty());
        assert_eq!(t.expire(1000), [a]);
        assert!(!t.release(&a), "already expired");
        assert!(t.release(&b));
        assert!(t.expire(10_000).is_empty());
        assert!(t.is_empty());
    }

    #[test]
    fn the_hops_of_one_request_are_held_apart() {
        let mut t = Reservations::new(1000, 10);
        let (prefill, decode) = (reserved(1, 1), reserved(1, 2));
        t.insert(prefill, 0).unwrap();
        t.insert(decode, 10).unwrap();
        assert_eq!(t.len(), 2);
        assert!(t.holds(&prefill) && t.holds(&decode));
        assert!(t.release(&prefill));
        assert!(t.holds(&decode) && !t.holds(&prefill));
        assert_eq!(t.expire(1010), [decode]);
    }

    #[test]
    fn a_full_table_refuses() {
        let mut t = Reservations::new(1000, 1);
        t.insert(reserved(1, 1), 0).expect("room");
        assert_eq!(t.insert(reserved(2, 1), 0), Err(Full));
        let other_worker = Reserved {
            worker_id: 9,
            ..reserved(1, 1)
        };
        assert!(!t.release(&other_worker), "an id must match in full");
    }

    proptest! {
        /// Against a model (request → expiry): inserts keep the first expiry, a release
        /// succeeds exactly when the reservation is held, and an expiry returns exactly those
        /// due — so every reservation ends once, by release or by expiry.
        #[test]
        fn the_table_follows_its_model(
            ops in proptest::collection::vec((0u8..3, 0u128..20, 0u64..8), 1..300),
        ) {
            let mut t = Reservations::new(10, 1000);
            let mut model: std::collections::BTreeMap<u128, u64> = Default::default();
            let mut now = 0;
            for (op, n, dt) in ops {
                now += dt;
                let r = reserved(n, 1);
                match op {
                    0 => {
                        let at = t.insert(r, now).expect("room");
                        prop_assert_eq!(at, *model.entry(n).or_insert(now + 10));
                    }
                    1 => prop_assert_eq!(t.release(&r), model.remove(&n).is_some()),
                    _ => {
                        let mut got: Vec<u128> =
                            t.expire(now).iter().map(|e| e.request_id.as_u128()).collect();
                        got.sort_unstable();
                        let due: Vec<u128> =
                            model.iter().filter(|(_, at)| **at <= now).map(|(n, _)| *n).collect();
                        model.retain(|_, at| *at > now);
                        prop_assert_eq!(got, due);
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                prop_assert_eq!(t.next_expiry(), model.values().min().copied());
            }
        }
    }
}
