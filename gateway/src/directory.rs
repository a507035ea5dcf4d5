//! The registered workers as the gateway needs them: where each one takes HTTP requests (its
//! card's `http_url`), which engine it is, its role (aggregated, prefill, decode) and, for an
//! SGLang prefill worker, its bootstrap port; and which models are served. Fed by the etcd
//! watch of worker cards ([`kvroute_common::discovery`]); readers take a snapshot without
//! waiting.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};

use kvroute_common::WorkerId;
use kvroute_common::discovery::WorkerEvent;
use kvroute_common::messages::{WorkerCard, WorkerRole};

/// The card label kvroute-bridge sets to the engine's kind (`vllm`, `sglang`).
pub const ENGINE_LABEL: &str = "kvroute.bridge/engine";
/// The card label kvroute-bridge sets to an SGLang prefill server's bootstrap port.
pub const BOOTSTRAP_PORT_LABEL: &str = "kvroute.bridge/bootstrap-port";

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
    /// An SGLang prefill server's bootstrap port (its card's label).
    pub bootstrap_port: Option<u16>,
}

impl Upstream {
    /// The host of the base URL (`[..]` kept around an IPv6 address).
    pub fn host(&self) -> &str {
        let rest = self
            .base_url
            .split_once("://")
            .map_or(self.base_url.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or(rest);
        let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
        match authority.rfind(']') {
            Some(end) => &authority[..=end],
            None => authority.split(':').next().unwrap_or(authority),
        }
    }
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

    /// Workers of `model`, by role: those with an HTTP URL, and how many have none.
    pub fn serving(&self, model: &str) -> Serving {
        let state = self.state.read().expect("directory lock");
        let mut out = Serving::default();
        for card in state.cards.values().filter(|c| c.model == model) {
            let Some(pool) = out.pool_mut(card.role) else {
                continue;
            };
            match upstream(card) {
                Some(up) => {
                    pool.http.push(card.worker_id);
                    pool.sglang |= up.engine == "sglang";
                }
                None => pool.without_http += 1,
            }
        }
        for pool in [&mut out.aggregated, &mut out.prefill, &mut out.decode] {
            pool.http.sort_unstable();
        }
        out
    }

    /// The block size every registered worker of `model` uses, if they agree (whatever their
    /// role: the prompt's hashes then serve both hops of a disaggregated request).
    pub fn block_size(&self, model: &str) -> Option<u32> {
        let state = self.state.read().expect("directory lock");
        let mut sizes = state
            .cards
            .values()
            .filter(|c| c.model == model)
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

/// The workers of one role of a model.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pool {
    /// With an HTTP URL, sorted.
    pub http: Vec<WorkerId>,
    /// Registered without one (kvroute-mocker's NATS workers): not eligible here.
    pub without_http: usize,
    /// Some worker with an HTTP URL is SGLang.
    pub sglang: bool,
}

/// Which workers can take a model's requests, by role.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Serving {
    pub aggregated: Pool,
    pub prefill: Pool,
    pub decode: Pool,
}

impl Serving {
    /// The pool of a role that serves text requests (not an encoder's).
    fn pool_mut(&mut self, role: WorkerRole) -> Option<&mut Pool> {
        match role {
            WorkerRole::Aggregated => Some(&mut self.aggregated),
            WorkerRole::Prefill => Some(&mut self.prefill),
            WorkerRole::Decode => Some(&mut self.decode),
            WorkerRole::Encode => None,
        }
    }

    /// Whether requests can be split: prefill and decode workers reachable over HTTP.
    pub fn pairs(&self) -> bool {
        !self.prefill.http.is_empty() && !self.decode.http.is_empty()
    }

    /// The workers a request's first (or only) hop may go to: aggregated ones, and prefill
    /// ones when requests can be split (a prefill worker may serve one end to end).
    pub fn first_hop(&self) -> Vec<WorkerId> {
        let mut out = self.aggregated.http.clone();
        if self.pairs() {
            out.extend_from_slice(&self.prefill.http);
        }
        out
    }

    /// Registered workers of the first hop's roles that have no HTTP URL.
    pub fn first_hop_without_http(&self) -> usize {
        self.aggregated.without_http
            + if self.pairs() {
                self.prefill.without_http
            } else {
                0
            }
    }
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
        bootstrap_port: card
            .labels
            .get(BOOTSTRAP_PORT_LABEL)
            .and_then(|p| p.trim().parse().ok()),
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
            lora_adapters: None,
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
            d.serving("m").aggregated,
            Pool {
                http: vec![1],
                without_http: 1,
                sglang: false,
            }
        );
        assert_eq!(d.models(), [("m".to_owned(), 1)].into());
        assert_eq!(d.block_size("m"), Some(16));
        assert_eq!(d.block_size("x"), None);
        assert_eq!(d.all_models().len(), 2);
        d.apply(WorkerEvent::Put {
            card: card(4, "m", Some("http://h:1")),
            revision: 2,
        });
        d.apply(WorkerEvent::Delete {
            worker_id: 1,
            revision: 3,
        });
        assert_eq!(d.serving("m").aggregated.http, [4]);
    }

    #[test]
    fn roles_make_pools_and_a_prefill_server_its_bootstrap_address() {
        let d = Directory::default();
        let mut prefill = card(5, "m", Some("http://[::1]:30000"));
        prefill.role = WorkerRole::Prefill;
        prefill.labels.insert(ENGINE_LABEL.into(), "sglang".into());
        prefill
            .labels
            .insert(BOOTSTRAP_PORT_LABEL.into(), "8998".into());
        let mut decode = card(6, "m", Some("http://10.0.0.2:30000"));
        decode.role = WorkerRole::Decode;
        let mut only_nats = card(7, "m", None);
        only_nats.role = WorkerRole::Decode;
        d.apply(WorkerEvent::Snapshot {
            cards: vec![card(1, "m", Some("http://a:1")), prefill, decode, only_nats],
            revision: 1,
        });
        let s = d.serving("m");
        assert!(s.pairs());
        assert!(s.prefill.sglang && !s.decode.sglang);
        assert_eq!(s.first_hop(), [1, 5]);
        assert_eq!(
            (s.decode.http.as_slice(), s.decode.without_http),
            (&[6][..], 1)
        );
        let up = d.upstream(5).unwrap();
        assert_eq!((up.host(), up.bootstrap_port), ("[::1]", Some(8998)));
        assert_eq!(d.upstream(6).unwrap().host(), "10.0.0.2");
        assert_eq!(d.upstream(6).unwrap().bootstrap_port, None);
    }
}
