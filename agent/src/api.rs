//! The HTTP API: `/v1/health` (with long-poll on the generation, or a watch stream of
//! every new document), probes, metrics, and fault injection when the simulator runs. Read-only apart from the simulator (and the
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
use crate::verdict::Verdicts;

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
    /// Long polls waiting now and watch streams open, at most [`MAX_WAITERS`].
    pub waiters: Arc<tokio::sync::Semaphore>,
    /// Ends the watch streams (the agent is stopping).
    pub stop: tokio_util::sync::CancellationToken,
    /// The aggregator's verdict on this node (`/v1/fault`).
    pub verdicts: Arc<Verdicts>,
}

/// Long polls held open at once; past this a poll waits at most [`SHORT_WAIT`], so
/// many pollers cannot pile up. The aggregator holds one per agent.
pub const MAX_WAITERS: usize = 256;
/// How long a poll past [`MAX_WAITERS`] waits.
pub const SHORT_WAIT: Duration = Duration::from_secs(1);

impl ApiState {
    /// The state over `store`, with the long-poll cap.
    pub fn new(store: Arc<Store>, metrics: Arc<Metrics>, sim: Option<Arc<SimControl>>) -> Self {
        ApiState {
            verdicts: Verdicts::new(store.node(), None, Duration::from_secs(60)),
            store,
            metrics,
            sim,
            waiters: Arc::new(tokio::sync::Semaphore::new(MAX_WAITERS)),
            stop: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// The verdicts `/v1/fault` serves and takes.
    pub fn with_verdicts(mut self, verdicts: Arc<Verdicts>) -> Self {
        self.verdicts = verdicts;
        self
    }

    /// Watch streams end when `stop` is cancelled.
    pub fn with_stop(mut self, stop: tokio_util::sync::CancellationToken) -> Self {
        self.stop = stop;
        self
    }
}

/// A watch stream lasts at least this, then the agent ends it and the client asks
/// again (a connection is not held for ever, and a fleet's streams do not all end at
/// once): each stream's life is drawn between this and twice this, as kube-apiserver
/// draws a watch's timeout (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/get.go,
/// `timeout = minRequestTimeout * (1 + rand)`).
pub const WATCH_MIN_LIFE: Duration = Duration::from_secs(300);
/// A watch stream's heartbeat (`timeout_ms`) is within these: a blank line is sent
/// after this long without a change, so the client knows the agent lives (below the
/// server's idle timeout of 60 s).
pub const WATCH_HEARTBEAT: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));
/// The media type of a watch stream: one JSON document per line.
pub const NDJSON: &str = "application/x-ndjson";

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
    /// Answer once the generation is greater than this (with `watch`: the first
    /// document is sent once the generation is another than this).
    wait_generation: Option<u64>,
    /// Longest wait in milliseconds (default 30000, at most 60000); with `watch`, the
    /// heartbeat's period (default 10000, within [`WATCH_HEARTBEAT`]).
    timeout_ms: Option<u64>,
    /// `true` (or `1`): a stream of documents ([`NDJSON`]), each new generation as it
    /// comes.
    watch: Option<String>,
    /// `pretty` for indented JSON.
    format: Option<String>,
}

/// The router.
pub fn router(state: ApiState) -> Router {
    router_with(state, Router::new())
}

/// The router with more routes (the agent adds `/v1/fault`, [`crate::fault_api`]), under
/// the same fallbacks and request counting.
pub fn router_with(state: ApiState, more: Router<ApiState>) -> Router {
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
        .merge(more)
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
        "/v1/fault" => "/v1/fault",
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
    let watch = match q.watch.as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(w) => {
            return Err(ApiError::bad_request(format!(
                "watch {w:?}: expected true or false"
            )))
        }
    };
    if watch {
        if pretty {
            return Err(ApiError::bad_request(
                "a watch stream is one document per line: format=pretty does not apply",
            ));
        }
        let heartbeat = Duration::from_millis(q.timeout_ms.unwrap_or(10_000))
            .clamp(WATCH_HEARTBEAT.0, WATCH_HEARTBEAT.1);
        return Ok(match s.waiters.clone().try_acquire_owned() {
            Ok(permit) => watch_stream(s, q.wait_generation, heartbeat, permit),
            // Past the cap: the document now, not a stream (the client long-polls).
            Err(_) => {
                s.metrics.long_poll_shortened();
                json_response(&s.store.render(), false)
            }
        });
    }
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

/// The watch stream: the current document at once (or once its generation is another
/// than `seen`), then every new generation as it comes, and a blank line after
/// `heartbeat` without one; it ends after its life ([`WATCH_MIN_LIFE`]), when the
/// agent stops, or when the client goes. It holds a waiter `permit` all along.
fn watch_stream(
    s: ApiState,
    seen: Option<u64>,
    heartbeat: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Response {
    let life = WATCH_MIN_LIFE.mul_f64(rand::random_range(1.0..2.0));
    let end = tokio::time::Instant::now() + life;
    let rx = s.store.subscribe();
    let stream = futures_util::stream::unfold(
        (s, rx, seen, permit),
        move |(s, mut rx, mut seen, permit)| async move {
            loop {
                let now = *rx.borrow_and_update();
                if seen != Some(now) {
                    let doc = s.store.render();
                    let mut line = match serde_json::to_vec(&doc) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot encode the document: the watch stream ends");
                            return None;
                        }
                    };
                    line.push(b'\n');
                    seen = Some(doc.generation);
                    let item = Ok::<_, std::convert::Infallible>(Bytes::from(line));
                    return Some((item, (s, rx, seen, permit)));
                }
                tokio::select! {
                    _ = s.stop.cancelled() => return None,
                    _ = tokio::time::sleep_until(end) => return None,
                    r = tokio::time::timeout(heartbeat, rx.changed()) => match r {
                        Ok(Ok(())) => {}
                        // The store is gone: the agent is stopping.
                        Ok(Err(_)) => return None,
                        // The heartbeat: a blank line, which NDJSON readers skip (a
                        // document with nothing new would cost the reader a parse).
                        Err(_) => {
                            let item = Ok(Bytes::from_static(b"\n"));
                            return Some((item, (s, rx, seen, permit)));
                        }
                    },
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
        .map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
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
