//! `kvroute-sim`: simulates a Mooncake trace offline through the mocker's engines, the
//! indexer's index and the router's policies, once per routing mode, and reports what
//! `kvroute-replay` reports (see `kvroute_mocker::sim`). Errors end it with one line and a
//! status of kvroute's exit table (`kvroute_common::ops::exit`): a bad policy file is a bad
//! configuration (2), as for the router.

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_mocker::replay::emit;
use kvroute_mocker::sim::{SimArgs, load_policies, run};

fn main() -> ExitCode {
    exit::run("kvroute-sim", |args: SimArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        load_policies(&args).map_err(|e| exit::with_status(exit::Status::BadConfig, e))?;
        emit(&run(&args)?, &args.output)
    })
}
