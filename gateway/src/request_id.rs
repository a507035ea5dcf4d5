//! `x-request-id`: accepted from the client or assigned, echoed in the answer, sent to the
//! engine, and turned into kvroute's request id (a UUID) — the header itself when it is one,
//! else a UUID derived from it (XXH3-128, version 8), so a client that retries through another
//! gateway replica with the same header gets the same decision.

use axum::http::HeaderMap;
use kvroute_common::RequestId;
use uuid::Uuid;

pub const HEADER: &str = "x-request-id";
/// The longest `x-request-id` taken as given; longer ones are replaced.
const MAX_LEN: usize = 256;

/// A request's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestIds {
    /// What goes back in `x-request-id` and to the engine.
    pub header: String,
    /// kvroute's request id (selections, decisions, lifecycle events).
    pub kvroute: RequestId,
}

impl RequestIds {
    /// From the client's header, or new ids (`new` is the id to assign when there is none).
    pub fn from_headers(headers: &HeaderMap, new: Uuid) -> Self {
        let given = headers
            .get(HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.len() <= MAX_LEN && v.bytes().all(is_visible));
        match given {
            Some(h) => Self {
                header: h.to_owned(),
                kvroute: derive(h),
            },
            None => Self {
                header: new.to_string(),
                kvroute: new,
            },
        }
    }

    /// The id of a retry on another worker: a different kvroute request (the first one's
    /// decision stays with the worker that failed), the same header.
    pub fn retry(&self, attempt: u32) -> RequestId {
        derive(&format!("{}#retry{attempt}", self.header))
    }
}

fn is_visible(b: u8) -> bool {
    (0x21..0x7f).contains(&b)
}

/// The header as a UUID, or a UUID derived from it.
pub fn derive(header: &str) -> RequestId {
    if let Ok(id) = Uuid::parse_str(header) {
        return id;
    }
    let hash = xxhash_rust::xxh3::xxh3_128(header.as_bytes());
    uuid::Builder::from_custom_bytes(hash.to_be_bytes()).into_uuid()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HEADER, v.parse().expect("header"));
        h
    }

    #[test]
    fn a_uuid_header_is_the_request_id() {
        let id = Uuid::new_v4();
        let ids = RequestIds::from_headers(&headers(&id.to_string()), Uuid::nil());
        assert_eq!(ids.kvroute, id);
        assert_eq!(ids.header, id.to_string());
    }

    #[test]
    fn other_headers_derive_a_stable_uuid() {
        let a = RequestIds::from_headers(&headers("job-17"), Uuid::new_v4());
        let b = RequestIds::from_headers(&headers("job-17"), Uuid::new_v4());
        let c = RequestIds::from_headers(&headers("job-18"), Uuid::new_v4());
        assert_eq!(a.kvroute, b.kvroute);
        assert_ne!(a.kvroute, c.kvroute);
        assert_eq!(a.header, "job-17");
        assert_ne!(a.retry(1), a.kvroute);
        assert_eq!(a.retry(1), b.retry(1));
    }

    #[test]
    fn no_or_unusable_header_assigns_one() {
        let new = Uuid::new_v4();
        let ids = RequestIds::from_headers(&HeaderMap::new(), new);
        assert_eq!(ids.kvroute, new);
        let long = "x".repeat(300);
        assert_eq!(
            RequestIds::from_headers(&headers(&long), new).header,
            new.to_string()
        );
    }
}
