//! An engine the test plays itself: raw HTTP/1.1 on a loopback socket, so a test can make it
//! answer, fail, crash mid-stream, freeze or notice its client leaving, and can read every
//! request it got (head and body). Register it under a card with [`crate::http_card`].

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the played engine does with each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Play {
    /// A whole completions answer (one token, with usage), as vLLM sends one.
    Answer,
    /// Answers the headers and one event, then closes the connection (a crash).
    DieAfterFirstChunk,
    /// Streams an event every 20 ms for up to 20 s; notes when the client went away.
    StreamSlowly,
    /// Answers 500 with an error body.
    Fail500,
    /// Reads the request, then sends nothing until the client closes (noted).
    FreezeBeforeHeaders,
    /// Answers the headers and one event, then sends nothing until the client closes (noted).
    FreezeAfterFirstChunk,
    /// Answers the headers of a whole answer and half its body, then sends nothing until the
    /// client closes (noted).
    FreezeMidAnswer,
    /// Streams two tokens and the last event (`finish_reason` set), then sends nothing (no
    /// `data: [DONE]`) until the client closes (noted).
    FinishWithoutDone,
}

/// A request as the engine received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The request line and headers, header names lowercased.
    pub head: String,
    pub body: Vec<u8>,
}

impl Received {
    /// The value of header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim().eq_ignore_ascii_case(name)).then(|| v.trim())
        })
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// A played engine on a free port.
#[derive(Debug)]
pub struct PlayedEngine {
    pub url: String,
    pub requests: Arc<AtomicU32>,
    /// Set when a client connection closed under a stream.
    pub gone: Arc<AtomicBool>,
    pub received: Arc<Mutex<Vec<Received>>>,
}

/// Starts a played engine.
pub async fn play(mode: Play) -> PlayedEngine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = PlayedEngine {
        url: format!("http://{}", listener.local_addr().unwrap()),
        requests: Arc::new(AtomicU32::new(0)),
        gone: Arc::new(AtomicBool::new(false)),
        received: Arc::new(Mutex::new(Vec::new())),
    };
    let (r, g, got) = (
        engine.requests.clone(),
        engine.gone.clone(),
        engine.received.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let (r, g, got) = (r.clone(), g.clone(), got.clone());
            tokio::spawn(async move {
                let Some(request) = read_request(&mut socket).await else {
                    return;
                };
                got.lock().unwrap().push(request);
                r.fetch_add(1, Ordering::SeqCst);
                serve(mode, &mut socket, &g).await;
            });
        }
    });
    engine
}

async fn serve(mode: Play, socket: &mut TcpStream, gone: &AtomicBool) {
    let whole = |status: &str, body: &str| {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let answer = json!({"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    .to_string();
    match mode {
        Play::Answer => {
            let _ = socket.write_all(whole("200 OK", &answer).as_bytes()).await;
            return;
        }
        Play::Fail500 => {
            let body = json!({"error": {"message": "played failure", "type": "internal_error"}});
            let text = whole("500 Internal Server Error", &body.to_string());
            let _ = socket.write_all(text.as_bytes()).await;
            return;
        }
        Play::FreezeBeforeHeaders => return hold(socket, gone).await,
        Play::FreezeMidAnswer => {
            let text = whole("200 OK", &answer);
            let cut = text.len() - answer.len() / 2;
            if socket.write_all(&text.as_bytes()[..cut]).await.is_ok() {
                hold(socket, gone).await;
            }
            return;
        }
        _ => {}
    }
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    if socket.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    let event = |i: u32| {
        let data = format!(
            "data: {}\n\n",
            json!({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": format!("t{i} "), "finish_reason": null}]})
        );
        format!("{:x}\r\n{data}\r\n", data.len())
    };
    match mode {
        Play::DieAfterFirstChunk => {
            // Dropped without the last chunk: the connection breaks mid-body.
            let _ = socket.write_all(event(0).as_bytes()).await;
        }
        Play::StreamSlowly => {
            for i in 0..1000 {
                if socket.write_all(event(i).as_bytes()).await.is_err()
                    || socket.flush().await.is_err()
                {
                    gone.store(true, Ordering::SeqCst);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Play::FreezeAfterFirstChunk => {
            if socket.write_all(event(0).as_bytes()).await.is_ok() {
                hold(socket, gone).await;
            }
        }
        Play::FinishWithoutDone => {
            let last = format!(
                "data: {}\n\n",
                json!({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": "t2", "finish_reason": "length"}]})
            );
            let last = format!("{:x}\r\n{last}\r\n", last.len());
            let all = format!("{}{}{last}", event(0), event(1));
            if socket.write_all(all.as_bytes()).await.is_ok() {
                hold(socket, gone).await;
            }
        }
        Play::Answer | Play::Fail500 | Play::FreezeBeforeHeaders | Play::FreezeMidAnswer => {
            unreachable!("answered above")
        }
    }
}

/// Sends nothing more; returns (noting it) when the client closes the connection.
async fn hold(socket: &mut TcpStream, gone: &AtomicBool) {
    let mut buf = [0u8; 256];
    loop {
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => {
                gone.store(true, Ordering::SeqCst);
                return;
            }
            Ok(_) => {}
        }
    }
}

/// Reads one request (headers, then `content-length` bytes of body).
async fn read_request(socket: &mut TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = socket.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(Received {
                head,
                body: buf[end + 4..end + 4 + len].to_vec(),
            });
        }
    }
}
