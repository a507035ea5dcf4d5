//! `kvroute-sim`: simulates a Mooncake trace offline through the mocker's engines, the
//! indexer's index and the router's policies, once per routing mode, and reports what
//! `kvroute-replay` reports (see `kvroute_lab::sim`). Errors end it with one line and a
//! status of kvroute's exit table (`kvroute_common::ops::exit`).

use std::process::ExitCode;

use kvroute_router::registry::RouterPluginRegistry;

fn main() -> ExitCode {
    kvroute_lab::sim::main_with(RouterPluginRegistry::with_builtins(), "kvroute-sim")
}
