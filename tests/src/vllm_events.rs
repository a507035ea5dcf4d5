//! What a real vLLM engine holds, according to its own KV events: a SUB on its PUB socket
//! (libzmq, as the bridge) in a thread, applying each `BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared` to a model of the engine's prefix cache, so tests can compare kvroute's
//! index and routing with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use rmpv::Value;

/// An engine block hash (an int or bytes), as its MessagePack encoding.
type Key = Vec<u8>;

#[derive(Debug, Clone)]
struct Held {
    parent: Option<Key>,
    tokens: Vec<u32>,
    /// Stores minus removals of this hash (vLLM may store one hash twice).
    count: u32,
}

/// The engine's cached blocks as its events describe them.
#[derive(Debug, Default)]
pub struct EngineBlocks {
    blocks: HashMap<Key, Held>,
    /// (parent, the block's tokens) → hash, to follow a prompt.
    children: HashMap<(Option<Key>, Vec<u32>), Key>,
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    /// Events this model could not read (a test asserts it stays 0).
    pub unreadable: u64,
}

fn key(v: &Value) -> Key {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encodes");
    out
}

fn get<'v>(event: &'v Value, name: &str) -> Option<&'v Value> {
    event
        .as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

impl EngineBlocks {
    fn apply(&mut self, event: &Value) {
        match get(event, "type").and_then(Value::as_str) {
            Some("BlockStored") => {
                let (Some(hashes), Some(tokens), Some(size)) = (
                    get(event, "block_hashes").and_then(Value::as_array),
                    get(event, "token_ids").and_then(Value::as_array),
                    get(event, "block_size").and_then(Value::as_u64),
                ) else {
                    self.unreadable += 1;
                    return;
                };
                let tokens: Vec<u32> = tokens
                    .iter()
                    .filter_map(|t| t.as_u64().map(|t| t as u32))
                    .collect();
                let mut parent = get(event, "parent_block_hash")
                    .filter(|v| !v.is_nil())
                    .map(key);
                for (i, hash) in hashes.iter().enumerate() {
                    let size = size as usize;
                    let Some(block) = tokens.get(i * size..(i + 1) * size) else {
                        self.unreadable += 1;
                        return;
                    };
                    let k = key(hash);
                    self.stored += 1;
                    let held = self.blocks.entry(k.clone()).or_insert_with(|| Held {
                        parent: parent.clone(),
                        tokens: block.to_vec(),
                        count: 0,
                    });
                    held.count += 1;
                    self.children
                        .insert((parent.clone(), block.to_vec()), k.clone());
                    parent = Some(k);
                }
            }
            Some("BlockRemoved") => {
                let Some(hashes) = get(event, "block_hashes").and_then(Value::as_array) else {
                    self.unreadable += 1;
                    return;
                };
                for hash in hashes {
                    self.removed += 1;
                    let k = key(hash);
                    if let Some(held) = self.blocks.get_mut(&k) {
                        held.count -= 1;
                        if held.count == 0 {
                            let held = self.blocks.remove(&k).expect("present");
                            self.children.remove(&(held.parent, held.tokens));
                        }
                    }
                }
            }
            Some("AllBlocksCleared") => {
                self.cleared += 1;
                self.forget();
            }
            _ => self.unreadable += 1,
        }
    }

    /// Forgets every block (the engine was killed).
    pub fn forget(&mut self) {
        self.blocks.clear();
        self.children.clear();
    }

    /// Leading full blocks of `tokens` the engine holds.
    pub fn held_prefix(&self, tokens: &[u32], block_size: usize) -> u32 {
        let mut parent: Option<Key> = None;
        let mut n = 0;
        for block in tokens.chunks_exact(block_size) {
            match self.children.get(&(parent.clone(), block.to_vec())) {
                Some(k) => {
                    parent = Some(k.clone());
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Every held block whose ancestors are all held, as the tokens from the root through it.
    pub fn chains(&self) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for start in self.blocks.values() {
            let mut tokens = start.tokens.clone();
            let mut parent = start.parent.clone();
            let reachable = loop {
                match parent {
                    None => break true,
                    Some(p) => match self.blocks.get(&p) {
                        Some(h) => {
                            let mut t = h.tokens.clone();
                            t.extend_from_slice(&tokens);
                            tokens = t;
                            parent = h.parent.clone();
                        }
                        None => break false,
                    },
                }
            };
            if reachable {
                out.push(tokens);
            }
        }
        out.sort();
        out
    }

    /// [`EngineBlocks::chains`] that are no other chain's prefix.
    pub fn leaf_chains(&self) -> Vec<Vec<u32>> {
        let all = self.chains();
        // Sorted: a chain's extensions follow it directly.
        all.iter()
            .enumerate()
            .filter(|(i, c)| all.get(i + 1).is_none_or(|next| !next.starts_with(c)))
            .map(|(_, c)| c.clone())
            .collect()
    }

    /// Blocks held (distinct hashes).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// A thread reading one engine's KV events into [`EngineBlocks`].
#[derive(Debug)]
pub struct EventWatch {
    blocks: Arc<Mutex<EngineBlocks>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EventWatch {
    /// Subscribes to everything `endpoint` publishes (it may not be bound yet: libzmq
    /// reconnects, also to an engine restarted on the same endpoint).
    pub fn start(endpoint: &str) -> Self {
        let blocks = Arc::new(Mutex::new(EngineBlocks::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let socket = zmq::Context::new().socket(zmq::SUB).expect("a SUB socket");
        socket.set_rcvtimeo(100).expect("rcvtimeo");
        socket.set_reconnect_ivl(50).expect("reconnect interval");
        socket.connect(endpoint).expect("connects");
        socket.set_subscribe(b"").expect("subscribes");
        let thread = {
            let (blocks, stop) = (blocks.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(frames) = socket.recv_multipart(0) else {
                        continue;
                    };
                    let mut b = blocks.lock().expect("not poisoned");
                    let payload = frames.last().map(Vec::as_slice).unwrap_or_default();
                    let mut slice = payload;
                    match rmpv::decode::read_value(&mut slice) {
                        Ok(Value::Array(slots)) if slots.len() >= 2 => {
                            for event in slots[1].as_array().into_iter().flatten() {
                                b.apply(event);
                            }
                        }
                        _ => b.unreadable += 1,
                    }
                }
            })
        };
        Self {
            blocks,
            stop,
            thread: Some(thread),
        }
    }

    /// The engine's blocks as of the events read so far.
    pub fn blocks(&self) -> MutexGuard<'_, EngineBlocks> {
        self.blocks.lock().expect("not poisoned")
    }
}

impl Drop for EventWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
