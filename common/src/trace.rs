//! Mooncake-format request traces (FAST'25): one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (the prompt as 512-token blocks), and
//! optionally kvroute's `session_id` and `turn` (a multi-turn conversation's requests) and
//! `lora_name` (the LoRA adapter it names).
//!
//! [`TraceRequest::tokens`] turns hash ids into deterministic token ids, so equal hash ids at
//! equal positions give equal tokens (a shared prefix) and every tool replays the same prompts.

use std::io::BufRead;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Tokens per trace hash id.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
    /// The session (conversation) the request belongs to; replays send it as the request's
    /// `SessionContext`. Absent in Mooncake's own traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The request's turn in its session, from 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// The LoRA adapter the request names (absent: the base model). Its blocks are keyed
    /// apart from the base model's and other adapters' (the adapter's hash seed), so equal
    /// hash ids under two adapters share nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
}

/// A trace line that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {detail}")]
    Parse {
        path: String,
        line: usize,
        detail: String,
    },
}

impl TraceRequest {
    /// The prompt's token ids: `input_length` tokens, 512 per hash id (the last block may be
    /// partial). Token `j` of hash id `h` is a fixed function of `(h, j)`.
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.input_length as usize);
        'outer: for &h in &self.hash_ids {
            for j in 0..TRACE_BLOCK_TOKENS as u64 {
                if out.len() == self.input_length as usize {
                    break 'outer;
                }
                out.push(token_of(h, j));
            }
        }
        out
    }
}

/// Token `j` of trace block `h`: SplitMix64 of the pair, truncated to `u32`.
pub fn token_of(hash_id: u64, j: u64) -> u32 {
    let mut z = hash_id
        .wrapping_mul(TRACE_BLOCK_TOKENS as u64)
        .wrapping_add(j)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) as u32
}

/// One trace line, as the trace files hold it (no trailing newline).
pub fn to_line(request: &TraceRequest) -> String {
    serde_json::to_string(request).expect("a trace request always serializes")
}

/// Reads a whole trace file. Blank lines are skipped; any other bad line is an error naming it.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let shown = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: shown.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: shown.clone(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let req: TraceRequest = serde_json::from_str(&line).map_err(|e| TraceError::Parse {
            path: shown.clone(),
            line: i + 1,
            detail: e.to_string(),
        })?;
        out.push(req);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_hash_ids_give_shared_tokens() {
        let a = TraceRequest {
            timestamp: 0,
            input_length: 1100,
            output_length: 1,
            hash_ids: vec![0, 1, 2],
            ..TraceRequest::default()
        };
        let b = TraceRequest {
            timestamp: 0,
            input_length: 1024,
            output_length: 1,
            hash_ids: vec![0, 1],
            ..TraceRequest::default()
        };
        let c = TraceRequest {
            timestamp: 0,
            input_length: 1024,
            output_length: 1,
            hash_ids: vec![0, 9],
            ..TraceRequest::default()
        };
        let (ta, tb, tc) = (a.tokens(), b.tokens(), c.tokens());
        assert_eq!(ta.len(), 1100);
        assert_eq!(&ta[..1024], &tb[..]);
        assert_eq!(&ta[..512], &tc[..512]);
        assert_ne!(&ta[512..1024], &tc[512..1024]);
    }

    #[test]
    fn a_row_with_an_adapter_round_trips() {
        let line = r#"{"timestamp":5,"input_length":10,"output_length":2,"hash_ids":[7],"session_id":"s","turn":1,"lora_name":"adapter-3"}"#;
        let r: TraceRequest = serde_json::from_str(line).unwrap();
        assert_eq!(r.lora_name.as_deref(), Some("adapter-3"));
        assert_eq!(to_line(&r), line);
        let plain = TraceRequest {
            lora_name: None,
            ..r
        };
        assert!(!to_line(&plain).contains("lora_name"), "absent, not null");
    }

    #[test]
    fn reads_the_shipped_traces_format() {
        let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(&p, "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\nnot json\n").unwrap();
        let err = read_trace(&p).unwrap_err().to_string();
        assert!(
            err.ends_with(&format!(
                "{}:3: expected ident at line 1 column 2",
                p.display()
            )),
            "{err}"
        );
        std::fs::write(&p, "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n").unwrap();
        let t = read_trace(&p).unwrap();
        assert_eq!(t[0].hash_ids, vec![0, 1]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn session_fields_are_optional_and_round_trip() {
        let dir = std::env::temp_dir().join(format!("kvroute-trace-s-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            concat!(
                "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n",
                "{\"timestamp\": 9, \"input_length\": 900, \"output_length\": 3, \"hash_ids\": [0, 1], ",
                "\"session_id\": \"chat-1\", \"turn\": 2}\n",
            ),
        )
        .unwrap();
        let t = read_trace(&p).unwrap();
        assert_eq!((t[0].session_id.as_deref(), t[0].turn), (None, None));
        assert_eq!(
            (t[1].session_id.as_deref(), t[1].turn),
            (Some("chat-1"), Some(2))
        );
        // Written back: a row without a session stays a plain Mooncake row.
        assert_eq!(
            to_line(&t[0]),
            r#"{"timestamp":0,"input_length":600,"output_length":3,"hash_ids":[0,1]}"#
        );
        let back: TraceRequest = serde_json::from_str(&to_line(&t[1])).unwrap();
        assert_eq!(back, t[1]);

        // A session field of the wrong type names its line.
        std::fs::write(
            &p,
            concat!(
                "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 3, \"hash_ids\": [0]}\n",
                "{\"timestamp\": 1, \"input_length\": 6, \"output_length\": 3, \"hash_ids\": [0], \"turn\": \"two\"}\n",
            ),
        )
        .unwrap();
        let err = read_trace(&p).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{}:2: invalid type: string \"two\"", p.display())),
            "{err}"
        );
        std::fs::write(
            &p,
            "{\"timestamp\": 1, \"input_length\": 6, \"output_length\": 3, \"hash_ids\": [0], \"session_id\": 7}\n",
        )
        .unwrap();
        let err = read_trace(&p).unwrap_err().to_string();
        assert!(
            err.contains(":1: invalid type: integer `7`, expected a string"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
