//! `kvroute-router-custom`: the standard router binary with `sticky-until-busy` registered
//! next to the built-ins — how a deployment links its own policy catalog. Same flags as
//! `kvroute-router`; select the policy through `--policy-config` YAML or a selection flag.

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_router::registry::RouterPluginRegistry;

const BIN: &str = "kvroute-router-custom";

fn main() -> ExitCode {
    let mut registry = RouterPluginRegistry::with_builtins();
    if let Err(e) = kvroute_example_custom_policy::register(&mut registry) {
        exit::report(BIN, &e.to_string());
        return exit::Status::Failed.into();
    }
    kvroute_router::service::main_with(registry, BIN)
}
