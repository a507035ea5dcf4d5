//! The fleet as the replay tool sees it: worker cards from etcd (a snapshot, and a live watch
//! that keeps a local selector current), and the mocker's cache reset between modes.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, bail};
use etcd_client::GetOptions;
use kvroute_common::codec::decode;
use kvroute_common::discovery::{WorkerEvent, watch_workers};
use kvroute_common::messages::WorkerCard;
use kvroute_common::{Names, WorkerId};
use kvroute_mocker::engine::EngineConfig;
use kvroute_mocker::fleet::{ENGINE_LABEL, SPEEDUP_LABEL};
use tokio::task::JoinHandle;

/// The cards of the workers serving `model`, by worker id.
pub async fn read_cards(
    etcd: &mut etcd_client::Client,
    names: &Names,
    model: &str,
) -> anyhow::Result<Vec<WorkerCard>> {
    let resp = etcd
        .get(
            names.workers_prefix(),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .context("reading worker cards from etcd")?;
    let mut cards: Vec<WorkerCard> = resp
        .kvs()
        .iter()
        .filter_map(|kv| decode::<WorkerCard>(kv.value()).ok())
        .filter(|c| c.model == model)
        .collect();
    cards.sort_by_key(|c| c.worker_id);
    Ok(cards)
}

/// Waits (up to `limit`) until at least one worker serves `model`; returns their cards.
pub async fn wait_for_workers(
    etcd: &mut etcd_client::Client,
    names: &Names,
    model: &str,
    limit: Duration,
) -> anyhow::Result<Vec<WorkerCard>> {
    let start = tokio::time::Instant::now();
    loop {
        let cards = read_cards(etcd, names, model).await?;
        if !cards.is_empty() {
            return Ok(cards);
        }
        if start.elapsed() > limit {
            bail!(
                "no worker serving model {model:?} registered in namespace {} within {limit:?}",
                names.namespace().as_str()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The fleet's time compression, from the mocker's card label (the first card that has it).
pub fn speedup_of(cards: &[WorkerCard]) -> Option<f64> {
    cards
        .iter()
        .find_map(|c| c.labels.get(SPEEDUP_LABEL)?.parse().ok())
}

/// The engine model of kvroute-mocker workers (their `kvroute.mocker/engine` label), when
/// every card carries the same one.
pub fn engine_of(cards: &[WorkerCard]) -> Option<EngineConfig> {
    let mut engines = cards
        .iter()
        .map(|c| serde_json::from_str::<EngineConfig>(c.labels.get(ENGINE_LABEL)?).ok());
    let first = engines.next()??;
    engines.all(|e| e.as_ref() == Some(&first)).then_some(first)
}

/// Asks every worker to drop its cache (kvroute-mocker's reset subject), concurrently.
pub async fn reset_workers(
    nats: &async_nats::Client,
    names: &Names,
    workers: &[WorkerId],
    timeout: Duration,
) -> anyhow::Result<()> {
    let resets = workers.iter().map(|&w| async move {
        let req = async_nats::Request::new().timeout(Some(timeout));
        nats.send_request(names.worker_reset(w), req)
            .await
            .with_context(|| {
                format!("resetting worker {w} (is it a kvroute-mocker worker? see --no-reset)")
            })
    });
    for result in futures::future::join_all(resets).await {
        result?;
    }
    Ok(())
}

/// Calls `on_change` with the current cards of `model` at start and after every change.
pub fn watch_cards(
    etcd: etcd_client::Client,
    names: &Names,
    model: String,
    on_change: impl Fn(&[WorkerCard]) + Send + 'static,
) -> JoinHandle<()> {
    let mut events = watch_workers(etcd, names);
    tokio::spawn(async move {
        let mut live: BTreeMap<WorkerId, WorkerCard> = BTreeMap::new();
        while let Some(event) = events.recv().await {
            match event {
                WorkerEvent::Snapshot { cards, .. } => {
                    live = cards.into_iter().map(|c| (c.worker_id, c)).collect();
                }
                WorkerEvent::Put { card, .. } => {
                    live.insert(card.worker_id, card);
                }
                WorkerEvent::Delete { worker_id, .. } => {
                    if live.remove(&worker_id).is_some() {
                        tracing::warn!(worker_id, "worker left the fleet");
                    }
                }
                WorkerEvent::Invalid { .. } => continue,
            }
            let cards: Vec<WorkerCard> = live
                .values()
                .filter(|c| c.model == model)
                .cloned()
                .collect();
            on_change(&cards);
        }
    })
}
