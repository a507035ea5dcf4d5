//! What every request handler shares.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_common::client::SelectClient;

use crate::directory::Directory;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::reservations::Reservations;
use crate::tokenize_gate::TokenizeGate;

/// Settings the handlers read.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_body_bytes: usize,
    /// For the whole request body, once the head arrived.
    pub body_read_timeout: Duration,
    /// The request line and headers, in bytes (beyond: 431).
    pub max_header_bytes: usize,
    pub max_prompt_tokens: usize,
    /// For the worker's response headers.
    pub response_timeout: Duration,
    /// For each next piece of the worker's body.
    pub upstream_idle_timeout: Duration,
    pub forward_token_ids: bool,
    pub retry_after_secs: u64,
    pub access_log: bool,
}

/// The gateway's shared state.
#[derive(Debug)]
pub struct App {
    pub settings: Settings,
    pub models: Models,
    pub directory: Directory,
    pub select: SelectClient,
    /// To the engines.
    pub http: reqwest::Client,
    pub lifecycle: Lifecycle,
    pub metrics: Arc<Metrics>,
    pub reservations: Mutex<Reservations>,
    /// `None`: no authentication.
    pub api_keys: Option<HashSet<String>>,
    pub nats: async_nats::Client,
    pub tokenize_gate: TokenizeGate,
    /// `--lora-adapter`: each adapter's base model.
    pub adapter_bases: std::collections::HashMap<String, String>,
}

impl App {
    /// The longest prompt accepted for `model`: `--max-prompt-tokens`, or less when the model's
    /// folder declares a shorter context.
    pub fn prompt_limit(&self, model: &str) -> usize {
        let ceiling = self.settings.max_prompt_tokens;
        self.models
            .context_length(model)
            .map_or(ceiling, |n| n.min(ceiling))
    }

    /// A request for `model`: the model whose workers serve it, and the LoRA adapter it names
    /// when `model` is one of `--lora-adapter`'s (else `None`).
    pub fn resolve_model(&self, model: &str) -> (String, Option<String>) {
        match self.adapter_bases.get(model) {
            Some(base) => (base.clone(), Some(model.to_owned())),
            None => (model.to_owned(), None),
        }
    }

    /// Whether the gateway can route: NATS connected and the worker cards read.
    pub fn ready(&self) -> Result<(), &'static str> {
        if self.nats.connection_state() != async_nats::connection::State::Connected {
            return Err("not connected to NATS");
        }
        if !self.directory.loaded() {
            return Err("worker cards not read from etcd yet");
        }
        Ok(())
    }
}

/// The HTTP client to the engines: no overall timeout (streams last as long as generation;
/// the proxy times the headers and each piece of the body itself), a connect timeout, no proxy
/// from the environment, TCP_NODELAY.
pub fn engine_client(connect_timeout: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
}
