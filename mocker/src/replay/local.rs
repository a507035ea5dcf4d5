//! An in-process [`Selector`] for each replay mode, for runs without a router (and for tests).
//!
//! It knows only what it sent: requests in flight per worker, and for `kv` an approximate
//! cache per worker (everything sent there, LRU-bounded by the card's capacity). `kv` picks
//! the lowest `uncached blocks + blocks still to prefill on the worker`; ties are broken at
//! random (seeded), as are `least-busy`'s.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use kvroute_common::hashing::BlockHashes;
use kvroute_common::messages::{
    CostBreakdown, ErrorCode, SchemaVersion, SelectError, SelectReply, SelectRequest, StorageTier,
    WorkerCard,
};
use kvroute_common::{RequestId, WorkerId};
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
        let pick = match self.mode {
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
                    .map(|&w| blocks - overlap(&state, w) as u64 + state.workers[&w].pending_blocks)
                    .collect();
                lowest(&candidates, &costs, &mut state.rng)
            }
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
            binding: None,
            router_id: "local".into(),
        })
    }
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
}
