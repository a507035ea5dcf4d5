//! `kvroute-replay`: replays a Mooncake trace through kvroute once per routing mode and
//! reports hit rates against the oracles (see `kvroute_mocker::replay`). Exits 3 when a mode
//! failed more than `--max-error-fraction` of its requests (after printing the report).

use std::process::ExitCode;

use clap::Parser;
use kvroute_mocker::replay::{ReplayArgs, emit, run};

fn main() -> ExitCode {
    let args = ReplayArgs::parse();
    kvroute_common::telemetry::init(&args.telemetry);
    if let Err(e) = args.validate() {
        eprintln!("kvroute-replay: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-replay: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime
        .block_on(run(&args))
        .and_then(|report| emit(&report, &args.output).map(|()| report));
    match result {
        // The report is out; a run with too many failed requests still fails (exit code 3).
        Ok(report) => match report.check_errors(args.max_error_fraction) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvroute-replay: {e}");
                ExitCode::from(3)
            }
        },
        Err(e) => {
            eprintln!("kvroute-replay: {e:#}");
            ExitCode::FAILURE
        }
    }
}
