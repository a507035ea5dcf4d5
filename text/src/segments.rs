//! Tokenizing a text piece by piece between the tokenizer's added tokens, with a bounded cache
//! of the pieces' ids: a later turn of a conversation, rendered by a chat template that puts
//! special tokens between messages, then tokenizes only its new messages.
//!
//! Exact because Hugging Face `tokenizers` itself works this way: it first splits the text at
//! every added token (leftmost-longest, `AddedVocabulary::extract_and_normalize`), then
//! normalizes, pre-tokenizes and encodes each piece on its own. A piece tokenized alone gives the
//! ids it gives inside the text only where no rule looks across a piece's edge, so the cache is
//! used only when:
//! - no added token strips spaces beside it (`lstrip`, `rstrip`), matches only whole words
//!   (`single_word`) or is matched after normalization (`normalized`);
//! - special tokens are split out (`split_special_tokens` off);
//! - the post-processor adds no tokens to a single sequence when asked to (`add_special_tokens`
//!   with a BOS, say, goes the whole-text way);
//! - and probes built from the tokenizer's own added tokens tokenize the same both ways at load
//!   (a pre-tokenizer that adds a prefix space only at the text's start, for one, fails them).
//!
//! While it runs, one encoding in [`CHECK_EVERY`] is also done the whole-text way and compared;
//! a difference turns the cache off for the process (logged by the caller through
//! [`Segmenter::disabled`]) and the whole-text ids are returned.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::Tokenizer;

/// Pieces shorter than this (bytes) are encoded each time, with the added tokens and short
/// pieces around them: a template's role names and newlines cost less to encode than to look
/// up.
const MIN_CACHED_BYTES: usize = 256;
/// One segmented encoding in this many is checked against the whole-text encoding.
pub const CHECK_EVERY: u64 = 64;
/// What one cached piece costs besides its text and ids (map and queue entries).
/// (The use-order queue holds at most twice as many entries as the map, each 24 bytes.)
const ENTRY_OVERHEAD: usize = 160;

/// Counters of a [`Segmenter`] (for metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Pieces found in the cache.
    pub hits: u64,
    /// Cacheable pieces encoded (and cached).
    pub misses: u64,
    /// Bytes the cache holds now.
    pub bytes: u64,
    /// Whether a check found a difference and the cache is off.
    pub disabled: bool,
}

#[derive(Debug)]
struct Cached {
    ids: Arc<[u32]>,
    stamp: u64,
}

/// Pieces' ids, least recently used first out, within a byte budget.
#[derive(Debug, Default)]
struct Cache {
    map: HashMap<Arc<str>, Cached>,
    /// (piece, stamp) in use order; an entry whose stamp is no longer the piece's is stale.
    order: VecDeque<(Arc<str>, u64)>,
    bytes: usize,
    clock: u64,
}

impl Cache {
    fn cost(text: &str, ids: usize) -> usize {
        text.len() + ids * 4 + ENTRY_OVERHEAD
    }

    fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        self.clock += 1;
        let stamp = self.clock;
        let key = self.map.get_key_value(text)?.0.clone();
        let entry = self.map.get_mut(text)?;
        entry.stamp = stamp;
        let ids = entry.ids.clone();
        self.order.push_back((key, stamp));
        self.compact();
        Some(ids)
    }

    fn insert(&mut self, text: &str, ids: Arc<[u32]>, budget: usize) {
        let cost = Self::cost(text, ids.len());
        if cost > budget / 4 || self.map.contains_key(text) {
            return;
        }
        self.clock += 1;
        let stamp = self.clock;
        let key: Arc<str> = text.into();
        self.map.insert(key.clone(), Cached { ids, stamp });
        self.order.push_back((key, stamp));
        self.bytes += cost;
        while self.bytes > budget {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&old).is_some_and(|c| c.stamp == stamp)
                && let Some(gone) = self.map.remove(&old)
            {
                self.bytes -= Self::cost(&old, gone.ids.len());
            }
        }
        self.compact();
    }

    /// Drops stale queue entries once they outnumber the live ones.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(text, stamp)| map.get(text).is_some_and(|c| c.stamp == *stamp));
        }
    }
}

/// Splits texts at a tokenizer's added tokens and encodes the pieces, caching the long ones.
#[derive(Debug)]
pub struct Segmenter {
    matcher: AhoCorasick,
    budget: usize,
    cache: Mutex<Cache>,
    disabled: AtomicBool,
    encodings: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Segmenter {
    /// A segmenter for `tokenizer` with a cache of `budget` bytes, or why the tokenizer does
    /// not allow encoding piece by piece.
    pub fn new(tokenizer: &Tokenizer, budget: usize) -> Result<Segmenter, String> {
        if tokenizer.get_encode_special_tokens() {
            return Err("split_special_tokens is on".into());
        }
        let mut added: Vec<(u32, tokenizers::AddedToken)> =
            tokenizer.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        if added.is_empty() {
            return Err("the tokenizer has no added tokens".into());
        }
        if let Some((_, t)) = added
            .iter()
            .find(|(_, t)| t.lstrip || t.rstrip || t.single_word || t.normalized)
        {
            return Err(format!(
                "added token {:?} has lstrip, rstrip, single_word or normalized set",
                t.content
            ));
        }
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, t)| t.content.as_str()))
            .map_err(|e| e.to_string())?;
        let segmenter = Segmenter {
            matcher,
            budget,
            cache: Mutex::new(Cache::default()),
            disabled: AtomicBool::new(false),
            encodings: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        for probe in probes(added.iter().map(|(_, t)| t.content.as_str())) {
            let whole = whole(tokenizer, &probe)?;
            // Every piece on its own, however short.
            let pieces = segmenter.pieces(tokenizer, &probe, 1)?;
            if whole != pieces {
                return Err(format!(
                    "a probe around the added tokens tokenizes differently piece by piece ({probe:?})"
                ));
            }
        }
        *segmenter.cache.lock().unwrap_or_else(|p| p.into_inner()) = Cache::default();
        segmenter.hits.store(0, Ordering::Relaxed);
        segmenter.misses.store(0, Ordering::Relaxed);
        Ok(segmenter)
    }

    /// Whether a check found a difference (the cache is off from then on).
    pub fn disabled(&self) -> bool {
        self.disabled.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> SegmentStats {
        SegmentStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: self.cache.lock().unwrap_or_else(|p| p.into_inner()).bytes as u64,
            disabled: self.disabled(),
        }
    }

    /// The ids of `text` encoded without special tokens added (a tokenizer's error as its
    /// message); `None` once a check turned the cache off.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Option<Result<Vec<u32>, String>> {
        if self.disabled() {
            return None;
        }
        let ids = match self.pieces(tokenizer, text, MIN_CACHED_BYTES) {
            Ok(ids) => ids,
            Err(e) => return Some(Err(e)),
        };
        let n = self.encodings.fetch_add(1, Ordering::Relaxed);
        if n % CHECK_EVERY == CHECK_EVERY - 1 {
            match whole(tokenizer, text) {
                Ok(expected) if expected != ids => {
                    self.disabled.store(true, Ordering::Relaxed);
                    return Some(Ok(expected));
                }
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(ids))
    }

    /// The text's ids: each piece between added tokens of `min_bytes` or more from the cache
    /// (or encoded and cached), the runs of short pieces and added tokens between them encoded whole (the
    /// tokenizer splits a run at the same added tokens, so the ids are the same).
    fn pieces(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        min_bytes: usize,
    ) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        let mut run = 0;
        let mut at = 0;
        let ends = self
            .matcher
            .find_iter(text)
            .map(|m| (m.start(), m.end()))
            .chain(std::iter::once((text.len(), text.len())));
        for (start, end) in ends {
            if start - at >= min_bytes {
                if run < at {
                    out.extend(whole(tokenizer, &text[run..at])?);
                }
                self.cached(tokenizer, &text[at..start], &mut out)?;
                run = start;
            }
            at = end;
        }
        if run < text.len() || text.is_empty() {
            out.extend(whole(tokenizer, &text[run..])?);
        }
        Ok(out)
    }

    fn cached(&self, tokenizer: &Tokenizer, piece: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(piece);
        if let Some(ids) = cached {
            self.hits.fetch_add(1, Ordering::Relaxed);
            out.extend_from_slice(&ids);
            return Ok(());
        }
        let ids: Arc<[u32]> = whole(tokenizer, piece)?.into();
        self.misses.fetch_add(1, Ordering::Relaxed);
        out.extend_from_slice(&ids);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(piece, ids, self.budget);
        Ok(())
    }
}

fn whole(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
    tokenizer
        .encode_fast(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| e.to_string())
}

/// Texts around each added token (the first 64 by id), with spaces, newlines and words on
/// both sides, at the start, the end, and twice in a row: where a rule that looks across a
/// piece's edge would show.
fn probes<'a>(tokens: impl Iterator<Item = &'a str>) -> Vec<String> {
    let long = "The quick brown fox, jumps over 12 lazy dogs.\n".repeat(8);
    let mut out = Vec::new();
    for t in tokens.take(64) {
        out.push(format!("{t}hello world{t}"));
        out.push(format!("hello {t} world\n{t}\n  indented"));
        out.push(format!("{long}{t}{long}{t}{t} {long}"));
        out.push(format!(" leading space{t} x"));
        out.push(format!("é ü 中文 {t}中文 é"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_the_recently_used_within_its_budget() {
        let mut cache = Cache::default();
        let ids: Arc<[u32]> = vec![1; 10].into();
        let text = |i: usize| format!("{i:0>300}");
        let one = Cache::cost(&text(0), 10);
        let budget = one * 4 + one / 2;
        for i in 0..4 {
            cache.insert(&text(i), ids.clone(), budget);
        }
        assert_eq!(cache.map.len(), 4);
        // 0 used again: 1 is now the least recently used and goes first.
        assert!(cache.get(&text(0)).is_some());
        cache.insert(&text(4), ids.clone(), budget);
        assert!(cache.get(&text(1)).is_none());
        assert!(cache.get(&text(0)).is_some());
        assert!(cache.get(&text(4)).is_some());
        assert!(cache.bytes <= budget);
        // Hits alone keep the queue bounded.
        for _ in 0..10_000 {
            cache.get(&text(0));
        }
        assert!(cache.order.len() <= 2 * cache.map.len() + 65);
        // A piece larger than a quarter of the budget is not kept.
        cache.insert(&"x".repeat(budget), ids, budget);
        assert!(!cache.map.contains_key("x".repeat(budget).as_str()));
    }
}
