//! What a classifier factory sees for one partition: the block size and the workers' ranks
//! with their advertised capacity. The host builds it again after each change of the
//! partition's workers and hands it to `RequestClassifier::workers_changed`.

use kvroute_common::messages::WorkerCard;

use crate::decide::candidates::Partition;
use crate::worker::WorkerRank;

/// One registered rank of the partition and its advertised KV capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClassifierWorker {
    pub worker: WorkerRank,
    /// KV blocks the rank's cache holds (capacity, not free space); `None` when the worker
    /// advertised none. Times the context's block size, it is the rank's token capacity.
    pub total_kv_blocks: Option<u64>,
}

impl ClassifierWorker {
    pub fn new(worker: WorkerRank, total_kv_blocks: Option<u64>) -> Self {
        Self {
            worker,
            total_kv_blocks,
        }
    }
}

/// The partition's view for a classifier: built when the classifier is built and after each
/// change of the partition's workers. It follows discovery only; it says nothing of health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestClassifierContext {
    block_size: u32,
    workers: Vec<ClassifierWorker>,
}

impl RequestClassifierContext {
    /// `workers` are kept sorted by rank, so classifiers that iterate them are deterministic.
    pub fn new(block_size: u32, mut workers: Vec<ClassifierWorker>) -> Self {
        workers.sort_by_key(|w| w.worker);
        workers.dedup_by_key(|w| w.worker);
        Self {
            block_size,
            workers,
        }
    }

    /// One entry per data-parallel rank of each card; a card advertising 0 blocks has unknown
    /// capacity.
    pub fn from_cards(block_size: u32, cards: &[WorkerCard]) -> Self {
        let workers = cards
            .iter()
            .flat_map(|card| {
                let total = (card.total_kv_blocks > 0).then_some(card.total_kv_blocks);
                card.dp_ranks().map(move |rank| {
                    ClassifierWorker::new(WorkerRank::new(card.worker_id, rank), total)
                })
            })
            .collect();
        Self::new(block_size, workers)
    }

    /// The context of a partition of the router's candidates.
    pub fn from_partition(partition: &Partition) -> Self {
        Self::from_cards(partition.block_size, &partition.cards)
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The partition's ranks, sorted.
    pub fn workers(&self) -> &[ClassifierWorker] {
        &self.workers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::card;

    #[test]
    fn one_entry_per_rank_sorted_with_unknown_capacity_as_none() {
        let mut wide = card(2);
        wide.dp_start_rank = 4;
        wide.dp_size = 2;
        let mut unknown = card(1);
        unknown.total_kv_blocks = 0;
        let context = RequestClassifierContext::from_cards(16, &[wide.clone(), unknown]);
        assert_eq!(context.block_size(), 16);
        let ranks: Vec<_> = context
            .workers()
            .iter()
            .map(|w| (w.worker, w.total_kv_blocks))
            .collect();
        assert_eq!(
            ranks,
            vec![
                (WorkerRank::new(1, 0), None),
                (WorkerRank::new(2, 4), Some(wide.total_kv_blocks)),
                (WorkerRank::new(2, 5), Some(wide.total_kv_blocks)),
            ]
        );
    }
}
