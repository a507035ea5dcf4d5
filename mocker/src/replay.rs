//! Pure pieces of trace replay: the oracle bounds of a trace's prefix-cache hit rate, summary
//! statistics and the run report. The replay tool drives workers and routers and feeds these.

pub mod oracle;
pub mod report;
pub mod stats;

pub use oracle::{InfiniteOracle, LruOracle, OracleHitRates, oracle_hit_rates};
pub use report::{ModeRecorder, ModeReport, RequestSample, RunReport};
pub use stats::{Summary, coefficient_of_variation, percentile};
