//! kvroute's evaluation lab: what measures the product rather than being part of it.
//!
//! [`replay`] sends a trace through the live system (routers over NATS, or an in-process
//! selector) and reports hit rates against the oracles; [`sim`] runs the same trace offline on
//! simulated time through the mocker's engines (`kvroute_mocker`), the indexer's index and the
//! router's policies; [`tracegen`] writes the multi-turn session traces both read.

pub mod replay;
pub mod sim;
pub mod tracegen;
