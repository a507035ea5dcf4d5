//! `kvroute-bridge`: the sidecar that makes vLLM / SGLang engines kvroute workers (see
//! `kvroute_bridge`). Errors end it with one line and a status of kvroute's exit table.

use std::process::ExitCode;

use kvroute_bridge::BridgeArgs;
use kvroute_common::ops::{exit, shutdown_signal};

fn main() -> ExitCode {
    exit::run("kvroute-bridge", |args: BridgeArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        let engines = args.engines().map_err(|e| origins.attribute(e))?;
        exit::block_on(kvroute_bridge::run::run(args, engines, shutdown_signal()))
    })
}
