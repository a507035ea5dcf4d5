//! Phase 1, added latency: one request at a time, the same prompt sent to every target in a
//! seeded random order per round — the engine directly, through the bare proxy, nginx and the
//! gateway —, plus (for whole answers) a selection by the bench itself through the same
//! routers, so the gateway's extra time can be read against the selection it must wait for.
//! The gateway's own tokenize / select histograms are scraped around each row.

use std::time::Duration;

use kvroute_common::messages::SelectRequest;
use kvroute_gateway::lifecycle::Placement;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::client::{Expect, call};
use crate::engine::Api;
use crate::prom::{Hist, Scrape};
use crate::prompts::{PromptSet, body};
use crate::stack::{Stack, Target};
use crate::stats::Samples;

/// One row of the latency table.
#[derive(Debug, Clone, Copy)]
pub struct RowSpec {
    pub size: usize,
    pub api: Api,
    pub stream: bool,
}

/// One target's timings in a row.
#[derive(Debug, Clone)]
pub struct Timings {
    pub target: Target,
    pub first: Samples,
    pub total: Samples,
}

/// A row's results.
#[derive(Debug, Clone)]
pub struct Row {
    pub spec: RowSpec,
    pub prompt_tokens: f64,
    pub targets: Vec<Timings>,
    /// The bench's own selections (whole-answer rows only).
    pub select: Option<Samples>,
    /// The gateway's histograms over the row.
    pub gw_select: Hist,
    pub gw_tokenize: Hist,
    /// Overlap blocks the gateway reported (min, max).
    pub overlap: Option<(u32, u32)>,
    /// CPU by account over the recorded rounds, and each core's busy share (other users'
    /// load included).
    pub cpu: std::collections::BTreeMap<String, Duration>,
    pub busy: Vec<f64>,
    pub rounds: usize,
}

impl Row {
    pub fn timings(&self, t: Target) -> Option<&Timings> {
        self.targets.iter().find(|x| x.target == t)
    }

    /// CPU µs per round of account `name` (for a proxy: per request through it).
    pub fn cpu_us(&self, name: &str) -> Option<f64> {
        let d = self.cpu.get(name)?;
        (self.rounds > 0).then(|| d.as_secs_f64() * 1e6 / self.rounds as f64)
    }
}

/// Runs one row: `warmup` unrecorded rounds, then `rounds` recorded ones.
pub async fn row(
    stack: &Stack,
    set: &PromptSet,
    spec: RowSpec,
    warmup: usize,
    rounds: usize,
    budget: Duration,
    seed: u64,
) -> anyhow::Result<Row> {
    let targets = stack.targets();
    let clients = targets
        .iter()
        .map(|_| crate::client::http_client())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bodies: Vec<_> = set
        .prompts
        .iter()
        .map(|p| body(&stack.model, spec.api, p, stack.output_tokens, spec.stream))
        .collect();
    let expect = if spec.stream {
        Expect::Stream {
            events: spec.api.stream_events(stack.output_tokens, true),
        }
    } else {
        Expect::Whole
    };
    let tokens_for = |i: usize| -> Vec<u32> {
        let p = &set.prompts[i % set.prompts.len()];
        match spec.api {
            Api::Completions => p.tokens.clone(),
            Api::Chat => p.chat_tokens.clone().unwrap_or_default(),
        }
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut first: Vec<Vec<Duration>> = vec![Vec::with_capacity(rounds); targets.len()];
    let mut total: Vec<Vec<Duration>> = vec![Vec::with_capacity(rounds); targets.len()];
    let mut selects = Vec::with_capacity(rounds);
    let mut overlap: Option<(u32, u32)> = None;
    let mut order: Vec<usize> = (0..=targets.len()).collect();
    let gateway_port = stack.gateway.port;
    let mut before = None;
    let mut cpu_before = None;
    let mut recording_since = std::time::Instant::now();
    let mut recorded_rounds = 0;
    for round in 0..warmup + rounds {
        if round == warmup {
            before = Some(Scrape::of(gateway_port));
            cpu_before = Some(stack.accounts.read());
            recording_since = std::time::Instant::now();
        }
        if round > warmup && recording_since.elapsed() >= budget {
            break;
        }
        recorded_rounds += usize::from(round >= warmup);
        let recorded = round >= warmup;
        let i = round % bodies.len();
        order.shuffle(&mut rng);
        for &k in &order {
            if k == targets.len() {
                // The bench's own selection, for whole-answer rows.
                if spec.stream {
                    continue;
                }
                let request = SelectRequest {
                    model: stack.model.clone(),
                    token_ids: Some(tokens_for(i)),
                    expected_output_tokens: Some(stack.output_tokens as u32),
                    ..SelectRequest::default()
                };
                let at = std::time::Instant::now();
                let reply = stack
                    .select
                    .select(request)
                    .await
                    .map_err(|e| anyhow::anyhow!("the bench's selection failed: {e}"))?
                    .reply;
                let took = at.elapsed();
                stack.lifecycle.finished(
                    Placement {
                        request_id: reply.request_id,
                        worker_id: reply.worker_id,
                        dp_rank: reply.dp_rank,
                    },
                    stack.output_tokens as u64,
                );
                if recorded {
                    selects.push(took);
                }
                continue;
            }
            let target = targets[k];
            let url = stack.url(target, spec.api);
            let c = call(&clients[k], &url, bodies[i].clone(), expect).await?;
            if recorded {
                first[k].push(c.first);
                total[k].push(c.total);
                if let Some(o) = c.overlap {
                    overlap = Some(overlap.map_or((o, o), |(lo, hi)| (lo.min(o), hi.max(o))));
                }
            }
        }
    }
    let cpu_after = stack.accounts.read();
    let cpu_before = cpu_before.unwrap_or_default();
    let after = Scrape::of(gateway_port);
    let before = before.unwrap_or_default();
    let select_label = format!("model=\"{}\"", stack.model);
    let tokenize_label = format!("endpoint=\"{}\"", spec.api.label());
    Ok(Row {
        spec,
        prompt_tokens: match spec.api {
            Api::Completions => set.mean_tokens(),
            Api::Chat => {
                set.prompts
                    .iter()
                    .map(|p| p.chat_tokens.as_ref().map_or(0, Vec::len))
                    .sum::<usize>() as f64
                    / set.prompts.len().max(1) as f64
            }
        },
        targets: targets
            .iter()
            .zip(first.into_iter().zip(total))
            .map(|(t, (f, a))| Timings {
                target: *t,
                first: Samples::new(f),
                total: Samples::new(a),
            })
            .collect(),
        select: (!spec.stream).then(|| Samples::new(selects)),
        gw_select: after
            .hist("kvroute_gateway_select_seconds", &select_label)
            .since(&before.hist("kvroute_gateway_select_seconds", &select_label)),
        gw_tokenize: after
            .hist("kvroute_gateway_tokenize_seconds", &tokenize_label)
            .since(&before.hist("kvroute_gateway_tokenize_seconds", &tokenize_label)),
        overlap,
        cpu: cpu_after.since(&cpu_before),
        busy: cpu_after.busy_since(&cpu_before),
        rounds: recorded_rounds,
    })
}

/// The bench's own tokenization of each prompt (`--model-dir` only): encode for completions,
/// the chat template for chat, `rounds` times cycling over the prompts.
pub fn tokenize_times(
    model: &crate::prompts::TextModel,
    set: &PromptSet,
    api: Api,
    rounds: usize,
) -> anyhow::Result<Samples> {
    let mut out = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let p = &set.prompts[i % set.prompts.len()];
        let text = p.text.as_deref().unwrap_or("");
        let at = std::time::Instant::now();
        match api {
            Api::Completions => {
                std::hint::black_box(model.encode(text)?);
            }
            Api::Chat => {
                std::hint::black_box(model.chat(text));
            }
        }
        out.push(at.elapsed());
    }
    Ok(Samples::new(out))
}

/// A conversation's next turn: seeded conversations (a system prompt, then user messages of
/// `user_words` words and assistant answers of a fifth of that) grow turn by turn until their
/// chat reaches `tokens` tokens; each turn is tokenized whole by `cached` (a model with the
/// segment cache, which saw the conversation's earlier turns) and by `plain` (without it), in
/// the same loop. Returns the samples of the turns of at least `from_tokens` tokens: (cached,
/// plain, their token counts' mean).
pub fn conversation_times(
    cached: &crate::prompts::TextModel,
    plain: &crate::prompts::TextModel,
    conversations: usize,
    tokens: usize,
    from_tokens: usize,
    user_words: usize,
) -> anyhow::Result<(Samples, Samples, f64)> {
    use rand::SeedableRng;
    let (mut with, mut without, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
    for c in 0..conversations {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xc0_0000 + c as u64);
        let mut messages = vec![serde_json::json!({
            "role": "system",
            "content": format!("You are assistant {c}. {}", crate::prompts::words(&mut rng, 120)),
        })];
        loop {
            messages.push(serde_json::json!({
                "role": "user",
                "content": crate::prompts::words(&mut rng, user_words),
            }));
            let at = std::time::Instant::now();
            let ids = cached
                .chat_messages(&messages)
                .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))?;
            let took_cached = at.elapsed();
            let at = std::time::Instant::now();
            let whole = plain
                .chat_messages(&messages)
                .ok_or_else(|| anyhow::anyhow!("the model has no chat template"))?;
            let took_plain = at.elapsed();
            anyhow::ensure!(
                ids == whole,
                "the segment cache's ids differ from the whole text's"
            );
            if ids.len() >= from_tokens {
                with.push(took_cached);
                without.push(took_plain);
                sizes.push(ids.len() as f64);
            }
            if ids.len() >= tokens {
                break;
            }
            messages.push(serde_json::json!({
                "role": "assistant",
                "content": crate::prompts::words(&mut rng, user_words / 5),
            }));
        }
    }
    let mean = sizes.iter().sum::<f64>() / sizes.len().max(1) as f64;
    Ok((Samples::new(with), Samples::new(without), mean))
}
