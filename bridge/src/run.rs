//! The process: connect, start every engine's relay and supervisor, serve /metrics, stop on a
//! signal. (In progress.)

use crate::config::{BridgeArgs, EngineSpec};

/// Runs the bridge until `shutdown` resolves.
pub async fn run(
    args: BridgeArgs,
    engines: Vec<EngineSpec>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let _ = (args, engines);
    shutdown.await;
    Ok(())
}
