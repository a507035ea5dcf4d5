//! `kvroute-gateway`: kvroute as an HTTP front door. Applications send OpenAI requests
//! (`/v1/completions`, `/v1/chat/completions`); the gateway tokenizes them with the model's own
//! tokenizer and chat template (so the hashed tokens are those the engine caches), asks kvroute's
//! routers which worker holds the prompt's prefix, forwards the request to that worker's HTTP
//! API (its card's `http_url`, set by kvroute-bridge) and streams the answer back, publishing the
//! request's lifecycle so every router's load view follows it. Gateways that forward requests
//! themselves use the selection API (`/v1/select`, reservations) instead.
//!
//! Code map: `config` (flags), `run` (the process), `serve` (connections and their limits; `serve/socket.rs` their timeouts), `http` (routes,
//! auth, limits), `openai`
//! (reading requests), `models` (tokenizing), `proxy` (select → forward → retry), `relay` (a
//! request in flight: streaming, lifecycle, metrics, access log), `select_api` and
//! `reservations` (the selection API), `directory` (workers from etcd), `tokenize_gate`, `lifecycle`, `metrics`,
//! `error` (OpenAI error shapes), `request_id`.

pub mod app;
pub mod config;
pub mod directory;
pub mod error;
pub mod handoff;
pub mod http;
pub mod lifecycle;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod proxy;
pub mod relay;
pub mod request_id;
pub mod reservations;
pub mod run;
pub mod select_api;
pub mod serve;
pub mod tokenize_gate;

pub use config::GatewayArgs;
