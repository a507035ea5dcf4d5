//! The generator: session start times (Poisson plus optional bursts), then each session's
//! turns, every prompt being the template, the conversation so far and the new message.
//!
//! Hash ids name content: a template's blocks are the same ids in every session that uses it;
//! every other block is new (one counter for the whole trace), so two prompts share exactly
//! their template and, within a session, the earlier conversation. A block a message leaves
//! partly filled keeps its id when the next message fills it (its tokens are a function of
//! id and position, `kvroute_common::trace::token_of`), so turn n + 1's prompt extends turn
//! n's token for token.

use std::io::Write;
use std::path::Path;

use kvroute_common::trace::{TRACE_BLOCK_TOKENS, TraceRequest, to_line};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::SessionTraceParams;

/// Mixed into the seed of the content draws, so arrivals and contents are independent streams
/// (adding bursts does not change the Poisson arrivals).
const CONTENT_STREAM: u64 = 0x5e55_10e5_c0de_0001;
/// Mixed into the seed of the sessions' adapter draws: adding adapters changes nothing else.
const ADAPTER_STREAM: u64 = 0xada9_7e45_0000_0002;

/// The trace `params` describe (validated by the caller), sorted by timestamp; a session's
/// turns keep their order.
pub fn generate(params: &SessionTraceParams) -> Vec<TraceRequest> {
    let starts = session_starts(params);
    let mut rng = StdRng::seed_from_u64(params.seed ^ CONTENT_STREAM);
    let mut next_id = 0u64;
    let templates: Vec<Vec<u64>> = (0..params.templates)
        .map(|_| {
            let blocks = u64::from(params.template_blocks.draw(&mut rng));
            let ids = (next_id..next_id + blocks).collect();
            next_id += blocks;
            ids
        })
        .collect();
    let adapters = Adapters::new(params.adapters, params.adapter_zipf);
    let mut adapter_rng = StdRng::seed_from_u64(params.seed ^ ADAPTER_STREAM);
    let mut out = Vec::new();
    for (i, start) in starts.into_iter().enumerate() {
        let lora_name = adapters.draw(&mut adapter_rng);
        let mut conversation = Conversation::default();
        if !templates.is_empty() {
            let template = &templates[rng.random_range(0..templates.len())];
            conversation.blocks.clone_from(template);
            conversation.tokens = template.len() as u64 * TRACE_BLOCK_TOKENS as u64;
        }
        let session_id = format!("session-{i}");
        let mut at = start;
        for turn in 1..=params.turns.draw(&mut rng) {
            conversation.append(params.user_tokens.draw(&mut rng), &mut next_id);
            let reply = params.reply_tokens.draw(&mut rng);
            out.push(TraceRequest {
                timestamp: (at * 1e3).round() as u64,
                input_length: conversation.tokens as u32,
                output_length: reply,
                hash_ids: conversation.blocks.clone(),
                session_id: Some(session_id.clone()),
                turn: Some(turn),
                lora_name: lora_name.clone(),
            });
            conversation.append(reply, &mut next_id);
            at += f64::from(reply) * params.reply_ms_per_token / 1e3
                + exponential(&mut rng, params.think_time_secs);
        }
    }
    // Stable: equal timestamps keep session, then turn, order.
    out.sort_by_key(|r| r.timestamp);
    out
}

/// Writes `requests` as JSONL to `path` (`-`: standard output).
pub fn write_trace(requests: &[TraceRequest], path: &Path) -> std::io::Result<()> {
    let mut sink: Box<dyn Write> = if path == Path::new("-") {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::fs::File::create(path)?)
    };
    let mut out = std::io::BufWriter::new(&mut sink);
    for r in requests {
        writeln!(out, "{}", to_line(r))?;
    }
    out.flush()
}

/// Start times in seconds: the Poisson stream at `session_rate` merged with the bursts, the
/// first `sessions` of them.
fn session_starts(params: &SessionTraceParams) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(params.seed);
    let mut starts = Vec::with_capacity(params.sessions as usize);
    let mut poisson = exponential(&mut rng, 1.0 / params.session_rate);
    let mut burst = 1u64;
    while starts.len() < params.sessions as usize {
        let burst_at = burst as f64 * params.burst_interval_secs;
        if params.burst_sessions > 0 && burst_at <= poisson {
            let left = params.sessions as usize - starts.len();
            starts.extend(std::iter::repeat_n(
                burst_at,
                left.min(params.burst_sessions as usize),
            ));
            burst += 1;
        } else {
            starts.push(poisson);
            poisson += exponential(&mut rng, 1.0 / params.session_rate);
        }
    }
    starts
}

/// The adapters sessions draw from: adapter k (from 1) with weight 1 / k^zipf.
#[derive(Debug)]
struct Adapters {
    /// Cumulative weights, normalized to end at 1 (empty: no adapters).
    cumulative: Vec<f64>,
}

impl Adapters {
    fn new(count: u32, zipf: f64) -> Self {
        let weights: Vec<f64> = (1..=count).map(|k| f64::from(k).powf(-zipf)).collect();
        let total: f64 = weights.iter().sum();
        let mut sum = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                sum += w / total;
                sum
            })
            .collect();
        Self { cumulative }
    }

    /// A session's adapter name (`None`: the base model, when there are no adapters).
    fn draw(&self, rng: &mut StdRng) -> Option<String> {
        if self.cumulative.is_empty() {
            return None;
        }
        let u: f64 = rng.random();
        let k = self
            .cumulative
            .partition_point(|&c| c < u)
            .min(self.cumulative.len() - 1);
        Some(format!("adapter-{}", k + 1))
    }
}

/// A draw of an exponential distribution with this mean (0: always 0).
fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random();
    -mean * (1.0 - u).ln()
}

/// A conversation so far: its trace blocks and length in tokens.
#[derive(Debug, Default)]
struct Conversation {
    blocks: Vec<u64>,
    tokens: u64,
}

impl Conversation {
    /// Appends `tokens` tokens of new content: the last block's free part first, then new
    /// blocks.
    fn append(&mut self, tokens: u32, next_id: &mut u64) {
        self.tokens += u64::from(tokens);
        let needed = self.tokens.div_ceil(TRACE_BLOCK_TOKENS as u64) as usize;
        while self.blocks.len() < needed {
            self.blocks.push(*next_id);
            *next_id += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap, HashSet};

    use super::*;
    use crate::tracegen::TokenRange;

    fn params() -> SessionTraceParams {
        SessionTraceParams {
            sessions: 40,
            ..SessionTraceParams::default()
        }
    }

    fn by_session(trace: &[TraceRequest]) -> BTreeMap<String, Vec<&TraceRequest>> {
        let mut sessions: BTreeMap<String, Vec<&TraceRequest>> = BTreeMap::new();
        for r in trace {
            sessions
                .entry(r.session_id.clone().unwrap())
                .or_default()
                .push(r);
        }
        sessions
    }

    #[test]
    fn a_seed_gives_one_trace() {
        let a = generate(&params());
        assert_eq!(a, generate(&params()));
        let other = generate(&SessionTraceParams {
            seed: 2,
            ..params()
        });
        assert_ne!(a, other);
    }

    #[test]
    fn every_turn_extends_the_previous_prompt_and_reply() {
        let p = params();
        let trace = generate(&p);
        let sessions = by_session(&trace);
        assert_eq!(sessions.len(), 40);
        for turns in sessions.values() {
            assert!((4..=8).contains(&turns.len()), "{}", turns.len());
            for (k, pair) in turns.windows(2).enumerate() {
                let (a, b) = (pair[0], pair[1]);
                assert_eq!((a.turn, b.turn), (Some(k as u32 + 1), Some(k as u32 + 2)));
                assert!(b.hash_ids.starts_with(&a.hash_ids), "{a:?} then {b:?}");
                let user = b.input_length - a.input_length - a.output_length;
                assert!(
                    p.user_tokens.min <= user && user <= p.user_tokens.max,
                    "{user}"
                );
                assert!(b.timestamp >= a.timestamp);
                // So the expanded tokens share the whole previous prompt.
                assert_eq!(&b.tokens()[..a.input_length as usize], &a.tokens()[..]);
            }
            for r in turns {
                let blocks = (r.input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
                assert_eq!(r.hash_ids.len(), blocks, "Mooncake's ids per prompt");
                assert!((100..=500).contains(&r.output_length));
            }
        }
        assert!(trace.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
    }

    #[test]
    fn sessions_share_their_template_and_nothing_else() {
        let p = SessionTraceParams {
            templates: 3,
            template_blocks: TokenRange::new(2, 5),
            ..params()
        };
        let trace = generate(&p);
        let mut owners: HashMap<u64, HashSet<&str>> = HashMap::new();
        for r in &trace {
            for &h in &r.hash_ids {
                owners
                    .entry(h)
                    .or_default()
                    .insert(r.session_id.as_deref().unwrap());
            }
        }
        let mut templates: HashMap<Vec<u64>, usize> = HashMap::new();
        for turns in by_session(&trace).values() {
            let first = turns[0];
            let shared: Vec<u64> = first
                .hash_ids
                .iter()
                .copied()
                .take_while(|h| owners[h].len() > 1)
                .collect();
            assert!((2..=5).contains(&shared.len()), "{shared:?}");
            // After the template, every block is the session's own.
            for turn in turns {
                assert!(
                    turn.hash_ids[shared.len()..]
                        .iter()
                        .all(|h| owners[h].len() == 1)
                );
            }
            *templates.entry(shared).or_default() += 1;
        }
        assert_eq!(templates.len(), 3, "each template used by several sessions");
        assert_eq!(templates.values().sum::<usize>(), 40);

        let none = generate(&SessionTraceParams {
            templates: 0,
            ..params()
        });
        let firsts: HashSet<u64> = none.iter().map(|r| r.hash_ids[0]).collect();
        assert_eq!(
            firsts.len(),
            40,
            "no template: nothing shared across sessions"
        );
    }

    #[test]
    fn sessions_draw_adapters_by_popularity_and_nothing_else_changes() {
        let p = SessionTraceParams {
            sessions: 2000,
            turns: TokenRange::new(1, 2),
            ..params()
        };
        let base = generate(&p);
        assert!(base.iter().all(|r| r.lora_name.is_none()));
        let with = generate(&SessionTraceParams {
            adapters: 10,
            ..p.clone()
        });
        // The same trace, each row with its session's adapter.
        let strip = |t: &[TraceRequest]| -> Vec<TraceRequest> {
            t.iter()
                .map(|r| TraceRequest {
                    lora_name: None,
                    ..r.clone()
                })
                .collect()
        };
        assert_eq!(strip(&with), base);
        let mut per_adapter: BTreeMap<String, HashSet<&str>> = BTreeMap::new();
        for turns in by_session(&with).values() {
            let names: HashSet<_> = turns.iter().map(|r| r.lora_name.clone()).collect();
            assert_eq!(names.len(), 1, "a session keeps its adapter");
            let name = turns[0].lora_name.clone().unwrap();
            per_adapter
                .entry(name)
                .or_default()
                .insert(turns[0].session_id.as_deref().unwrap());
        }
        let sessions = |k: u32| per_adapter[&format!("adapter-{k}")].len() as f64;
        assert_eq!(per_adapter.len(), 10);
        // Zipf with s = 1 over 10: adapter 1 has 1/H(10) = 34 % of the sessions, adapter 10
        // 3.4 %, within sampling noise over 2000 sessions.
        assert!(
            (0.30..0.38).contains(&(sessions(1) / 2000.0)),
            "{}",
            sessions(1)
        );
        assert!(
            (0.02..0.05).contains(&(sessions(10) / 2000.0)),
            "{}",
            sessions(10)
        );
        assert!(sessions(1) > sessions(2) && sessions(2) > sessions(5));
        // Uniform: every adapter near a tenth.
        let uniform = generate(&SessionTraceParams {
            adapters: 10,
            adapter_zipf: 0.0,
            ..p.clone()
        });
        let mut counts: BTreeMap<String, u32> = BTreeMap::new();
        for r in uniform.iter().filter(|r| r.turn == Some(1)) {
            *counts.entry(r.lora_name.clone().unwrap()).or_default() += 1;
        }
        assert!(
            counts.values().all(|&n| (150..250).contains(&n)),
            "{counts:?}"
        );
    }

    #[test]
    fn arrivals_follow_the_rate_and_bursts_start_together() {
        let p = SessionTraceParams {
            sessions: 400,
            turns: TokenRange::new(1, 1),
            session_rate: 4.0,
            ..params()
        };
        let trace = generate(&p);
        let span_s = trace.last().unwrap().timestamp as f64 / 1e3;
        // 400 arrivals at 4/s: about 100 s (± a few standard deviations of 5 s).
        assert!((80.0..120.0).contains(&span_s), "{span_s}");

        let bursty = generate(&SessionTraceParams {
            burst_sessions: 10,
            burst_interval_secs: 20.0,
            ..p.clone()
        });
        let at_20s = bursty.iter().filter(|r| r.timestamp == 20_000).count();
        assert_eq!(at_20s, 10, "one burst of 10 first turns at 20 s");
        // The Poisson arrivals are the same stream with or without bursts.
        let plain: Vec<u64> = trace.iter().map(|r| r.timestamp).take(50).collect();
        let merged: Vec<u64> = bursty
            .iter()
            .map(|r| r.timestamp)
            .filter(|t| t % 20_000 != 0)
            .take(50)
            .collect();
        assert_eq!(plain, merged);
    }
}
