//! An in-process [`Selector`] for each replay mode, for runs without a router (and for tests).
//!
//! It decides through the router's decision core (`kvroute_router::decide`, the service's own
//! code) with the mode's policy — the built-in of that name, or `default` for `kv` — over a load
//! view charged by its own decisions and relieved when a request finishes, and the router's
//! session table (in memory; hard affinity by default). It knows only what it sent: the
//! overlap it offers the policy is an approximate cache per worker (every prompt sent there,
//! LRU-bounded by the card's capacity), and no load reports reach the view. It reads no policy
//! file and runs no request classifier: admission belongs to the router service (the simulator
//! refuses a policy file configuring one).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use kvroute_common::hashing::BlockHashes;
use kvroute_common::messages::{
    ErrorCode, LifecycleKind, RequestLifecycle, SchemaVersion, SelectError, SelectReply,
    SelectRequest, WorkerCard, now_ms,
};
use kvroute_common::{Names, Namespace, WorkerId};
use kvroute_router::decide::candidates::Partition;
use kvroute_router::decide::load_view::models::LoadModels;
use kvroute_router::decide::load_view::{LoadView, LoadViewConfig};
use kvroute_router::decide::prompt::Prepared;
use kvroute_router::decide::selection::{Context, Selection, Start};
use kvroute_router::decide::{Decided, Owned, PartitionPolicy};
use kvroute_router::drive::{self, Ended};
use kvroute_router::pipeline::WorkerInputs;
use kvroute_router::registry::{ResolvedPolicies, RouterPluginRegistry, WorkerSelectionConfig};
use kvroute_router::select::SelectionSettings;
use kvroute_router::session::{MemSessionStore, SessionConfig, SessionTable};
use kvroute_router::signals::{Overlap, SignalSnapshot};
use kvroute_router::worker::WorkerRank;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::config::Mode;
use super::oracle::LruOracle;
use super::selector::{SelectCallFailure, Selected, Selector};

/// The load view's settings: no reports arrive, so predictions go by lifecycle or age.
const VIEW: LoadViewConfig = LoadViewConfig {
    report_interval_ms: 1_000,
    confirm_window_ms: 60_000,
    prediction_max_age_ms: 600_000,
    // The overlap offered is already what was sent, at once: nothing to predict.
    predicted_overlap_ttl_ms: 0,
    approx_cache_ttl_ms: 0,
    models: LoadModels::OFF,
};

/// The in-process selector of one mode.
#[derive(Debug)]
pub struct LocalSelector {
    mode: Mode,
    state: Mutex<State>,
    sessions: SessionTable<MemSessionStore>,
    settings: SelectionSettings,
    names: Names,
}

#[derive(Debug)]
struct State {
    workers: BTreeMap<WorkerId, LocalWorker>,
    policies: ResolvedPolicies,
    /// One policy per model, built on first use (as the router builds one per partition).
    partitions: HashMap<String, PartitionPolicy>,
    view: LoadView,
    seed: u64,
}

#[derive(Debug)]
struct LocalWorker {
    card: WorkerCard,
    cache: LruOracle,
}

impl LocalSelector {
    pub fn new(mode: Mode, cards: &[WorkerCard], seed: u64) -> Self {
        let policies = RouterPluginRegistry::with_builtins()
            .resolve(&WorkerSelectionConfig::default(), &Default::default())
            .expect("the built-in selection resolves");
        let selector = Self {
            mode,
            state: Mutex::new(State {
                workers: BTreeMap::new(),
                policies,
                partitions: HashMap::new(),
                view: LoadView::new(VIEW),
                seed,
            }),
            sessions: SessionTable::new(MemSessionStore::new(), SessionConfig::default()),
            settings: SelectionSettings::default(),
            names: Names::new(&Namespace::new("replay").expect("a valid namespace")),
        };
        selector.workers_changed(cards);
        selector
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The choice, synchronously (the trait's future just wraps it).
    pub fn choose(&self, request: &SelectRequest) -> Result<SelectReply, SelectCallFailure> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let refused = |code: ErrorCode, message: String| {
            SelectCallFailure::Refused(SelectError {
                v: SchemaVersion::CURRENT,
                request_id: request.request_id,
                code,
                message,
                reasons: Default::default(),
            })
        };
        let cards: Vec<WorkerCard> = state
            .workers
            .values()
            .filter(|w| w.card.model == request.model && w.card.role == request.role)
            .map(|w| w.card.clone())
            .collect();
        let Some(first) = cards.first() else {
            return Err(refused(
                ErrorCode::NoWorkers,
                "no registered worker serves this model".into(),
            ));
        };
        let partition = Arc::new(Partition {
            block_size: first.block_size,
            cards,
        });
        let request_id = request.request_id.unwrap_or_else(uuid::Uuid::new_v4);
        let prepared = Prepared::new(request.clone(), request_id, partition)
            .map_err(|e| refused(e.code(), e.to_string()))?;
        let partition = &prepared.partition;
        let sequence = request.token_ids.as_deref().map(|tokens| {
            BlockHashes::of_tokens(
                tokens,
                partition.block_size as usize,
                request.lora_name.as_deref(),
            )
            .sequence
        });
        let policy = match state.partitions.entry(request.model.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let built = self
                    .mode
                    .build_policy(&state.policies, &request.model)
                    .map_err(|e| refused(ErrorCode::Unavailable, e.to_string()))?;
                e.insert(PartitionPolicy::new(
                    built,
                    StdRng::seed_from_u64(state.seed),
                    &self.settings,
                ))
            }
        };
        let context = Context {
            settings: &self.settings,
            names: &self.names,
            router_id: "local",
            sessions: *self.sessions.config(),
        };
        let start = Start {
            decision_id: uuid::Uuid::new_v4(),
            reads_cache: policy.inputs.contains(WorkerInputs::CACHE),
            overlap: None,
            target: None,
            queues: false,
        };
        let now = now_ms();
        let mut decision_state = Owned {
            policy,
            view: &mut state.view,
            now_ms: now,
        };
        let (selection, need) = Selection::start(&prepared, context, start, &mut decision_state);
        let workers = &state.workers;
        // It offers what it sent: each worker's approximate cache.
        let overlap = || {
            let mut overlap = SignalSnapshot::new();
            let Some(sequence) = &sequence else {
                return overlap;
            };
            for card in &partition.cards {
                let device = workers[&card.worker_id].cache.peek(sequence) as u32;
                if device > 0 {
                    overlap = overlap.with_overlap(
                        WorkerRank::new(card.worker_id, 0),
                        Overlap {
                            device,
                            ..Overlap::default()
                        },
                    );
                }
            }
            overlap
        };
        let decided = match drive::now(
            selection,
            need,
            &mut decision_state,
            self.sessions.store(),
            overlap,
        ) {
            Ended::Reply(decided) => decided,
            Ended::Join(_) => unreachable!("the local selector queues nothing"),
        }
        .map_err(|e| SelectCallFailure::Refused(e.to_select_error(Some(request_id))))?;
        match decided {
            Decided::New(new) => {
                if let (Some(sequence), Some(worker)) =
                    (&sequence, state.workers.get_mut(&new.decision.worker_id))
                {
                    worker.cache.observe(sequence);
                }
                Ok(new.reply)
            }
            Decided::Known(reply) => Ok(*reply),
            Decided::Expired => Err(refused(ErrorCode::Unavailable, "past its deadline".into())),
        }
    }
}

impl Selector for LocalSelector {
    async fn select(&self, request: SelectRequest) -> Result<Selected, SelectCallFailure> {
        self.choose(&request)
            .map(|reply| Selected { reply, attempts: 1 })
    }

    fn finished(&self, reply: &SelectReply) {
        let finished = RequestLifecycle {
            v: SchemaVersion::CURRENT,
            request_id: reply.request_id,
            worker_id: reply.worker_id,
            dp_rank: reply.dp_rank,
            kind: LifecycleKind::Finished { output_tokens: 0 },
            ts: 0,
        };
        self.lock().view.apply_lifecycle(&finished, now_ms());
    }

    fn workers_changed(&self, cards: &[WorkerCard]) {
        let mut state = self.lock();
        let gone: Vec<WorkerId> = state
            .workers
            .keys()
            .filter(|id| !cards.iter().any(|c| c.worker_id == **id))
            .copied()
            .collect();
        for id in gone {
            state.workers.remove(&id);
            state.view.remove_worker(id);
        }
        for card in cards {
            state
                .workers
                .entry(card.worker_id)
                .or_insert_with(|| LocalWorker {
                    cache: LruOracle::new(card.total_kv_blocks),
                    card: card.clone(),
                });
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::{StorageTier, WorkerRole};

    use super::*;

    fn card(worker_id: WorkerId) -> WorkerCard {
        WorkerCard {
            v: SchemaVersion::CURRENT,
            worker_id,
            model: "m".into(),
            role: WorkerRole::Aggregated,
            block_size: 4,
            total_kv_blocks: 100,
            max_num_batched_tokens: 0,
            dp_start_rank: 0,
            dp_size: 1,
            taints: vec![],
            labels: Default::default(),
            request_subject: format!("w{worker_id}"),
            software_version: String::new(),
            http_url: None,
            kv_events: true,
            lora_adapters: None,
        }
    }

    fn request(first: u32) -> SelectRequest {
        SelectRequest {
            model: "m".into(),
            token_ids: Some((first..first + 16).collect()),
            ..SelectRequest::default()
        }
    }

    #[test]
    fn round_robin_cycles_and_kv_follows_the_prefix() {
        let cards = [card(1), card(2), card(3)];
        let rr = LocalSelector::new(Mode::RoundRobin, &cards, 1);
        let picks: Vec<WorkerId> = (0..4)
            .map(|_| rr.choose(&request(0)).unwrap().worker_id)
            .collect();
        assert_eq!(picks, vec![1, 2, 3, 1]);

        let kv = LocalSelector::new(Mode::Kv, &cards, 1);
        let first = kv.choose(&request(0)).unwrap();
        kv.finished(&first);
        let again = kv.choose(&request(0)).unwrap();
        assert_eq!(again.worker_id, first.worker_id);
        assert_eq!(again.overlap_blocks[&StorageTier::Device], 4);
        // While a worker has a cold prompt to prefill, the next cold prompt goes elsewhere.
        let busy = kv.choose(&request(2000)).unwrap();
        let other = kv.choose(&request(1000)).unwrap();
        assert_ne!(other.worker_id, busy.worker_id);
    }

    #[test]
    fn least_busy_spreads_and_gone_workers_are_dropped() {
        let lb = LocalSelector::new(Mode::LeastBusy, &[card(1), card(2)], 7);
        let a = lb.choose(&request(0)).unwrap().worker_id;
        let b = lb.choose(&request(0)).unwrap().worker_id;
        assert_ne!(a, b);
        lb.workers_changed(&[card(2)]);
        assert_eq!(lb.choose(&request(0)).unwrap().worker_id, 2);
        lb.workers_changed(&[]);
        assert_eq!(
            lb.choose(&request(0)).unwrap_err().kind(),
            "select_no_workers"
        );
    }

    #[test]
    fn a_session_stays_on_its_bound_worker_until_it_leaves() {
        use kvroute_common::messages::{BindingState, SessionContext};
        let in_session = |id: &str| SelectRequest {
            session: Some(SessionContext {
                id: id.into(),
                parent_id: None,
                is_final: false,
                trigger: Default::default(),
            }),
            ..request(0)
        };
        let rr = LocalSelector::new(Mode::RoundRobin, &[card(1), card(2), card(3)], 1);
        let first = rr.choose(&in_session("a")).unwrap();
        assert_eq!(first.binding, Some(BindingState::New));
        let later: Vec<_> = (0..3)
            .map(|_| rr.choose(&in_session("a")).unwrap())
            .collect();
        assert!(later.iter().all(|r| r.worker_id == first.worker_id));
        assert_eq!(later[0].binding, Some(BindingState::Kept));
        // Another session, and requests without one, still go round.
        assert_ne!(
            rr.choose(&in_session("b")).unwrap().worker_id,
            first.worker_id
        );
        // The bound worker leaves: the session is rebound elsewhere.
        let others: Vec<_> = [1, 2, 3]
            .into_iter()
            .filter(|&w| w != first.worker_id)
            .map(card)
            .collect();
        rr.workers_changed(&others);
        let moved = rr.choose(&in_session("a")).unwrap();
        assert_ne!(moved.worker_id, first.worker_id);
        assert_eq!(moved.binding, Some(BindingState::Rebound));
    }
}
