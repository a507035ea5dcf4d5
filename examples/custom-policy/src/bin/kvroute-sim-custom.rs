//! `kvroute-sim-custom`: `kvroute-sim` with the example's plugins registered next to the
//! built-ins, so the example's policy can be tried offline on a trace before it runs in a
//! router. Same flags as `kvroute-sim`; like it, it refuses a `request_classifier`.

use std::process::ExitCode;

use kvroute_common::ops::exit;
use kvroute_router::registry::RouterPluginRegistry;

const BIN: &str = "kvroute-sim-custom";

fn main() -> ExitCode {
    let mut registry = RouterPluginRegistry::with_builtins();
    if let Err(e) = kvroute_example_custom_policy::register(&mut registry) {
        exit::report(BIN, &e.to_string());
        return exit::Status::Failed.into();
    }
    kvroute_lab::sim::main_with(registry, BIN)
}
