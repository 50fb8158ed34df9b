//! The HTTP API: `/v1/health` (with long-poll on the generation), probes, metrics, and
//! fault injection when the simulator runs. Read-only apart from the simulator (and the
//! per-device gauges `/metrics` refreshes from the document before encoding). Every
//! error answer is an [`ApiError`], sent as the shared [`ErrorBody`] JSON.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use faultline_common::api::ErrorBody;
use serde::Deserialize;
use serde_json::json;

use crate::metrics::Metrics;
use crate::sources::sim::{FaultRequest, SimControl};
use crate::store::Store;

/// Longest a long-poll may wait.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Largest request body accepted (fault injection only).
const MAX_BODY: usize = 64 << 10;

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub sim: Option<Arc<SimControl>>,
    /// Long polls waiting now, at most [`MAX_WAITERS`].
    pub waiters: Arc<tokio::sync::Semaphore>,
}

/// Long polls held open at once; past this a poll waits at most [`SHORT_WAIT`], so
/// many pollers cannot pile up (issue 10). The aggregator holds one per agent.
pub const MAX_WAITERS: usize = 256;
/// How long a poll past [`MAX_WAITERS`] waits.
pub const SHORT_WAIT: Duration = Duration::from_secs(1);

impl ApiState {
    /// The state over `store`, with the long-poll cap.
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>, sim: Option<Arc<SimControl>>) -> Self {
        ApiState {
            store,
            metrics,
            sim,
            waiters: Arc::new(tokio::sync::Semaphore::new(MAX_WAITERS)),
        }
    }
}

/// An error answer: its HTTP status and message, sent as [`ErrorBody`] JSON
/// (`{"error": "...", "status": N}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The answer's status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
}

impl ApiError {
    /// An error answered with `status`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// 400: the request itself is wrong.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404: no such thing here.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(self.status.as_u16(), self.message);
        (self.status, Json(body)).into_response()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HealthQuery {
    /// Answer once the generation is greater than this.
    wait_generation: Option<u64>,
    /// Longest wait in milliseconds (default 30000, at most 60000).
    timeout_ms: Option<u64>,
    /// `pretty` for indented JSON.
    format: Option<String>,
}

/// The router.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/health/{device}", get(device))
        .route(
            "/v1/sim/faults",
            get(list_faults).post(inject_fault).delete(clear_faults),
        )
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

async fn count_requests(
    State(s): State<ApiState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path: &'static str = match req.uri().path() {
        "/v1/health" => "/v1/health",
        "/v1/sim/faults" => "/v1/sim/faults",
        "/healthz" => "/healthz",
        "/readyz" => "/readyz",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/health/") => "/v1/health/{device}",
        _ => "other",
    };
    let resp = next.run(req).await;
    s.metrics.count_http(path, resp.status().as_u16());
    resp
}

fn json_response<T: serde::Serialize>(v: &T, pretty: bool) -> Response {
    let body = if pretty {
        serde_json::to_vec_pretty(v)
    } else {
        serde_json::to_vec(v)
    };
    match body {
        Ok(b) => ([(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn pretty(format: &Option<String>) -> Result<bool, ApiError> {
    match format.as_deref() {
        None | Some("json") => Ok(false),
        Some("pretty") => Ok(true),
        Some(f) => Err(ApiError::bad_request(format!(
            "format {f:?}: expected json or pretty"
        ))),
    }
}

async fn health(
    State(s): State<ApiState>,
    q: Result<Query<HealthQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let pretty = pretty(&q.format)?;
    if let Some(seen) = q.wait_generation {
        let mut wait = Duration::from_millis(q.timeout_ms.unwrap_or(30_000)).min(MAX_WAIT);
        let permit = s.waiters.clone().try_acquire_owned().ok();
        if permit.is_none() {
            s.metrics.long_poll_shortened();
            wait = wait.min(SHORT_WAIT);
        }
        let mut rx = s.store.subscribe();
        // Waits only while the generation is the one the client saw. Any other value,
        // higher or lower (the agent restarted and counts from 1 again), answers at once.
        let _ = tokio::time::timeout(wait, rx.wait_for(|g| *g != seen)).await;
    } else if q.timeout_ms.is_some() {
        return Err(ApiError::bad_request(
            "timeout_ms only makes sense with wait_generation",
        ));
    }
    Ok(json_response(&s.store.render(), pretty))
}

async fn device(
    State(s): State<ApiState>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let doc = s.store.render();
    let d = doc
        .npus
        .iter()
        .find(|d| d.reading.id == id || d.reading.uuid.as_deref() == Some(id.as_str()))
        .ok_or_else(|| ApiError::not_found(format!("no device {id:?} on this node")))?;
    Ok(json_response(d, false))
}

async fn readyz(State(s): State<ApiState>) -> Response {
    if s.store.ready() {
        Json(json!({"ready": true})).into_response()
    } else {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "first sample not done yet").into_response()
    }
}

async fn metrics(State(s): State<ApiState>) -> Response {
    // Refresh the per-device gauges from the document as of now, for scrapers that
    // read nothing else; rendering itself writes nothing.
    let doc = s.store.render();
    s.metrics.observe_devices(&doc.npus);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

fn sim(s: &ApiState) -> Result<&Arc<SimControl>, ApiError> {
    s.sim.as_ref().ok_or_else(|| {
        ApiError::not_found("fault injection is only available when the sim source runs")
    })
}

async fn list_faults(State(s): State<ApiState>) -> Result<Response, ApiError> {
    Ok(json_response(&sim(&s)?.faults(), false))
}

async fn inject_fault(
    State(s): State<ApiState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let sim = sim(&s)?;
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    if body.len() > MAX_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body over {MAX_BODY} bytes"),
        ));
    }
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v.starts_with("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "expected Content-Type: application/json",
        ));
    }
    let req: FaultRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid fault: {e}")))?;
    let applied = sim
        .inject(req)
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e))?;
    Ok((StatusCode::CREATED, Json(applied)).into_response())
}

async fn clear_faults(State(s): State<ApiState>) -> Result<Response, ApiError> {
    let n = sim(&s)?.clear();
    Ok(Json(json!({"cleared": n})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_error_is_the_shared_body_with_its_status() {
        let resp = ApiError::not_found("no such endpoint").into_response();
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "application/json",
            "{resp:?}"
        );
        let body = axum::body::to_bytes(resp.into_body(), 1 << 10)
            .await
            .unwrap();
        assert_eq!(&body[..], br#"{"error":"no such endpoint","status":404}"#);
    }
}
