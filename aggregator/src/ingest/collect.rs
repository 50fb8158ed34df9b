//! Following each agent's change stream: a long-poll on `/v1/health?wait_generation=G`
//! answers as soon as the agent's document changes, and at the poll timeout otherwise,
//! so a change is heard within tens of milliseconds without polling faster. Every
//! request has a deadline; failures back off with jitter.

use std::sync::Arc;
use std::time::Duration;

use faultline_common::NodeHealth;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Longest the agent holds a poll open.
pub const POLL_WAIT: Duration = Duration::from_secs(10);
/// Deadline of one request: the poll wait plus slack.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Largest document accepted from an agent.
const MAX_DOC: usize = 4 << 20;

/// What a collector reports.
#[derive(Debug)]
pub enum AgentEvent {
    /// The agent's current document.
    Document(Box<NodeHealth>),
    /// The agent at `url` (serving `node`, if known) could not be reached.
    Unreachable { node: String, error: String },
    /// The node left the cluster (or the selector).
    Removed { node: String },
}

/// A shared HTTP client for all agents.
pub type AgentClient = Client<HttpConnector, Empty<Bytes>>;

/// A client with keep-alive connections.
pub fn client() -> AgentClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_secs(3)));
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(http)
}

/// Why an agent's document could not be had.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The URL does not parse.
    #[error("bad url {0}: {1}")]
    Url(String, String),
    /// No answer within the deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection failed.
    #[error("request failed: {0}")]
    Request(String),
    /// The body did not arrive within the deadline.
    #[error("body timed out")]
    BodyTimeout,
    /// The body could not be read (or is over the limit).
    #[error("body: {0}")]
    Body(String),
    /// The agent answered with an error status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status line.
        status: hyper::StatusCode,
        /// The start of the body.
        body: String,
    },
    /// The body is not a node document.
    #[error("not a node document: {0}")]
    Parse(String),
}

impl FetchError {
    /// The kind, as a metric label.
    pub fn metric_label(&self) -> &'static str {
        match self {
            FetchError::Url(..) => "url",
            FetchError::Timeout(_) | FetchError::BodyTimeout => "timeout",
            FetchError::Request(_) => "connect",
            FetchError::Body(_) => "body",
            FetchError::Status { .. } => "status",
            FetchError::Parse(_) => "parse",
        }
    }
}

async fn fetch(client: &AgentClient, url: &str) -> Result<NodeHealth, FetchError> {
    let uri: hyper::Uri = url.parse().map_err(|e: hyper::http::uri::InvalidUri| {
        FetchError::Url(url.to_string(), e.to_string())
    })?;
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, client.get(uri))
        .await
        .map_err(|_| FetchError::Timeout(REQUEST_TIMEOUT))?
        .map_err(|e| FetchError::Request(e.to_string()))?;
    let status = resp.status();
    let body = tokio::time::timeout(
        REQUEST_TIMEOUT,
        Limited::new(resp.into_body(), MAX_DOC).collect(),
    )
    .await
    .map_err(|_| FetchError::BodyTimeout)?
    .map_err(|e| FetchError::Body(e.to_string()))?
    .to_bytes();
    if !status.is_success() {
        return Err(FetchError::Status {
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| FetchError::Parse(e.to_string()))
}

/// Follow one agent until cancelled. `node` names it before its first answer; an agent
/// without a name that cannot be reached is counted and logged, never published (its
/// URL is not a node, and not a valid ConfigMap key).
pub async fn follow(
    base: String,
    mut node: Option<String>,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut generation: Option<u64> = None;
    let mut backoff = Duration::from_millis(500);
    loop {
        let url = match generation {
            Some(g) => format!(
                "{base}/v1/health?wait_generation={g}&timeout_ms={}",
                POLL_WAIT.as_millis()
            ),
            None => format!("{base}/v1/health"),
        };
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = fetch(&client, &url) => r,
        };
        match r {
            Ok(doc) => {
                metrics.agent_poll("ok");
                backoff = Duration::from_millis(500);
                generation = Some(doc.generation);
                node = Some(doc.node.clone());
                if tx.send(AgentEvent::Document(Box::new(doc))).await.is_err() {
                    return;
                }
            }
            Err(error) => {
                metrics.agent_poll("error");
                metrics.agent_poll_error(error.metric_label());
                let error = error.to_string();
                generation = None;
                tracing::debug!(agent = %base, %error, "agent unreachable");
                match &node {
                    Some(node) => {
                        let gone = AgentEvent::Unreachable {
                            node: node.clone(),
                            error,
                        };
                        if tx.send(gone).await.is_err() {
                            return;
                        }
                    }
                    None => {
                        tracing::warn!(agent = %base, %error, "agent unreachable before its first answer: its node is unknown, nothing is published for it (name it with --agents NODE=URL)");
                    }
                }
                // Jitter spreads a fleet's retries after a network blip.
                let jitter = rand::rng().random_range(0.8..1.2);
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}
