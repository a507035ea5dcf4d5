//! `kvroute-replay`: replays a Mooncake trace through kvroute once per routing mode and
//! reports hit rates against the oracles (see `kvroute_mocker::replay`). Errors end it with
//! one line and a status of kvroute's exit table (`kvroute_common::ops::exit`).

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_mocker::replay::{ReplayArgs, emit, run};

fn main() -> ExitCode {
    exit::run("kvroute-replay", |args: ReplayArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        let report = exit::block_on_value(run(&args))?;
        emit(&report, &args.output)
    })
}
