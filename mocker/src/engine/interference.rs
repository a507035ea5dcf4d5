//! Tests: prefill chunks slow the decodes that share their step (an aggregated worker), while a
//! decode worker, whose prompts arrive computed by a prefill worker, keeps its pace.

use std::time::Duration;

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A prompt of `len` tokens, distinct per `salt`.
fn request(n: u128, salt: u32, len: u32, output: u32) -> SimRequest {
    let tokens: Vec<u32> = (0..len).map(|t| salt.wrapping_mul(1_000_003) ^ t).collect();
    SimRequest::from_tokens(RequestId::from_u128(n), &tokens, output, 64, None)
}

/// The longest gap between consecutive tokens of request 1 (the streamed decode) while four
/// 4000-token prompts arrive at 100 ms; `transferred`: their KV comes from a prefill worker.
fn max_inter_token_latency(transferred: bool) -> Duration {
    let mut e = Engine::new(EngineConfig::default()).unwrap();
    let mut decode = request(1, 1, 64, 100);
    decode.report_tokens = true;
    e.submit(decode, Duration::ZERO).unwrap();
    let mut tokens = Vec::new();
    tokens.extend(e.advance_to(ms(100)).tokens);
    for n in 2..6 {
        let mut prompt = request(n, n as u32, 4000, 2);
        if transferred {
            prompt.transferred_tokens = prompt.prompt_tokens;
        }
        e.submit(prompt, ms(100)).unwrap();
    }
    while let Some(t) = e.next_wakeup() {
        tokens.extend(e.advance_to(t).tokens);
    }
    let at: Vec<Duration> = tokens
        .iter()
        .filter(|t| t.request_id == RequestId::from_u128(1))
        .map(|t| t.at)
        .collect();
    assert!(
        at.len() > 50,
        "the decode streamed its tokens: {}",
        at.len()
    );
    at.windows(2).map(|w| w[1] - w[0]).max().unwrap()
}

#[test]
fn concurrent_prefills_raise_an_aggregated_workers_inter_token_latency() {
    let alone = EngineConfig::default().step_duration(StepWork {
        decode_seqs: 1,
        decode_context_tokens: 164,
        ..StepWork::default()
    });
    let aggregated = max_inter_token_latency(false);
    let decode_only = max_inter_token_latency(true);
    // Two 4000-token prompts fill a step's 8192-token budget: ~330 ms for that step.
    assert!(
        aggregated > alone * 20,
        "aggregated {aggregated:?} vs alone {alone:?}"
    );
    // The decode worker computes one token of each arriving prompt.
    assert!(
        decode_only < alone + ms(2),
        "decode-only {decode_only:?} vs alone {alone:?}"
    );
}

#[test]
fn a_transferred_prompt_computes_only_its_last_token() {
    let mut e = Engine::new(EngineConfig::default()).unwrap();
    let mut r = request(1, 3, 4000, 1);
    r.transferred_tokens = 4000;
    e.submit(r, Duration::ZERO).unwrap();
    let ready = e.advance_to(Duration::from_secs(10));
    let first = ready
        .outputs
        .iter()
        .find_map(|o| match *o {
            EngineOutput::PrefillDone {
                cached_tokens,
                ttft,
                ..
            } => Some((cached_tokens, ttft)),
            _ => None,
        })
        .expect("prefill done");
    assert_eq!(first.0, 3999);
    let one_token = EngineConfig::default().step_duration(StepWork {
        prefill_tokens: 1,
        ..StepWork::default()
    });
    assert_eq!(first.1, one_token);
    // The transferred blocks are stored in the decode worker's cache (and announced).
    assert!(
        ready
            .kv_events
            .iter()
            .any(|e| matches!(e, kvroute_common::messages::KvEventData::Stored { .. }))
    );
}
