//! `kvroute-router-custom`: the standard router binary with `sticky-until-busy` registered
//! next to the built-ins — how a deployment links its own policy catalog. Same flags as
//! `kvroute-router`; select the policy through `--policy-config` YAML or a selection flag.

use kvroute_router::registry::PolicyRegistry;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut registry = PolicyRegistry::with_builtins();
    kvroute_example_custom_policy::register(&mut registry)?;
    kvroute_router::service::main_with(registry, "kvroute-router-custom").await
}
