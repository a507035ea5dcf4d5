//! Free loopback ports (never the services' default ports).
//!
//! A port is handed out free and bound later by another process (nats-server, etcd, a ZMQ
//! socket), so it must not be one the kernel may give away meanwhile. Ports of the ephemeral
//! range (Linux: 32768–60999, `ip_local_port_range`) are: every outgoing connection of the
//! tests running beside takes one as its source port, and a suite running four tests at a time
//! made such collisions ("address already in use") a flake. So ports come from below that
//! range, in a sequence that starts at a place of each process's own and that no process uses
//! twice; the bind check skips a port a listener holds.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

const RESERVED: [u16; 4] = [4222, 2379, 2380, 8222];
/// Handed out: `[FIRST, FIRST + SPAN)`, below Linux's default ephemeral range.
const FIRST: u32 = 10_000;
const SPAN: u32 = 22_000;

/// A port that was free a moment ago on 127.0.0.1, outside the ephemeral range.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    // Where this process starts: from its id and the clock's nanoseconds, so test processes
    // started together begin far apart (a stride, not a seeded generator: no state to share).
    let start = || {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        std::process::id().wrapping_mul(7_919) ^ nanos
    };
    let _ = NEXT.compare_exchange(
        u32::MAX,
        start() % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if RESERVED.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {FIRST}..{}", FIRST + SPAN);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!((FIRST..FIRST + SPAN).contains(&u32::from(p)), "{p}");
            assert!(!RESERVED.contains(&p));
            TcpListener::bind(("127.0.0.1", p)).expect("a free port binds");
        }
    }
}
