//! A minimal HTTP/1.0 GET for readiness probes and metrics, so the harness needs no HTTP stack.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// `GET http://127.0.0.1:<port><path>`: the status code and body, or `None` if unreachable.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// The value of sample `name` (exactly, labels included, as rendered) at the process's
/// `/metrics` on `port`; 0 when the sample or the process is absent (counters start at 0).
pub fn metric_sample(port: u16, name: &str) -> f64 {
    let Some((_, body)) = http_get(port, "/metrics") else {
        return 0.0;
    };
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().ok())?
        })
        .unwrap_or(0.0)
}
