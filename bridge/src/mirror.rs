//! One engine rank's cache as the engine announced it, and the translation of engine events into
//! kvroute's. Pure: no I/O, no clock.
//!
//! The mirror follows the index's rules for one (worker, rank), so that what the bridge publishes
//! and what a resync recreates are the same state:
//! - a block is a node keyed by the engine's hash, with its parent, its tokens hash and a count of
//!   copies per tier — vLLM may hold two physical copies of one hash, so a `BlockRemoved` only
//!   reaches kvroute when the last copy of that tier goes, and a second `BlockStored` of a held
//!   (hash, tier) is absorbed;
//! - a store under a parent the rank does not hold is refused (the index would refuse it too);
//! - a block whose copies are all gone but which still has children stays as a *ghost* (the index
//!   keeps such nodes for their children) and goes when its last child goes;
//! - token-less stores (CPU offload: no tokens, `block_size` 0) add a tier to blocks already
//!   known by engine hash; unknown ones are ignored and counted;
//! - hybrid models: only the full-attention KV-cache group is indexed (the first `group_idx`
//!   whose `kv_cache_spec_kind` is full attention; without kinds, group 0); other groups counted;
//! - media: `GPU` → device; `CPU`, `CPU_PINNED`, `CPU_TIER1` → host; `STORAGE`, `DISK`,
//!   `CPU_TIER2`, `NVME` → disk; `EXTERNAL` media (SGLang's L4 shared pool) and `REMOTE`
//!   locality (vLLM's network-backed offload tiers, whatever their medium) → the shared tier,
//!   which any worker can load from; with the shared tier turned off (`shared_tier` false)
//!   they are ignored and counted, as is an unknown medium;
//! - tokens hashes are kvroute's local hashes of the tokens under the LoRA seed, with the
//!   block's extra keys (multimodal ids, cache salt, ...) folded in ([`fold_extra`]), so such
//!   blocks never match a plain-text prompt;
//! - hash lookahead (vLLM 0.34, for speculative decoding's drafter): a block's engine hash
//!   also covers the L tokens after it, so one engine block is (prefix, block tokens, next L
//!   tokens), and two prompts that share a block's tokens but not the next L tokens hold two
//!   blocks, each a hit only for its own continuation. The lookahead tokens are folded into
//!   the tokens hash last, as one more key ([`lookahead_key`]): one index node per engine
//!   block, so the index equals the engine's cache. A query finds such a block only if it
//!   folds each block's next L prompt tokens the same way (PROTOCOL.md, "Engine events").
//!
//! The mirror is bounded: past `max_blocks` held blocks the one stored longest ago is evicted —
//! published as `Removed` like an engine eviction, so kvroute's state stays equal to the mirror.
//!
//! No event it makes names more than [`MAX_BLOCKS_PER_EVENT`] blocks: a longer chain (live, or
//! recreated by a resync) continues in the next `Stored` event under its last block, so every
//! event fits a `KvEventBatch` (1 MiB; a stored block takes 42 bytes).

use std::collections::VecDeque;

use hashbrown::HashMap;
use kvroute_common::hashing::{local_block_hashes, seed_for_lora};
use kvroute_common::messages::{KvEventData, StorageTier, StoredBlock};
use kvroute_engine_wire::extra_keys::{lookahead_key, salt_key};
use kvroute_engine_wire::media::{is_remote, tier_of};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::wire::{EngineEvent, Removed, Stored};

/// Most blocks one `Stored` or `Removed` event names (about 340 KB encoded, a third of a
/// `KvEventBatch`'s limit).
pub const MAX_BLOCKS_PER_EVENT: usize = 8192;

/// What one engine event became, and what was absorbed or ignored on the way.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Translation {
    pub events: Vec<KvEventData>,
    /// Events about a second copy of a (hash, tier) already held, or about a copy that was not
    /// the last.
    pub duplicate_copies: u64,
    /// Blocks (or whole events) not indexed, by reason.
    pub ignored: Vec<(&'static str, u64)>,
}

impl Translation {
    fn ignore(&mut self, reason: &'static str, n: u64) {
        if n == 0 {
            return;
        }
        match self.ignored.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, c)) => *c += n,
            None => self.ignored.push((reason, n)),
        }
    }

    /// Appends one stored block, extending the last `Stored` event when it continues its chain.
    fn push_stored(&mut self, parent: Option<u64>, block: StoredBlock, tier: StorageTier) {
        if let Some(KvEventData::Stored {
            blocks, tier: t, ..
        }) = self.events.last_mut()
            && *t == tier
            && blocks.last().map(|b| b.block_hash) == parent
            && parent.is_some()
            && blocks.len() < MAX_BLOCKS_PER_EVENT
        {
            blocks.push(block);
            return;
        }
        self.events.push(KvEventData::Stored {
            parent_hash: parent,
            blocks: vec![block],
            tier,
        });
    }

    fn push_removed(&mut self, hash: u64, tier: StorageTier) {
        if let Some(KvEventData::Removed {
            block_hashes,
            tier: t,
        }) = self.events.last_mut()
            && *t == tier
            && block_hashes.len() < MAX_BLOCKS_PER_EVENT
        {
            block_hashes.push(hash);
            return;
        }
        self.events.push(KvEventData::Removed {
            block_hashes: vec![hash],
            tier,
        });
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    parent: Option<u64>,
    tokens_hash: u64,
    copies: [u32; 4],
    children: u32,
    /// When the node was last stored (for the bound's eviction order).
    stamp: u64,
}

impl Node {
    fn held(&self) -> bool {
        self.copies.iter().any(|&c| c > 0)
    }
}

/// One rank's mirror.
#[derive(Debug, Clone)]
pub struct RankMirror {
    nodes: HashMap<u64, Node>,
    /// Held blocks (nodes with a copy in some tier).
    held: usize,
    max_blocks: usize,
    order: VecDeque<(u64, u64)>,
    stamp: u64,
    /// The KV-cache group that is indexed, once known.
    index_group: Option<i64>,
    /// Whether external and remote media become the shared tier (else they are ignored).
    shared_tier: bool,
}

/// Why a shared-tier medium is ignored when the shared tier is off.
fn shared_reason(locality: Option<&str>) -> &'static str {
    if is_remote(locality) {
        "remote"
    } else {
        "external"
    }
}

/// Whether a `kv_cache_spec_kind` is full attention (its blocks name whole prefixes).
pub fn is_full_attention(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

/// Folds a block's extra keys (canonically encoded, PROTOCOL.md "Extra keys") into its tokens
/// hash: `XXH3-64(LE64(tokens_hash) ‖ keys, seed)`; no keys leave the hash as it is.
pub fn fold_extra(tokens_hash: u64, keys: &[u8], seed: u64) -> u64 {
    if keys.is_empty() {
        return tokens_hash;
    }
    let mut buf = Vec::with_capacity(8 + keys.len());
    buf.extend_from_slice(&tokens_hash.to_le_bytes());
    buf.extend_from_slice(keys);
    xxh3_64_with_seed(&buf, seed)
}

impl RankMirror {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            nodes: HashMap::new(),
            held: 0,
            max_blocks: max_blocks.max(1),
            order: VecDeque::new(),
            stamp: 0,
            index_group: None,
            shared_tier: true,
        }
    }

    /// Turns the shared tier off (`false`): external and remote media are then ignored and
    /// counted, for event logs whose readers predate the tier.
    pub fn with_shared_tier(mut self, on: bool) -> Self {
        self.shared_tier = on;
        self
    }

    /// The tier of an event's medium and locality, or why it is not indexed.
    fn tier(
        &self,
        medium: Option<&str>,
        locality: Option<&str>,
    ) -> Result<StorageTier, &'static str> {
        match tier_of(medium, locality)? {
            StorageTier::Shared if !self.shared_tier => Err(shared_reason(locality)),
            t => Ok(t),
        }
    }

    /// Blocks held in some tier.
    pub fn len(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Nodes including ghosts (for tests of the no-leftovers rule).
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Forgets everything (the engine cleared its cache or restarted).
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.order.clear();
        self.held = 0;
    }

    /// Applies one engine event, appending kvroute's events to `out`.
    pub fn apply(&mut self, event: &EngineEvent, out: &mut Translation) {
        match event {
            EngineEvent::AllCleared => {
                self.clear();
                out.events.push(KvEventData::Cleared);
            }
            EngineEvent::Stored(s) => self.stored(s, out),
            EngineEvent::Removed(r) => self.removed(r, out),
        }
    }

    /// Whether events of `group` are indexed, learning the indexed group from store events.
    fn group_indexed(&mut self, group: Option<i64>, kind: Option<&str>) -> bool {
        let Some(g) = group else { return true };
        match kind {
            Some(k) if !is_full_attention(k) => false,
            Some(_) => *self.index_group.get_or_insert(g) == g,
            None => self.index_group.unwrap_or(0) == g,
        }
    }

    fn stored(&mut self, s: &Stored, out: &mut Translation) {
        let n = s.block_hashes.len() as u64;
        if !self.group_indexed(s.group_idx, s.kv_cache_spec_kind.as_deref()) {
            return out.ignore("other_group", n);
        }
        let tier = match self.tier(s.medium.as_deref(), s.locality.as_deref()) {
            Ok(t) => t,
            Err(reason) => return out.ignore(reason, n),
        };
        if s.token_ids.is_empty() || s.block_size == 0 {
            return self.offload_stored(s, tier, out);
        }
        let bs = s.block_size as usize;
        if s.token_ids.len() != bs * s.block_hashes.len() {
            return out.ignore("token_count_mismatch", n);
        }
        if let Some(p) = s.parent_block_hash
            && !self.nodes.get(&p).is_some_and(Node::held)
        {
            return out.ignore("parent_unknown", n);
        }
        let lora = s
            .lora_name
            .clone()
            .or_else(|| s.lora_id.map(|id| id.to_string()));
        let seed = seed_for_lora(lora.as_deref());
        let local = local_block_hashes(&s.token_ids, bs, seed);
        let salt = s.cache_salt.as_deref().map(salt_key);
        let mut parent = s.parent_block_hash;
        for (i, (&hash, &local)) in s.block_hashes.iter().zip(&local).enumerate() {
            let mut tokens_hash = local;
            if let Some(keys) = s.extra_keys.get(i) {
                tokens_hash = fold_extra(tokens_hash, keys, seed);
            }
            if let Some(salt) = &salt {
                tokens_hash = fold_extra(tokens_hash, salt, seed);
            }
            if let Some(ahead) = s.lookahead_token_ids.get(i).filter(|a| !a.is_empty()) {
                tokens_hash = fold_extra(tokens_hash, &lookahead_key(ahead), seed);
            }
            if self
                .nodes
                .get(&hash)
                .is_some_and(|n| n.tokens_hash != tokens_hash || n.parent != parent)
            {
                // The hash now names another block (an engine hash collision). The old block
                // and everything stored under it go, announced as removed, so the index (which
                // rebinds the hash too) holds exactly the mirror; the chain's parent may have
                // been among them.
                self.drop_subtree(hash, out);
                if let Some(p) = parent
                    && !self.nodes.get(&p).is_some_and(Node::held)
                {
                    out.ignore("parent_unknown", n - i as u64);
                    break;
                }
                out.ignore("rebound_hash", 1);
            }
            if self.store_one(hash, parent, tokens_hash, tier) {
                out.push_stored(
                    parent,
                    StoredBlock {
                        block_hash: hash,
                        tokens_hash,
                    },
                    tier,
                );
            } else {
                out.duplicate_copies += 1;
            }
            parent = Some(hash);
        }
        self.enforce_bound(out);
    }

    /// Records one copy; true when the (hash, tier) is newly held (kvroute must hear of it).
    fn store_one(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        tokens_hash: u64,
        tier: StorageTier,
    ) -> bool {
        self.stamp += 1;
        let stamp = self.stamp;
        let t = tier.index();
        // The caller dropped a node of this hash naming another block (`drop_subtree`).
        if let Some(node) = self.nodes.get_mut(&hash) {
            debug_assert!(node.tokens_hash == tokens_hash && node.parent == parent);
            let was_held = node.held();
            node.copies[t] += 1;
            if node.copies[t] > 1 {
                return false;
            }
            node.stamp = stamp;
            if !was_held {
                self.held += 1;
            }
            self.order.push_back((hash, stamp));
            return true;
        }
        self.nodes.insert(
            hash,
            Node {
                parent,
                tokens_hash,
                copies: {
                    let mut c = [0; 4];
                    c[t] = 1;
                    c
                },
                children: 0,
                stamp,
            },
        );
        self.held += 1;
        self.order.push_back((hash, stamp));
        if let Some(p) = parent
            && let Some(pn) = self.nodes.get_mut(&p)
        {
            pn.children += 1;
        }
        true
    }

    fn offload_stored(&mut self, s: &Stored, tier: StorageTier, out: &mut Translation) {
        let t = tier.index();
        for &hash in &s.block_hashes {
            self.stamp += 1;
            let stamp = self.stamp;
            let Some(node) = self.nodes.get_mut(&hash) else {
                out.ignore("offload_unknown_block", 1);
                continue;
            };
            if node.copies[t] > 0 {
                node.copies[t] += 1;
                out.duplicate_copies += 1;
                continue;
            }
            // A store needs its parent held (a ghost parent is not): the index refuses it.
            let parent = node.parent;
            if let Some(p) = parent
                && !self.nodes.get(&p).is_some_and(Node::held)
            {
                out.ignore("parent_unknown", 1);
                continue;
            }
            let node = self.nodes.get_mut(&hash).expect("present");
            if !node.held() {
                self.held += 1;
            }
            node.copies[t] = 1;
            let node = self.nodes.get_mut(&hash).expect("present");
            node.stamp = stamp;
            let (parent, tokens_hash) = (node.parent, node.tokens_hash);
            self.order.push_back((hash, stamp));
            out.push_stored(
                parent,
                StoredBlock {
                    block_hash: hash,
                    tokens_hash,
                },
                tier,
            );
        }
        self.enforce_bound(out);
    }

    fn removed(&mut self, r: &Removed, out: &mut Translation) {
        let n = r.block_hashes.len() as u64;
        if !self.group_indexed(r.group_idx, None) {
            return out.ignore("other_group", n);
        }
        let tier = match self.tier(r.medium.as_deref(), r.locality.as_deref()) {
            Ok(t) => t,
            Err(reason) => return out.ignore(reason, n),
        };
        for &hash in &r.block_hashes {
            match self.remove_copy(hash, tier) {
                Some(true) => out.push_removed(hash, tier),
                Some(false) => out.duplicate_copies += 1,
                None => out.ignore("removed_unknown", 1),
            }
        }
    }

    /// Drops one copy: `Some(true)` when it was the tier's last, `None` when none was held.
    fn remove_copy(&mut self, hash: u64, tier: StorageTier) -> Option<bool> {
        let node = self.nodes.get_mut(&hash)?;
        let c = &mut node.copies[tier.index()];
        if *c == 0 {
            return None;
        }
        *c -= 1;
        if *c > 0 {
            return Some(false);
        }
        if !node.held() {
            self.held -= 1;
            if node.children == 0 {
                self.delete(hash);
            }
        }
        Some(true)
    }

    /// Deletes an unheld, childless node and then every ghost ancestor left childless.
    fn delete(&mut self, hash: u64) {
        if let Some(node) = self.nodes.remove(&hash)
            && let Some(p) = node.parent
        {
            self.child_gone(p);
        }
    }

    fn child_gone(&mut self, parent: u64) {
        let mut next = Some(parent);
        while let Some(p) = next.take() {
            let Some(pn) = self.nodes.get_mut(&p) else {
                break;
            };
            pn.children = pn.children.saturating_sub(1);
            if pn.children == 0 && !pn.held() {
                let gp = pn.parent;
                self.nodes.remove(&p);
                next = gp;
            }
        }
    }

    /// Removes `hash` and all its descendants, announcing every held copy as removed.
    fn drop_subtree(&mut self, hash: u64, out: &mut Translation) {
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        for (&h, n) in &self.nodes {
            if let Some(p) = n.parent {
                children.entry(p).or_default().push(h);
            }
        }
        let old_parent = self.nodes.get(&hash).and_then(|n| n.parent);
        let mut stack = vec![hash];
        let mut seen = hashbrown::HashSet::new();
        while let Some(h) = stack.pop() {
            if !seen.insert(h) {
                continue;
            }
            let Some(node) = self.nodes.remove(&h) else {
                continue;
            };
            for tier in StorageTier::ALL {
                if node.copies[tier.index()] > 0 {
                    out.push_removed(h, tier);
                }
            }
            if node.held() {
                self.held -= 1;
            }
            if let Some(list) = children.get(&h) {
                stack.extend(list);
            }
        }
        if let Some(p) = old_parent {
            self.child_gone(p);
        }
    }

    /// Evicts the blocks stored longest ago while more than `max_blocks` are held.
    fn enforce_bound(&mut self, out: &mut Translation) {
        while self.held > self.max_blocks {
            let Some((hash, stamp)) = self.order.pop_front() else {
                break;
            };
            let Some(node) = self.nodes.get(&hash) else {
                continue;
            };
            if node.stamp != stamp || !node.held() {
                continue;
            }
            let copies = node.copies;
            for tier in StorageTier::ALL {
                if copies[tier.index()] > 0 {
                    out.push_removed(hash, tier);
                }
            }
            let node = self.nodes.get_mut(&hash).expect("present");
            node.copies = [0; 4];
            self.held -= 1;
            if node.children == 0 {
                self.delete(hash);
            }
            out.ignore("mirror_full", 1);
        }
        if self.order.len() > 2 * self.nodes.len() + 1024 {
            let nodes = &self.nodes;
            self.order
                .retain(|(h, s)| nodes.get(h).is_some_and(|n| n.stamp == *s && n.held()));
        }
    }

    /// The events that recreate this mirror in an empty rank (after `Cleared`): every chain
    /// from its root, parents first, in each node's first tier (ghosts as device blocks), then
    /// the further tiers, then `Removed` of the ghosts.
    pub fn chains(&self) -> Vec<KvEventData> {
        let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut roots = Vec::new();
        for (&h, n) in &self.nodes {
            match n.parent {
                Some(p) if self.nodes.contains_key(&p) => children.entry(p).or_default().push(h),
                _ => roots.push(h),
            }
        }
        roots.sort_unstable();
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let mut order = Vec::with_capacity(self.nodes.len());
        let mut stack: Vec<u64> = roots.into_iter().rev().collect();
        while let Some(h) = stack.pop() {
            order.push(h);
            if let Some(list) = children.get(&h) {
                stack.extend(list.iter().rev());
            }
        }
        let mut out = Translation::default();
        let first_tier = |n: &Node| {
            StorageTier::ALL
                .into_iter()
                .find(|t| n.copies[t.index()] > 0)
                .unwrap_or(StorageTier::Device)
        };
        for &h in &order {
            let n = &self.nodes[&h];
            let block = StoredBlock {
                block_hash: h,
                tokens_hash: n.tokens_hash,
            };
            out.push_stored(n.parent, block, first_tier(n));
        }
        for tier in StorageTier::ALL {
            for &h in &order {
                let n = &self.nodes[&h];
                if n.copies[tier.index()] > 0 && first_tier(n) != tier {
                    let block = StoredBlock {
                        block_hash: h,
                        tokens_hash: n.tokens_hash,
                    };
                    out.push_stored(n.parent, block, tier);
                }
            }
        }
        for &h in &order {
            if !self.nodes[&h].held() {
                out.push_removed(h, StorageTier::Device);
            }
        }
        out.events
    }
}

#[cfg(test)]
mod tests;
