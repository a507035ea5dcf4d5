//! A steady load of selections for the stall tests: requests at a fixed rate through kvroute's
//! retrying [`SelectClient`], each of which then "runs" on its worker — the worker publishes
//! `finished` a moment later — so the routers' load views drain once the load stops. Every
//! outcome is kept with its send time, so a test can look at any window of the run.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_common::WorkerId;
use kvroute_common::client::{SelectCallFailure, SelectClient, Selected};
use kvroute_common::messages::{
    LifecycleKind, RequestLifecycle, SchemaVersion, SelectRequest, now_ms,
};
use tokio::time::Instant;

use crate::router::PromptWorker;

/// How hard and how long.
#[derive(Debug, Clone, Copy)]
pub struct LoadPlan {
    pub rate_per_s: f64,
    pub duration: Duration,
    /// How long a selected request "runs" on its worker before `finished`.
    pub run_time: Duration,
}

/// One request of the load.
#[derive(Debug, Clone)]
pub struct Sent {
    /// When it was sent, from the start of the load.
    pub at: Duration,
    /// Index of its prompt in the load's prompt list.
    pub prompt: usize,
    pub result: Result<Selected, SelectCallFailure>,
}

/// Outcomes of a load, in send order.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub sent: Vec<Sent>,
}

impl LoadReport {
    pub fn ok(&self) -> usize {
        self.sent.iter().filter(|s| s.result.is_ok()).count()
    }

    pub fn success(&self) -> f64 {
        self.ok() as f64 / self.sent.len().max(1) as f64
    }

    /// Requests sent in `[from, to)`.
    pub fn window(&self, from: Duration, to: Duration) -> LoadReport {
        LoadReport {
            sent: self
                .sent
                .iter()
                .filter(|s| s.at >= from && s.at < to)
                .cloned()
                .collect(),
        }
    }

    /// Selection attempts beyond the first, over the successful requests.
    pub fn retries(&self) -> u32 {
        self.sent
            .iter()
            .filter_map(|s| s.result.as_ref().ok())
            .map(|s| s.attempts - 1)
            .sum()
    }

    /// Failures by kind (`select_timeout`, ...).
    pub fn failures(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for s in &self.sent {
            if let Err(e) = &s.result {
                *out.entry(e.kind()).or_default() += 1;
            }
        }
        out
    }
}

/// Sends `plan.rate_per_s` requests a second for `plan.duration`, cycling through `prompts`
/// (for model `model`); a selected request is finished by its worker (one of `workers`)
/// after `plan.run_time`. Returns once every request has its outcome and every `finished`
/// is published.
pub async fn steady_load(
    client: Arc<SelectClient>,
    workers: Arc<Vec<PromptWorker>>,
    model: &str,
    prompts: Arc<Vec<Vec<u32>>>,
    plan: LoadPlan,
) -> LoadReport {
    let start = Instant::now();
    let count = (plan.rate_per_s * plan.duration.as_secs_f64()).round() as usize;
    let interval = Duration::from_secs_f64(1.0 / plan.rate_per_s);
    let by_id: Arc<HashMap<WorkerId, usize>> = Arc::new(
        workers
            .iter()
            .enumerate()
            .map(|(i, w)| (w.id(), i))
            .collect(),
    );
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let at = interval * i as u32;
        let (client, workers, by_id, prompts) = (
            client.clone(),
            workers.clone(),
            by_id.clone(),
            prompts.clone(),
        );
        let model = model.to_owned();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + at).await;
            let prompt = i % prompts.len();
            let request = SelectRequest {
                model,
                token_ids: Some(prompts[prompt].clone()),
                ..SelectRequest::default()
            };
            let result = client.select(request).await;
            if let Ok(selected) = &result
                && let Some(&w) = by_id.get(&selected.reply.worker_id)
            {
                tokio::time::sleep(plan.run_time).await;
                let event = RequestLifecycle {
                    v: SchemaVersion::CURRENT,
                    request_id: selected.reply.request_id,
                    worker_id: selected.reply.worker_id,
                    dp_rank: selected.reply.dp_rank,
                    kind: LifecycleKind::Finished { output_tokens: 1 },
                    ts: now_ms(),
                };
                let _ = workers[w].agent().publish_lifecycle(&event).await;
            }
            Sent { at, prompt, result }
        }));
    }
    let mut sent = Vec::with_capacity(count);
    for t in tasks {
        sent.push(t.await.expect("a load task panicked"));
    }
    LoadReport { sent }
}
