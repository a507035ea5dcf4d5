//! Reads the events stream in order from a given sequence with an ordered consumer and hands
//! every message to the main loop. If the consumer fails (for example while NATS restarts),
//! it is recreated from the next sequence not yet handed over, so nothing is skipped.

use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::Stream;
use futures::StreamExt;
use tokio::sync::mpsc;

/// One message of the log.
#[derive(Debug, Clone)]
pub struct LogMessage {
    pub seq: u64,
    pub subject: String,
    pub payload: bytes::Bytes,
}

/// Consumes from `start_seq` until `tx` closes.
pub fn spawn_consumer(
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
            while let Some(item) = messages.next().await {
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
                            subject: msg.subject.to_string(),
                            payload: msg.payload.clone(),
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
