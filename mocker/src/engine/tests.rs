use std::time::Duration;

use kvroute_common::messages::KvEventData;

use super::*;

fn id(n: u128) -> RequestId {
    RequestId::from_u128(n)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn engine(config: EngineConfig) -> Engine {
    Engine::new(config).unwrap()
}

/// A prompt of `len` tokens, distinct per `salt`.
fn request(n: u128, salt: u32, len: u32, output: u32) -> SimRequest {
    let tokens: Vec<u32> = (0..len).map(|t| salt.wrapping_mul(1_000_003) ^ t).collect();
    SimRequest::from_tokens(id(n), &tokens, output, 64, None)
}

/// Runs until idle and returns every output.
fn drain(e: &mut Engine) -> Vec<EngineOutput> {
    let mut out = Vec::new();
    while let Some(t) = e.next_wakeup() {
        out.extend(e.advance_to(t).outputs);
    }
    out
}

fn finished(outputs: &[EngineOutput], request: RequestId) -> (Duration, Duration, u64) {
    outputs
        .iter()
        .find_map(|o| match *o {
            EngineOutput::Finished {
                request_id,
                ttft,
                latency,
                output_tokens,
                ..
            } if request_id == request => Some((ttft, latency, output_tokens)),
            _ => None,
        })
        .expect("request finished")
}

#[test]
fn a_cached_prompt_has_a_shorter_ttft() {
    let mut e = engine(EngineConfig::default());
    e.submit(request(1, 7, 4000, 10), ms(0)).unwrap();
    let cold = drain(&mut e);
    e.submit(request(2, 7, 4000, 10), ms(10_000)).unwrap();
    let warm = drain(&mut e);
    let (cold_ttft, _, n) = finished(&cold, id(1));
    let (warm_ttft, _, _) = finished(&warm, id(2));
    assert_eq!(n, 10);
    assert!(
        warm_ttft * 5 < cold_ttft,
        "warm {warm_ttft:?} cold {cold_ttft:?}"
    );
    assert!(matches!(
        warm[0],
        EngineOutput::PrefillDone {
            cached_tokens: 3968,
            ..
        }
    ));
    // Uncached prefill: 4000 tokens in one chunk, at 40 µs each plus 10 ms of overhead.
    assert_eq!(cold_ttft, ms(10) + Duration::from_micros(40 * 4000));
}

#[test]
fn decode_slows_with_batch_size() {
    let per_token = |batch: u32| {
        let mut e = engine(EngineConfig::default());
        for n in 0..batch {
            e.submit(request(u128::from(n), n, 2000, 100), ms(0))
                .unwrap();
        }
        let out = drain(&mut e);
        let (ttft, latency, _) = finished(&out, id(0));
        (latency - ttft) / 99
    };
    let (one, many) = (per_token(1), per_token(64));
    assert!(one >= ms(10) && one < ms(12), "{one:?}");
    assert!(many > one * 3 / 2, "batch 64: {many:?} vs batch 1: {one:?}");
}

#[test]
fn requests_queue_when_the_batch_is_full() {
    let mut e = engine(EngineConfig {
        max_num_seqs: 2,
        ..EngineConfig::default()
    });
    for n in 0..3 {
        e.submit(request(n, n as u32, 500, 20), ms(0)).unwrap();
    }
    e.advance_to(ms(0));
    let load = e.load();
    assert_eq!((load.active_requests, load.waiting_requests), (2, 1));
    assert_eq!(load.active_prefill_tokens, 1500);
    let out = drain(&mut e);
    let (_, first_latency, _) = finished(&out, id(0));
    let (third_ttft, _, _) = finished(&out, id(2));
    assert!(third_ttft > first_latency);
    assert_eq!(e.load().active_requests, 0);
}

#[test]
fn requests_queue_when_the_cache_is_full() {
    // Each request needs ceil((1000 + 24) / 64) = 16 blocks; 40 blocks fit two.
    let mut e = engine(EngineConfig {
        num_blocks: 40,
        ..EngineConfig::default()
    });
    for n in 0..3 {
        e.submit(request(n, n as u32, 1000, 24), ms(0)).unwrap();
    }
    e.advance_to(ms(0));
    let load = e.load();
    assert_eq!((load.active_requests, load.waiting_requests), (2, 1));
    assert_eq!(load.kv_used_blocks, 32);
    let out = drain(&mut e);
    assert_eq!(out.len(), 6);
    let (_, first_latency, _) = finished(&out, id(0));
    assert!(finished(&out, id(2)).0 > first_latency);

    let too_big = request(9, 9, 64 * 40, 1);
    assert!(matches!(
        e.submit(too_big, ms(1)),
        Err(SubmitError::TooLarge { needed: 41, .. })
    ));
    let mut bad = request(10, 9, 640, 1);
    bad.hashes.sequence.pop();
    assert!(matches!(
        e.submit(bad, ms(1)),
        Err(SubmitError::BlockCountMismatch { .. })
    ));
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut e = engine(EngineConfig {
        max_num_batched_tokens: 1024,
        ..EngineConfig::default()
    });
    e.submit(request(1, 1, 3000, 1), ms(0)).unwrap();
    let out = drain(&mut e);
    // Three steps: 1024 + 1024 + 952 tokens.
    let (ttft, latency, _) = finished(&out, id(1));
    assert_eq!(ttft, latency);
    assert_eq!(ttft, ms(30) + Duration::from_micros(40 * 3000));
}

/// A seeded mixed workload; returns everything observable.
fn run(step_ms: u64) -> (Vec<EngineOutput>, Vec<KvEventData>) {
    let mut e = engine(EngineConfig {
        num_blocks: 600,
        max_num_seqs: 8,
        max_num_batched_tokens: 2048,
        ..EngineConfig::default()
    });
    let (mut outputs, mut events) = (Vec::new(), Vec::new());
    let mut t = 0;
    for n in 0..120u32 {
        let arrival = u64::from(n) * 37;
        while t + step_ms <= arrival {
            t += step_ms;
            let r = e.advance_to(ms(t));
            outputs.extend(r.outputs);
            events.extend(r.kv_events);
        }
        let shared = n % 5;
        let len = 300 + (n * 7919) % 2500;
        let mut tokens: Vec<u32> = (0..1024).map(|i| shared * 100_000 + i).collect();
        tokens.extend((0..len).map(|i| n * 1_000_000 + i));
        let req = SimRequest::from_tokens(id(u128::from(n)), &tokens, 1 + n % 40, 64, None);
        e.submit(req, ms(arrival)).unwrap();
    }
    while let Some(w) = e.next_wakeup() {
        let r = e.advance_to(w);
        outputs.extend(r.outputs);
        events.extend(r.kv_events);
    }
    (outputs, events)
}

#[test]
fn deterministic_and_independent_of_how_often_time_advances() {
    let a = run(1);
    assert_eq!(a, run(1));
    assert_eq!(a, run(25), "coarser advance_to calls change nothing");
    let finished =
        a.0.iter()
            .filter(|o| matches!(o, EngineOutput::Finished { .. }))
            .count();
    assert_eq!(finished, 120);
    assert!(a.1.iter().any(|e| matches!(e, KvEventData::Removed { .. })));
    let hits = a
        .0
        .iter()
        .filter(
            |o| matches!(o, EngineOutput::PrefillDone { cached_tokens, .. } if *cached_tokens > 0),
        )
        .count();
    assert!(hits > 50, "shared 1024-token prefixes should hit: {hits}");
}

#[test]
fn an_aborted_request_leaves_and_frees_its_blocks_but_keeps_its_prefix_cached() {
    let mut e = engine(EngineConfig {
        max_num_seqs: 1,
        ..EngineConfig::default()
    });
    e.submit(request(1, 1, 640, 100), ms(0)).unwrap();
    e.submit(request(2, 2, 640, 5), ms(0)).unwrap();
    // The first prefills and decodes a few tokens; the second waits for its batch slot.
    e.advance_to(ms(100));
    assert_eq!(e.request_counts(), (1, 1));
    let pinned = e.cache().pinned_blocks();
    assert!(pinned > 10, "{pinned}");

    let aborted = e.abort(id(1)).expect("running");
    assert!(aborted.was_running);
    assert!(aborted.output_tokens > 1 && aborted.output_tokens < 100);
    assert_eq!(e.request_counts(), (0, 1));
    assert_eq!(
        e.cache().pinned_blocks(),
        0,
        "nothing pins its blocks any more"
    );
    assert_eq!(e.abort(id(1)), None, "gone");
    assert_eq!(e.abort(id(9)), None, "never here");

    let out = drain(&mut e);
    assert!(
        out.iter().all(|o| o.request_id() == id(2)),
        "no output for the aborted request: {out:?}"
    );
    finished(&out, id(2));
    // Its prompt blocks stayed cached: the same prompt again hits them.
    e.submit(request(3, 1, 640, 1), ms(10_000)).unwrap();
    let out = drain(&mut e);
    assert!(matches!(
        out[0],
        EngineOutput::PrefillDone {
            cached_tokens: 639,
            ..
        }
    ));

    // A waiting request leaves the queue without having held anything.
    e.submit(request(4, 4, 640, 50), ms(20_000)).unwrap();
    e.submit(request(5, 5, 640, 50), ms(20_000)).unwrap();
    e.advance_to(ms(20_000));
    assert_eq!(
        e.abort(id(5)),
        Some(Aborted {
            was_running: false,
            output_tokens: 0
        })
    );
    assert_eq!(e.request_counts(), (1, 0));
    assert!(e.load().active_prefill_tokens <= 640);
}

#[test]
fn requests_that_report_tokens_get_one_per_decode_step() {
    let mut e = engine(EngineConfig::default());
    let mut streamed = request(1, 1, 100, 6);
    streamed.report_tokens = true;
    e.submit(streamed, ms(0)).unwrap();
    e.submit(request(2, 2, 100, 6), ms(0)).unwrap();
    let (mut outputs, mut tokens) = (Vec::new(), Vec::new());
    while let Some(t) = e.next_wakeup() {
        let r = e.advance_to(t);
        outputs.extend(r.outputs);
        tokens.extend(r.tokens);
    }
    // Token 1 is PrefillDone, token 6 is Finished: 2..=5 in between, one step apart.
    assert!(tokens.iter().all(|t| t.request_id == id(1)), "{tokens:?}");
    let counts: Vec<u64> = tokens.iter().map(|t| t.generated).collect();
    assert_eq!(counts, [2, 3, 4, 5]);
    let (ttft, latency, _) = finished(&outputs, id(1));
    let mut at = vec![ttft];
    at.extend(tokens.iter().map(|t| t.at));
    at.push(latency);
    // Each a decode step of both requests: 10 ms + 2 × 0.1 ms + the context at 20 ns a token.
    for w in at.windows(2) {
        let gap = w[1] - w[0];
        assert!(gap > ms(10) && gap < ms(11), "{at:?}");
    }
}

#[test]
fn shared_tier_blocks_beyond_the_device_prefix_are_loaded_not_prefilled() {
    let config = EngineConfig::default();
    // 4,096 tokens = 64 blocks, none on the device.
    let ttft = |shared_blocks: u32, writes: bool| {
        let mut e = engine(config.clone()).with_shared_writes(writes);
        let mut req = request(1, 3, 4096, 1);
        req.shared_blocks = shared_blocks;
        e.submit(req, ms(0)).unwrap();
        let mut out = Vec::new();
        let mut prefilled = Vec::new();
        while let Some(t) = e.next_wakeup() {
            let ready = e.advance_to(t);
            out.extend(ready.outputs);
            prefilled.extend(ready.prefilled);
        }
        let cached = out
            .iter()
            .find_map(|o| match *o {
                EngineOutput::PrefillDone { cached_tokens, .. } => Some(cached_tokens),
                _ => None,
            })
            .unwrap();
        (finished(&out, id(1)).0, cached, prefilled.len())
    };
    let (cold, cached, written) = ttft(0, false);
    assert_eq!((cached, written), (0, 0));
    let (warm, cached, written) = ttft(48, true);
    assert_eq!(cached, 48 * 64, "loaded tokens are not recomputed");
    assert_eq!(
        written, 1,
        "the computed prompt is reported for the shared tier"
    );
    // 3,072 tokens loaded at 10 µs instead of prefilled at 40 µs: 92 ms less.
    let saved = cold - warm;
    assert_eq!(saved, Duration::from_micros(3072 * 30));
}

#[test]
fn progress_comes_once_per_block_of_output_before_the_last_token() {
    let mut e = engine(EngineConfig::default());
    // Block size 64: blocks end at 64, 128 and 192 tokens; 192 is the last token (finished).
    e.submit(request(1, 1, 100, 192), ms(0)).unwrap();
    e.submit(request(2, 2, 100, 63), ms(0)).unwrap();
    let mut progress = Vec::new();
    while let Some(t) = e.next_wakeup() {
        progress.extend(e.advance_to(t).progress);
    }
    let seen: Vec<(RequestId, u64)> = progress
        .iter()
        .map(|p| (p.request_id, p.generated))
        .collect();
    assert_eq!(seen, [(id(1), 64), (id(1), 128)]);
}

/// A request of adapter `lora` (a prompt of its own, `len` tokens).
fn adapter_request(n: u128, lora: &str, len: u32, output: u32) -> SimRequest {
    let tokens: Vec<u32> = (0..len)
        .map(|t| (n as u32).wrapping_mul(7_919) ^ t)
        .collect();
    SimRequest::from_tokens(id(n), &tokens, output, 64, Some(lora))
}

fn first_token_at(outputs: &[EngineOutput], request: RequestId) -> Duration {
    outputs
        .iter()
        .find_map(|o| match *o {
            EngineOutput::PrefillDone { request_id, at, .. } if request_id == request => Some(at),
            _ => None,
        })
        .expect("request prefilled")
}

#[test]
fn adapters_take_slots_and_a_load_costs_its_step() {
    let config = EngineConfig {
        max_loras: 2,
        lora_load_us: 100_000,
        ..EngineConfig::default()
    };
    let mut e = engine(config.clone());
    // a and b fill the two slots (each load adds 100 ms to the step that admits it); c must
    // wait until a request of a or b is done, then evicts the least recently used idle one.
    e.submit(adapter_request(1, "a", 64, 50), ms(0)).unwrap();
    e.submit(adapter_request(2, "b", 64, 5), ms(0)).unwrap();
    e.submit(adapter_request(3, "c", 64, 5), ms(0)).unwrap();
    // A base-model request passes c, which waits for a slot.
    e.submit(request(4, 1, 64, 5), ms(0)).unwrap();
    let out = drain(&mut e);
    assert_eq!(e.adapter_loads(), 3);
    let first = config.step_duration(StepWork {
        prefill_tokens: 3 * 64,
        lora_loads: 2,
        ..StepWork::default()
    });
    assert_eq!(first_token_at(&out, id(1)), first);
    assert_eq!(first_token_at(&out, id(2)), first);
    assert_eq!(
        first_token_at(&out, id(4)),
        first,
        "the base model needs no slot"
    );
    // c starts only after b finished (a still runs), in place of b.
    let (_, b_latency, _) = finished(&out, id(2));
    let c_first = first_token_at(&out, id(3));
    assert!(
        c_first > b_latency,
        "c {c_first:?} after b's end {b_latency:?}"
    );
    assert_eq!(e.resident_adapters().len(), 2);
    assert!(e.resident_adapters().contains(&"c"));
    assert!(e.resident_adapters().contains(&"a"));

    // A resident adapter costs nothing more.
    e.submit(adapter_request(5, "a", 64, 1), ms(60_000))
        .unwrap();
    drain(&mut e);
    assert_eq!(e.adapter_loads(), 3);

    // Without max_loras, adapters are not modelled: no waiting, no load.
    let mut free = engine(EngineConfig::default());
    for (n, lora) in ["a", "b", "c", "d"].iter().enumerate() {
        free.submit(adapter_request(n as u128 + 1, lora, 64, 5), ms(0))
            .unwrap();
    }
    let out = drain(&mut free);
    assert_eq!(free.adapter_loads(), 0);
    let step = EngineConfig::default().step_duration(StepWork {
        prefill_tokens: 4 * 64,
        ..StepWork::default()
    });
    for n in 1..=4 {
        assert_eq!(first_token_at(&out, id(n)), step);
    }
}

#[test]
fn load_reports_carry_the_adapter_slots() {
    let mut e = engine(EngineConfig {
        max_loras: 2,
        ..EngineConfig::default()
    });
    e.submit(adapter_request(1, "a", 64, 50), ms(0)).unwrap();
    e.submit(adapter_request(2, "b", 64, 50), ms(0)).unwrap();
    e.submit(adapter_request(3, "c", 64, 5), ms(0)).unwrap();
    e.submit(adapter_request(4, "c", 64, 5), ms(0)).unwrap();
    // The first step admits a and b into the two slots; c's two requests wait for one.
    let first = e.next_wakeup().unwrap();
    e.advance_to(first);
    let slots = e.adapter_slots().unwrap();
    let mut loaded = slots.loaded.clone();
    loaded.sort();
    assert_eq!(loaded, ["a", "b"]);
    assert_eq!(slots.waiting, ["c"], "one name per adapter");
    assert_eq!(slots.max_loaded, 2);
    drain(&mut e);
    let slots = e.adapter_slots().unwrap();
    assert!(slots.holds("c") && slots.waiting.is_empty());
    // Without max_loras the engine reports no slots.
    assert_eq!(engine(EngineConfig::default()).adapter_slots(), None);
}
