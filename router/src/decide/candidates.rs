//! The registered workers, from the etcd watch, partitioned by (model, role). Each partition
//! has one block size (the lowest worker id's); a card with another block size cannot share
//! the prompt's hashes and is left out, with a warning.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvroute_common::WorkerId;
use kvroute_common::discovery::WorkerEvent;
use kvroute_common::messages::{WorkerCard, WorkerRole};

/// A partition's name: (model, role).
pub type PartitionKey = (String, WorkerRole);

/// The workers serving one (model, role).
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    pub cards: Vec<WorkerCard>,
    /// Tokens per block, shared by every card here.
    pub block_size: u32,
}

/// What a worker event changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Change {
    /// Workers that left (their load and bindings are invalid now).
    pub departed: Vec<WorkerId>,
    /// The first full snapshot arrived.
    pub loaded: bool,
}

/// Every registered worker and the partitions built from them.
#[derive(Debug, Default)]
pub struct Candidates {
    cards: BTreeMap<WorkerId, WorkerCard>,
    partitions: HashMap<PartitionKey, Arc<Partition>>,
    loaded: bool,
}

impl Candidates {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the first snapshot of the registered workers arrived.
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    pub fn len(&self) -> usize {
        self.cards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cards.is_empty()
    }

    /// Every registered worker's card, by worker id.
    pub fn cards(&self) -> impl Iterator<Item = &WorkerCard> {
        self.cards.values()
    }

    /// The workers of `model` in `role`.
    pub fn partition(&self, model: &str, role: WorkerRole) -> Option<Arc<Partition>> {
        self.partitions.get(&(model.to_owned(), role)).cloned()
    }

    /// Every partition.
    pub fn partitions(&self) -> HashMap<PartitionKey, Arc<Partition>> {
        self.partitions.clone()
    }

    pub fn apply(&mut self, event: WorkerEvent) -> Change {
        let mut change = Change::default();
        match event {
            WorkerEvent::Snapshot { cards, .. } => {
                let fresh: BTreeMap<_, _> = cards.into_iter().map(|c| (c.worker_id, c)).collect();
                change.departed = self
                    .cards
                    .keys()
                    .filter(|id| !fresh.contains_key(id))
                    .copied()
                    .collect();
                self.cards = fresh;
                change.loaded = !self.loaded;
                self.loaded = true;
            }
            WorkerEvent::Put { card, .. } => {
                if let Some(old) = self.cards.get(&card.worker_id)
                    && (old.model != card.model || old.role != card.role)
                {
                    // Moved to another partition: its old load and bindings no longer apply.
                    change.departed.push(card.worker_id);
                }
                self.cards.insert(card.worker_id, card);
            }
            WorkerEvent::Delete { worker_id, .. } => {
                if self.cards.remove(&worker_id).is_some() {
                    change.departed.push(worker_id);
                }
            }
            WorkerEvent::Invalid { key, error, .. } => {
                tracing::warn!(key, error, "ignoring an undecodable worker card");
                return change;
            }
        }
        self.rebuild();
        change
    }

    fn rebuild(&mut self) {
        let mut groups: HashMap<PartitionKey, Vec<WorkerCard>> = HashMap::new();
        for card in self.cards.values() {
            groups
                .entry((card.model.clone(), card.role))
                .or_default()
                .push(card.clone());
        }
        self.partitions = groups
            .into_iter()
            .map(|(key, cards)| {
                let block_size = cards[0].block_size;
                let (same, other): (Vec<_>, Vec<_>) =
                    cards.into_iter().partition(|c| c.block_size == block_size);
                for c in &other {
                    tracing::warn!(
                        worker_id = c.worker_id,
                        model = key.0,
                        block_size = c.block_size,
                        expected = block_size,
                        "worker's block size differs from its model's; not a candidate"
                    );
                }
                let partition = Partition {
                    cards: same,
                    block_size,
                };
                (key, Arc::new(partition))
            })
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(id: u64, model: &str, block_size: u32) -> WorkerCard {
        WorkerCard {
            v: Default::default(),
            worker_id: id,
            model: model.into(),
            role: WorkerRole::Aggregated,
            block_size,
            total_kv_blocks: 100,
            max_num_batched_tokens: 0,
            dp_start_rank: 0,
            dp_size: 1,
            taints: vec![],
            labels: Default::default(),
            request_subject: format!("w.{id}"),
            software_version: String::new(),
            http_url: None,
            kv_events: true,
            lora_adapters: None,
        }
    }

    #[test]
    fn partitions_follow_puts_deletes_and_snapshots() {
        let mut c = Candidates::new();
        let change = c.apply(WorkerEvent::Snapshot {
            cards: vec![card(1, "a", 16), card(2, "a", 16), card(3, "b", 32)],
            revision: 1,
        });
        assert!(change.loaded && c.is_loaded());
        let a = c.partition("a", WorkerRole::Aggregated).unwrap();
        assert_eq!((a.cards.len(), a.block_size), (2, 16));
        assert!(c.partition("a", WorkerRole::Decode).is_none());
        c.apply(WorkerEvent::Put {
            card: card(4, "a", 32),
            revision: 2,
        });
        assert_eq!(
            c.partition("a", WorkerRole::Aggregated)
                .unwrap()
                .cards
                .len(),
            2
        );
        let change = c.apply(WorkerEvent::Delete {
            worker_id: 1,
            revision: 3,
        });
        assert_eq!(change.departed, vec![1]);
        let change = c.apply(WorkerEvent::Snapshot {
            cards: vec![card(3, "b", 32)],
            revision: 9,
        });
        assert_eq!(change.departed, vec![2, 4]);
        assert!(!change.loaded);
        assert!(c.partition("a", WorkerRole::Aggregated).is_none());
    }
}
