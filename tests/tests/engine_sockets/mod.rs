//! The engines' sockets and frames from the test's side: a plain libzmq SUB joined with probe
//! batches, the replay DEALER's frames, and rmpv views of the payload.

use std::time::{Duration, Instant};

use kvroute_tests::{Engine, EngineOptions, EnginePublisher};
use rmpv::Value as Mp;
use serde_json::{Value, json};

pub(crate) const TOPIC: &str = "kv@test";
/// How long a batch that should not arrive is waited for.
pub(crate) const QUIET: Duration = Duration::from_millis(300);
pub(crate) const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

pub(crate) fn start(options: EngineOptions) -> EnginePublisher {
    EnginePublisher::start(options).expect("the engine's publisher starts (scripts/install-deps)")
}

pub(crate) fn options(engine: Engine) -> EngineOptions {
    EngineOptions {
        topic: TOPIC.into(),
        ..EngineOptions::new(engine)
    }
}

pub(crate) fn socket(ctx: &zmq::Context, kind: zmq::SocketType) -> zmq::Socket {
    let socket = ctx.socket(kind).unwrap();
    socket.set_linger(0).unwrap();
    socket
}

/// A SUB for `TOPIC` connected to (or, when the engine connects, bound at) `endpoint`.
pub(crate) fn subscriber(ctx: &zmq::Context, endpoint: &str, bind: bool) -> zmq::Socket {
    let sub = socket(ctx, zmq::SUB);
    sub.set_subscribe(TOPIC.as_bytes()).unwrap();
    if bind {
        sub.bind(endpoint).unwrap();
    } else {
        sub.connect(endpoint).unwrap();
    }
    sub
}

pub(crate) fn recv(socket: &zmq::Socket, timeout: Duration) -> Option<Vec<Vec<u8>>> {
    let ready = socket
        .poll(zmq::POLLIN, timeout.as_millis() as i64)
        .unwrap();
    (ready > 0).then(|| socket.recv_multipart(0).unwrap())
}

/// A live batch: exactly `[topic, seq, payload]`.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) seq: u64,
    pub(crate) payload: Vec<u8>,
}

pub(crate) fn live(frames: Vec<Vec<u8>>) -> Live {
    assert_eq!(frames.len(), 3, "a live batch is [topic, seq, payload]");
    assert_eq!(frames[0], TOPIC.as_bytes(), "the first frame is the topic");
    let seq: [u8; 8] = frames[1].as_slice().try_into().expect("seq is 8 bytes");
    Live {
        seq: u64::from_be_bytes(seq),
        payload: frames[2].clone(),
    }
}

pub(crate) fn next_live(sub: &zmq::Socket) -> Live {
    live(recv(sub, Duration::from_secs(10)).expect("a live batch within 10 s"))
}

pub(crate) fn probe() -> Value {
    json!([{"type": "AllBlocksCleared"}])
}

/// ZMQ's slow joiner: a SUB gets nothing until its subscription has reached the PUB. Publishes
/// probe batches on `rank` until one arrives, then drains those still in flight; returns the
/// probes' seqs (received or not, they are in the replay buffer).
pub(crate) fn join(engine: &mut EnginePublisher, rank: u16, sub: &zmq::Socket) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut probes = Vec::new();
    loop {
        probes.push(engine.publish(rank, probe()).unwrap());
        if let Some(frames) = recv(sub, Duration::from_millis(100)) {
            assert!(probes.contains(&live(frames).seq));
            break;
        }
        assert!(Instant::now() < deadline, "rank {rank}'s SUB never joined");
    }
    while let Some(frames) = recv(sub, Duration::from_millis(200)) {
        assert!(probes.contains(&live(frames).seq));
    }
    probes
}

pub(crate) fn decode(payload: &[u8]) -> Mp {
    let mut rest = payload;
    let value = rmpv::decode::read_value(&mut rest).expect("the payload is msgpack");
    assert!(rest.is_empty(), "one msgpack value per payload");
    value
}

/// A decoded batch: positional `[ts, events, rank]` (msgspec array_like).
pub(crate) struct Batch {
    pub(crate) ts: f64,
    pub(crate) events: Vec<Mp>,
    pub(crate) rank: Mp,
}

pub(crate) fn batch(payload: &[u8]) -> Batch {
    let value = decode(payload);
    let fields = value.as_array().expect("a batch is a msgpack array");
    assert_eq!(fields.len(), 3, "[ts, events, rank]: {value}");
    let Mp::F64(ts) = fields[0] else {
        panic!("ts is a float64: {}", fields[0]);
    };
    Batch {
        ts,
        events: fields[1].as_array().expect("events is an array").clone(),
        rank: fields[2].clone(),
    }
}

/// An event's keys in wire order (msgspec writes the tag, then the struct's field order).
pub(crate) fn keys(event: &Mp) -> Vec<&str> {
    event
        .as_map()
        .expect("an event is a map (tag=True)")
        .iter()
        .map(|(k, _)| k.as_str().expect("keys are strings"))
        .collect()
}

pub(crate) fn field<'a>(event: &'a Mp, name: &str) -> &'a Mp {
    event
        .as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {name} in {event}"))
}

pub(crate) fn hashes(event: &Mp) -> &[Mp] {
    field(event, "block_hashes").as_array().unwrap()
}
