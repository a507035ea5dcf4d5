//! Silent misconfiguration made loud: an engine that computes prompts while none of its KV
//! events reach the bridge (a wrong `--zmq-endpoint` or `--zmq-topic`, or events not enabled in
//! the engine) is registered and routed to, but kvroute never learns its cache. Pure: fed at
//! each load poll with the batches the relay received and the tokens the engine computed
//! (vLLM: `vllm:prefix_cache_queries_total − vllm:prefix_cache_hits_total`, the prompt tokens
//! not found in its cache, which it stores as blocks and announces).

use kvroute_common::DpRank;

/// Computed tokens, in blocks of the engine's size, that must pass without a single event
/// batch before a rank is called silent (a prompt's last partial block is never stored, so a
/// few short prompts alone are no sign).
pub const SILENT_AFTER_BLOCKS: u64 = 8;

/// One rank's watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Watch {
    /// Batches received when last seen, and the tokens computed then (the baseline).
    batches: u64,
    computed: Option<u64>,
    /// A warning was given in the current silent spell.
    warned: bool,
}

/// What a poll found for one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Silence {
    /// Events arrive, or the engine computed too little to tell.
    Fine,
    /// `tokens` computed since the last batch (or since the watch began), with no batch:
    /// `first` in this spell (warn), or still.
    Silent { tokens: u64, first: bool },
}

/// Every rank's watch.
#[derive(Debug, Clone)]
pub struct SilenceWatch {
    ranks: Vec<(DpRank, Watch)>,
    threshold: u64,
}

impl SilenceWatch {
    pub fn new(ranks: &[DpRank], block_size: u32) -> Self {
        Self {
            ranks: ranks.iter().map(|&r| (r, Watch::default())).collect(),
            threshold: SILENT_AFTER_BLOCKS * u64::from(block_size.max(1)),
        }
    }

    /// One poll of `rank`: `batches` received so far, `computed` tokens so far (a counter;
    /// `None` when the engine does not report it).
    pub fn observe(&mut self, rank: DpRank, batches: u64, computed: Option<u64>) -> Silence {
        let threshold = self.threshold;
        let Some((_, w)) = self.ranks.iter_mut().find(|(r, _)| *r == rank) else {
            return Silence::Fine;
        };
        let Some(now) = computed else {
            return Silence::Fine;
        };
        // A batch came, the watch begins, or the counter went back (the engine restarted).
        if w.computed.is_none_or(|base| now < base) || batches != w.batches {
            *w = Watch {
                batches,
                computed: Some(now),
                warned: false,
            };
            return Silence::Fine;
        }
        let tokens = now - w.computed.unwrap_or(now);
        if tokens < threshold {
            return Silence::Fine;
        }
        let first = !w.warned;
        w.warned = true;
        Silence::Silent { tokens, first }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computing_without_events_is_silence_until_a_batch_comes() {
        let mut w = SilenceWatch::new(&[0, 1], 16);
        // The watch begins; the engine computes 100 tokens, then 128 in all: 8 blocks.
        assert_eq!(w.observe(0, 0, Some(1000)), Silence::Fine);
        assert_eq!(w.observe(0, 0, Some(1100)), Silence::Fine);
        assert_eq!(
            w.observe(0, 0, Some(1128)),
            Silence::Silent {
                tokens: 128,
                first: true
            }
        );
        assert_eq!(
            w.observe(0, 0, Some(1200)),
            Silence::Silent {
                tokens: 200,
                first: false
            }
        );
        // A batch arrives: a new baseline, and a new spell warns again.
        assert_eq!(w.observe(0, 1, Some(1300)), Silence::Fine);
        assert_eq!(w.observe(0, 1, Some(1427)), Silence::Fine);
        assert_eq!(
            w.observe(0, 1, Some(1428)),
            Silence::Silent {
                tokens: 128,
                first: true
            }
        );
        // Events flowing while the engine computes: never silent.
        for i in 0..10 {
            assert_eq!(w.observe(1, i, Some(i * 1000)), Silence::Fine);
        }
        // A counter that goes back (an engine restart) starts a new baseline; no counter, no
        // judgement; an unknown rank is fine.
        assert_eq!(w.observe(0, 1, Some(5)), Silence::Fine);
        assert_eq!(w.observe(0, 1, None), Silence::Fine);
        assert_eq!(w.observe(0, 1, Some(100)), Silence::Fine);
        assert_eq!(w.observe(7, 0, Some(1 << 40)), Silence::Fine);
    }
}
