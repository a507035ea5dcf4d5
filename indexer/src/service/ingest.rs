//! Reads the events stream in order from a given sequence with an ordered consumer, decodes
//! every message on this task (so decoding overlaps the main loop's applying) and hands it to
//! the main loop. If the consumer fails (for example while NATS restarts),
//! it is recreated from the next sequence not yet handed over, so nothing is skipped.
//! [`poll_stream_end`] asks the stream for its last sequence on a task of its own, so that the
//! loops judging their lag never wait on the JetStream API.

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::Stream;
use futures::StreamExt;
use kvroute_common::names::Names;
use tokio::sync::{mpsc, watch};

use crate::replica::{BadEntry, LogEntry, decode_entry};

/// One message of the log, decoded.
#[derive(Debug, Clone)]
pub struct LogMessage {
    pub seq: u64,
    pub entry: Result<LogEntry, BadEntry>,
}

/// How long one question about the stream's state may take before the poll asks again.
const INFO_TIMEOUT: Duration = Duration::from_secs(1);

/// The stream's last sequence, asked every `every` on a task of its own (a slow or lost answer
/// of the JetStream API delays only that task); the receiver holds the newest answer (0 before
/// the first). The task ends when every receiver is gone, or when the handle is aborted.
pub fn poll_stream_end(
    mut stream: Stream,
    every: Duration,
) -> (watch::Receiver<u64>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(0);
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if tx.is_closed() {
                return;
            }
            if let Ok(Ok(info)) = tokio::time::timeout(INFO_TIMEOUT, stream.info()).await {
                tx.send_replace(info.state.last_sequence);
            }
        }
    });
    (rx, task)
}

/// Consumes from `start_seq` until `tx` closes. `client` is the connection the stream was
/// opened on: after it reconnects (a NATS restart) the consumer is recreated at once rather
/// than after the ordered consumer's missed-heartbeat timeout.
pub fn spawn_consumer(
    names: Names,
    client: async_nats::Client,
    stream: Stream,
    start_seq: u64,
    tx: mpsc::Sender<LogMessage>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut next = start_seq.max(1);
        loop {
            let config = pull::OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: next,
                },
                ..Default::default()
            };
            let messages: Result<_, String> = match stream.create_consumer(config).await {
                Ok(consumer) => consumer.messages().await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let mut messages = match messages {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, next, "creating the log consumer failed; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    if tx.is_closed() {
                        return;
                    }
                    continue;
                }
            };
            let mut check = tokio::time::interval(Duration::from_millis(250));
            let mut disconnected = false;
            loop {
                let item = tokio::select! {
                    item = messages.next() => item,
                    _ = check.tick() => {
                        match client.connection_state() {
                            async_nats::connection::State::Connected if disconnected => {
                                tracing::info!(next, "reconnected to NATS; recreating the log consumer");
                                break;
                            }
                            async_nats::connection::State::Connected => {}
                            _ => disconnected = true,
                        }
                        continue;
                    }
                };
                let Some(item) = item else { break };
                match item {
                    Ok(msg) => {
                        let seq = match msg.info() {
                            Ok(info) => info.stream_sequence,
                            Err(e) => {
                                tracing::warn!(error = %e, "log message without stream info; skipped");
                                continue;
                            }
                        };
                        if seq < next {
                            continue;
                        }
                        let out = LogMessage {
                            seq,
                            entry: decode_entry(&names, &msg.subject, &msg.payload),
                        };
                        if tx.send(out).await.is_err() {
                            return;
                        }
                        next = seq + 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, next, "log consumer failed; recreating");
                        break;
                    }
                }
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}
