//! Which router replica owns a (model, role) partition: rendezvous hashing over the serving
//! replicas registered in etcd. Every replica computes the same owner from the same set, and a
//! replica leaving moves only its own partitions. The owner makes every decision of its
//! partitions, so a burst spread over replicas is decided in one sequence, as by one router.
//!
//! Why owners: replicas that each decide a burst's requests before seeing the others'
//! decisions pick the same least-loaded worker (TTFT p90 1.31× one replica's on the
//! conversation trace; BENCHMARKS.md, "Router replicas: partition owners and predicted
//! overlap"). Sharing state faster cannot close that window, and per-worker reservations by
//! compare-and-set in JetStream KV would make every decision a replicated round trip with a
//! retry loop under contention, for per-worker atomicity only. An owner costs one NATS hop for
//! requests that arrive at another replica, and makes each partition's decisions one sequence
//! under one policy lock. Its costs: a partition's decisions are bounded by one replica's CPU
//! (replicas add throughput across partitions, not within one), and a dead owner's partitions
//! are decided where requests arrive until its lease expires.

use kvroute_common::messages::WorkerRole;
use xxhash_rust::xxh3::xxh3_64;

/// The replica's score for the partition: the highest owns it.
fn score(router_id: &str, model: &str, role: WorkerRole) -> u64 {
    let mut key = Vec::with_capacity(router_id.len() + model.len() + 16);
    key.extend_from_slice(router_id.as_bytes());
    key.push(0);
    key.extend_from_slice(model.as_bytes());
    key.push(0);
    key.extend_from_slice(role.as_str().as_bytes());
    xxh3_64(&key)
}

/// The owner of (`model`, `role`) among `routers`; `None` when there are none. Ties (equal
/// scores) go to the smaller id.
pub fn owner<'a>(
    routers: impl IntoIterator<Item = &'a str>,
    model: &str,
    role: WorkerRole,
) -> Option<&'a str> {
    routers
        .into_iter()
        .map(|r| (score(r, model, role), std::cmp::Reverse(r)))
        .max()
        .map(|(_, std::cmp::Reverse(r))| r)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn every_replica_agrees_and_a_departure_moves_only_its_partitions() {
        let routers = ["r-a", "r-b", "r-c", "r-d"];
        let models: Vec<String> = (0..400).map(|i| format!("model-{i}")).collect();
        let owners: BTreeMap<&str, &str> = models
            .iter()
            .map(|m| {
                (
                    m.as_str(),
                    owner(routers, m, WorkerRole::Aggregated).unwrap(),
                )
            })
            .collect();
        // Order of the set does not matter.
        for m in &models {
            let reversed = owner(routers.iter().rev().copied(), m, WorkerRole::Aggregated);
            assert_eq!(reversed, Some(owners[m.as_str()]));
        }
        // Spread: each of 4 replicas owns a fair share of 400 partitions.
        for r in routers {
            let n = owners.values().filter(|o| **o == r).count();
            assert!((60..=140).contains(&n), "{r} owns {n}");
        }
        // r-b leaves: only its partitions move.
        let left = ["r-a", "r-c", "r-d"];
        for m in &models {
            let now = owner(left, m, WorkerRole::Aggregated).unwrap();
            if owners[m.as_str()] != "r-b" {
                assert_eq!(now, owners[m.as_str()], "{m}");
            }
        }
        // Roles are partitions of their own.
        let differ = models
            .iter()
            .filter(|m| {
                owner(routers, m, WorkerRole::Prefill) != owner(routers, m, WorkerRole::Decode)
            })
            .count();
        assert!(differ > 100, "{differ}");
        assert_eq!(owner([], "m", WorkerRole::Aggregated), None);
    }
}
