//! LoRA adapters in the decision core: a request goes where its adapter is resident, away
//! from ranks whose slots are full, at a bounded cost; base-model requests pay nothing.

use super::*;

/// A report of worker `worker_id` with nothing running and the adapters `loaded` in 2 slots.
fn adapter_report(worker_id: u64, loaded: &[&str]) -> kvroute_common::messages::WorkerLoad {
    kvroute_common::messages::WorkerLoad {
        adapters: Some(kvroute_common::messages::AdapterSlots {
            loaded: loaded.iter().map(|a| a.to_string()).collect(),
            waiting: Vec::new(),
            max_loaded: 2,
        }),
        ..crate::testing::idle_report(worker_id)
    }
}

fn for_adapter(id: u128, adapter: &str) -> SelectRequest {
    SelectRequest {
        lora_name: Some(adapter.into()),
        ..request(id)
    }
}

#[test]
fn requests_go_where_their_adapter_is_and_away_from_full_ranks() {
    let mut f = Fixture::predicting(3, 0);
    // The affinity alone (placement has its own test).
    f.settings.adapter_placement = false;
    f.view.apply_report(&adapter_report(1, &["a", "b"]), 900);
    f.view.apply_report(&adapter_report(2, &["c", "x"]), 900);
    f.view.apply_report(&adapter_report(3, &[]), 900);
    // Equal load: the rank holding the adapter wins; the decision names it.
    let a = new(f.decide_distinct(&for_adapter(1, "a"), 0, 1_000).unwrap()).decision;
    assert_eq!((a.worker_id, a.lora_name.as_deref()), (1, Some("a")));
    assert_eq!(a.cost.terms["prefill"], 64.0 * 32.0, "no adapter cost");
    // A new adapter avoids the full ranks 1 and 2 (16 blocks each) for rank 3's free slot
    // (0.2 · 16 blocks), though rank 1 has a request charged now.
    let d = new(f.decide_distinct(&for_adapter(2, "d"), 100, 1_000).unwrap()).decision;
    assert_eq!(d.worker_id, 3);
    assert_eq!(d.cost.terms["prefill"], 64.0 * (32.0 + 0.2 * 16.0));
    // The decision made `d` resident on rank 3 (for every replica: it is in the decision),
    // so the next request for it pays no adapter cost there...
    let view = &f.view;
    assert_eq!(
        view.adapter_affinity(WorkerRank::new(3, 0), "d"),
        Some(crate::signals::AdapterAffinity::Loaded)
    );
    // ... but the adapter cost is bounded: rank 3's queued prompt (32 blocks) outweighs it,
    // and `e` goes to the idle full rank 2, paying the 16 blocks of a load there.
    let e = new(f.decide_distinct(&for_adapter(3, "e"), 200, 1_000).unwrap()).decision;
    assert_eq!(e.worker_id, 2);
    assert_eq!(e.cost.terms["prefill"], 64.0 * (32.0 + 16.0));
    // A base-model request pays nothing for adapters.
    let base = new(f.decide_distinct(&request(4), 300, 1_000).unwrap()).decision;
    assert_eq!(base.lora_name, None);
    // Its own 32 blocks and the 32 queued on whichever rank it went to: no adapter part.
    assert_eq!(base.cost.terms["prefill"], 64.0 * (32.0 + 32.0));
    // Off (adapter_miss_blocks 0): the policy does not read adapters; the load alone decides.
    let mut off = Fixture::predicting(3, 0);
    off.settings.adapter_placement = false;
    off.policy = PartitionPolicy::new(
        DefaultPolicyParameters {
            adapter_miss_blocks: 0.0,
            ..DefaultPolicyParameters::default()
        }
        .policy(),
        StdRng::seed_from_u64(7),
        &off.settings,
    );
    assert!(!off.policy.inputs.contains(WorkerInputs::ADAPTER));
    off.view.apply_report(&adapter_report(1, &["a", "b"]), 900);
    let d = new(off
        .decide_distinct(&for_adapter(2, "d"), 100, 1_000)
        .unwrap())
    .decision;
    assert_eq!(d.cost.terms["prefill"], 64.0 * 32.0);
}

#[test]
fn adapters_are_placed_by_their_share_of_demand() {
    let mut f = Fixture::predicting(8, 0);
    for w in 1..=8 {
        f.view.apply_report(&adapter_report(w, &[]), 900);
    }
    // A hot adapter: once it is most of the demand, its home is every rank, and its requests
    // spread with the load.
    let mut hot = std::collections::BTreeSet::new();
    for id in 1..=40 {
        let d = new(f
            .decide_distinct(&for_adapter(id, "hot"), id as u64 * 100, 1_000)
            .unwrap());
        hot.insert(d.decision.worker_id);
    }
    assert!(hot.len() >= 6, "{hot:?}");
    // Every slot holds another adapter now (a free slot would take any adapter).
    let fill = |f: &mut Fixture| {
        for w in 1..=8 {
            let (x, y) = (format!("x{w}"), format!("y{w}"));
            let report = kvroute_common::messages::WorkerLoad {
                seq: 2,
                ..adapter_report(w, &[&x, &y])
            };
            f.view.apply_report(&report, 1_000);
        }
    };
    fill(&mut f);
    // Cold adapters (each a fortieth of the demand: ⌈16 slots / 40⌉ = 1 rank) go to their own
    // home, the rank ranking first for them by rendezvous hashing, whatever its load.
    let ranks: Vec<WorkerRank> = (1..=8).map(|w| WorkerRank::new(w, 0)).collect();
    let mut homes = std::collections::BTreeSet::new();
    for i in 0..10u128 {
        let name = format!("cold{i}");
        let home = *ranks
            .iter()
            .max_by_key(|r| crate::eligibility::placement::rendezvous(&name, **r))
            .unwrap();
        let d = new(f
            .decide_distinct(&for_adapter(100 + i, &name), 10_000 + i as u64 * 100, 1_000)
            .unwrap());
        assert_eq!(d.decision.worker_id, home.worker_id, "{name}");
        homes.insert(home.worker_id);
    }
    assert!(
        homes.len() >= 4,
        "cold adapters spread over the ranks: {homes:?}"
    );
    // Without placement the same cold adapters go by load and affinity alone: not all home.
    let mut off = Fixture::predicting(8, 0);
    off.settings.adapter_placement = false;
    for w in 1..=8 {
        off.view.apply_report(&adapter_report(w, &[]), 900);
    }
    for id in 1..=40 {
        new(off
            .decide_distinct(&for_adapter(id, "hot"), id as u64 * 100, 1_000)
            .unwrap());
    }
    fill(&mut off);
    let away = (0..10u128)
        .filter(|&i| {
            let name = format!("cold{i}");
            let home = ranks
                .iter()
                .max_by_key(|r| crate::eligibility::placement::rendezvous(&name, **r))
                .unwrap()
                .worker_id;
            let d = new(off
                .decide_distinct(&for_adapter(100 + i, &name), 10_000 + i as u64 * 100, 1_000)
                .unwrap());
            d.decision.worker_id != home
        })
        .count();
    assert!(away >= 3, "{away} of 10 away from home");
}
