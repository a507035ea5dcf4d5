//! Multi-turn session traces (`kvroute-tracegen`): seeded, deterministic Mooncake-format traces
//! of chat sessions whose turns resend the whole conversation, so sessions, affinity and
//! bursts can be measured without a private trace.

pub mod config;
pub mod generate;
pub mod range;

pub use config::{SessionTraceParams, TracegenArgs};
pub use generate::{generate, write_trace};
pub use range::TokenRange;
