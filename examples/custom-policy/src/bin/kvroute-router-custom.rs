//! `kvroute-router-custom`: the standard router binary with the example's plugins
//! (`sticky-until-busy`, `session-serial`) registered next to the built-ins — how a deployment
//! links its own catalog. Same flags as `kvroute-router`; select the plugins through
//! `--policy-config` YAML (the policy also through a selection flag).

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
