//! The engine side: a libzmq PUB bound as the engines bind theirs, sending live frames
//! `[topic, seq (8-byte big-endian), payload]` from its own thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use kvroute_tests::{cpu, free_port};

/// vLLM's send high-water mark (`ZmqEventPublisher(hwm=100_000)`).
const PUB_HWM: i32 = 100_000;

/// One rank's PUB socket and its sequence.
pub struct EnginePub {
    socket: zmq::Socket,
    pub endpoint: String,
    seq: u64,
}

/// Pacing of [`EnginePub::send_all`]: `blocks[i]` block events in payload `i`, sent at `rate`
/// block events per second; `sent[i]` gets its send time in ns since the start, plus 1.
#[derive(Debug, Clone, Copy)]
pub struct Pace<'a> {
    pub blocks: &'a [u64],
    pub rate: u64,
    pub sent: &'a [AtomicU64],
}

/// What the sending thread reports of itself before it ends.
#[derive(Debug, Clone, Copy)]
pub struct Sender {
    pub cpu: Duration,
    pub tid: i32,
}

impl EnginePub {
    pub fn bind(ctx: &zmq::Context) -> anyhow::Result<Self> {
        let socket = ctx.socket(zmq::PUB)?;
        socket.set_sndhwm(PUB_HWM)?;
        socket.set_linger(0)?;
        let endpoint = format!("tcp://127.0.0.1:{}", free_port());
        socket.bind(&endpoint)?;
        Ok(Self {
            socket,
            endpoint,
            seq: 0,
        })
    }

    fn send(&mut self, payload: &[u8]) -> anyhow::Result<()> {
        let seq = self.seq.to_be_bytes();
        self.socket
            .send_multipart([&b""[..], &seq[..], payload], 0)?;
        self.seq += 1;
        Ok(())
    }

    /// ZMQ's slow joiner: a SUB gets nothing until its subscription has reached the PUB. Sends
    /// probes until `joined` says one arrived, then leaves the ones in flight 200 ms to land.
    pub fn join(&mut self, probe: &[u8], mut joined: impl FnMut() -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !joined() {
            anyhow::ensure!(Instant::now() < deadline, "the SUB never joined");
            self.send(probe)?;
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        Ok(())
    }

    /// Sends `payloads` from the calling thread, as fast as it can or paced from `start`.
    pub fn send_all(
        &mut self,
        payloads: &[Vec<u8>],
        pace: Option<Pace<'_>>,
        start: Instant,
    ) -> anyhow::Result<Sender> {
        let mut due = 0u64;
        for (i, p) in payloads.iter().enumerate() {
            if let Some(pace) = pace {
                let at = start + Duration::from_nanos(due * 1_000_000_000 / pace.rate);
                if let Some(wait) = at.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                due += pace.blocks[i];
                pace.sent[i].store(start.elapsed().as_nanos() as u64 + 1, Ordering::Release);
            }
            self.send(p)?;
        }
        Ok(Sender {
            cpu: cpu::current_thread_cpu(),
            tid: cpu::current_tid(),
        })
    }
}

/// Runs `f` on the engine's sending thread (named, so its CPU is told apart).
pub fn sender_thread<'scope, F>(
    s: &'scope Scope<'scope, '_>,
    f: F,
) -> std::io::Result<ScopedJoinHandle<'scope, anyhow::Result<Sender>>>
where
    F: FnOnce() -> anyhow::Result<Sender> + Send + 'scope,
{
    std::thread::Builder::new()
        .name("engine-pub".into())
        .spawn_scoped(s, f)
}
