//! LoRA adapters through the real processes: kvroute-mocker engines impersonating vLLM with
//! `--lora-modules` and 2 adapter slots each, behind kvroute-bridge (which reads their
//! `vllm:lora_requests_info` into the load reports and hashes their `BlockStored` events under
//! the adapter each names), a router and an indexer, and a gateway with `--lora-adapter`. A
//! request naming an adapter as its model is routed among the base model's workers with its
//! blocks keyed apart from the base model's, each adapter's requests stay on the worker that
//! loaded it, more adapters than one worker's slots spread over the fleet, and `/v1/models`
//! lists the adapters under their base model.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use kvroute_common::Names;
use kvroute_common::codec::decode;
use kvroute_common::messages::WorkerLoad;
use kvroute_tests::{GatewayProcess, GatewayStack, STACK_MODEL};
use serde_json::{Value, json};

const ADAPTERS: [&str; 4] = ["sql", "chat", "math", "poem"];

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| 1000 + seed * 10_000 + i).collect()
}

/// Completes `prompt` as `model`; the status, the worker that served it and the overlap the
/// router counted.
async fn complete(
    http: &reqwest::Client,
    gateway: &GatewayProcess,
    model: &str,
    prompt: &[u32],
) -> (u16, u64, u64) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let r = gateway.post(http, "/v1/completions", &body).await;
    let header = |name: &str| -> u64 {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(u64::MAX)
    };
    let (worker, overlap) = (
        header("x-kvroute-worker-id"),
        header("x-kvroute-overlap-blocks"),
    );
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{model}: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], model, "the engine answered as the adapter");
    (status, worker, overlap)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_route_to_their_adapter_keyed_apart_from_the_base_model() {
    let stack = GatewayStack::start(3, |c| {
        c.engine.max_loras = 2;
        c.engine.lora_load_us = 20_000;
        c.face.engine_lora_modules = ADAPTERS.map(String::from).to_vec();
    })
    .await
    .unwrap();
    let flags: String = ADAPTERS
        .iter()
        .map(|a| format!("{a}={STACK_MODEL}"))
        .collect::<Vec<_>>()
        .join(",");
    let gateway = stack.gateway("g", &["--lora-adapter", &flags]).unwrap();
    let http = reqwest::Client::new();
    let names = Names::new(&stack.env.namespace);
    let nats = stack.env.nats.connect().await.unwrap();
    let mut loads = nats.subscribe(names.load_all()).await.unwrap();

    // The gateway lists each adapter under its base model.
    let models: Value = http
        .get(gateway.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<(&str, &str)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap(),
                m["parent"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        ids,
        [
            ("m", ""),
            ("chat", "m"),
            ("math", "m"),
            ("poem", "m"),
            ("sql", "m")
        ]
    );

    // Three rounds of one fresh prompt per adapter: each adapter stays where it went first.
    let mut home: BTreeMap<&str, u64> = BTreeMap::new();
    for round in 0..3u32 {
        for (i, adapter) in ADAPTERS.iter().enumerate() {
            let (_, worker, _) =
                complete(&http, &gateway, adapter, &prompt(round * 10 + i as u32, 40)).await;
            let first = *home.entry(adapter).or_insert(worker);
            assert_eq!(worker, first, "{adapter} in round {round}: {home:?}");
            // Lifecycle events and a load report settle before the next request.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }
    // Four adapters, two slots per worker: they cannot all share one worker.
    let mut per_worker: BTreeMap<u64, u32> = BTreeMap::new();
    for w in home.values() {
        *per_worker.entry(*w).or_default() += 1;
    }
    assert!(
        per_worker.len() >= 2 && per_worker.values().all(|&n| n <= 2),
        "{home:?}"
    );

    // The blocks an adapter computed are the adapter's: the same prompt again under it
    // overlaps, under the base model or another adapter it does not (the bridge hashed the
    // engine's events under the adapter each named).
    let shared = prompt(99, 40);
    let (_, w, overlap) = complete(&http, &gateway, "sql", &shared).await;
    assert_eq!((w, overlap), (home["sql"], 0));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, w, overlap) = complete(&http, &gateway, "sql", &shared).await;
    assert_eq!(w, home["sql"]);
    assert!(
        overlap >= 8,
        "sql again: {overlap} blocks of 4 tokens cached"
    );
    let (_, _, overlap) = complete(&http, &gateway, STACK_MODEL, &shared).await;
    assert_eq!(overlap, 0, "the base model holds none of sql's blocks");
    let (_, _, overlap) = complete(&http, &gateway, "chat", &shared).await;
    assert_eq!(overlap, 0, "chat holds none of sql's blocks");

    // The bridge's load reports carry each worker's adapter slots, read from vLLM's gauge.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut reported: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    while reported.len() < per_worker.len() {
        let m = tokio::time::timeout_at(deadline, loads.next())
            .await
            .expect("load reports with adapters")
            .unwrap();
        let load: WorkerLoad = decode(&m.payload).unwrap();
        if let Some(slots) = load.adapters {
            assert_eq!(slots.max_loaded, 2);
            assert!(slots.loaded.len() <= 2, "{slots:?}");
            if per_worker.contains_key(&load.worker_id) {
                reported.insert(load.worker_id, slots.loaded);
            }
        }
    }
}
