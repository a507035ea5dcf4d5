//! Reading an OpenAI request body (`Parsed::from_body`): completions bodies with token-id
//! prompts of 1,024 and 8,192 tokens (the gateway bench's throughput and latency rows) and a
//! few sampling fields the gateway skips. Deterministic, for instruction counts under callgrind:
//!
//! ```text
//! cargo bench -p kvroute-gateway --bench parse --no-run
//! valgrind --tool=callgrind --toggle-collect='parse::measured' target/release/deps/parse-<hash> --tokens 8192
//! ```
//!
//! Without valgrind it prints the wall time per body.

use std::hint::black_box;
use std::time::Instant;

use axum::http::HeaderMap;
use kvroute_gateway::openai::{Api, Parsed};

fn body(tokens: u32) -> Vec<u8> {
    // Token ids spread like a real vocabulary's (1 to 6 digits).
    let ids: Vec<u32> = (0..tokens)
        .map(|i| i.wrapping_mul(2_654_435_761) % 151_000)
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "prompt": ids,
        "max_tokens": 16,
        "stream": true,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop": ["\n\n"],
        "stream_options": {"include_usage": true},
    }))
    .expect("serializes")
}

#[inline(never)]
fn measured(body: &[u8], rounds: usize) -> usize {
    let headers = HeaderMap::new();
    let mut sum = 0;
    for _ in 0..rounds {
        let parsed =
            Parsed::from_body(Api::Completions, black_box(body), &headers).expect("a valid body");
        sum += black_box(parsed).prompts.len();
    }
    sum
}

fn main() {
    let mut tokens = 1024u32;
    let mut rounds = 1000usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => {
                tokens = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--tokens N")
            }
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--rounds N")
            }
            // cargo bench passes --bench.
            _ => {}
        }
    }
    let body = body(tokens);
    let started = Instant::now();
    black_box(measured(&body, rounds));
    println!(
        "{tokens}-token body ({} bytes), {rounds} rounds: {:.2} µs per body",
        body.len(),
        started.elapsed().as_secs_f64() * 1e6 / rounds as f64
    );
}
