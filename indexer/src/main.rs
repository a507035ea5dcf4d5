//! `kvroute-indexer`: parses the configuration, sets up logging, runs the replica until
//! SIGTERM or Ctrl-C. Errors end it with one line and a status of kvroute's exit table
//! (`kvroute_common::ops::exit`).

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_indexer::config::IndexerConfig;

fn main() -> ExitCode {
    exit::run("kvroute-indexer", |config: IndexerConfig, origins| {
        kvroute_common::telemetry::init(&config.telemetry);
        config.validate().map_err(|e| origins.attribute(e))?;
        exit::block_on(kvroute_indexer::service::run(
            config,
            kvroute_common::ops::shutdown_signal(),
        ))
    })
}
