//! `kvroute-gateway`: the OpenAI-compatible front door and HTTP selection API (see
//! `kvroute_gateway`). Errors end it with one line and a status of kvroute's exit table.

use std::process::ExitCode;

use kvroute_common::ops::{exit, shutdown_signal};
use kvroute_gateway::GatewayArgs;

fn main() -> ExitCode {
    exit::run("kvroute-gateway", |args: GatewayArgs, origins| {
        kvroute_common::telemetry::init(&args.telemetry);
        let (models, keys) =
            kvroute_gateway::run::prepare(&args).map_err(|e| origins.attribute(e))?;
        exit::block_on(kvroute_gateway::run::run(
            args,
            models,
            keys,
            shutdown_signal(),
        ))
    })
}
