//! Where the replay gets its worker choices: the [`Selector`] boundary, with the real
//! implementation (kvroute routers over NATS) here and an in-process one in `local.rs`.

use std::future::Future;
use std::time::Duration;

use async_nats::client::RequestErrorKind;
use kvroute_common::Names;
use kvroute_common::codec::{decode, encode};
use kvroute_common::messages::{SelectReply, SelectRequest, SelectResponse, WorkerCard};

/// Why a selection produced no worker. [`SelectFailure::kind`] is the report's error label.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SelectFailure {
    /// The router answered with an error code (`no_workers`, `all_overloaded`, ...).
    #[error("router refused: {code}: {message}")]
    Refused { code: String, message: String },
    /// Nobody listens on the select subject.
    #[error("no router is listening")]
    NoRouter,
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer could not be decoded, or the request could not be sent.
    #[error("{0}")]
    Transport(String),
}

impl SelectFailure {
    pub fn kind(&self) -> String {
        match self {
            SelectFailure::Refused { code, .. } => format!("select_{code}"),
            SelectFailure::NoRouter => "select_no_router".into(),
            SelectFailure::Timeout(_) => "select_timeout".into(),
            SelectFailure::Transport(_) => "select_transport".into(),
        }
    }
}

/// Chooses a worker for each request. Implementations are shared by every request task.
pub trait Selector: Send + Sync + 'static {
    fn select(
        &self,
        request: SelectRequest,
    ) -> impl Future<Output = Result<SelectReply, SelectFailure>> + Send;

    /// The request placed by `reply` has left its worker (finished or failed).
    fn finished(&self, _reply: &SelectReply) {}

    /// The registered workers changed (from the etcd watch).
    fn workers_changed(&self, _cards: &[WorkerCard]) {}
}

/// kvroute's routers: `SelectRequest` → `SelectResponse` on `kvroute.<ns>.select`.
#[derive(Debug, Clone)]
pub struct RouterSelector {
    nats: async_nats::Client,
    subject: String,
    timeout: Duration,
}

impl RouterSelector {
    pub fn new(nats: async_nats::Client, names: &Names, timeout: Duration) -> Self {
        Self {
            nats,
            subject: names.select(),
            timeout,
        }
    }
}

impl Selector for RouterSelector {
    async fn select(&self, request: SelectRequest) -> Result<SelectReply, SelectFailure> {
        let payload = encode(&request).map_err(|e| SelectFailure::Transport(e.to_string()))?;
        let req = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(self.timeout));
        let msg = self
            .nats
            .send_request(self.subject.clone(), req)
            .await
            .map_err(|e| match e.kind() {
                RequestErrorKind::NoResponders => SelectFailure::NoRouter,
                RequestErrorKind::TimedOut => SelectFailure::Timeout(self.timeout),
                _ => SelectFailure::Transport(e.to_string()),
            })?;
        match decode::<SelectResponse>(&msg.payload) {
            Ok(SelectResponse::Ok(reply)) => Ok(reply),
            Ok(SelectResponse::Error(e)) => Err(SelectFailure::Refused {
                code: serde_json::to_value(e.code)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_else(|| format!("{:?}", e.code)),
                message: e.message,
            }),
            Err(e) => Err(SelectFailure::Transport(e.to_string())),
        }
    }
}
