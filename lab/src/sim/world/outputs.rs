//! What an engine's step produced, forwarded: its KV events to the index, its first and last
//! tokens to the requests' records (and a prefill's end to its KV transfer), its load reports
//! and lifecycle signals to the router replicas.

use super::*;

impl World<'_> {
    /// Runs engine `w` up to `now`, forwards what it produced and schedules its next wake-up.
    pub(super) fn advance(&mut self, w: usize, now: Duration) -> bool {
        let ready = self.workers[w].engine.advance_to(now);
        if !ready.kv_events.is_empty() {
            self.schedule(
                now + self.settings.event_delay,
                Event::KvEvents(w, ready.kv_events),
            );
        }
        let worker_id = self.workers[w].card.worker_id;
        if let Some(store) = &mut self.shared {
            // Written through once computed; announced after the device blocks (their parents).
            let events: Vec<KvEventData> = ready
                .prefilled
                .iter()
                .flat_map(|hashes| store.write(worker_id, hashes))
                .collect();
            if !events.is_empty() {
                self.schedule(now + self.settings.event_delay, Event::KvEvents(w, events));
            }
        }
        // Progress events only matter to routers that track output blocks.
        if self.settings.load_models.track_output_blocks {
            for token in ready.progress {
                let lifecycle = RequestLifecycle {
                    v: SchemaVersion::CURRENT,
                    request_id: token.request_id,
                    worker_id,
                    dp_rank: 0,
                    kind: LifecycleKind::Progress {
                        output_tokens: token.generated,
                    },
                    ts: millis(token.at),
                };
                self.schedule(
                    token.at + self.settings.signal_delay,
                    Event::Lifecycle(lifecycle),
                );
            }
        }
        for output in &ready.outputs {
            let lifecycle = RequestLifecycle {
                v: SchemaVersion::CURRENT,
                request_id: output.request_id(),
                worker_id,
                dp_rank: 0,
                kind: output.lifecycle_kind(),
                ts: millis(output.at()),
            };
            self.schedule(
                output.at() + self.settings.signal_delay,
                Event::Lifecycle(lifecycle),
            );
        }
        // Per request, its first token comes before its streamed ones, and they before its
        // last: first tokens, then the stream, then the ends.
        for output in &ready.outputs {
            if let EngineOutput::PrefillDone {
                request_id,
                at,
                cached_tokens,
                ..
            } = *output
                && let Some(flight) = self.in_flight.get_mut(&request_id)
            {
                if w == flight.worker {
                    flight.cached_tokens = cached_tokens;
                }
                if w == flight.streams_from() {
                    flight.first_token = Some(at);
                    flight.last_token = Some(at);
                }
            }
        }
        for token in &ready.tokens {
            if let Some(flight) = self.in_flight.get_mut(&token.request_id)
                && let Some(last) = flight.last_token.replace(token.at)
            {
                self.itl_ms.push((token.at - last).as_secs_f64() * 1e3);
            }
        }
        let mut finished = false;
        for output in ready.outputs {
            if let EngineOutput::Finished {
                request_id,
                at,
                output_tokens,
                ..
            } = output
            {
                finished |= self.finish(w, request_id, at, output_tokens);
            }
        }
        let worker = &mut self.workers[w];
        let next = worker.engine.next_wakeup();
        if next != worker.wake
            && let Some(at) = next
        {
            worker.wake = Some(at);
            self.schedule(at, Event::Wake(w));
        }
        finished
    }

    /// Request `request_id` ended on worker `w` at `at`: a paired request's prefill goes on to
    /// its KV transfer; otherwise the client has its last token. True when it completed.
    fn finish(
        &mut self,
        w: usize,
        request_id: RequestId,
        at: Duration,
        output_tokens: u64,
    ) -> bool {
        let Some(flight) = self.in_flight.get_mut(&request_id) else {
            return false;
        };
        if w != flight.streams_from() {
            debug_assert_eq!(w, flight.worker, "a pair's prefill worker");
            self.transfer(request_id, at);
            return false;
        }
        let done = self.in_flight.remove(&request_id).expect("looked up above");
        if let Some(last) = done.last_token
            && output_tokens > 1
        {
            self.itl_ms.push((at - last).as_secs_f64() * 1e3);
        }
        let first = done
            .first_token
            .expect("a request's first token precedes its end");
        if let Some(decode) = &done.decode {
            self.pairs.completed(decode, done.arrived);
        } else {
            self.pairs.unpaired += 1;
        }
        let worker_id = self.workers[done.worker].card.worker_id;
        let cached = done.cached_tokens;
        self.tally.done += 1;
        self.tally.prompt_tokens += done.prompt_tokens;
        self.tally.cached_tokens += cached;
        self.finished_at = self.finished_at.max(at);
        self.recorder.record(RequestSample {
            request: done.request,
            worker_id,
            prompt_tokens: done.prompt_tokens,
            cached_tokens: cached,
            output_tokens,
            ttft: first - done.arrived,
            latency: at - done.arrived,
            selection_latency: Some(done.selection),
            selection_wait: Duration::ZERO,
        });
        true
    }
}
