//! `kvroute-mocker`: a fleet of simulated inference workers (see `kvroute_mocker::fleet`).

use std::process::ExitCode;

use clap::Parser;
use kvroute_mocker::fleet::{MockerArgs, run};

fn main() -> ExitCode {
    let args = MockerArgs::parse();
    kvroute_common::telemetry::init(&args.telemetry);
    if let Err(e) = args.validate() {
        eprintln!("kvroute-mocker: {e}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute-mocker: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args, shutdown_signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-mocker: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
