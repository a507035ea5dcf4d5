//! Where the replay gets its worker choices: the [`Selector`] boundary, with the real
//! implementation (kvroute routers over NATS) here and an in-process one in `local.rs`.

use std::future::Future;

use kvroute_common::Names;
use kvroute_common::client::{RetryPolicy, SelectClient};
pub use kvroute_common::client::{SelectCallFailure, Selected};
use kvroute_common::messages::{SelectReply, SelectRequest, WorkerCard};

/// Chooses a worker for each request. Implementations are shared by every request task.
pub trait Selector: Send + Sync + 'static {
    fn select(
        &self,
        request: SelectRequest,
    ) -> impl Future<Output = Result<Selected, SelectCallFailure>> + Send;

    /// The request placed by `reply` has left its worker (finished or failed).
    fn finished(&self, _reply: &SelectReply) {}

    /// The registered workers changed (from the etcd watch).
    fn workers_changed(&self, _cards: &[WorkerCard]) {}
}

/// kvroute's routers on `kvroute.<ns>.select`, through the retrying [`SelectClient`] (any
/// number of router replicas; a stalled one costs a request one attempt timeout).
#[derive(Debug)]
pub struct RouterSelector {
    client: SelectClient,
}

impl RouterSelector {
    pub fn new(nats: async_nats::Client, names: &Names, policy: RetryPolicy) -> Self {
        Self {
            client: SelectClient::new(nats, names, policy),
        }
    }
}

impl Selector for RouterSelector {
    async fn select(&self, request: SelectRequest) -> Result<Selected, SelectCallFailure> {
        self.client.select(request).await
    }
}
