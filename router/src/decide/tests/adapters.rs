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
