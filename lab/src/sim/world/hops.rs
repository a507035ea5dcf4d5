//! A request's hops on a fleet with prefill and decode workers, as the router and a client
//! through the gateway serve it: decided in the prefill partition (the router's
//! `decide::pairing::plan_hops`), paired by the router's rule (`gets_decode_hop`) with a decode
//! worker chosen by the decode role's policy over the decode partition (`decode_request`, then
//! the selection machine); the prefill worker computes the prompt and one token, the KV moves
//! (`kv_transfer_per_block` × the prompt's blocks, all of them, as kvroute-mocker's transfer),
//! and the decode worker, given the prompt as `transferred_tokens`, computes its last token and
//! streams the output. The client's first token is the decode worker's; the prefill worker's
//! token is never streamed.
//!
//! Not modelled: the gateway's hop between the two (the decode request is sent the moment the
//! prefill ends), transfer failures, and a decode worker pulling while its blocks are held.

use std::time::Duration;

use kvroute_common::RequestId;
use kvroute_common::messages::{Disaggregation, WorkerRole};
use kvroute_mocker::engine::SimRequest;
use kvroute_router::decide::pairing;
use kvroute_router::decide::prompt::Prepared;
use kvroute_router::decide::{NewDecision, wire};
use uuid::Uuid;

use super::{Event, Paired, SimSettings, World, millis};
use crate::replay::{DisaggregationReport, Summary, coefficient_of_variation};

/// The paired requests' figures, as they complete.
#[derive(Debug, Default)]
pub(super) struct PairTally {
    pub unpaired: u64,
    transfer_ms: Vec<f64>,
    /// From arrival to the prefill worker's end.
    prefill_ms: Vec<f64>,
    /// Requests completed per decode worker (by position).
    per_decode: std::collections::BTreeMap<usize, u64>,
}

impl PairTally {
    pub fn completed(&mut self, pair: &Paired, arrived: Duration) {
        self.transfer_ms.push(pair.transfer.as_secs_f64() * 1e3);
        if let Some(at) = pair.prefilled {
            self.prefill_ms.push((at - arrived).as_secs_f64() * 1e3);
        }
        *self.per_decode.entry(pair.worker).or_default() += 1;
    }

    /// The report of a fleet with prefill and decode workers (`None` without).
    pub fn report(&self, settings: &SimSettings) -> Option<DisaggregationReport> {
        if settings.prefill_workers == 0 || settings.decode_workers == 0 {
            return None;
        }
        let first_decode = (settings.workers + settings.prefill_workers) as usize;
        let per_decode: Vec<f64> = (first_decode..settings.fleet() as usize)
            .map(|w| self.per_decode.get(&w).copied().unwrap_or(0) as f64)
            .collect();
        Some(DisaggregationReport {
            mode: settings.disaggregation.mode.as_str().to_owned(),
            prefill_workers: settings.prefill_workers,
            decode_workers: settings.decode_workers,
            paired: self.transfer_ms.len() as u64,
            unpaired: self.unpaired,
            transfer_ms: Summary::of(&self.transfer_ms),
            prefill_ms: Summary::of(&self.prefill_ms),
            load_cv_decode_requests: coefficient_of_variation(&per_decode),
        })
    }
}

impl World<'_> {
    /// The partition a new request is decided in, and its pairing (the service's rule).
    pub(super) fn plan_hops(&self) -> (WorkerRole, Option<Disaggregation>) {
        let mode = self.settings.disaggregation.mode;
        pairing::plan_hops(mode, |role| self.partitions.contains_key(&role))
    }

    /// Replica `r`'s decode hop for the prefill decision `prefill`, when the rule gives it one
    /// and a decode worker can take it (as the service's pairing: the decode selection is
    /// charged to the replica's decode view and carried in the published decision). The
    /// decode worker's position, or `None`: served by the prefill worker end to end.
    pub(super) fn pair(
        &mut self,
        r: usize,
        mode: Disaggregation,
        prepared: &Prepared,
        prefill: &mut NewDecision,
        now: Duration,
    ) -> Option<usize> {
        let config = self.settings.disaggregation;
        let view = &self.replicas[r].partitions[&WorkerRole::Prefill].view;
        let rank = prefill.selection.worker;
        let prefill_load = || {
            view.load(rank, millis(now))
                .map_or(0, |l| l.active_prefill_tokens)
        };
        if !pairing::gets_decode_hop(&config, mode, prepared, &prefill.decision, prefill_load) {
            return None;
        }
        let partition = self.partitions.get(&WorkerRole::Decode)?.clone();
        let decode = pairing::decode_request(prepared, partition)?;
        let decision_id = Uuid::from_u128(prefill.decision.decision_id.as_u128() | 1);
        let hop = self.select(r, &decode, decision_id, now).ok()?;
        let subject = hop.selection.request_subject.clone();
        // No SGLang bootstrap room here: the sim's transfer needs none.
        prefill.decision.decode = Some(wire::hop(&hop.decision, subject, 0));
        if let Some(p) = self.replicas[r].partitions.get_mut(&WorkerRole::Prefill) {
            p.view.attach_decode(&prefill.decision);
        }
        Some(self.worker_index(hop.selection.worker.worker_id))
    }

    /// A paired request's prefill ended at `at`: its KV moves to the decode worker.
    pub(super) fn transfer(&mut self, request_id: RequestId, at: Duration) {
        let per_block = self.settings.kv_transfer_per_block;
        let block_size = self.settings.engine.block_size;
        let Some(pair) = self
            .in_flight
            .get_mut(&request_id)
            .and_then(|f| f.decode.as_mut().map(|d| (d, f.prompt_tokens)))
        else {
            return;
        };
        let (pair, prompt_tokens) = pair;
        let blocks = prompt_tokens.div_ceil(u64::from(block_size));
        pair.prefilled = Some(at);
        pair.transfer = per_block * blocks as u32;
        let ends = at + pair.transfer;
        self.schedule(ends, Event::Transferred(request_id));
    }

    /// A paired request's KV has arrived: its decode worker gets it, the prompt transferred.
    pub(super) fn start_decode(&mut self, now: Duration, request_id: RequestId) -> bool {
        let Some(flight) = self.in_flight.get(&request_id) else {
            return false;
        };
        let pair = flight.decode.as_ref().expect("only a pair is transferred");
        let w = pair.worker;
        let prompt_tokens = flight.prompt_tokens as u32;
        let sim = SimRequest {
            request_id,
            prompt_tokens,
            output_tokens: self.plan.requests[flight.request].output_length,
            hashes: pair.hashes.clone(),
            report_tokens: true,
            shared_blocks: 0,
            transferred_tokens: prompt_tokens,
            lora_name: self.plan.requests[flight.request].lora_name.clone(),
        };
        if let Err(e) = self.workers[w].engine.submit(sim, now) {
            tracing::debug!(error = %e, "the simulated decode worker refused a request");
            self.in_flight.remove(&request_id);
            self.tally.errors += 1;
            self.recorder.record_error("decode_refused");
            return true;
        }
        self.workers[w].new_requests.push(request_id);
        self.advance(w, now)
    }
}
