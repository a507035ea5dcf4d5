//! kvroute's shared vocabulary: everything that crosses a process boundary is defined here once.
//!
//! - [`ids`]: worker, rank, request, decision and session identifiers, and the namespace;
//! - [`hashing`]: the block hashing scheme (XXH3-64, seed 1337) engines must reproduce;
//! - [`messages`]: every wire message (serde types);
//! - [`codec`]: MessagePack with named fields, a schema version and size limits;
//! - [`names`]: every NATS subject, JetStream stream, bucket and etcd key;
//! - [`config`]: NATS / etcd connection settings shared by all binaries;
//! - [`client`]: clients of the router and indexer groups (deadlines, retries);
//! - [`telemetry`]: logging setup;
//! - [`cli`]: command-line parsing conventions, and [`ops::exit`]: exit statuses and the
//!   error line, shared by every binary;
//! - [`jetstream`]: the startup check that NATS has JetStream, and creation errors.

pub mod cli;
pub mod client;
pub mod codec;
pub mod config;
pub mod discovery;
pub mod error_chain;
pub mod events_stream;
pub mod hashing;
pub mod ids;
pub mod jetstream;
pub mod lease;
pub mod messages;
pub mod names;
pub mod ops;
pub mod telemetry;
pub mod trace;
pub mod worker;

pub use codec::{DecodeError, EncodeError, WireMessage, decode, encode};
pub use ids::{DecisionId, DpRank, Namespace, RequestId, SessionId, WorkerId};
pub use names::Names;
