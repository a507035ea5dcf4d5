//! `kvroute-sim`: simulates a Mooncake trace offline through the mocker's engines, the
//! indexer's index and the router's policies, once per routing mode, and reports what
//! `kvroute-replay` reports (see `kvroute_mocker::sim`).

use std::process::ExitCode;

use clap::Parser;
use kvroute_mocker::replay::emit;
use kvroute_mocker::sim::{SimArgs, run};

fn main() -> ExitCode {
    let args = SimArgs::parse();
    kvroute_common::telemetry::init(&args.telemetry);
    if let Err(e) = args.validate() {
        eprintln!("kvroute-sim: {e}");
        return ExitCode::from(2);
    }
    match run(&args).and_then(|report| emit(&report, &args.output)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}
