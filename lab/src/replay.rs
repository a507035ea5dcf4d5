//! Trace replay. The pure pieces: the oracle bounds of a trace's prefix-cache hit rate, summary
//! statistics, the run report and its table and chart. The shell (`kvroute-replay`): the plan
//! of arrivals, the selectors (routers over NATS, or in-process), the driver that sends each
//! request through a selector to its worker (or streams it through a kvroute-gateway), and the
//! run over every mode.

pub mod chart;
pub mod config;
pub mod driver;
pub mod gateway;
pub mod local;
pub mod oracle;
pub mod plan;
pub mod progress;
pub mod report;
pub mod run;
pub mod selector;
pub mod sessions;
pub mod stats;
pub mod table;
pub mod workers;

pub use chart::{ChartError, DEFAULT_FONT, write_chart};
pub use config::{Mode, OutputArgs, ReplayArgs, SelectorKind};
pub use driver::{DriveSettings, Tally, drive};
pub use gateway::{GatewayTarget, drive_gateway, prefix_cache_counters};
pub use local::LocalSelector;
pub use oracle::{
    InfiniteOracle, LruOracle, OracleHitRates, oracle_hit_rates, oracle_with_hits, ttft_floor,
};
pub use plan::Plan;
pub use progress::Progress;
pub use report::{
    DisaggregationReport, ModeRecorder, ModeReport, RequestSample, RunReport, TooManyErrors,
};
pub use run::{emit, run, run_until};
pub use selector::{RouterSelector, SelectCallFailure, Selector};
pub use sessions::{SessionKeys, SessionOracle, SessionReport, session_context, session_oracle};
pub use stats::{Summary, coefficient_of_variation, percentile};
pub use table::render_table;
