//! One rank's ZMQ sockets, as the engines' `ZmqEventPublisher` runs them: a PUB socket sending
//! `[topic, seq (8-byte big-endian, from 0), payload]`, and a ROUTER socket answering replay
//! requests `[client, "", start_seq]` with every buffered batch from `start_seq` on
//! (`[client, "", topic, seq, payload]`), then `[client, "", "", -1 (8-byte signed), ""]`.
//!
//! libzmq sockets are blocking and not shareable, so both live on a dedicated thread fed by a
//! channel; its loop is the engines' own: serve one waiting replay request, then wait up to
//! 100 ms for the next batch.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use kvroute_common::ops::ListenError;

/// The engines' high-water mark for the PUB socket.
const PUB_HWM: i32 = 100_000;
/// The engines' end-of-replay marker: -1 as an 8-byte big-endian signed integer.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Where one rank's sockets bind; port 0 lets the OS choose.
#[derive(Debug, Clone)]
pub(crate) struct PublisherConfig {
    pub host: IpAddr,
    pub pub_port: u16,
    pub replay_port: u16,
    pub topic: Vec<u8>,
    /// Batches kept for replay.
    pub buffer: usize,
    /// For logs.
    pub name: String,
}

/// A running publisher thread. Dropping the handle (or [`Publisher::stop`]) ends it.
#[derive(Debug)]
pub(crate) struct Publisher {
    tx: Mutex<Option<mpsc::Sender<Vec<u8>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub endpoint: String,
    pub replay_endpoint: String,
}

impl Publisher {
    /// Binds both sockets (an address in use is a [`ListenError`] naming the flag) and starts
    /// the thread.
    pub fn start(ctx: &zmq::Context, config: PublisherConfig) -> anyhow::Result<Self> {
        let pub_socket = ctx.socket(zmq::PUB)?;
        pub_socket.set_sndhwm(PUB_HWM)?;
        pub_socket.set_linger(0)?;
        let endpoint = bind(&pub_socket, config.host, config.pub_port, "engine-zmq-port")?;
        let replay = ctx.socket(zmq::ROUTER)?;
        replay.set_linger(0)?;
        let replay_endpoint = bind(
            &replay,
            config.host,
            config.replay_port,
            "engine-replay-port",
        )?;
        let (tx, rx) = mpsc::channel();
        let name = config.name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("zmq-{name}"))
            .spawn(move || {
                let mut state = Loop {
                    pub_socket,
                    replay,
                    topic: config.topic,
                    buffer: VecDeque::new(),
                    capacity: config.buffer,
                    next_seq: 0,
                };
                if let Err(e) = state.run(&rx) {
                    tracing::error!(publisher = name, error = %e, "ZMQ publisher stopped");
                }
            })?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            endpoint,
            replay_endpoint,
        })
    }

    /// Queues one batch payload (sent in call order).
    pub fn send(&self, payload: Vec<u8>) {
        if let Some(tx) = &*lock(&self.tx) {
            // The thread only ends when stopped, or after a socket error it logged.
            let _ = tx.send(payload);
        }
    }

    /// Ends the thread after it sent what is queued (at most ~100 ms later); later batches are
    /// dropped.
    pub async fn stop(&self) {
        lock(&self.tx).take();
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bind(
    socket: &zmq::Socket,
    host: IpAddr,
    port: u16,
    flag: &'static str,
) -> anyhow::Result<String> {
    let wanted = SocketAddr::new(host, port);
    let listen_error = |e: zmq::Error| ListenError {
        flag,
        addr: wanted,
        error: std::io::Error::from_raw_os_error(e.to_raw()),
    };
    if host.is_ipv6() {
        socket.set_ipv6(true)?;
    }
    let spec = match port {
        0 => format!("tcp://{}:*", bracket(host)),
        p => format!("tcp://{}:{p}", bracket(host)),
    };
    socket.bind(&spec).map_err(listen_error)?;
    // The bound endpoint names the port the OS chose for `*`.
    let bound = socket
        .get_last_endpoint()?
        .map_err(|raw| anyhow::anyhow!("non-UTF-8 endpoint {raw:?}"))?;
    Ok(bound)
}

fn bracket(host: IpAddr) -> String {
    match host {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

struct Loop {
    pub_socket: zmq::Socket,
    replay: zmq::Socket,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    capacity: usize,
    next_seq: u64,
}

impl Loop {
    fn run(&mut self, rx: &mpsc::Receiver<Vec<u8>>) -> Result<(), zmq::Error> {
        loop {
            if self.replay.poll(zmq::POLLIN, 0)? > 0 {
                self.serve_replay()?;
            }
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(payload) => self.publish(payload)?,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
    }

    fn publish(&mut self, payload: Vec<u8>) -> Result<(), zmq::Error> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let seq_bytes = seq.to_be_bytes();
        self.pub_socket.send_multipart(
            [self.topic.as_slice(), &seq_bytes[..], payload.as_slice()],
            0,
        )?;
        if self.buffer.len() == self.capacity {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
        Ok(())
    }

    /// One replay request: every buffered batch from its start sequence, then the end marker.
    fn serve_replay(&mut self) -> Result<(), zmq::Error> {
        let frames = self.replay.recv_multipart(0)?;
        let [client, _, start] = frames.as_slice() else {
            tracing::warn!(
                frames = frames.len(),
                "invalid replay request (want 3 frames)"
            );
            return Ok(());
        };
        // Python's int.from_bytes(start, "big"): unsigned, any length.
        let start = start.iter().fold(0u128, |acc, &b| {
            acc.saturating_mul(256).saturating_add(u128::from(b))
        });
        for (seq, payload) in &self.buffer {
            if u128::from(*seq) >= start {
                let seq_bytes = seq.to_be_bytes();
                self.replay.send_multipart(
                    [
                        client.as_slice(),
                        b"",
                        self.topic.as_slice(),
                        &seq_bytes[..],
                        payload.as_slice(),
                    ],
                    0,
                )?;
            }
        }
        self.replay
            .send_multipart([client.as_slice(), b"", b"", &END_SEQ[..], b""], 0)
    }
}
