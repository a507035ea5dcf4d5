//! `kvroute-mocker`: a fleet of simulated inference workers (see `kvroute_mocker::fleet`).
//! Errors end it with one line and a status of kvroute's exit table
//! (`kvroute_common::ops::exit`).

use std::process::ExitCode;

use kvroute_common::ops::{exit, shutdown_signal};
use kvroute_mocker::fleet::{MockerArgs, run};

fn main() -> ExitCode {
    exit::run("kvroute-mocker", |args: MockerArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        exit::block_on(run(args, shutdown_signal()))
    })
}
