//! Disaggregated prefill/decode as the impersonated engines spell it on the wire, and what a
//! request's fields ask of a worker in its role. Pure.
//!
//! vLLM (NIXL connector, vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py):
//! a prefill request carries `kv_transfer_params` with `do_remote_decode: true`; the prefill
//! answers with `request_finished`'s dict (`do_remote_prefill: true`, `remote_block_ids`,
//! `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`, …),
//! which the decode request carries back. SGLang (sglang/srt/managers/io_struct.py): both
//! requests carry `bootstrap_host`, `bootstrap_port` and `bootstrap_room`; the scheduler
//! refuses a disaggregated request without a room (scheduler.py, 400).
//!
//! The mocker's decode workers are stricter than vLLM's: vLLM decodes a request with missing
//! or invalid parameters locally (with a warning); here it is refused (400), so a router that
//! skips the prefill is caught.

use axum::http::StatusCode;
use serde_json::{Value, json};

use super::config::{DisaggregationRole, EngineKind};
use super::face::ApiError;
use super::openai::CommonFields;
use super::transfer::PullRequest;

/// What a request's disaggregation fields ask of this worker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// Prefill and decode here (an aggregated worker, or a prefill worker's plain request).
    Local,
    /// Compute the prompt and hold its KV under `key` for a decode worker.
    Prefill {
        key: String,
        /// vLLM: the block ids announced in the answer's `kv_transfer_params`.
        block_ids: Vec<u64>,
        /// SGLang: a prefill answers with its first token only.
        one_token: bool,
    },
    /// Pull the prompt's KV from a prefill worker's side channel first.
    Decode(Pull),
}

/// Where a decode's KV is and how to ask for it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pull {
    /// `http://host:port` of the prefill worker's side channel.
    pub url: String,
    pub request: PullRequest,
    /// SGLang's room (for its error messages).
    pub room: Option<u64>,
}

/// Who this worker is, for planning.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Me<'a> {
    pub engine: EngineKind,
    pub role: DisaggregationRole,
    /// This request's id (SGLang's `rid`, vLLM's `remote_request_id` stem).
    pub request_id: &'a str,
    pub block_size: u32,
    /// How long an SGLang decode waits for its room, ms.
    pub room_wait_ms: u64,
}

/// Reads the request's fields for a worker in `me.role`. Only single-prompt requests can be
/// disaggregated.
pub(crate) fn plan(
    me: Me<'_>,
    common: &CommonFields,
    prompts: &[Vec<u32>],
) -> Result<Plan, ApiError> {
    if me.role == DisaggregationRole::None {
        return Ok(Plan::Local);
    }
    let plan = match me.engine {
        EngineKind::Vllm => vllm_plan(me, common.kv_transfer_params.as_ref(), prompts)?,
        EngineKind::Sglang => sglang_plan(me, common)?,
    };
    if plan != Plan::Local && prompts.len() != 1 {
        return Err(ApiError::bad_request(format!(
            "a disaggregated request has one prompt here, got {}",
            prompts.len()
        )));
    }
    Ok(plan)
}

fn vllm_plan(me: Me<'_>, params: Option<&Value>, prompts: &[Vec<u32>]) -> Result<Plan, ApiError> {
    let flag = |name| params.and_then(|p| p.get(name)).and_then(Value::as_bool) == Some(true);
    match me.role {
        DisaggregationRole::Prefill if flag("do_remote_decode") => {
            let tokens = prompts.first().map_or(0, Vec::len) as u64;
            let blocks = tokens.div_ceil(u64::from(me.block_size));
            Ok(Plan::Prefill {
                key: vllm_remote_request_id(me.request_id),
                block_ids: (0..blocks).collect(),
                one_token: false,
            })
        }
        DisaggregationRole::Decode => {
            let p = params.filter(|_| flag("do_remote_prefill")).ok_or_else(|| {
                ApiError::bad_request(
                    "kv_transfer_params: this decode worker takes only requests with do_remote_prefill: true and the prefill worker's remote_* fields (its answer's kv_transfer_params)",
                )
            })?;
            let text = |name: &str| p.get(name).and_then(Value::as_str).map(str::to_owned);
            let missing = |name: &str| {
                ApiError::bad_request(format!(
                    "kv_transfer_params.{name} is missing or of the wrong type"
                ))
            };
            let engine_id = text("remote_engine_id").ok_or_else(|| missing("remote_engine_id"))?;
            let key = text("remote_request_id").ok_or_else(|| missing("remote_request_id"))?;
            let host = text("remote_host").ok_or_else(|| missing("remote_host"))?;
            let port = p
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| missing("remote_port"))?;
            let block_ids =
                block_ids(p.get("remote_block_ids")).ok_or_else(|| missing("remote_block_ids"))?;
            Ok(Plan::Decode(Pull {
                url: format!("http://{}", host_port(&host, port)),
                request: PullRequest {
                    key,
                    engine_id: Some(engine_id),
                    block_ids: Some(block_ids),
                    wait_ms: 0,
                },
                room: None,
            }))
        }
        _ => Ok(Plan::Local),
    }
}

/// `remote_block_ids`: vLLM's `BlockIds`, a list per KV-cache group (one group here); a flat
/// list is taken too.
fn block_ids(v: Option<&Value>) -> Option<Vec<u64>> {
    let list = v?.as_array()?;
    let flat = match list.first() {
        Some(Value::Array(_)) if list.len() == 1 => list[0].as_array()?,
        _ => list,
    };
    let ids: Option<Vec<u64>> = flat.iter().map(Value::as_u64).collect();
    ids.filter(|ids| !ids.is_empty())
}

fn sglang_plan(me: Me<'_>, common: &CommonFields) -> Result<Plan, ApiError> {
    // scheduler.py: a disaggregated request without a room is aborted with 400.
    let room = common
        .bootstrap_room
        .as_ref()
        .and_then(Value::as_u64)
        .filter(|r| *r < 1 << 63)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "Invalid request: Disaggregated request received without bootstrap room id. req.rid='{}'",
                me.request_id
            ))
        })?;
    let key = room_key(room);
    match me.role {
        DisaggregationRole::Prefill => Ok(Plan::Prefill {
            key,
            block_ids: Vec::new(),
            one_token: true,
        }),
        DisaggregationRole::Decode => {
            let host = common.bootstrap_host.as_ref().and_then(Value::as_str);
            let port = common
                .bootstrap_port
                .as_ref()
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok());
            let (Some(host), Some(port)) = (host, port) else {
                return Err(ApiError::bad_request(format!(
                    "Invalid request: Disaggregated request received without bootstrap_host and bootstrap_port (the prefill worker's bootstrap server). req.rid='{}'",
                    me.request_id
                )));
            };
            Ok(Plan::Decode(Pull {
                url: format!("http://{}", host_port(host, port)),
                request: PullRequest {
                    key,
                    engine_id: None,
                    block_ids: None,
                    wait_ms: me.room_wait_ms,
                },
                room: Some(room),
            }))
        }
        DisaggregationRole::None => Ok(Plan::Local),
    }
}

fn room_key(room: u64) -> String {
    format!("room:{room}")
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// vLLM's engine-side request id for a response id (its `-0` is the prompt's index).
fn vllm_remote_request_id(response_id: &str) -> String {
    format!("{response_id}-0")
}

/// What a vLLM prefill worker answers in `kv_transfer_params` (`request_finished`'s dict, in
/// its order): the decode worker's `do_remote_prefill` and where to read the blocks.
pub(crate) struct VllmHandoff<'a> {
    pub key: &'a str,
    pub block_ids: &'a [u64],
    pub engine_id: &'a str,
    pub host: &'a str,
    pub port: u16,
    pub prompt_tokens: u64,
}

impl VllmHandoff<'_> {
    pub fn params(&self) -> Value {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [self.block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.key,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": self.prompt_tokens,
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
        })
    }
}

/// How a failed transfer reaches the client: vLLM (`kv_load_failure_policy` "fail", its
/// default) finishes the request with reason `error`, which its server turns into a 500
/// "Internal server error" (vllm/entrypoints/generate/base/serving.py `_raise_if_error`);
/// SGLang aborts it with 500 and the decode's message (disaggregation/decode.py).
pub(crate) fn transfer_failure(
    engine: EngineKind,
    request_id: &str,
    room: Option<u64>,
    cause: &str,
) -> ApiError {
    let message = match engine {
        EngineKind::Vllm => "Internal server error".to_owned(),
        EngineKind::Sglang => format!(
            "Decode transfer failed for request rank=0 decode_req.req.rid='{request_id}' decode_req.req.bootstrap_room={} with exception {cause}",
            room.unwrap_or_default()
        ),
    };
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(engine: EngineKind, role: DisaggregationRole) -> Me<'static> {
        Me {
            engine,
            role,
            request_id: "cmpl-1",
            block_size: 4,
            room_wait_ms: 500,
        }
    }

    fn fields(v: Value) -> CommonFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_vllm_prefill_round_trips_into_its_decode() {
        let prefill = me(EngineKind::Vllm, DisaggregationRole::Prefill);
        let asked = fields(json!({"kv_transfer_params": {"do_remote_decode": true,
            "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
            "remote_host": null, "remote_port": null}}));
        let Plan::Prefill { key, block_ids, .. } = plan(prefill, &asked, &[vec![1; 9]]).unwrap()
        else {
            panic!("a prefill")
        };
        assert_eq!(block_ids, vec![0, 1, 2], "9 tokens in 4-token blocks");
        let params = VllmHandoff {
            key: &key,
            block_ids: &block_ids,
            engine_id: "e1",
            host: "127.0.0.1",
            port: 5600,
            prompt_tokens: 9,
        }
        .params();
        assert_eq!(params["remote_block_ids"], json!([[0, 1, 2]]));
        let decode = me(EngineKind::Vllm, DisaggregationRole::Decode);
        let Plan::Decode(pull) = plan(
            decode,
            &fields(json!({"kv_transfer_params": params})),
            &[vec![1; 9]],
        )
        .unwrap() else {
            panic!("a decode")
        };
        assert_eq!(pull.url, "http://127.0.0.1:5600");
        assert_eq!(pull.request.key, "cmpl-1-0");
        assert_eq!(pull.request.engine_id.as_deref(), Some("e1"));
        assert_eq!(pull.request.block_ids, Some(vec![0, 1, 2]));
        // A plain request on a prefill worker runs there.
        assert_eq!(
            plan(prefill, &fields(json!({})), &[vec![1]]),
            Ok(Plan::Local)
        );
    }

    #[test]
    fn a_vllm_decode_refuses_missing_or_malformed_params() {
        let decode = me(EngineKind::Vllm, DisaggregationRole::Decode);
        let refused = |v: Value| plan(decode, &fields(v), &[vec![1]]).unwrap_err();
        assert_eq!(refused(json!({})).status, StatusCode::BAD_REQUEST);
        let e = refused(json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [[1]],
            "remote_host": "h"}}));
        assert!(e.message.contains("remote_port"), "{e:?}");
        let e = refused(json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [],
            "remote_host": "h", "remote_port": 1}}));
        assert!(e.message.contains("remote_block_ids"), "{e:?}");
        let e = refused(json!({"kv_transfer_params": {"do_remote_decode": true}}));
        assert!(e.message.contains("do_remote_prefill"), "{e:?}");
    }

    #[test]
    fn sglang_needs_a_room_and_a_decode_its_bootstrap_address() {
        let prefill = me(EngineKind::Sglang, DisaggregationRole::Prefill);
        let decode = me(EngineKind::Sglang, DisaggregationRole::Decode);
        let e = plan(prefill, &fields(json!({})), &[vec![1]]).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.starts_with(
            "Invalid request: Disaggregated request received without bootstrap room id."
        ));
        let both = fields(json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
            "bootstrap_room": 7_000_000_000_000_000_000u64}));
        assert!(matches!(
            plan(prefill, &both, &[vec![1]]).unwrap(),
            Plan::Prefill {
                one_token: true,
                ..
            }
        ));
        let Plan::Decode(pull) = plan(decode, &both, &[vec![1]]).unwrap() else {
            panic!("a decode")
        };
        assert_eq!(pull.url, "http://10.0.0.1:8998");
        assert_eq!(pull.request.key, "room:7000000000000000000");
        assert_eq!(pull.request.wait_ms, 500);
        let no_host = fields(json!({"bootstrap_room": 1}));
        assert_eq!(
            plan(decode, &no_host, &[vec![1]]).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        // A room beyond 63 bits is no room.
        let big = fields(json!({"bootstrap_room": u64::MAX}));
        assert!(plan(prefill, &big, &[vec![1]]).is_err());
        // Aggregated workers ignore the fields.
        let none = me(EngineKind::Sglang, DisaggregationRole::None);
        assert_eq!(plan(none, &fields(json!({})), &[vec![1]]), Ok(Plan::Local));
    }
}
