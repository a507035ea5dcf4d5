//! An in-process [`Selector`] for each replay mode, for runs without a router (and for tests).
//!
//! It knows only what it sent: requests in flight per worker, and for `kv` an approximate
//! cache per worker (everything sent there, LRU-bounded by the card's capacity). `kv` picks
//! the lowest `uncached blocks + blocks still to prefill on the worker`; ties are broken at
//! random (seeded), as are `least-busy`'s. A request in a session goes where the router's
//! session table (kvroute-router's own, in memory, hard affinity) has bound it, while that
//! worker is registered; bindings do not expire within a run.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use futures::FutureExt as _;
use kvroute_common::hashing::BlockHashes;
use kvroute_common::messages::{
    CostBreakdown, ErrorCode, SchemaVersion, SelectError, SelectReply, SelectRequest, StorageTier,
    WorkerCard,
};
use kvroute_common::{RequestId, WorkerId};
use kvroute_router::session::{
    BindingStatus, CommitOutcome, MemSessionStore, SessionConfig, SessionError, SessionTable,
};
use kvroute_router::worker::WorkerRank;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::Mode;
use super::oracle::LruOracle;
use super::selector::{SelectFailure, Selected, Selector};

/// The in-process selector of one mode.
#[derive(Debug)]
pub struct LocalSelector {
    mode: Mode,
    state: Mutex<State>,
    sessions: SessionTable<MemSessionStore>,
}

#[derive(Debug)]
struct State {
    workers: BTreeMap<WorkerId, LocalWorker>,
    placed: HashMap<RequestId, (WorkerId, u64)>,
    next: usize,
    rng: StdRng,
}

#[derive(Debug)]
struct LocalWorker {
    card: WorkerCard,
    in_flight: u64,
    /// Uncached blocks of the requests in flight here.
    pending_blocks: u64,
    cache: LruOracle,
}

impl LocalWorker {
    fn new(card: WorkerCard) -> Self {
        let cache = LruOracle::new(card.total_kv_blocks);
        Self {
            card,
            in_flight: 0,
            pending_blocks: 0,
            cache,
        }
    }
}

impl LocalSelector {
    pub fn new(mode: Mode, cards: &[WorkerCard], seed: u64) -> Self {
        let selector = Self {
            mode,
            state: Mutex::new(State {
                workers: BTreeMap::new(),
                placed: HashMap::new(),
                next: 0,
                rng: StdRng::seed_from_u64(seed),
            }),
            sessions: SessionTable::new(MemSessionStore::new(), SessionConfig::default()),
        };
        selector.workers_changed(cards);
        selector
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The choice, synchronously (the trait's future just wraps it).
    pub fn choose(&self, request: &SelectRequest) -> Result<SelectReply, SelectFailure> {
        let mut state = self.lock();
        let refused = |code: ErrorCode, message: &str| {
            SelectFailure::Refused(SelectError {
                v: SchemaVersion::CURRENT,
                request_id: request.request_id,
                code,
                message: message.into(),
                reasons: Default::default(),
            })
        };
        let candidates: Vec<WorkerId> = state
            .workers
            .values()
            .filter(|w| w.card.model == request.model)
            .map(|w| w.card.worker_id)
            .collect();
        if candidates.is_empty() {
            return Err(refused(
                ErrorCode::NoWorkers,
                "no registered worker serves this model",
            ));
        }
        let block_size = state.workers[&candidates[0]].card.block_size as usize;
        let tokens = request
            .token_ids
            .as_deref()
            .ok_or_else(|| refused(ErrorCode::BadRequest, "the local selector needs token_ids"))?;
        let hashes = BlockHashes::of_tokens(tokens, block_size, request.lora_name.as_deref());
        let blocks = hashes.sequence.len() as u64;
        let overlap = |state: &State, w: WorkerId| state.workers[&w].cache.peek(&hashes.sequence);
        let registered = |w: WorkerRank| w.dp_rank == 0 && candidates.contains(&w.worker_id);
        let lookup = match &request.session {
            Some(session) => Some(
                ready(self.sessions.lookup(session, &registered, 0))
                    .map_err(|e| refused(ErrorCode::Unavailable, &e.to_string()))?,
            ),
            None => None,
        };
        let bound = match lookup.as_ref().map(|l| l.status()) {
            Some(BindingStatus::Live(w)) => Some(w.worker_id),
            _ => None,
        };
        let pick = match bound {
            Some(worker) => worker,
            None => match self.mode {
                Mode::RoundRobin => {
                    let i = state.next % candidates.len();
                    state.next = state.next.wrapping_add(1);
                    candidates[i]
                }
                Mode::Random => candidates[state.rng.random_range(0..candidates.len())],
                Mode::LeastBusy => {
                    let costs: Vec<u64> = candidates
                        .iter()
                        .map(|w| state.workers[w].in_flight)
                        .collect();
                    lowest(&candidates, &costs, &mut state.rng)
                }
                Mode::Kv => {
                    let costs: Vec<u64> = candidates
                        .iter()
                        .map(|&w| {
                            blocks - overlap(&state, w) as u64 + state.workers[&w].pending_blocks
                        })
                        .collect();
                    lowest(&candidates, &costs, &mut state.rng)
                }
            },
        };
        let binding = match &lookup {
            Some(lookup) => {
                let chosen = WorkerRank::new(pick, 0);
                match ready(self.sessions.commit(lookup, chosen, &registered, 0)) {
                    Ok(CommitOutcome::Committed(state)) => state,
                    // One selector, one writer: a conflict cannot happen.
                    Ok(CommitOutcome::Conflict(_)) | Err(_) => {
                        return Err(refused(ErrorCode::Unavailable, "session commit failed"));
                    }
                }
            }
            None => None,
        };
        let hit = overlap(&state, pick) as u64;
        let request_id = request.request_id.unwrap_or_else(uuid::Uuid::new_v4);
        let worker = state.workers.get_mut(&pick).expect("a candidate");
        worker.cache.observe(&hashes.sequence);
        worker.in_flight += 1;
        worker.pending_blocks += blocks - hit;
        let request_subject = worker.card.request_subject.clone();
        state.placed.insert(request_id, (pick, blocks - hit));
        Ok(SelectReply {
            v: SchemaVersion::CURRENT,
            request_id,
            decision_id: uuid::Uuid::new_v4(),
            worker_id: pick,
            dp_rank: 0,
            request_subject,
            overlap_blocks: [(StorageTier::Device, hit as u32)].into(),
            request_blocks: blocks as u32,
            cost: CostBreakdown::default(),
            policy: format!("local-{}", self.mode),
            binding,
            router_id: "local".into(),
        })
    }
}

/// The result of a session table call over the in-memory store, which never waits.
fn ready<T>(
    call: impl std::future::Future<Output = Result<T, SessionError>>,
) -> Result<T, SessionError> {
    call.now_or_never()
        .expect("the in-memory session store answers at once")
}

/// The candidate with the lowest cost; ties broken at random.
fn lowest(candidates: &[WorkerId], costs: &[u64], rng: &mut StdRng) -> WorkerId {
    let min = costs.iter().copied().min().expect("non-empty");
    let tied: Vec<WorkerId> = candidates
        .iter()
        .zip(costs)
        .filter(|(_, c)| **c == min)
        .map(|(w, _)| *w)
        .collect();
    tied[rng.random_range(0..tied.len())]
}

impl Selector for LocalSelector {
    async fn select(&self, request: SelectRequest) -> Result<Selected, SelectFailure> {
        self.choose(&request)
            .map(|reply| Selected { reply, attempts: 1 })
    }

    fn finished(&self, reply: &SelectReply) {
        let mut state = self.lock();
        if let Some((w, pending)) = state.placed.remove(&reply.request_id)
            && let Some(worker) = state.workers.get_mut(&w)
        {
            worker.in_flight = worker.in_flight.saturating_sub(1);
            worker.pending_blocks = worker.pending_blocks.saturating_sub(pending);
        }
    }

    fn workers_changed(&self, cards: &[WorkerCard]) {
        let mut state = self.lock();
        state
            .workers
            .retain(|id, _| cards.iter().any(|c| c.worker_id == *id));
        for card in cards {
            state
                .workers
                .entry(card.worker_id)
                .or_insert_with(|| LocalWorker::new(card.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_common::messages::WorkerRole;

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
