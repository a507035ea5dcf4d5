//! The `kvroute-sim` command line, shared with binaries that link their own policy catalog
//! (such as the custom-policy example's `kvroute-sim-custom`).

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use kvroute_router::registry::PolicyRegistry;

use super::{SimArgs, run_with};
use crate::replay::emit;

/// Parses the command line, simulates with `registry`'s policy types and prints the report;
/// `name` is the binary's, for `--help` and messages.
pub fn main_with(registry: PolicyRegistry, name: &str) -> ExitCode {
    let types = registry.types().collect::<Vec<_>>().join(", ");
    let command = SimArgs::command()
        .bin_name(name.to_owned())
        .after_help(format!("Policy types (for --policy-config): {types}"));
    let args = match SimArgs::from_arg_matches(&command.get_matches()) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    kvroute_common::telemetry::init(&args.telemetry);
    if let Err(e) = args.validate() {
        eprintln!("{name}: {e}");
        return ExitCode::from(2);
    }
    match run_with(&args, &registry).and_then(|report| emit(&report, &args.output)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
