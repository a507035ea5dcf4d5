use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use uuid::Uuid;

use super::*;

fn config() -> QueueConfig {
    QueueConfig {
        max_len: 8,
        default_timeout_ms: 1_000,
        max_timeout_ms: 5_000,
        max_priority_jump_ms: 500,
        age_limit_ms: 2_000,
    }
}

fn id(n: u128) -> RequestId {
    Uuid::from_u128(n)
}

fn ticket(arrived_ms: u64) -> Ticket {
    Ticket {
        class: 0,
        strict_priority: 0,
        due_ms: arrived_ms,
        cost: 1,
        arrived_ms,
        deadline_ms: arrived_ms + 1_000,
    }
}

fn order(q: &AdmissionQueue<u32>) -> Vec<u32> {
    q.head(usize::MAX)
        .iter()
        .map(|i| *q.get(i).unwrap().0)
        .collect()
}

#[test]
fn deadline_and_due_follow_the_config() {
    let c = config();
    assert_eq!(c.deadline(100, None, 100, None), 1_100);
    assert_eq!(c.deadline(100, Some(50), 100, None), 150);
    assert_eq!(c.deadline(100, Some(60_000), 100, None), 5_100, "capped");
    assert_eq!(
        c.deadline(100, None, 100, Some(400)),
        375,
        "answered before the attempt's deadline"
    );
    assert_eq!(
        c.deadline(100, None, 300, Some(340)),
        330,
        "a quarter of what is left"
    );
    assert_eq!(c.deadline(100, None, 500, Some(400)), 400, "already past");
    assert_eq!(
        c.deadline(0, Some(200), 150, Some(400)),
        200,
        "a retry counts from the first arrival"
    );
    assert_eq!(c.due(1_000, None), 1_000);
    assert_eq!(c.due(1_000, Some(-300)), 1_000, "negative jump is 0");
    assert_eq!(c.due(1_000, Some(200)), 800);
    assert_eq!(c.due(1_000, Some(10_000)), 500, "capped");
    assert_eq!(c.due(100, Some(400)), 0, "saturates");
}

#[test]
fn class_then_priority_then_due_then_arrival() {
    let mut q = AdmissionQueue::new(config());
    let mut t = |n: u32, class: u8, prio: i32, due: u64| {
        let mut tk = ticket(100 + u64::from(n));
        tk.class = class;
        tk.strict_priority = prio;
        tk.due_ms = due;
        q.push(id(n.into()), n, tk, false).unwrap();
    };
    t(1, 1, 0, 10);
    t(2, 0, 0, 50);
    t(3, 0, 5, 90);
    t(4, 0, 0, 20);
    t(5, 0, -3, 0);
    t(6, 0, 0, 20);
    assert_eq!(order(&q), vec![3, 4, 6, 2, 5, 1]);
}

#[test]
fn priority_jump_moves_a_request_forward_within_its_bound() {
    let c = config();
    let mut q = AdmissionQueue::new(c);
    for (n, arrived, jump) in [
        (1u32, 1_000u64, None),
        (2, 1_100, Some(50)),
        (3, 1_200, Some(450)),
    ] {
        let mut tk = ticket(arrived);
        tk.due_ms = c.due(arrived, jump);
        q.push(id(n.into()), n, tk, false).unwrap();
    }
    // 3 is due at 750: ahead of 1 (1000); 2 at 1050 stays behind 1.
    assert_eq!(order(&q), vec![3, 1, 2]);
}

#[test]
fn aged_requests_go_first_oldest_first() {
    let mut q = AdmissionQueue::new(config());
    let mut low = ticket(0);
    low.strict_priority = -10;
    q.push(id(1), 1, low, false).unwrap();
    let mut low_later = ticket(500);
    low_later.strict_priority = -10;
    q.push(id(2), 2, low_later, false).unwrap();
    for n in 3..6u32 {
        let mut hi = ticket(1_000 + u64::from(n));
        hi.strict_priority = 10;
        q.push(id(n.into()), n, hi, false).unwrap();
    }
    assert_eq!(order(&q), vec![3, 4, 5, 1, 2]);
    assert_eq!(q.next_timer(), Some(1_001), "the first deadline");
    assert_eq!(q.age(1_999), 0);
    assert_eq!(q.age(2_000), 1);
    assert_eq!(order(&q), vec![1, 3, 4, 5, 2]);
    assert_eq!(q.age(2_600), 1);
    assert_eq!(order(&q), vec![1, 2, 3, 4, 5]);
}

/// The starvation bound: with high-priority requests arriving forever, a low-priority
/// request is served no later than `age_limit_ms` after it arrived plus the serving of aged
/// requests older than itself.
#[test]
fn a_low_priority_request_is_not_starved() {
    let mut c = config();
    c.max_len = 1_000;
    c.age_limit_ms = 300;
    let mut q = AdmissionQueue::new(c);
    let mut rng = StdRng::seed_from_u64(7);
    let mut low = ticket(0);
    low.strict_priority = -1;
    low.deadline_ms = u64::MAX;
    q.push(id(0), 0, low, false).unwrap();
    let mut served_at = None;
    // One request served every 10 ms; two high-priority arrivals every 10 ms.
    for step in 1..200u64 {
        let now = step * 10;
        for k in 0..2 {
            let n = u32::try_from(step * 2 + k).unwrap();
            let mut hi = ticket(now);
            hi.strict_priority = rng.random_range(1..5);
            hi.deadline_ms = u64::MAX;
            q.push(id(n.into()), n, hi, false).unwrap();
        }
        q.age(now);
        let head = q.head(1)[0];
        let left = q.take(&head).unwrap();
        if left.item == 0 {
            served_at = Some(now);
            break;
        }
    }
    assert_eq!(served_at, Some(300), "served as soon as it aged");
}

#[test]
fn capacity_counts_cost_and_refuses_what_does_not_fit() {
    let mut q = AdmissionQueue::new(config());
    let mut big = ticket(0);
    big.cost = 5;
    q.push(id(1), 1, big, false).unwrap();
    q.push(id(2), 2, ticket(1), true).unwrap();
    assert_eq!(q.used(), 6);
    let mut too_big = ticket(2);
    too_big.cost = 3;
    assert_eq!(
        q.push(id(3), 3, too_big, false),
        Err(QueueError::Full {
            used: 6,
            max: 8,
            cost: 3
        })
    );
    let mut zero = ticket(3);
    zero.cost = 0;
    q.push(id(4), 4, zero, false).unwrap();
    assert_eq!(q.used(), 7, "a cost of 0 counts as 1");
    q.take(&id(1)).unwrap();
    assert_eq!(q.used(), 2);
}

#[test]
fn a_retry_keeps_its_place_and_takes_the_new_deadline() {
    let mut q = AdmissionQueue::new(config());
    q.push(id(1), 1, ticket(0), false).unwrap();
    q.push(id(2), 2, ticket(10), false).unwrap();
    let mut retry = ticket(500);
    retry.deadline_ms = 900;
    assert_eq!(q.push(id(1), 11, retry, false), Ok(Pushed::Replaced(1)));
    assert_eq!(order(&q), vec![11, 2]);
    assert_eq!(q.used(), 2);
    let expired = q.expire(901);
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].item, 11);
    assert_eq!(order(&q), vec![2]);
}

#[test]
fn expiry_takes_exactly_the_requests_past_their_deadline() {
    let mut q = AdmissionQueue::new(config());
    for n in 0..5u32 {
        let mut t = ticket(u64::from(n) * 100);
        t.deadline_ms = 1_000 + u64::from(n) * 100;
        q.push(id(n.into()), n, t, n % 2 == 1).unwrap();
    }
    assert!(q.expire(1_000).is_empty(), "a deadline is inclusive");
    let gone: Vec<(u32, bool)> = q
        .expire(1_250)
        .into_iter()
        .map(|l| (l.item, l.deferred))
        .collect();
    assert_eq!(gone, vec![(0, false), (1, true), (2, false)]);
    assert_eq!(q.len(), 2);
    assert_eq!(q.used(), 2);
}

#[test]
fn deferred_requests_wait_outside_the_order_until_admitted() {
    let mut q = AdmissionQueue::new(config());
    q.push(id(1), 1, ticket(0), true).unwrap();
    q.push(id(2), 2, ticket(5), false).unwrap();
    q.push(id(3), 3, ticket(7), true).unwrap();
    assert_eq!(order(&q), vec![2]);
    assert_eq!(q.deferred_ids(), vec![id(1), id(3)]);
    assert_eq!((q.waiting(), q.deferred()), (1, 2));
    assert!(q.admit(&id(1), 0, 0));
    assert!(!q.admit(&id(1), 0, 0), "already admitted");
    assert!(!q.admit(&id(9), 0, 0), "unknown");
    assert_eq!(order(&q), vec![1, 2]);
    let drained: Vec<(u32, bool)> = q
        .drain()
        .into_iter()
        .map(|l| (l.item, l.deferred))
        .collect();
    assert_eq!(drained, vec![(1, false), (2, false), (3, true)]);
    assert!(q.is_empty());
    assert_eq!(q.used(), 0);
    assert_eq!(q.next_timer(), None);
}

/// Random operations keep the bookkeeping consistent: `used` is the sum of costs, every held
/// request is exactly once in the order or the deferred set, and the order is sorted.
#[test]
fn random_operations_keep_the_queue_consistent() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut c = config();
    c.max_len = 40;
    let mut q: AdmissionQueue<u32> = AdmissionQueue::new(c);
    let mut now = 0u64;
    for step in 0..5_000u32 {
        now += rng.random_range(0..20);
        match rng.random_range(0..10) {
            0..=4 => {
                let n = rng.random_range(0..60u32);
                let t = Ticket {
                    class: rng.random_range(0..3),
                    strict_priority: rng.random_range(-2..3),
                    due_ms: now.saturating_sub(rng.random_range(0..300)),
                    cost: rng.random_range(0..4),
                    arrived_ms: now,
                    deadline_ms: now + rng.random_range(0..3_000),
                };
                let _ = q.push(id(n.into()), step, t, rng.random_bool(0.2));
            }
            5 => {
                let n = rng.random_range(0..60u32);
                q.admit(&id(n.into()), rng.random_range(0..3), now);
            }
            6 => {
                if let Some(head) = q.head(1).first() {
                    q.take(head).unwrap();
                }
            }
            7 => {
                for left in q.expire(now) {
                    assert!(left.ticket.deadline_ms < now);
                }
            }
            _ => {
                q.age(now);
            }
        }
        let cost: u32 = q.entries.values().map(|e| e.ticket.cost).sum();
        assert_eq!(q.used(), cost);
        assert!(q.used() <= 40);
        assert_eq!(q.waiting() + q.deferred(), q.len());
        assert_eq!(q.deadlines.len(), q.len());
        for (key, rid) in &q.order {
            assert_eq!(q.entries[rid].order, Some(*key));
        }
        for &(_, _, rid) in &q.deferred {
            assert_eq!(q.entries[&rid].order, None);
        }
    }
}
