//! How a view changes: only through the writer's [`Op`]s (new node, length, split, merge,
//! free, owner, pair), each applied the same way on every view.

use super::*;
use crate::index::ops::Op;

impl View {
    pub fn apply(&mut self, op: &Op) {
        match *op {
            Op::Chunk(ref chunk) => self.arena.push(chunk.clone()),
            Op::NewNode {
                id,
                parent,
                start,
                len,
                anchor,
            } => self.new_node(id, parent, start, len, anchor),
            Op::SetLen { id, len } => {
                let n = &mut self.nodes[id as usize];
                self.blocks = self.blocks + len as usize - n.len as usize;
                n.len = len;
            }
            Op::Split { id, at, tail } => self.split(id, at, tail),
            Op::Merge { id, child } => self.merge(id, child),
            Op::FreeNode { id, parent } => self.free_node(id, parent),
            Op::SetOwner {
                node,
                slot,
                tiers,
                end,
            } => self.set_owner(node, slot, tiers, end),
            Op::NewPair {
                slot,
                worker_id,
                dp_rank,
            } => {
                if self.pairs.len() <= slot as usize {
                    self.pairs.resize(slot as usize + 1, PairInfo::default());
                }
                self.pairs[slot as usize] = PairInfo {
                    worker_id,
                    dp_rank,
                    blocks: 0,
                    rank: 0,
                    used: true,
                };
                self.pairs_used += 1;
                let key = (worker_id, dp_rank);
                let at = self.order.partition_point(|&s| self.pair_key(s) < key);
                self.order.insert(at, slot);
                self.rerank_from(at);
            }
            Op::FreePair { slot } => {
                let key = self.pair_key(slot);
                let at = self.order.partition_point(|&s| self.pair_key(s) < key);
                debug_assert_eq!(self.order[at], slot);
                self.order.remove(at);
                self.pairs[slot as usize] = PairInfo::default();
                self.pairs_used -= 1;
                self.rerank_from(at);
            }
            Op::PairBlocks { slot, blocks } => self.pairs[slot as usize].blocks = blocks,
        }
    }

    fn pair_key(&self, slot: Slot) -> (WorkerId, DpRank) {
        let p = &self.pairs[slot as usize];
        (p.worker_id, p.dp_rank)
    }

    /// Renumbers the ranks from position `at` of the order (a pair joined or left there): O(pairs)
    /// per change, where sorting every pair again made 10,000 joins take seconds.
    fn rerank_from(&mut self, at: usize) {
        for (r, &s) in self.order.iter().enumerate().skip(at) {
            self.pairs[s as usize].rank = r as u32;
        }
    }

    fn new_node(
        &mut self,
        id: NodeId,
        parent: NodeId,
        start: BlockSlot,
        len: u32,
        anchor: BlockSlot,
    ) {
        if self.nodes.len() <= id as usize {
            self.nodes.resize(id as usize + 1, Node::empty());
        }
        debug_assert!(!self.nodes[id as usize].is_live());
        self.nodes[id as usize] = Node {
            start,
            len,
            anchor,
            hint: ROOT,
            children: 0,
            n_owners: 0,
            owners: [0; INLINE],
        };
        self.live += 1;
        self.blocks += len as usize;
        self.link(parent, id);
    }

    /// Counts `id` as a child of `parent`: its hint if it has none, else in the edge tables.
    fn link(&mut self, parent: NodeId, id: NodeId) {
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        if p.hint == ROOT {
            p.hint = id;
            return;
        }
        let c = &self.nodes[id as usize];
        let hash = edge_hash(c.anchor, self.arena.get(c.start));
        let (nodes, arena) = (&self.nodes, &self.arena);
        self.edges[shard_of(hash)].insert_unique(hash, id, |&c| {
            let n = &nodes[c as usize];
            edge_hash(n.anchor, arena.get(n.start))
        });
    }

    /// Removes `id` from the edge tables (it is a child that is not its parent's hint).
    fn unlink_edge(&mut self, id: NodeId) {
        let c = &self.nodes[id as usize];
        let hash = edge_hash(c.anchor, self.arena.get(c.start));
        if let Ok(e) = self.edges[shard_of(hash)].find_entry(hash, |&x| x == id) {
            e.remove();
        }
    }

    fn free_node(&mut self, id: NodeId, parent: NodeId) {
        let p = &mut self.nodes[parent as usize];
        p.children -= 1;
        if p.hint == id {
            p.hint = ROOT;
        } else {
            self.unlink_edge(id);
        }
        self.replace_owners(id, &[]);
        self.blocks -= self.nodes[id as usize].len as usize;
        self.nodes[id as usize] = Node::empty();
        self.live -= 1;
    }

    /// Replaces the owner list of `id` (sorted by slot).
    fn replace_owners(&mut self, id: NodeId, list: &[Owner]) {
        let n = &mut self.nodes[id as usize];
        if n.n_owners as usize > INLINE {
            let [off, cap] = n.owners;
            self.spill.release(off as u32, cap as usize);
        }
        let n = &mut self.nodes[id as usize];
        n.n_owners = list.len() as u32;
        if list.len() <= INLINE {
            n.owners = [0; INLINE];
            n.owners[..list.len()].copy_from_slice(list);
        } else {
            let cap = list.len().next_power_of_two();
            let off = self.spill.alloc(cap);
            self.spill.words[off as usize..off as usize + list.len()].copy_from_slice(list);
            self.nodes[id as usize].owners = [u64::from(off), cap as u64];
        }
    }

    /// Sets (end > 0) or drops (end 0) `slot`'s entry on `node`.
    fn set_owner(&mut self, node: NodeId, slot: Slot, tiers: u8, end: u32) {
        let entry = owner(slot, tiers, end);
        let n = &mut self.nodes[node as usize];
        let len = n.n_owners as usize;
        if len <= INLINE {
            match n.owners[..len].binary_search_by_key(&slot, |&o| owner_slot(o)) {
                Ok(i) if end == 0 => {
                    n.owners.copy_within(i + 1..len, i);
                    n.n_owners -= 1;
                }
                Ok(i) => n.owners[i] = entry,
                Err(_) if end == 0 => {}
                Err(i) if len < INLINE => {
                    n.owners.copy_within(i..len, i + 1);
                    n.owners[i] = entry;
                    n.n_owners += 1;
                }
                Err(i) => {
                    let mut list = [0; INLINE + 1];
                    list[..i].copy_from_slice(&n.owners[..i]);
                    list[i] = entry;
                    list[i + 1..].copy_from_slice(&n.owners[i..]);
                    n.n_owners = 0;
                    self.replace_owners(node, &list);
                }
            }
            return;
        }
        let [off, cap] = n.owners.map(|w| w as usize);
        let words = &mut self.spill.words;
        match words[off..off + len].binary_search_by_key(&slot, |&o| owner_slot(o)) {
            Ok(i) if end == 0 => {
                words.copy_within(off + i + 1..off + len, off + i);
                n.n_owners -= 1;
                if n.n_owners as usize == INLINE {
                    let list = [words[off], words[off + 1]];
                    self.spill.release(off as u32, cap);
                    let n = &mut self.nodes[node as usize];
                    n.owners = list;
                }
            }
            Ok(i) => words[off + i] = entry,
            Err(_) if end == 0 => {}
            Err(i) => {
                let mut off = off;
                if len == cap {
                    let new = self.spill.alloc(2 * cap) as usize;
                    self.spill.words.copy_within(off..off + len, new);
                    self.spill.release(off as u32, cap);
                    off = new;
                    self.nodes[node as usize].owners = [off as u64, 2 * cap as u64];
                }
                let words = &mut self.spill.words;
                words.copy_within(off + i..off + len, off + i + 1);
                words[off + i] = entry;
                self.nodes[node as usize].n_owners += 1;
            }
        }
    }

    /// Cuts `id` after `at` blocks: the rest becomes `tail`, its only child, which takes over
    /// `id`'s children (their anchor, the last block, moves with them).
    fn split(&mut self, id: NodeId, at: u32, tail: NodeId) {
        if self.nodes.len() <= tail as usize {
            self.nodes.resize(tail as usize + 1, Node::empty());
        }
        let n = self.nodes[id as usize];
        debug_assert!(at > 0 && at < n.len);
        let mut head_owners = Vec::new();
        let mut tail_owners = Vec::new();
        for &o in self.owners(id) {
            let (slot, tiers, end) = (owner_slot(o), owner_tiers(o), owner_end(o));
            head_owners.push(owner(slot, tiers, end.min(at)));
            if end > at {
                tail_owners.push(owner(slot, tiers, end - at));
            }
        }
        self.nodes[tail as usize] = Node {
            start: n.start + at,
            len: n.len - at,
            anchor: n.start + at - 1,
            hint: n.hint,
            children: n.children,
            n_owners: 0,
            owners: [0; INLINE],
        };
        self.live += 1;
        self.replace_owners(tail, &tail_owners);
        let head = &mut self.nodes[id as usize];
        head.len = at;
        head.hint = tail;
        head.children = 1;
        self.replace_owners(id, &head_owners);
    }

    /// Joins `child`, the only child of `id` and the next run in the arena, onto `id`. Every
    /// owner of `child` holds all of `id` in the same tiers.
    fn merge(&mut self, id: NodeId, child: NodeId) {
        let c = self.nodes[child as usize];
        let n = self.nodes[id as usize];
        debug_assert!(n.children == 1 && c.start == n.start + n.len);
        if n.hint != child {
            self.unlink_edge(child);
        }
        let child_owners = self.owners(child).to_vec();
        let mut list = self.owners(id).to_vec();
        for o in child_owners {
            let i = list
                .binary_search_by_key(&owner_slot(o), |&x| owner_slot(x))
                .expect("a child owner holds the parent");
            list[i] = owner(owner_slot(o), owner_tiers(o), n.len + owner_end(o));
        }
        self.replace_owners(id, &list);
        self.replace_owners(child, &[]);
        let head = &mut self.nodes[id as usize];
        head.len += c.len;
        head.hint = c.hint;
        head.children = c.children;
        self.nodes[child as usize] = Node::empty();
        self.live -= 1;
    }
}
