//! `kvroute-router`: parses the configuration, sets up logging, resolves the policies (a bad
//! configuration exits with status 2 and a line naming it), runs until SIGTERM or Ctrl-C.

use kvroute_router::registry::RouterPluginRegistry;

fn main() -> std::process::ExitCode {
    kvroute_router::service::main_with(RouterPluginRegistry::with_builtins(), "kvroute-router")
}
