//! `kvroute-indexer`: parses the configuration, sets up logging, runs the replica until
//! SIGTERM or Ctrl-C.

use clap::Parser;
use kvroute_indexer::config::IndexerConfig;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = IndexerConfig::parse();
    kvroute_common::telemetry::init(&config.telemetry);
    if let Err(e) = config.validate() {
        eprintln!("kvroute-indexer: {e}");
        std::process::exit(2);
    }
    kvroute_indexer::service::run(config, kvroute_common::ops::shutdown_signal()).await
}
