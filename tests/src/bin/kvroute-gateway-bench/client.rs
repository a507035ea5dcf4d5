//! The bench's HTTP client: one request, timed to its first body byte and to its end, and
//! checked — a whole answer must carry `usage`; a streamed one must hold exactly the events the
//! engine sends, end with `data: [DONE]` and carry no error event.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;

/// What a request's answer must be.
#[derive(Debug, Clone, Copy)]
pub enum Expect {
    Whole,
    /// `data:` events in the stream.
    Stream {
        events: usize,
    },
}

/// One timed request.
#[derive(Debug, Clone, Copy)]
pub struct Call {
    /// To the first body bytes (a stream's first token).
    pub first: Duration,
    pub total: Duration,
    /// The gateway's `x-kvroute-overlap-blocks`, when it answered.
    pub overlap: Option<u32>,
}

/// The client the bench uses for one target.
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(120))
        .timeout(Duration::from_secs(30))
        .build()?)
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

/// POSTs `body` to `url` and reads the whole answer.
pub async fn call(
    http: &reqwest::Client,
    url: &str,
    body: Bytes,
    expect: Expect,
) -> anyhow::Result<Call> {
    let start = Instant::now();
    let mut answer = http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = answer.status();
    let overlap = answer
        .headers()
        .get("x-kvroute-overlap-blocks")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut first = None;
    let mut got = Vec::new();
    while let Some(chunk) = answer.chunk().await.context("reading the answer")? {
        first.get_or_insert_with(|| start.elapsed());
        got.extend_from_slice(&chunk);
    }
    let total = start.elapsed();
    if !status.is_success() {
        bail!("{url}: {status}: {}", String::from_utf8_lossy(&got));
    }
    match expect {
        Expect::Whole => {
            if count(&got, b"\"usage\"") != 1 {
                bail!("{url}: no usage in {}", String::from_utf8_lossy(&got));
            }
        }
        Expect::Stream { events } => {
            let n = count(&got, b"data:");
            if n != events || !got.ends_with(b"data: [DONE]\n\n") || count(&got, b"\"error\"") > 0 {
                bail!(
                    "{url}: a stream of {n} events (expected {events} ending with [DONE]): {}",
                    String::from_utf8_lossy(&got[got.len().saturating_sub(600)..])
                );
            }
        }
    }
    Ok(Call {
        first: first.unwrap_or(total),
        total,
        overlap,
    })
}
