//! `kvroute-replay`: replays a Mooncake trace through kvroute once per routing mode and
//! reports hit rates against the oracles (see `kvroute_lab::replay`). Errors end it with
//! one line and a status of kvroute's exit table (`kvroute_common::ops::exit`); a run whose
//! mode failed more than `--max-error-fraction` of its requests exits 3 after its report.
//!
//! SIGTERM or Ctrl-C stops the run early: no more requests are sent, those sent are waited for,
//! and the report covers what ran (the rest counted as not sent). A second signal ends the
//! process at once (status 130).

use std::process::ExitCode;

use kvroute_common::ops::{exit, shutdown_signal};
use kvroute_lab::replay::{ReplayArgs, emit, run_until};
use tokio::sync::watch;

fn main() -> ExitCode {
    exit::run("kvroute-replay", |args: ReplayArgs, origins| {
        kvroute_common::telemetry::init_tool(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        let report = exit::block_on_value(async {
            let (stop_tx, stop) = watch::channel(false);
            tokio::spawn(async move {
                shutdown_signal().await;
                tracing::warn!("stopping: no more requests are sent; waiting for those sent");
                let _ = stop_tx.send(true);
                shutdown_signal().await;
                std::process::exit(130);
            });
            run_until(&args, stop).await
        })?;
        emit(&report, &args.output)?;
        // The report is out; a run with too many failed requests still fails.
        report
            .check_errors(args.max_error_fraction)
            .map_err(|e| exit::with_status(exit::Status::Threshold, e))
    })
}
