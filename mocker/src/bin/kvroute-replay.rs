//! `kvroute-replay`: replays a Mooncake trace through kvroute once per routing mode and
//! reports hit rates against the oracles (see `kvroute_mocker::replay`). Errors end it with
//! one line and a status of kvroute's exit table (`kvroute_common::ops::exit`); a run whose
//! mode failed more than `--max-error-fraction` of its requests exits 3 after its report.

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_mocker::replay::{ReplayArgs, emit, run};

fn main() -> ExitCode {
    exit::run("kvroute-replay", |args: ReplayArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        let report = exit::block_on_value(run(&args))?;
        emit(&report, &args.output)?;
        // The report is out; a run with too many failed requests still fails.
        report
            .check_errors(args.max_error_fraction)
            .map_err(|e| exit::with_status(exit::Status::Threshold, e))
    })
}
