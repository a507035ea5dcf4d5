//! The `kvroute-sim` command line, shared with binaries that link their own policy catalog
//! (such as the custom-policy example's `kvroute-sim-custom`).

use std::process::ExitCode;

use clap::CommandFactory;
use kvroute_common::ops::exit;
use kvroute_router::registry::RouterPluginRegistry;

use super::{SimArgs, load_policies, run_with};
use crate::replay::emit;

/// Parses the command line, simulates with `registry`'s policy types and prints the report;
/// `name` is the binary's, for `--help` and messages. A bad policy file is a bad
/// configuration (exit 2).
pub fn main_with(registry: RouterPluginRegistry, name: &'static str) -> ExitCode {
    let types = registry.types().collect::<Vec<_>>().join(", ");
    let command = SimArgs::command()
        .name(name)
        .bin_name(name)
        .after_help(format!("Policy types (for --policy-config): {types}"));
    exit::run_command(name, command, |args: SimArgs, origins| {
        kvroute_common::telemetry::init_tool(&args.telemetry);
        args.validate().map_err(|e| origins.attribute(e))?;
        load_policies(&args, &registry, name)
            .map_err(|e| exit::with_status(exit::Status::BadConfig, e))?;
        emit(&run_with(&args, &registry)?, &args.output)
    })
}
