//! `/metrics`, `/healthz`, `/readyz` (200 while in the select queue group: ready and keeping
//! up) and `/status` (JSON: id, readiness, membership, workers, policies, each rank's load
//! as the load view sees it now, and, with a local replica, its `(applied_seq, digest)`).

use std::sync::Arc;

use futures::future::BoxFuture;
use kvroute_common::messages::{WorkerRole, now_ms};
use kvroute_common::ops::{HttpHandler, HttpResponse};

use super::Router;
use super::overlap::OverlapSource;

pub struct Http(pub Arc<Router>);

impl HttpHandler for Http {
    fn get(&self, path: &str) -> BoxFuture<'static, HttpResponse> {
        let router = &self.0;
        let path = path.split('?').next().unwrap_or(path);
        let response = match path {
            "/metrics" => {
                router.metrics.ready.set(i64::from(router.is_ready()));
                HttpResponse::prometheus(router.metrics.registry.render())
            }
            "/healthz" => HttpResponse::text(200, "ok\n"),
            "/readyz" if router.is_serving() => HttpResponse::text(200, "ready\n"),
            "/readyz" if router.is_ready() => {
                HttpResponse::text(503, "ready, but out of the select queue group (behind)\n")
            }
            "/readyz" => HttpResponse::text(503, "not ready\n"),
            "/status" => HttpResponse::json(200, status(router).to_string()),
            _ => HttpResponse::text(404, "not found\n"),
        };
        Box::pin(async move { response })
    }
}

fn status(router: &Router) -> serde_json::Value {
    let workers = router
        .candidates
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .len();
    let policies: serde_json::Map<String, serde_json::Value> = WorkerRole::ALL
        .into_iter()
        .map(|role| {
            let s = router.policies.resolved().selection(role);
            (
                role.to_string(),
                serde_json::json!({"instance": s.instance, "source": s.origin}),
            )
        })
        .collect();
    let load: Vec<serde_json::Value> = router
        .load
        .ranks(now_ms())
        .into_iter()
        .map(|r| {
            let mut entry = serde_json::json!({
                "worker_id": r.rank.worker_id,
                "dp_rank": r.rank.dp_rank,
            });
            if let Some(l) = r.load {
                entry["active_prefill_tokens"] = l.active_prefill_tokens.into();
                entry["active_decode_blocks"] = l.active_decode_blocks.into();
                entry["output_blocks"] = l.output_blocks.into();
                entry["active_requests"] = l.active_requests.into();
            }
            if let Some(rate) = r.prefill_tokens_per_sec {
                entry["prefill_tokens_per_sec"] = rate.into();
            }
            entry
        })
        .collect();
    let mut out = serde_json::json!({
        "router_id": router.router_id,
        "ready": router.is_ready(),
        "serving": router.is_serving(),
        "workers": workers,
        "policies": policies,
        "load": load,
    });
    if let OverlapSource::Local(replica) = &router.overlap {
        out["local_index"] = local_index(replica);
    }
    out
}

/// The local replica's `(applied_seq, digest)`, as an indexer's `/status` gives them (the
/// digest a `0x` string of 16 hex digits). The follower applies while this reads, so the pair
/// is exact only while the log is quiet; a sequence that moved during the digest is retried,
/// and after a few tries `digest` is null (the replica is busy applying: ask again).
fn local_index(replica: &kvroute_indexer::service::IndexFollower) -> serde_json::Value {
    for _ in 0..4 {
        let seq = replica.applied_seq();
        let index = replica.index();
        let digest = index.digest();
        if replica.applied_seq() == seq {
            return serde_json::json!({
                "applied_seq": seq,
                "digest": format!("{digest:#018x}"),
            });
        }
    }
    serde_json::json!({"applied_seq": replica.applied_seq(), "digest": null})
}
