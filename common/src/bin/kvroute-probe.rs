//! `kvroute-probe URL [--print]`: one HTTP GET over plain TCP; exits 0 when the answer is 200.
//! Container health checks use it, since kvroute's images (`FROM scratch`) have no shell or curl.
//! Standard library only (and kvroute's exit statuses), so the binary stays small.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

use kvroute_common::ops::exit::{Status, report};

const BIN: &str = "kvroute-probe";

const TIMEOUT: Duration = Duration::from_secs(3);
const MAX_RESPONSE: u64 = 4 * 1024 * 1024;

const USAGE: &str = "usage: kvroute-probe http://HOST:PORT/PATH [--print]
  GET the URL; exit 0 on status 200, 1 otherwise (2: bad usage).
  --print    write the response body to stdout
  --version  print the version";

fn main() -> ExitCode {
    let mut url = None;
    let mut print = false;
    let usage = |problem: &str| {
        report(
            BIN,
            &format!("{problem} (usage: kvroute-probe http://HOST:PORT/PATH [--print])"),
        );
        Status::BadConfig.into()
    };
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--print" => print = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "-V" | "--version" => {
                println!("{BIN} {}", env!("CARGO_PKG_VERSION"));
                return ExitCode::SUCCESS;
            }
            _ if url.is_none() => url = Some(arg),
            _ => return usage(&format!("unexpected argument {arg:?}")),
        }
    }
    let Some(url) = url else {
        return usage("no URL given");
    };
    let Some((host, path)) = split_url(&url) else {
        return usage(&format!("{url:?} is not http://host:port/path"));
    };
    match get(host, path) {
        Ok((status, body)) => {
            if print {
                print!("{body}");
            }
            if status == 200 {
                ExitCode::SUCCESS
            } else {
                report(BIN, &format!("{url}: status {status}"));
                Status::Failed.into()
            }
        }
        Err(e) => {
            report(BIN, &format!("{url}: {e}"));
            Status::Failed.into()
        }
    }
}

/// `http://host:port/path?query` → (`host:port`, `/path?query`).
fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("http://")?;
    let (host, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    (!host.is_empty()).then_some((host, path))
}

fn get(host: &str, path: &str) -> std::io::Result<(u16, String)> {
    let addr_host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:80")
    };
    let addr = addr_host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("host resolves to no address"))?;
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: kvroute-probe\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.take(MAX_RESPONSE).read_to_end(&mut raw)?;
    let split = find(&raw, b"\r\n\r\n").unwrap_or(raw.len());
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = raw.get(split + 4..).unwrap_or_default();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("no HTTP status line"))?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Joins a chunked body (Go's HTTP servers, NATS's monitoring port among them, may chunk).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = find(body, b"\r\n") {
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok());
        let rest = &body[line_end + 2..];
        let Some(size) = size.filter(|&n| n > 0 && n <= rest.len()) else {
            break;
        };
        out.extend_from_slice(&rest[..size]);
        body = rest[size..].strip_prefix(b"\r\n").unwrap_or(&rest[size..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_and_path() {
        assert_eq!(
            split_url("http://nats-1:8222/healthz?js-enabled-only=true"),
            Some(("nats-1:8222", "/healthz?js-enabled-only=true"))
        );
        assert_eq!(
            split_url("http://127.0.0.1:9100"),
            Some(("127.0.0.1:9100", "/"))
        );
        assert_eq!(split_url("https://x:1/"), None);
        assert_eq!(split_url("http:///x"), None);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk(b"4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n"),
            b"{\"a\":1}"
        );
    }
}
