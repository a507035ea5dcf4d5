//! LoRA adapters in the simulated fleet: blocks keyed apart per adapter, and adapter loads
//! under affinity and placement.

use super::*;

/// The same prompts under two adapters share no block: their hits are only within an adapter,
/// in the oracle and in the fleet.
#[test]
fn adapters_key_the_same_prompt_apart() {
    // 20 requests 2 s apart of one 4-block document: alone, every request after the first hits.
    let doc = |i: u64, lora: Option<&str>| TraceRequest {
        timestamp: i * 2000,
        input_length: 2048,
        output_length: 4,
        hash_ids: vec![0, 1, 2, 3],
        lora_name: lora.map(str::to_owned),
        ..TraceRequest::default()
    };
    let base: Vec<_> = (0..20).map(|i| doc(i, None)).collect();
    let two: Vec<_> = (0..20)
        .map(|i| doc(i, Some(if i % 2 == 0 { "a" } else { "b" })))
        .collect();
    let run = |requests: Vec<TraceRequest>| {
        let plan = Plan::new(requests, 0, 1.0, None);
        let settings = SimSettings {
            send_sessions: false,
            ..settings(Mode::Kv, 1, 1)
        };
        let report = simulate(&plan, &settings, &builtins(), |_| {}).unwrap();
        let (oracle, _) =
            crate::replay::oracle_with_hits(&plan.requests, settings.engine.block_size, 1 << 20);
        (report, oracle)
    };
    let (alone, alone_oracle) = run(base);
    let (split, split_oracle) = run(two);
    // One cold prompt against two (one per adapter), of 20.
    assert!(
        (alone_oracle.infinite - 19.0 / 20.0).abs() < 0.01,
        "{alone_oracle:?}"
    );
    assert!(
        (split_oracle.infinite - 18.0 / 20.0).abs() < 0.01,
        "{split_oracle:?}"
    );
    assert_eq!(alone.prompt_tokens, split.prompt_tokens);
    assert!(
        alone.cached_prompt_tokens > split.cached_prompt_tokens,
        "alone {} cached, split {}",
        alone.cached_prompt_tokens,
        split.cached_prompt_tokens
    );
    // Each adapter's own requests still hit: 18 of 20 prompts cached but for their last
    // block's partial tail.
    assert!(split.hit_rate > 0.8, "{}", split.hit_rate);
}

/// More adapters than the fleet's slots: adapter affinity and placement cut adapter loads
/// against round-robin, whether workers list every resident adapter or, as vLLM's gauge does,
/// only running requests' (the routers' LRU of decisions makes up for the idle ones).
#[test]
fn adapters_beyond_the_slots_load_less_with_affinity_and_placement() {
    let params = crate::tracegen::SessionTraceParams {
        sessions: 120,
        turns: crate::tracegen::TokenRange::new(2, 4),
        session_rate: 2.0,
        think_time_secs: 2.0,
        adapters: 24,
        ..Default::default()
    };
    let plan = Plan::new(crate::tracegen::generate(&params), 0, 1.0, None);
    let loads = |mode, placement, running_only| {
        let settings = SimSettings {
            engine: EngineConfig {
                max_loras: 2,
                ..engine()
            },
            adapter_placement: placement,
            running_adapters_only: running_only,
            ..settings(mode, 1, 1)
        };
        let report = simulate(&plan, &settings, &builtins(), |_| {}).unwrap();
        assert_eq!(report.errors, 0, "{report:?}");
        report.adapter_loads.unwrap()
    };
    for running_only in [false, true] {
        let rr = loads(Mode::RoundRobin, false, running_only);
        let affinity = loads(Mode::Kv, false, running_only);
        let placed = loads(Mode::Kv, true, running_only);
        assert!(
            placed < affinity && affinity < rr,
            "running only {running_only}: placed {placed}, affinity {affinity}, round-robin {rr}"
        );
    }
}
