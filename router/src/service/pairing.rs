//! Disaggregated prefill and decode: a request of role `aggregated` whose model has prefill and
//! decode workers is decided in the prefill partition (the KV-aware cost over the prefill
//! pool, with its session binding), then — always, or when the conditional rule says so — gets
//! a decode hop: a second run of the selection machine over the decode partition with the
//! decode role's policy and the request's `decode` rules, charged to the decode partition's
//! load view. Both are published as one decision (the decode hop inside it), which every
//! replica charges to both workers. A request that gets no decode hop is served end to end by
//! its prefill worker (or, in mode `never`, by an aggregated worker when the model has any):
//! a decode worker never gets a request without a prefill to take over.

use kvroute_common::messages::{Disaggregation, SelectRequest, WorkerRole};

use super::Router;
use super::intake::Clock;
use super::load_views;
use super::metrics::labels;
use crate::decide::prompt::Prepared;
use crate::decide::{Decided, NewDecision, pairing, wire};
use crate::drive::Ended;

impl Router {
    /// Plans a new request's hops: the role it is decided in (`prefill` for a request that
    /// may be disaggregated, or that a prefill worker serves end to end) and its pairing.
    pub(super) fn plan_hops(&self, request: &mut SelectRequest) -> Option<Disaggregation> {
        if request.role != WorkerRole::Aggregated {
            return None;
        }
        let candidates = self.candidates.read().unwrap_or_else(|p| p.into_inner());
        let has = |role| candidates.partition(&request.model, role).is_some();
        let mode = request.disaggregation.unwrap_or(self.disaggregation.mode);
        let (role, pair) = pairing::plan_hops(mode, has);
        request.role = role;
        pair
    }

    /// A prefill decision's decode hop, when its request is paired and the rule says so; a
    /// request no decode worker can take keeps its prefill worker end to end.
    pub(super) async fn pair(
        &self,
        prepared: &Prepared,
        decided: Decided,
        clock: Clock,
    ) -> Decided {
        let decided = match (prepared.pair, decided) {
            (Some(mode), Decided::New(new)) => (mode, new),
            (_, other) => return other,
        };
        let (mode, mut new) = decided;
        let m = &self.metrics.disaggregation;
        let d = &new.decision;
        // The prefill worker's load is read only where the rule uses it (a rank nothing is
        // known of is idle, as everywhere in the view).
        let prefill_load = || {
            let view = self.load.partition(&(d.model.clone(), d.role));
            load_views::lock(&view)
                .load(new.selection.worker, clock.now_ms())
                .map_or(0, |l| l.active_prefill_tokens)
        };
        if !pairing::gets_decode_hop(&self.disaggregation, mode, prepared, d, prefill_load) {
            m.inc(labels::DISAGG_PREFILL_ONLY);
            return Decided::New(new);
        }
        match self.decode_hop(prepared, &new, clock).await {
            Some(hop) => {
                new.decision.decode = Some(hop.clone());
                new.reply.decode = Some(hop);
                self.load.attach_decode(&new.decision);
                m.inc(labels::DISAGG_PAIRED);
            }
            None => m.inc(labels::DISAGG_DECODE_UNAVAILABLE),
        }
        Decided::New(new)
    }

    /// Runs the selection machine for the decode hop of `prefill`'s request.
    async fn decode_hop(
        &self,
        prepared: &Prepared,
        prefill: &NewDecision,
        clock: Clock,
    ) -> Option<kvroute_common::messages::DecodeHop> {
        let partition = self
            .candidates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .partition(&prepared.request.model, WorkerRole::Decode)?;
        let decode = pairing::decode_request(prepared, partition)?;
        let slot = self
            .policies
            .slot(
                WorkerRole::Decode,
                &decode.request.model,
                None,
                &self.settings,
            )
            .ok()
            .flatten()?;
        let ended = self.select(&decode, &slot, None, None, false, clock).await;
        let (rank, size) = prefill_rank(prefill, &prepared.partition.cards);
        let room = bootstrap_room(rand::random(), rank, size);
        match ended {
            Ended::Reply(Ok(Decided::New(hop))) => Some(wire::hop(
                &hop.decision,
                hop.selection.request_subject.clone(),
                room,
            )),
            Ended::Reply(Ok(Decided::Known(reply))) => Some(kvroute_common::messages::DecodeHop {
                decision_id: reply.decision_id,
                worker_id: reply.worker_id,
                dp_rank: reply.dp_rank,
                request_subject: reply.request_subject,
                cost: reply.cost,
                policy: reply.policy,
                bootstrap_room: room,
            }),
            Ended::Reply(Ok(Decided::Expired) | Err(_)) | Ended::Join(_) => None,
        }
    }
}

/// The chosen prefill rank's index within its worker and the worker's data-parallel size.
fn prefill_rank(
    prefill: &NewDecision,
    cards: &[kvroute_common::messages::WorkerCard],
) -> (u64, u64) {
    let worker = prefill.selection.worker;
    let card = cards.iter().find(|c| c.worker_id == worker.worker_id);
    let size = card.map_or(1, |c| u64::from(c.dp_size.max(1)));
    let start = card.map_or(0, |c| u64::from(c.dp_start_rank));
    (u64::from(worker.dp_rank).saturating_sub(start) % size, size)
}

/// SGLang's bootstrap room for a pair: `random` cut to 63 bits, moved down to the value whose
/// remainder modulo the prefill worker's data-parallel `size` is the chosen prefill `rank`
/// (SGLang's prefill side takes its rank from the room).
fn bootstrap_room(random: u64, rank: u64, size: u64) -> u64 {
    let size = size.max(1);
    let room = (random >> 1) / size * size + rank % size;
    // The top multiple of `size` plus the rank may pass 63 bits: the one below it does not.
    if room >> 63 == 0 { room } else { room - size }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_room_carries_the_prefill_rank_in_63_bits() {
        for (random, rank, size) in [
            (u64::MAX, 3, 4),
            (u64::MAX, 2, 3),
            (0, 0, 1),
            (12_345, 2, 3),
            (7, 5, 8),
        ] {
            let room = bootstrap_room(random, rank, size);
            assert!(room < 1 << 63, "{room}");
            assert_eq!(room % size, rank);
            assert!(room.abs_diff(random >> 1) < size, "{room} from {random}");
        }
        assert_eq!(bootstrap_room(u64::MAX, 0, 1), u64::MAX >> 1);
    }
}
