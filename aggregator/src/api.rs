//! The aggregator's HTTP API: `/healthz`, `/readyz`, `/metrics`, `/v1/faults` (the whole
//! document) and `POST /v1/alerts` (the alert intake). [`router`] builds it from an
//! [`ApiState`]; every error answer is an [`ApiError`] with faultline's JSON error body.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use faultline_common::api::ErrorBody;
use faultline_common::fault::FaultDocument;
use faultline_common::sync::Locked;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::ingest::{Intake, IntakeError};
use crate::metrics::Metrics;

/// A request for the whole document, answered by the core loop.
pub type DocumentAsk = oneshot::Sender<Arc<FaultDocument>>;

/// A document and its JSON.
pub type Rendered = (Arc<FaultDocument>, axum::body::Bytes);

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    /// The metrics served at `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The file sink's last document (it is built for the files anyway).
    pub latest: Arc<Mutex<Option<Arc<FaultDocument>>>>,
    /// The ConfigMap sink builds the whole document only when someone asks.
    pub asks: mpsc::Sender<DocumentAsk>,
    /// A first document was written.
    pub ready: Arc<AtomicBool>,
    /// The alert intake, when on.
    pub intake: Option<Arc<Intake>>,
    /// The last document served and its JSON: a document shared by many requests is
    /// serialized once.
    pub rendered: Arc<Mutex<Option<Rendered>>>,
}

/// An error answer: a status and a message, as `{"error": ..., "status": ...}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong.
    pub message: String,
    /// Seconds to wait before retrying (`Retry-After`), when known.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error answer with `status`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }
}

impl From<IntakeError> for ApiError {
    fn from(e: IntakeError) -> Self {
        ApiError {
            status: e.status(),
            message: e.to_string(),
            retry_after: e.retry_after(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            Json(ErrorBody::new(self.status.as_u16(), self.message)),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// The API.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/v1/faults", get(faults))
        .route("/v1/alerts", post(alerts))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
}

async fn ready(State(s): State<ApiState>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        Json(json!({"ready": true})).into_response()
    } else {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no document written yet").into_response()
    }
}

async fn metrics_text(State(s): State<ApiState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

/// `?threshold=N` on the receiver URL: the sender says N alerts are enough.
#[derive(Debug, serde::Deserialize)]
struct AlertsQuery {
    threshold: Option<usize>,
}

async fn alerts(
    State(s): State<ApiState>,
    headers: HeaderMap,
    q: Result<axum::extract::Query<AlertsQuery>, axum::extract::rejection::QueryRejection>,
    body: axum::body::Body,
) -> Response {
    let threshold = match q {
        Ok(axum::extract::Query(q)) => q.threshold,
        Err(e) => {
            let r = ApiError::new(StatusCode::BAD_REQUEST, e.body_text()).into_response();
            s.metrics.intake_response(r.status().as_u16());
            return r;
        }
    };
    let r = match &s.intake {
        Some(i) => match i.handle(&headers, threshold, body).await {
            Ok(summary) => (StatusCode::ACCEPTED, Json(summary)).into_response(),
            Err(e) => ApiError::from(e).into_response(),
        },
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "the alert intake is off (no --intake-token-file)",
        )
        .into_response(),
    };
    s.metrics.intake_response(r.status().as_u16());
    r
}

async fn faults(State(s): State<ApiState>) -> Result<Response, ApiError> {
    let not_yet = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no document yet");
    if !s.ready.load(Ordering::Acquire) {
        return Err(not_yet());
    }
    let cached = s.latest.locked().clone();
    let doc = match cached {
        Some(d) => d,
        None => {
            let (tx, rx) = oneshot::channel();
            if s.asks.send(tx).await.is_err() {
                return Err(not_yet());
            }
            match tokio::time::timeout(Duration::from_secs(10), rx).await {
                Ok(Ok(d)) => d,
                _ => return Err(not_yet()),
            }
        }
    };
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        rendered(&s, doc)?,
    )
        .into_response())
}

/// The JSON of `doc`, serialized once however many requests share it.
fn rendered(s: &ApiState, doc: Arc<FaultDocument>) -> Result<axum::body::Bytes, ApiError> {
    let mut r = s.rendered.locked();
    if let Some((d, bytes)) = r.as_ref() {
        if Arc::ptr_eq(d, &doc) {
            return Ok(bytes.clone());
        }
    }
    let bytes = axum::body::Bytes::from(
        serde_json::to_vec(doc.as_ref())
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    );
    *r = Some((doc, bytes.clone()));
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    fn state() -> (ApiState, mpsc::Receiver<DocumentAsk>) {
        let (asks, rx) = mpsc::channel(4);
        (
            ApiState {
                metrics: Arc::new(Metrics::new()),
                latest: Default::default(),
                asks,
                ready: Default::default(),
                intake: None,
                rendered: Default::default(),
            },
            rx,
        )
    }

    async fn call(s: ApiState, method: &str, path: &str) -> (StatusCode, serde_json::Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let resp = router(s).oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    #[tokio::test]
    async fn errors_have_one_body_and_readiness_follows_the_first_write() {
        let (s, _rx) = state();
        let (code, body) = call(s.clone(), "GET", "/nope").await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert_eq!(body, json!({"error": "no such endpoint", "status": 404}));
        let (code, body) = call(s.clone(), "GET", "/readyz").await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["status"], 503);
        assert_eq!(
            call(s.clone(), "GET", "/v1/faults").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        let (code, body) = call(s.clone(), "POST", "/v1/alerts").await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert!(body["error"].as_str().unwrap().contains("intake is off"));
        assert!(s
            .metrics
            .encode()
            .contains("faultline_aggregator_intake_responses_total{code=\"404\"} 1"));
        s.ready.store(true, Ordering::Release);
        assert_eq!(
            call(s, "GET", "/readyz").await,
            (StatusCode::OK, json!({"ready": true}))
        );
    }

    #[tokio::test]
    async fn the_whole_document_is_asked_of_the_core_when_not_cached() {
        let (s, mut rx) = state();
        s.ready.store(true, Ordering::Release);
        tokio::spawn(async move {
            while let Some(ask) = rx.recv().await {
                let doc: FaultDocument = serde_json::from_value(json!({
                    "version": "v1", "timestamp": "t", "sequence": 7, "shard": 0, "shards": 1,
                    "writer": "r1", "summary": {"total": 0, "healthy": 0, "degraded": 0, "failed": 0, "unknown": 0},
                    "nodes": {}
                }))
                .unwrap();
                let _ = ask.send(Arc::new(doc));
            }
        });
        let (code, body) = call(s, "GET", "/v1/faults").await;
        assert_eq!(code, StatusCode::OK);
        assert_eq!(body["sequence"], 7);
    }

    #[test]
    fn a_retry_after_goes_in_a_header() {
        let e = ApiError::from(IntakeError::Unavailable("busy".into(), Some(5)));
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "5");
    }
}
