use std::sync::mpsc;
use std::time::Duration;

use kvroute_common::messages::{StorageTier, StoredBlock};

use super::*;

/// A small seeded generator (xorshift64*), so every run writes the same events.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Seeded events of 4 workers: chains stored under earlier blocks (shared prefixes), removals
/// and clears, with some refused (unknown parents).
fn events(seed: u64, n: usize) -> Vec<(WorkerId, KvEventData)> {
    let mut rng = Rng(seed | 1);
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); 4];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let w = rng.below(4) as usize;
        let data = match rng.below(10) {
            0..=5 => {
                let parent = if held[w].is_empty() || rng.below(3) == 0 {
                    None
                } else {
                    Some(held[w][rng.below(held[w].len() as u64) as usize])
                };
                let blocks: Vec<StoredBlock> = (0..1 + rng.below(6))
                    .map(|_| {
                        let tokens_hash = rng.below(64);
                        StoredBlock {
                            block_hash: tokens_hash * 1_000 + rng.below(3),
                            tokens_hash,
                        }
                    })
                    .collect();
                held[w].extend(blocks.iter().map(|b| b.block_hash));
                let tier = [StorageTier::Device, StorageTier::Host][rng.below(2) as usize];
                KvEventData::Stored {
                    parent_hash: parent,
                    blocks,
                    tier,
                }
            }
            6..=8 if !held[w].is_empty() => {
                let i = rng.below(held[w].len() as u64) as usize;
                KvEventData::Removed {
                    block_hashes: vec![held[w].swap_remove(i)],
                    tier: StorageTier::Device,
                }
            }
            _ => {
                held[w].clear();
                KvEventData::Cleared
            }
        };
        out.push((w as WorkerId + 1, data));
    }
    out
}

/// The digest each view gives with the writer's maps (views that diverged differ).
fn copy_digests(shared: &SharedIndex) -> [u64; 2] {
    let st = shared.inner.writer();
    [0, 1].map(|v| digest_of(&shared.inner.read_view(v), &st.core))
}

#[test]
fn every_write_reaches_both_copies_with_the_outcome_of_one_index() {
    let shared = SharedIndex::new(IndexConfig::default());
    let mut reference = RadixIndex::new(IndexConfig::default());
    for (w, data) in events(7, 2_000) {
        let want = reference.apply(w, 0, &data);
        assert_eq!(shared.apply(w, 0, &data), want);
        let q = [1, 2, 3];
        assert_eq!(shared.find_matches(&q), reference.find_matches(&q));
    }
    shared.remove_worker(2);
    reference.remove_worker(2);
    assert_eq!(copy_digests(&shared), [reference.digest(); 2]);
    assert_eq!(shared.digest(), reference.digest());
    assert_eq!(shared.stats().entries, reference.len());
    // The second view is small: the maps and the arena exist once.
    let (two, one) = (shared.stats().bytes_in_use, reference.stats().bytes_in_use);
    assert!(two > one && two < one * 3 / 2, "{two} vs {one}");
}

#[test]
fn a_pinned_copy_keeps_its_state_while_the_writer_goes_on_and_then_catches_up() {
    let shared = SharedIndex::new(IndexConfig::default());
    let mut reference = RadixIndex::new(IndexConfig::default());
    let all = events(11, 6_000);
    let (first, rest) = all.split_at(1_000);
    for (w, data) in first {
        shared.apply(*w, 0, data).ok();
        reference.apply(*w, 0, data).ok();
    }
    let at_pin = reference.digest();
    let pin = shared.try_pin().expect("nothing else pinned");
    // One pin at a time.
    assert!(shared.try_pin().is_none(), "a second pin");
    for (w, data) in rest.iter().take(10) {
        assert_eq!(shared.apply(*w, 0, data), reference.apply(*w, 0, data));
    }
    assert!(
        shared.try_pin().is_none(),
        "the other copy must stay writable"
    );
    assert_eq!(pin.digest(), at_pin);
    // Readers see the writes the pin does not.
    assert_eq!(shared.digest(), reference.digest());
    drop(pin);
    // The copy that was pinned catches up a bounded amount per write, until both agree.
    for (w, data) in rest.iter().skip(10) {
        assert_eq!(shared.apply(*w, 0, data), reference.apply(*w, 0, data));
    }
    assert_eq!(copy_digests(&shared), [reference.digest(); 2]);
    assert!(shared.inner.writer().behind.iter().all(VecDeque::is_empty));
    assert!(shared.try_pin().is_some());
}

#[test]
fn seeded_writes_pins_and_releases_leave_both_copies_equal_to_one_index() {
    for seed in 1..=20u64 {
        let shared = SharedIndex::new(IndexConfig {
            write_chunk_events: 1 + (seed as usize % 4),
            ..IndexConfig::default()
        });
        let mut reference = RadixIndex::new(IndexConfig::default());
        let mut rng = Rng(seed * 0x9e37_79b9);
        let mut pins: Vec<(PinnedIndex, u64)> = Vec::new();
        for (i, (w, data)) in events(seed, 1_500).into_iter().enumerate() {
            match rng.below(20) {
                0 => {
                    if let Some(p) = shared.try_pin() {
                        pins.push((p, reference.digest()));
                    }
                }
                1 if !pins.is_empty() => {
                    let (p, at) = pins.swap_remove(rng.below(pins.len() as u64) as usize);
                    assert_eq!(p.digest(), at, "seed {seed}: a pinned copy changed");
                }
                2 => {
                    shared.remove_worker_dp_rank(w, 0);
                    reference.remove_worker_dp_rank(w, 0);
                }
                _ => {}
            }
            assert_eq!(
                shared.apply(w, 0, &data),
                reference.apply(w, 0, &data),
                "seed {seed} event {i}"
            );
            if i % 50 == 0 {
                assert_eq!(shared.digest(), reference.digest(), "seed {seed} event {i}");
            }
        }
        for (p, at) in pins.drain(..) {
            assert_eq!(p.digest(), at, "seed {seed}: a pinned copy changed");
        }
        // Drain what the last pin left behind.
        for _ in 0..2_000 {
            shared.apply_events(9, 0, &[]);
        }
        assert_eq!(
            copy_digests(&shared),
            [reference.digest(); 2],
            "seed {seed}"
        );
    }
}

#[test]
fn a_long_read_on_a_pin_never_makes_the_writer_wait() {
    let shared = SharedIndex::new(IndexConfig::default());
    let all = events(5, 3_000);
    let pin = shared.try_pin().unwrap();
    let before = pin.digest();
    pin.with(|_view, _maps| {
        // The pinned copy is read-locked for as long as this closure runs; the writer must
        // finish every write meanwhile.
        let (done_tx, done_rx) = mpsc::channel();
        let writer = {
            let shared = shared.clone();
            let all = all.clone();
            std::thread::spawn(move || {
                for (w, data) in &all {
                    let _ = shared.apply(*w, 0, data);
                }
                done_tx.send(()).unwrap();
            })
        };
        done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the writer was blocked by a pinned read");
        writer.join().unwrap();
    });
    assert_eq!(pin.digest(), before);
    drop(pin);
    let mut reference = RadixIndex::new(IndexConfig::default());
    for (w, data) in &all {
        let _ = reference.apply(*w, 0, data);
    }
    assert_eq!(shared.digest(), reference.digest());
}

#[test]
fn readers_on_other_threads_always_see_a_whole_write() {
    // Each write clears worker 1 and stores its 8-block chain again, as one write: a reader
    // must always see the whole chain (never the cleared state in between).
    let shared = SharedIndex::new(IndexConfig::default());
    let store = KvEventData::Stored {
        parent_hash: None,
        blocks: (1..=8)
            .map(|h| StoredBlock {
                block_hash: h,
                tokens_hash: h,
            })
            .collect(),
        tier: StorageTier::Device,
    };
    shared.apply(1, 0, &store).unwrap();
    // Readers count their reads; the writer starts once both have read, and writes until the
    // readers have read while it wrote (a busy machine may not run a reader at all during
    // any fixed number of writes).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (shared, stop, reads) = (shared.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || {
                let q: Vec<u64> = (1..=8).collect();
                loop {
                    let m = shared.find_matches(&q);
                    assert_eq!(m.matches.len(), 1, "{m:?}");
                    assert_eq!(m.matches[0].device, 8, "{m:?}");
                    reads.fetch_add(1, Ordering::Relaxed);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
            })
        })
        .collect();
    // (A reader that panicked ends the wait; no clock in this crate's tests either.)
    while reads.load(Ordering::Relaxed) < 2 && !readers.iter().any(|r| r.is_finished()) {
        std::thread::yield_now();
    }
    let before = reads.load(Ordering::Relaxed);
    let write = [KvEventData::Cleared, store];
    let mut writes = 0u64;
    while writes < 5_000
        || (reads.load(Ordering::Relaxed) < before + 1_000
            && writes < 50_000_000
            && !readers.iter().any(|r| r.is_finished()))
    {
        let outcome = shared.apply_events(1, 0, &write);
        assert_eq!(outcome.applied, 2);
        writes += 1;
    }
    let during = reads.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().expect("a reader saw a partial write");
    }
    assert!(during > 0, "no read overlapped the {writes} writes");
}

#[test]
fn a_solo_index_is_one_copy_until_its_second_is_attached() {
    let shared = SharedIndex::solo(RadixIndex::new(IndexConfig::default()));
    let mut reference = RadixIndex::new(IndexConfig::default());
    let all = events(3, 1_000);
    for (w, data) in &all[..500] {
        assert_eq!(shared.apply(*w, 0, data), reference.apply(*w, 0, data));
    }
    assert!(shared.is_solo());
    assert!(shared.try_pin().is_none(), "nothing to pin on one copy");
    // The second view is untouched until attached, and costs nothing meanwhile.
    assert_eq!(copy_digests(&shared)[1], 0, "an empty view");
    assert!(shared.stats().bytes_in_use <= reference.stats().bytes_in_use + 1024);
    assert_eq!(shared.digest(), reference.digest());
    shared.attach_second_copy();
    assert!(!shared.is_solo());
    assert_eq!(copy_digests(&shared), [reference.digest(); 2]);
    for (w, data) in &all[500..] {
        assert_eq!(shared.apply(*w, 0, data), reference.apply(*w, 0, data));
    }
    assert_eq!(copy_digests(&shared), [reference.digest(); 2]);
    assert!(shared.try_pin().is_some());
    // Attaching twice changes nothing.
    shared.attach_second_copy();
    assert_eq!(copy_digests(&shared), [reference.digest(); 2]);
}
