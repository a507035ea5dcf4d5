//! The four measurements, each on the same workload: raw ZMQ, raw JetStream, the relay, and
//! visibility at a paced rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::{self, message::PublishMessage, stream::Stream};
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use kvroute_bridge::BridgeMetrics;
use kvroute_bridge::config::{EngineKind, EngineSpec};
use kvroute_bridge::metrics::names as metric;
use kvroute_bridge::relay::{Relay, RelaySettings};
use kvroute_common::codec::decode;
use kvroute_common::messages::KvEventBatch;
use kvroute_common::worker::{PublisherConfig, WorkerAgent, WorkerAgentConfig};
use kvroute_common::{Names, WorkerId};
use kvroute_indexer::{IndexConfig, RadixIndex};
use kvroute_tests::{TestEnv, sim_card};

use crate::cpu_split::{CpuSplit, Threads, mark, split};
use crate::engine_pub::{EnginePub, Pace, sender_thread};
use crate::workload::Workload;

/// The relay's engine label (its metrics' `engine=` and its thread `zmq-bench-0`).
const ENGINE: &str = "bench";

#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    pub messages: f64,
    pub blocks: f64,
}

impl Rate {
    fn of(messages: usize, blocks: u64, took: Duration) -> Self {
        let s = took.as_secs_f64();
        Self {
            messages: messages as f64 / s,
            blocks: blocks as f64 / s,
        }
    }
}

/// What every phase runs against.
pub struct Run<'a> {
    pub rt: &'a tokio::runtime::Runtime,
    pub env: &'a TestEnv,
    pub names: Names,
    pub js: jetstream::Context,
    pub stream: Stream,
    /// The engine side's libzmq context.
    pub pub_ctx: zmq::Context,
    pub threads: Threads,
}

impl Run<'_> {
    /// Empties the events stream between phases (its file store shares a small disk).
    pub fn purge(&mut self) -> anyhow::Result<()> {
        self.rt
            .block_on(std::future::IntoFuture::into_future(self.stream.purge()))?;
        Ok(())
    }

    /// Phase 1: PUB → SUB, the SUB only receiving (`recv_multipart`, as the relay does).
    pub fn raw_zmq(&self, w: &Workload) -> anyhow::Result<Rate> {
        let mut engine = EnginePub::bind(&self.pub_ctx)?;
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB)?;
        sub.set_rcvhwm(1_000_000)?;
        sub.set_maxmsgsize(kvroute_bridge::zmq_io::MAX_PAYLOAD_BYTES)?;
        sub.set_linger(0)?;
        sub.set_subscribe(b"")?;
        sub.connect(&engine.endpoint)?;
        engine.join(&w.probe, || {
            sub.poll(zmq::POLLIN, 0).unwrap_or(0) > 0 && sub.recv_multipart(0).is_ok()
        })?;
        while sub.poll(zmq::POLLIN, 0)? > 0 {
            sub.recv_multipart(0)?;
        }
        sub.set_rcvtimeo(5_000)?;
        let start = Instant::now();
        let took = std::thread::scope(|s| {
            let sender = sender_thread(s, || engine.send_all(&w.payloads, None, start))?;
            let mut bytes = 0usize;
            for _ in 0..w.payloads.len() {
                let frames = sub.recv_multipart(0).context("a batch within 5 s")?;
                bytes += frames[2].len();
            }
            let took = start.elapsed();
            std::hint::black_box(bytes);
            sender.join().expect("sender thread")?;
            anyhow::Ok(took)
        })?;
        Ok(Rate::of(w.payloads.len(), w.total_blocks(), took))
    }

    /// Phase 2: `batches` published as worker `worker`, one in flight like `EventPublisher`
    /// (send, await the ack, a message id each) or up to `window` acks outstanding.
    pub fn raw_jetstream(
        &self,
        worker: WorkerId,
        batches: &[bytes::Bytes],
        blocks: u64,
        window: usize,
    ) -> anyhow::Result<Rate> {
        let subject = self.names.kv_events(worker);
        let start = Instant::now();
        self.rt.block_on(async {
            let mut acks = FuturesOrdered::new();
            for (i, b) in batches.iter().enumerate() {
                let msg = PublishMessage::build()
                    .payload(b.clone())
                    .message_id(format!("{worker}-bench-0-{i}-{i}"));
                let ack = self.js.send_publish(subject.clone(), msg).await?;
                acks.push_back(tokio::time::timeout(Duration::from_secs(2), ack));
                while acks.len() >= window {
                    acks.next().await.context("an ack")???;
                }
            }
            while let Some(ack) = acks.next().await {
                ack??;
            }
            anyhow::Ok(())
        })?;
        Ok(Rate::of(batches.len(), blocks, start.elapsed()))
    }

    /// A relay for one rank of a PUB, joined, then attached to a registered worker agent
    /// (what `kvroute-bridge` runs per engine, minus the HTTP side) whose publisher keeps up to
    /// `in_flight` acks outstanding.
    fn start_bridge(
        &self,
        worker: WorkerId,
        probe: &[u8],
        in_flight: usize,
    ) -> anyhow::Result<Bridge> {
        let mut engine = EnginePub::bind(&self.pub_ctx)?;
        let spec = EngineSpec {
            name: ENGINE.into(),
            engine: EngineKind::Vllm,
            engine_url: "http://127.0.0.1:9".into(),
            zmq_endpoint: engine.endpoint.clone(),
            zmq_replay_endpoint: None,
            zmq_topic: String::new(),
            kv_events: true,
            worker_id: Some(worker),
            dp_size: Some(1),
            dp_start_rank: 0,
            model: None,
            block_size: None,
            total_kv_blocks: None,
            max_num_batched_tokens: None,
            role: Default::default(),
            taints: vec![],
            labels: Default::default(),
        };
        let metrics = Arc::new(BridgeMetrics::default());
        let relay = Relay::start(
            &spec,
            vec![0],
            RelaySettings {
                mirror_max_blocks: 1_000_000,
                shared_tier: true,
            },
            metrics.clone(),
        )?;
        // Joined before the publisher is attached: the probes (and the late-join gap before
        // the first that arrives) reach only the mirror, which they leave empty.
        engine.join(probe, || batches(&metrics) > 0.0)?;
        let names = self.names.clone();
        let agent = self.rt.block_on(async {
            let mut agent = WorkerAgent::start(
                self.env.nats.connect().await?,
                self.env.etcd.connect().await?,
                &names,
                sim_card(&names, worker, "bench"),
                WorkerAgentConfig {
                    publisher: PublisherConfig {
                        max_in_flight: in_flight,
                        ..PublisherConfig::default()
                    },
                    ..WorkerAgentConfig::default()
                },
                relay.resync_source(),
            )
            .await?;
            agent.wait_registered().await;
            agent.publisher().flush().await;
            anyhow::Ok(agent)
        })?;
        relay.attach(agent.publisher().clone());
        Ok(Bridge {
            engine,
            relay,
            agent: Some(agent),
            metrics,
        })
    }

    /// Phase 3: every payload through a relay (its publisher keeping up to `in_flight` acks
    /// outstanding) as fast as the PUB sends, until the publisher has all `kv_events` of them
    /// acked; checked against the stream and the relay's gaps.
    pub fn relay(
        &self,
        w: &Workload,
        kv_events: usize,
        worker: WorkerId,
        in_flight: usize,
    ) -> anyhow::Result<Relayed> {
        let mut bridge = self.start_bridge(worker, &w.probe, in_flight)?;
        let stats = bridge.agent.as_ref().expect("agent").publisher().stats();
        let acked_before = stats.events_published.load(Ordering::Relaxed);
        let messages_before = stats.batches_published.load(Ordering::Relaxed);
        let received_before = batches(&bridge.metrics);
        // The late join's gap (before the first probe that arrived) is counted already.
        let gaps_before = gaps(&bridge.metrics);
        let want = acked_before + kv_events as u64;
        let n = w.payloads.len();
        let before = mark(&self.threads);
        let start = Instant::now();
        let engine = &mut bridge.engine;
        let metrics = &bridge.metrics;
        let (took, all_received, cpu) = std::thread::scope(|s| {
            let sender = sender_thread(s, || engine.send_all(&w.payloads, None, start))?;
            let mut all_received = None;
            let deadline = start + Duration::from_secs(120);
            while stats.events_published.load(Ordering::Relaxed) < want {
                if all_received.is_none() && batches(metrics) >= received_before + n as f64 {
                    all_received = Some(start.elapsed());
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the relay published {} of {kv_events} events in 120 s",
                    stats.events_published.load(Ordering::Relaxed) - acked_before
                );
                std::thread::sleep(Duration::from_micros(500));
            }
            let took = start.elapsed();
            let after = mark(&self.threads);
            let sender = sender.join().expect("sender thread")?;
            let cpu = split(&before, &after, &self.threads, sender);
            anyhow::Ok((took, all_received.unwrap_or(took), cpu))
        })?;
        let js_messages = stats.batches_published.load(Ordering::Relaxed) - messages_before;
        let gaps = gaps(&bridge.metrics) - gaps_before;
        anyhow::ensure!(
            gaps == 0.0,
            "the relay saw {gaps} gaps: the PUB dropped batches"
        );
        let in_stream = self.rt.block_on(self.stream.clone().info())?.state.messages;
        anyhow::ensure!(
            in_stream == messages_before + js_messages,
            "the stream holds {in_stream} messages, the publisher had {} acked",
            messages_before + js_messages
        );
        bridge.stop(self.rt);
        Ok(Relayed {
            rate: Rate::of(n, w.total_blocks(), took),
            took,
            all_received,
            js_messages,
            cpu,
        })
    }

    /// Phase 4: the first payloads, `seconds` worth at `rate` block events/s, through a relay;
    /// an ordered consumer of the events stream (as an indexer's ingest) applies them to a
    /// `RadixIndex` here, and each engine batch is timed from its send until `find_matches`
    /// finds its last stored block at full depth.
    pub fn visibility(
        &self,
        w: &Workload,
        rate: u64,
        seconds: u64,
        worker: WorkerId,
    ) -> anyhow::Result<Visibility> {
        let budget = rate * seconds;
        let (mut m, mut blocks) = (0, 0);
        while m < w.payloads.len() && blocks + w.blocks[m] <= budget {
            blocks += w.blocks[m];
            m += 1;
        }
        anyhow::ensure!(
            m > 0,
            "--latency-rate × --latency-seconds is under one batch"
        );
        let start_seq = self
            .rt
            .block_on(self.stream.clone().info())?
            .state
            .last_sequence
            + 1;
        let mut bridge =
            self.start_bridge(worker, &w.probe, PublisherConfig::default().max_in_flight)?;
        let config = pull::OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start_seq,
            },
            ..Default::default()
        };
        let mut messages = self.rt.block_on(async {
            let consumer = self.stream.create_consumer(config).await?;
            anyhow::Ok(consumer.messages().await?)
        })?;
        let sent: Vec<AtomicU64> = (0..m).map(|_| AtomicU64::new(0)).collect();
        let start = Instant::now();
        let sent_ref = &sent;
        let consumer = async move {
            let mut index = RadixIndex::new(IndexConfig::default());
            let mut latencies = Vec::with_capacity(m);
            let deadline = Instant::now() + Duration::from_secs(seconds + 30);
            while latencies.len() < m {
                let left = deadline.saturating_duration_since(Instant::now());
                let msg = tokio::time::timeout(left, messages.next())
                    .await
                    .context("the visibility phase timed out")?
                    .context("the consumer ended")??;
                let batch: KvEventBatch = decode(&msg.payload)?;
                if batch.worker_id != worker {
                    continue;
                }
                index.apply_batch(&batch);
                let now = start.elapsed().as_nanos() as u64;
                while latencies.len() < m {
                    let i = latencies.len();
                    let at = sent_ref[i].load(Ordering::Acquire);
                    let (chain, depth) = w.last_stored[i];
                    let found = at > 0
                        && index
                            .find_matches(&w.chains[chain][..depth])
                            .matches
                            .iter()
                            .any(|x| x.worker_id == worker && x.device as usize >= depth);
                    if !found {
                        break;
                    }
                    latencies.push(Duration::from_nanos(now.saturating_sub(at - 1)));
                }
            }
            anyhow::Ok(latencies)
        };
        let pace = Pace {
            blocks: &w.blocks[..m],
            rate,
            sent: &sent,
        };
        let before = mark(&self.threads);
        let engine = &mut bridge.engine;
        let (mut latencies, cpu) = std::thread::scope(|s| {
            let sender = sender_thread(s, || engine.send_all(&w.payloads[..m], Some(pace), start))?;
            let latencies = self.rt.block_on(consumer);
            let after = mark(&self.threads);
            let sender = sender.join().expect("sender thread")?;
            anyhow::Ok((latencies?, split(&before, &after, &self.threads, sender)))
        })?;
        let took = start.elapsed();
        bridge.stop(self.rt);
        latencies.sort();
        Ok(Visibility {
            rate: Rate::of(m, blocks, took),
            took,
            latencies,
            cpu,
        })
    }
}

/// The relay phase's outcome.
#[derive(Debug)]
pub struct Relayed {
    pub rate: Rate,
    /// Until every event was acked.
    pub took: Duration,
    /// Until the relay had received every batch.
    pub all_received: Duration,
    pub js_messages: u64,
    pub cpu: CpuSplit,
}

/// The visibility phase's outcome.
#[derive(Debug)]
pub struct Visibility {
    pub rate: Rate,
    pub took: Duration,
    /// One per engine batch, sorted.
    pub latencies: Vec<Duration>,
    pub cpu: CpuSplit,
}

impl Visibility {
    pub fn percentile(&self, p: f64) -> Duration {
        let last = self.latencies.len() - 1;
        self.latencies[((last as f64) * p).round() as usize]
    }
}

/// One engine's event path under test.
struct Bridge {
    engine: EnginePub,
    relay: Relay,
    agent: Option<WorkerAgent>,
    metrics: Arc<BridgeMetrics>,
}

impl Bridge {
    fn stop(mut self, rt: &tokio::runtime::Runtime) {
        self.relay.shutdown();
        if let Some(agent) = self.agent.take() {
            rt.block_on(agent.shutdown());
        }
    }
}

fn batches(metrics: &BridgeMetrics) -> f64 {
    metrics.get(metric::BATCHES, ENGINE, Some(0), "")
}

fn gaps(metrics: &BridgeMetrics) -> f64 {
    metrics.get(metric::GAPS, ENGINE, Some(0), "")
}
