//! The vLLM / SGLang engines' wire vocabulary, in one place for both sides that speak it: the
//! bridge, which decodes real engines' KV events (`kvroute-bridge`), and the mocker's engine
//! face, which impersonates those engines (`kvroute-mocker --engine-api vllm|sglang`).
//!
//! - [`events`]: the ZMQ event batches' keys, the event tags, field names and, per engine, the
//!   slot order of the positional (array) form;
//! - [`media`]: the engines' `medium` strings and `locality`, and the storage tier each means;
//! - [`extra_keys`]: the canonical encoding of a block's extra keys (PROTOCOL.md, "Extra
//!   keys"), a cache salt's and lookahead tokens' included.
//!
//! Only names and encodings live here: the decoder (bridge/src/wire.rs) and the writer
//! (mocker/src/engine_face/wire.rs) stay with their users.

pub mod events;
pub mod extra_keys;
pub mod media;

use serde::Deserialize;

/// Which engine's wire formats and HTTP API to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
