//! `/v1/fault`: the node's own `fault.json` ([`crate::verdict`]). `GET` serves it (a
//! watch stream with `watch=true`), `PUT` takes the aggregator's delivery (bearer
//! token). [`pod_router`] serves only the `GET`, for `--fault-listen`: the port the
//! node's pods may reach. There a pod sees the node's entry with only its own drain
//! intent (the one that lists the address it asks from): other namespaces' pod
//! names, UIDs and addresses are not a pod's to read.
//!
//! `POST /v1/drain/ack` (both ports) is a pod's word that it has checkpointed, so it
//! may be evicted before its drain intent's deadline. It needs no API
//! rights: it must come from one of the addresses the intent lists for that pod (the
//! pod's own `status.podIPs`), name a pod the entry held has an intent for, and is
//! then carried to the aggregator in this agent's `/v1/health` (`drain_acks`).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{ConnectInfo, DefaultBodyLimit, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use faultline_common::fault::Delivery;
use faultline_common::seal::SIGNATURE_HEADER;
use faultline_common::time::now_ms;
use serde::Deserialize;
use serde_json::json;

use crate::api::{ApiError, ApiState, NDJSON, WATCH_HEARTBEAT, WATCH_MIN_LIFE};
use crate::verdict::Refused;

/// Largest delivery accepted (an entry of 1,024 devices is about 400 KiB).
pub const MAX_DELIVERY: usize = 1 << 20;
/// Watch streams open at once on `--fault-listen` (the node's pods), apart from the
/// API's own cap; past it a watch gets the document once.
pub const POD_WAITERS: usize = 64;
/// Largest acknowledgement body accepted.
const MAX_ACK: usize = 4096;
/// How often a watch looks whether the verdict turned stale.
const STALE_LOOK: Duration = Duration::from_millis(500);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultQuery {
    /// `true` (or `1`): each new version as one line ([`NDJSON`]).
    watch: Option<String>,
    /// With `watch`, the heartbeat's period in milliseconds (default 10000).
    timeout_ms: Option<u64>,
}

/// The `/v1/fault` routes of the agent's API.
pub fn routes() -> Router<ApiState> {
    Router::new()
        .route(
            "/v1/fault",
            get(fault)
                .put(deliver)
                .layer(DefaultBodyLimit::max(MAX_DELIVERY)),
        )
        .route(
            "/v1/drain/ack",
            post(ack).layer(DefaultBodyLimit::max(MAX_ACK)),
        )
}

/// What `--fault-listen` serves: the node's `fault.json` and a liveness probe, nothing
/// else (no delivery, no health document, no metrics).
pub fn pod_router(state: ApiState) -> Router {
    Router::new()
        .route("/v1/fault", get(pod_fault))
        .route(
            "/v1/drain/ack",
            post(ack).layer(DefaultBodyLimit::max(MAX_ACK)),
        )
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .with_state(state)
}

/// Who reads the document: the node (the API port: the aggregator, an SRE), or a pod
/// asking from an address (the pod port).
#[derive(Debug, Clone, Copy)]
enum Reader {
    Node,
    Pod(Option<std::net::IpAddr>),
}

/// Whether drain intent `n` lists address `ip` as its pod's (who may read and
/// acknowledge it).
fn lists(n: &faultline_common::fault::DrainNotice, ip: std::net::IpAddr) -> bool {
    n.pod_ips.iter().any(|p| p.parse() == Ok(ip))
}

fn document(s: &ApiState, reader: Reader) -> faultline_common::fault::NodeFaults {
    let mut doc = s.verdicts.render(&s.store.render(), now_ms());
    if let Reader::Pod(from) = reader {
        // Its own intent only: one that lists the address it asks from. A pod on the
        // host network (no address listed) learns of its intent from the node's file.
        doc.drain.retain(|n| from.is_some_and(|ip| lists(n, ip)));
    }
    doc
}

async fn fault(
    State(s): State<ApiState>,
    q: Result<Query<FaultQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    serve_fault(s, q, Reader::Node)
}

async fn pod_fault(
    State(s): State<ApiState>,
    peer: Option<axum::Extension<ConnectInfo<std::net::SocketAddr>>>,
    q: Result<Query<FaultQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let from = peer.map(|axum::Extension(ConnectInfo(p))| p.ip().to_canonical());
    serve_fault(s, q, Reader::Pod(from))
}

fn serve_fault(
    s: ApiState,
    q: Result<Query<FaultQuery>, QueryRejection>,
    reader: Reader,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let watch = match q.watch.as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(w) => {
            return Err(ApiError::bad_request(format!(
                "watch {w:?}: expected true or false"
            )))
        }
    };
    if !watch {
        if q.timeout_ms.is_some() {
            return Err(ApiError::bad_request(
                "timeout_ms only makes sense with watch",
            ));
        }
        return Ok(Json(document(&s, reader)).into_response());
    }
    let heartbeat = Duration::from_millis(q.timeout_ms.unwrap_or(10_000))
        .clamp(WATCH_HEARTBEAT.0, WATCH_HEARTBEAT.1);
    Ok(match s.waiters.clone().try_acquire_owned() {
        Ok(permit) => stream(s, reader, heartbeat, permit),
        Err(_) => {
            s.metrics.long_poll_shortened();
            Json(document(&s, reader)).into_response()
        }
    })
}

/// The document at once, then each new version (a new verdict or confirmation, a new
/// agent document, the verdict turning stale), and a blank line after `heartbeat`
/// without one; it ends after its life, when the agent stops, or when the client goes.
fn stream(
    s: ApiState,
    reader: Reader,
    heartbeat: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response {
    let end = tokio::time::Instant::now() + WATCH_MIN_LIFE.mul_f64(rand::random_range(1.0..2.0));
    let (verdicts, docs) = (s.verdicts.subscribe(), s.store.subscribe());
    type Seen = Option<(u64, u64, bool)>;
    let stream = futures_util::stream::unfold(
        (s, verdicts, docs, None::<(u64, u64, bool)>, permit),
        move |(s, mut verdicts, mut docs, seen, permit): (_, _, _, Seen, _)| async move {
            let quiet = tokio::time::Instant::now() + heartbeat;
            loop {
                let now = (
                    *verdicts.borrow_and_update(),
                    *docs.borrow_and_update(),
                    s.verdicts.stale(now_ms()),
                );
                if seen != Some(now) {
                    let mut line = match serde_json::to_vec(&document(&s, reader)) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot encode fault.json: the watch ends");
                            return None;
                        }
                    };
                    line.push(b'\n');
                    let item = Ok::<_, std::convert::Infallible>(Bytes::from(line));
                    return Some((item, (s, verdicts, docs, Some(now), permit)));
                }
                tokio::select! {
                    _ = s.stop.cancelled() => return None,
                    _ = tokio::time::sleep_until(end) => return None,
                    r = verdicts.changed() => if r.is_err() { return None },
                    r = docs.changed() => if r.is_err() { return None },
                    _ = tokio::time::sleep(STALE_LOOK) => {}
                    _ = tokio::time::sleep_until(quiet) => {
                        let item = Ok(Bytes::from_static(b"\n"));
                        return Some((item, (s, verdicts, docs, seen, permit)));
                    }
                }
            }
        },
    );
    (
        [(header::CONTENT_TYPE, NDJSON)],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

async fn deliver(
    State(s): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let refused = |e: Refused| {
        s.metrics.count_error("delivery", e.label());
        let status = match e {
            Refused::Off => StatusCode::FORBIDDEN,
            Refused::Unauthorized | Refused::Unsigned(_) => StatusCode::UNAUTHORIZED,
            Refused::Invalid(_) => StatusCode::BAD_REQUEST,
            Refused::Conflict(_) => StatusCode::CONFLICT,
        };
        ApiError::new(status, e.to_string())
    };
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let how = s
        .verdicts
        .authorize(
            headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
            headers.get(SIGNATURE_HEADER).map(|v| v.as_bytes()),
            &body,
        )
        .map_err(refused)?;
    let d: Delivery = serde_json::from_slice(&body)
        .map_err(|e| refused(Refused::Invalid(format!("not a delivery: {e}"))))?;
    let sequence = d.sequence;
    s.verdicts.apply(d, how, now_ms()).map_err(refused)?;
    // Acknowledgements of intents the new entry no longer lists go.
    let verdicts = s.verdicts.clone();
    s.store.prune_drain_acks(|a| verdicts.lists(a));
    Ok(Json(json!({"sequence": sequence})).into_response())
}

/// What a pod sends to acknowledge its drain intent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ack {
    /// The pod's UID (the downward API's `metadata.uid`).
    uid: String,
}

/// A pod's acknowledgement: from one of its own addresses, for an intent the entry
/// held lists. 202 once taken (again: 200), 404 for no such intent, 403 from another
/// address; each refusal counted (`errors_total{source="drain-ack"}`).
async fn ack(
    State(s): State<ApiState>,
    peer: Option<axum::Extension<ConnectInfo<std::net::SocketAddr>>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let refuse = |kind: &'static str, status: StatusCode, message: String| {
        s.metrics.count_error("drain-ack", kind);
        ApiError::new(status, message)
    };
    let body = body.map_err(|e| refuse("body", e.status(), e.body_text()))?;
    let a: Ack = serde_json::from_slice(&body).map_err(|e| {
        refuse(
            "invalid",
            StatusCode::BAD_REQUEST,
            format!("not an acknowledgement ({{\"uid\": \"<pod uid>\"}}): {e}"),
        )
    })?;
    let Some(notice) = s.verdicts.drain_notice(&a.uid) else {
        return Err(refuse(
            "unknown",
            StatusCode::NOT_FOUND,
            format!("no drain intent for pod {} on this node", a.uid),
        ));
    };
    let from = peer.map(|axum::Extension(ConnectInfo(p))| p.ip().to_canonical());
    let own = from.is_some_and(|ip| lists(&notice, ip));
    if !own {
        let from = from.map_or_else(|| "an unknown address".to_string(), |ip| ip.to_string());
        return Err(refuse(
            "address",
            StatusCode::FORBIDDEN,
            format!(
                "pod {}/{} acknowledges from its own address ({}), not from {from}",
                notice.namespace,
                notice.pod,
                if notice.pod_ips.is_empty() {
                    "none listed: a pod on the host network acknowledges by exiting".to_string()
                } else {
                    notice.pod_ips.join(", ")
                }
            ),
        ));
    }
    let verdicts = s.verdicts.clone();
    let new = s
        .store
        .ack_drain(&a.uid, &notice.requested, |a| verdicts.lists(a));
    if new {
        s.metrics.drain_acked();
        tracing::info!(namespace = %notice.namespace, pod = %notice.pod, uid = %a.uid, "drain intent acknowledged");
    }
    let status = if new {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(json!({"uid": a.uid, "evict_after": notice.evict_after, "acknowledged": true})),
    )
        .into_response())
}
