//! The registered workers as the gateway needs them: where each one takes HTTP requests (its
//! card's `http_url`), which engine it is, and which models are served. Fed by the etcd watch
//! of worker cards ([`kvroute_common::discovery`]); readers take a snapshot without waiting.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use kvroute_common::WorkerId;
use kvroute_common::discovery::WorkerEvent;
use kvroute_common::messages::{WorkerCard, WorkerRole};

/// The card label kvroute-bridge sets to the engine's kind (`vllm`, `sglang`).
pub const ENGINE_LABEL: &str = "kvroute.bridge/engine";

/// A worker the gateway can send requests to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub worker_id: WorkerId,
    pub model: String,
    pub role: WorkerRole,
    /// The engine's HTTP base URL, without a trailing `/`.
    pub base_url: String,
    /// `sglang` takes the rank in the body (`routed_dp_rank`); others in the
    /// `X-data-parallel-rank` header.
    pub engine: String,
    pub dp_size: u32,
}

/// The directory's content at one moment.
#[derive(Debug, Default)]
struct State {
    /// Every registered worker, with or without an HTTP URL.
    cards: HashMap<WorkerId, WorkerCard>,
    loaded: bool,
}

/// Shared by every request task.
#[derive(Debug, Default, Clone)]
pub struct Directory {
    state: Arc<RwLock<State>>,
}

impl Directory {
    /// Applies one change of the watch.
    pub fn apply(&self, event: WorkerEvent) {
        let mut state = self.state.write().expect("directory lock");
        match event {
            WorkerEvent::Snapshot { cards, .. } => {
                state.cards = cards.into_iter().map(|c| (c.worker_id, c)).collect();
                state.loaded = true;
            }
            WorkerEvent::Put { card, .. } => {
                state.cards.insert(card.worker_id, card);
            }
            WorkerEvent::Delete { worker_id, .. } => {
                state.cards.remove(&worker_id);
            }
            WorkerEvent::Invalid { key, error, .. } => {
                tracing::warn!(key, error, "skipping an undecodable worker card");
            }
        }
    }

    /// Whether the first full read of the cards has arrived.
    pub fn loaded(&self) -> bool {
        self.state.read().expect("directory lock").loaded
    }

    /// The worker, if registered and reachable over HTTP.
    pub fn upstream(&self, worker_id: WorkerId) -> Option<Upstream> {
        let state = self.state.read().expect("directory lock");
        state.cards.get(&worker_id).and_then(upstream)
    }

    /// Workers of `model` in `role`: those with an HTTP URL, and whether some have none.
    pub fn serving(&self, model: &str, role: WorkerRole) -> Serving {
        let state = self.state.read().expect("directory lock");
        let mut out = Serving::default();
        for card in state.cards.values() {
            if card.model == model && card.role == role {
                match upstream(card) {
                    Some(_) => out.http.push(card.worker_id),
                    None => out.without_http += 1,
                }
            }
        }
        out.http.sort_unstable();
        out
    }

    /// The block size every registered worker of `model` in `role` uses, if they agree.
    pub fn block_size(&self, model: &str, role: WorkerRole) -> Option<u32> {
        let state = self.state.read().expect("directory lock");
        let mut sizes = state
            .cards
            .values()
            .filter(|c| c.model == model && c.role == role)
            .map(|c| c.block_size);
        let first = sizes.next()?;
        (first > 0 && sizes.all(|b| b == first)).then_some(first)
    }

    /// Every model a registered worker with an HTTP URL serves, and how many such workers.
    pub fn models(&self) -> BTreeMap<String, usize> {
        let state = self.state.read().expect("directory lock");
        let mut out = BTreeMap::new();
        for card in state.cards.values().filter(|c| upstream(c).is_some()) {
            *out.entry(card.model.clone()).or_insert(0) += 1;
        }
        out
    }

    /// Models some worker serves (with or without an HTTP URL).
    pub fn all_models(&self) -> BTreeSet<String> {
        let state = self.state.read().expect("directory lock");
        state.cards.values().map(|c| c.model.clone()).collect()
    }
}

/// Which workers can take a model's requests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Serving {
    /// With an HTTP URL, sorted.
    pub http: Vec<WorkerId>,
    /// Registered without one (kvroute-mocker's NATS workers): not eligible here.
    pub without_http: usize,
}

fn upstream(card: &WorkerCard) -> Option<Upstream> {
    let url = card.http_url.as_deref()?.trim_end_matches('/');
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return None;
    }
    Some(Upstream {
        worker_id: card.worker_id,
        model: card.model.clone(),
        role: card.role,
        base_url: url.to_owned(),
        engine: card.labels.get(ENGINE_LABEL).cloned().unwrap_or_default(),
        dp_size: card.dp_size.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(id: u64, model: &str, url: Option<&str>) -> WorkerCard {
        WorkerCard {
            v: Default::default(),
            worker_id: id,
            model: model.into(),
            role: WorkerRole::Aggregated,
            block_size: 16,
            total_kv_blocks: 100,
            max_num_batched_tokens: 0,
            dp_start_rank: 0,
            dp_size: 1,
            taints: vec![],
            labels: [(ENGINE_LABEL.to_owned(), "vllm".to_owned())].into(),
            request_subject: "r".into(),
            software_version: String::new(),
            http_url: url.map(str::to_owned),
            kv_events: true,
        }
    }

    #[test]
    fn only_workers_with_an_http_url_are_upstreams() {
        let d = Directory::default();
        assert!(!d.loaded());
        d.apply(WorkerEvent::Snapshot {
            cards: vec![
                card(1, "m", Some("http://10.0.0.1:8000/")),
                card(2, "m", None),
                card(3, "n", Some("ftp://x")),
            ],
            revision: 1,
        });
        assert!(d.loaded());
        let up = d.upstream(1).expect("has a url");
        assert_eq!(up.base_url, "http://10.0.0.1:8000");
        assert_eq!(up.engine, "vllm");
        assert!(d.upstream(2).is_none() && d.upstream(3).is_none());
        assert_eq!(
            d.serving("m", WorkerRole::Aggregated),
            Serving {
                http: vec![1],
                without_http: 1
            }
        );
        assert_eq!(d.models(), [("m".to_owned(), 1)].into());
        assert_eq!(d.block_size("m", WorkerRole::Aggregated), Some(16));
        assert_eq!(d.block_size("x", WorkerRole::Aggregated), None);
        assert_eq!(d.all_models().len(), 2);
        d.apply(WorkerEvent::Put {
            card: card(4, "m", Some("http://h:1")),
            revision: 2,
        });
        d.apply(WorkerEvent::Delete {
            worker_id: 1,
            revision: 3,
        });
        assert_eq!(d.serving("m", WorkerRole::Aggregated).http, [4]);
    }
}
