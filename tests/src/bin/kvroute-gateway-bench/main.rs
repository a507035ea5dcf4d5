//! `kvroute-gateway-bench`: what `kvroute-gateway` costs in front of an engine, in one run,
//! against real release builds of `kvroute-router` and `kvroute-indexer` over the harness's
//! nats-server and etcd:
//!
//! 1. added latency: one request at a time, interleaved, to the same in-process engine
//!    directly, through a bare reverse proxy, nginx (when installed) and the gateway, for each
//!    prompt length (`--sizes`), whole and streamed answers; with the gateway's tokenize and
//!    select histograms and the bench's own selections through the same routers;
//! 2. throughput: streamed completions with `--streams` in flight through the gateway, the bare
//!    proxy and nginx, alternating over `--rounds`, with the CPU every process used per request.
//!
//! Prompts are token-id lists (no tokenization), or with `--model-dir DIR` text of the right
//! token length under that model's tokenizer (the gateway then gets `--model NAME=DIR`).
//! Build and run, in release:
//!
//! `cargo build --release -p kvroute-tests -p kvroute-gateway -p kvroute-router -p kvroute-indexer --bin kvroute-gateway-bench --bin kvroute-gateway --bin kvroute-router --bin kvroute-indexer && target/release/kvroute-gateway-bench`

mod accounts;
mod bare_proxy;
mod client;
mod engine;
mod latency;
mod nginx;
mod prom;
mod prompts;
mod report;
mod stack;
mod stats;
mod throughput;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use kvroute_tests::cpu;

use crate::engine::Api;
use crate::latency::RowSpec;
use crate::stack::{Stack, StackConfig, Target};

#[derive(Debug, Parser)]
#[command(about = "kvroute-gateway's added latency and streamed throughput against its peers")]
pub struct Args {
    /// A model folder (tokenizer.json, tokenizer_config.json): prompts are text of the right
    /// token length and the gateway tokenizes them. Absent: prompts are token-id lists.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The model's name (default: the folder's name; `bench` for token-id prompts).
    #[arg(long)]
    model_name: Option<String>,
    /// Prompt lengths of the latency phase, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    sizes: Vec<usize>,
    /// Distinct prompts per length (each stored on one worker).
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    /// Worker cards registered for the engine (every one at the engine's URL).
    #[arg(long, default_value_t = 4)]
    workers: u64,
    /// Tokens in every answer.
    #[arg(long, default_value_t = 16)]
    output_tokens: usize,
    /// Recorded rounds per latency row (each round: one request to every target).
    #[arg(long, default_value_t = 2000)]
    latency_rounds: usize,
    /// Most seconds of recorded rounds per latency row (a row stops at whichever comes first).
    #[arg(long, default_value_t = 15)]
    latency_row_secs: u64,
    /// Unrecorded rounds before them.
    #[arg(long, default_value_t = 100)]
    latency_warmup: usize,
    /// Streamed requests in flight in the throughput phase.
    #[arg(long, default_value_t = 64)]
    streams: usize,
    /// Prompt length of the throughput phase, in tokens.
    #[arg(long, default_value_t = 1024)]
    throughput_prompt_tokens: usize,
    /// Measured seconds per throughput window.
    #[arg(long, default_value_t = 5)]
    throughput_secs: u64,
    /// Warm-up seconds before each window.
    #[arg(long, default_value_t = 1)]
    throughput_warmup_secs: u64,
    /// Throughput rounds (each one window per target, the order rotating).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Targets of the throughput phase, comma-separated (gateway, bare, nginx).
    #[arg(long, value_delimiter = ',', default_value = "gateway,bare,nginx")]
    throughput_targets: Vec<String>,
    /// Conversations tokenized turn by turn for the next-turn rows (`--model-dir` only).
    #[arg(long, default_value_t = 40)]
    conversations: usize,
    /// Skip the latency phase.
    #[arg(long)]
    no_latency: bool,
    /// Skip the throughput phase.
    #[arg(long)]
    no_throughput: bool,
    /// Leave nginx out even when installed.
    #[arg(long)]
    no_nginx: bool,
    /// Leave CPU placement to the scheduler.
    #[arg(long)]
    no_pin: bool,
    /// The kvroute-gateway binary (default: the one next to this bench), to compare builds.
    #[arg(long)]
    gateway_bin: Option<PathBuf>,
    /// An extra flag for kvroute-router (repeat; e.g. `--router-arg=--overlap-mode=local`).
    #[arg(long = "router-arg", allow_hyphen_values = true)]
    router_args: Vec<String>,
    /// An extra flag for kvroute-gateway (repeat; e.g. `--gateway-arg=--no-access-log`).
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    gateway_args: Vec<String>,
    /// Also write every figure to this JSON file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seed of the latency phase's target order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

fn runtime(name: &'static str, threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()?)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        !args.sizes.is_empty()
            && args.sizes.iter().all(|s| *s > 0)
            && args.prompts > 0
            && args.workers > 0
            && args.output_tokens > 0
            && args.latency_rounds > 0
            && args.streams > 0
            && args.throughput_prompt_tokens > 0
            && args.throughput_secs > 0
            && args.rounds > 0,
        "sizes, counts and durations must be positive"
    );
    let nproc = cpu::online_cpus();
    let pin = !args.no_pin && nproc >= 2;
    let model = match (&args.model_name, &args.model_dir) {
        (Some(n), _) => n.clone(),
        (None, Some(dir)) => dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_owned(),
        (None, None) => "bench".to_owned(),
    };
    let text = match &args.model_dir {
        Some(dir) => Some(prompts::TextModel::load(&model, dir)?),
        None => None,
    };
    let mut sizes = args.sizes.clone();
    if !sizes.contains(&args.throughput_prompt_tokens) {
        sizes.push(args.throughput_prompt_tokens);
    }
    let sets = sizes
        .iter()
        .map(|s| prompts::build(*s, args.prompts, text.as_ref()))
        .collect::<anyhow::Result<Vec<_>>>()?;

    let client_rt = runtime("bench-client", 1)?;
    let engine_rt = runtime("bench-engine", 1)?;
    // Two workers, as the gateway's runtime has on this machine.
    let proxy_rt = runtime("bench-proxy", 2)?;
    let engine = engine_rt.block_on(engine::start(&model, args.output_tokens))?;
    let bare = proxy_rt.block_on(bare_proxy::start(engine))?;
    let config = StackConfig {
        model: model.clone(),
        model_dir: args.model_dir.clone(),
        workers: args.workers,
        output_tokens: args.output_tokens,
        nginx: !args.no_nginx,
        router_args: args.router_args.clone(),
        gateway_args: args.gateway_args.clone(),
        main_tid: cpu::current_tid(),
        gateway_bin: args.gateway_bin.clone(),
    };
    let result = client_rt.block_on(async {
        let stack = Stack::start(&config, engine, bare).await?;
        let out = run(&args, &stack, &sets, text.as_ref(), pin, nproc).await;
        if out.is_err() {
            eprintln!("gateway log (tail):\n{}", tail(&stack.gateway.log(), 40));
        }
        stack.shutdown().await?;
        out
    });
    drop(client_rt);
    drop(proxy_rt);
    drop(engine_rt);
    result
}

/// Tokenizing a conversation's next turn with the segment cache (as the gateway does by
/// default) and without it, in the same loop.
fn conversation_turns(args: &Args, dir: &std::path::Path) -> anyhow::Result<()> {
    let name = "conversation";
    let cached =
        prompts::TextModel::load_with_cache(name, dir, kvroute_text::DEFAULT_SEGMENT_CACHE_BYTES)?;
    let plain = prompts::TextModel::load(name, dir)?;
    println!(
        "\n## Tokenizing a conversation's next turn (chat template + encode, µs; the bench's own thread)\n"
    );
    println!(
        "| turns from .. to tokens | user message words | turns | mean tokens | with the tokenize cache p50 / p99 | without p50 / p99 | without / with (p50) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (from, to, words) in [(7168, 8192, 300), (1024, 2048, 100)] {
        let (with, without, mean) =
            latency::conversation_times(&cached, &plain, args.conversations, to, from, words)?;
        let ratio = match (with.p50(), without.p50()) {
            (Some(w), Some(o)) if w > 0.0 => format!("{:.1}×", o / w),
            _ => "—".into(),
        };
        println!(
            "| {from}..{to} | {words} | {} | {mean:.0} | {} | {} | {ratio} |",
            with.len(),
            report::pair(with.p50(), with.p99()),
            report::pair(without.p50(), without.p99()),
        );
    }
    let stats = cached.model.segment_cache();
    println!("\nthe cache after the run: {stats:?}");
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

async fn run(
    args: &Args,
    stack: &Stack,
    sets: &[prompts::PromptSet],
    text: Option<&prompts::TextModel>,
    pin: bool,
    nproc: usize,
) -> anyhow::Result<()> {
    stack.store(sets).await?;
    stack.gateway_sees_workers().await?;
    check_paths(stack, &sets[0]).await?;
    let mut out = report::Report::new(args, stack, pin, nproc);

    if !args.no_latency {
        stack.unpin()?;
        let mut seed = args.seed;
        for set in sets.iter().filter(|s| args.sizes.contains(&s.size)) {
            let apis: &[Api] = if set.has_chat() && text.is_some() {
                &[Api::Completions, Api::Chat]
            } else {
                &[Api::Completions]
            };
            for &api in apis {
                let tokenize = match text {
                    Some(m) => Some(latency::tokenize_times(m, set, api, args.latency_rounds)?),
                    None => None,
                };
                for stream in [false, true] {
                    let spec = RowSpec {
                        size: set.size,
                        api,
                        stream,
                    };
                    seed += 1;
                    let row = latency::row(
                        stack,
                        set,
                        spec,
                        args.latency_warmup,
                        args.latency_rounds,
                        Duration::from_secs(args.latency_row_secs),
                        seed,
                    )
                    .await?;
                    out.latency(row, tokenize.clone());
                }
            }
        }
        out.print_latency();
    }

    if let (Some(dir), false) = (&args.model_dir, args.no_latency) {
        conversation_turns(args, dir)?;
    }

    if !args.no_throughput {
        let set = sets
            .iter()
            .find(|s| s.size == args.throughput_prompt_tokens)
            .expect("the throughput prompts were built");
        let bodies: Vec<_> = set
            .prompts
            .iter()
            .map(|p| prompts::body(&stack.model, Api::Completions, p, args.output_tokens, true))
            .collect();
        let bodies = Arc::new(bodies);
        let mut targets: Vec<Target> = stack
            .targets()
            .into_iter()
            .filter(|t| *t != Target::Direct)
            .filter(|t| args.throughput_targets.iter().any(|k| k == t.key()))
            .collect();
        anyhow::ensure!(!targets.is_empty(), "no throughput target to run");
        targets.reverse(); // gateway first
        if pin {
            stack.pin()?;
        }
        for round in 0..args.rounds {
            for &target in &targets {
                let load = throughput::Load {
                    url: stack.url(target, Api::Completions),
                    bodies: bodies.clone(),
                    events: Api::Completions.stream_events(args.output_tokens, true),
                    streams: args.streams,
                    warmup: Duration::from_secs(args.throughput_warmup_secs),
                    measure: Duration::from_secs(args.throughput_secs),
                };
                let w = throughput::window(target, round, &load, &stack.accounts).await?;
                eprintln!(
                    "throughput round {} {}: {:.0} req/s, {} errors",
                    round + 1,
                    target.label(),
                    w.per_sec(),
                    w.errors
                );
                out.window(w);
            }
            targets.rotate_left(1);
        }
        out.print_throughput(set.mean_tokens());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out.json())?)?;
        println!("\nJSON: {}", path.display());
    }
    Ok(())
}

/// One request of every kind through every target, so a broken path stops the run before
/// anything is timed; the gateway must name one of the registered workers.
async fn check_paths(stack: &Stack, set: &prompts::PromptSet) -> anyhow::Result<()> {
    let http = client::http_client()?;
    let apis: &[Api] = if set.has_chat() {
        &[Api::Completions, Api::Chat]
    } else {
        &[Api::Completions]
    };
    for &api in apis {
        for stream in [false, true] {
            let body = prompts::body(
                &stack.model,
                api,
                &set.prompts[0],
                stack.output_tokens,
                stream,
            );
            let expect = if stream {
                client::Expect::Stream {
                    events: api.stream_events(stack.output_tokens, true),
                }
            } else {
                client::Expect::Whole
            };
            for target in stack.targets() {
                client::call(&http, &stack.url(target, api), body.clone(), expect).await?;
            }
        }
    }
    Ok(())
}
