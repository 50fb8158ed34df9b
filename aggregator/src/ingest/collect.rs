//! Following each agent's change stream: a long-poll on `/v1/health?wait_generation=G`
//! answers as soon as the agent's document changes, and at the poll timeout otherwise,
//! so a change is heard within tens of milliseconds without polling faster. Every
//! request has a deadline; failures back off with jitter.

use std::sync::Arc;
use std::time::Duration;

use faultline_common::NodeHealth;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::http::{Conn, HttpError, Target};
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

/// How agents are reached: each follower keeps one connection to its agent
/// ([`super::http`]).
#[derive(Debug, Clone, Copy)]
pub struct AgentClient {
    /// Bound on connecting.
    pub connect_timeout: Duration,
}

/// The agents' client.
pub fn client() -> AgentClient {
    AgentClient {
        connect_timeout: Duration::from_secs(3),
    }
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
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The body is not a node document.
    #[error("not a node document: {0}")]
    Parse(String),
    /// The document is outside the limits (`faultline_common::document::limits`).
    #[error("document refused: {0}")]
    Invalid(String),
    /// The agent speaks for another node than the one followed at its address.
    #[error(
        "identity mismatch: followed as node {expected:?}, the document is for {got:?}; refused"
    )]
    Identity {
        /// The node followed at this address.
        expected: String,
        /// The node the document names.
        got: String,
    },
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
            FetchError::Invalid(_) => "invalid",
            FetchError::Identity { .. } => "identity",
        }
    }
}

async fn fetch(conn: &mut Conn, path: &str) -> Result<NodeHealth, FetchError> {
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, conn.get(path, MAX_DOC))
        .await
        .map_err(|_| FetchError::Timeout(REQUEST_TIMEOUT))?
        .map_err(|e| match e {
            HttpError::Url(e) | HttpError::Io(e) => FetchError::Request(e),
            e @ (HttpError::Malformed(_) | HttpError::TooLarge(_)) => {
                FetchError::Body(e.to_string())
            }
        })?;
    if !(200..300).contains(&resp.status) {
        let body = &resp.body[..resp.body.len().min(200)];
        return Err(FetchError::Status {
            status: resp.status,
            body: String::from_utf8_lossy(body).into_owned(),
        });
    }
    serde_json::from_slice(&resp.body).map_err(|e| FetchError::Parse(e.to_string()))
}

/// The document, if it may be accepted from the agent followed as `pinned`: within the
/// limits, and for that node. The first document of an agent followed without a name
/// pins it.
fn admit(doc: NodeHealth, pinned: &mut Option<String>) -> Result<NodeHealth, FetchError> {
    doc.check_bounds().map_err(FetchError::Invalid)?;
    match pinned {
        Some(expected) if *expected != doc.node => Err(FetchError::Identity {
            expected: expected.clone(),
            got: doc.node,
        }),
        Some(_) => Ok(doc),
        None => {
            *pinned = Some(doc.node.clone());
            Ok(doc)
        }
    }
}

/// Send `ev` unless the follower was stopped first: whoever stops it (its shard was
/// handed back) cancels, then sends `Removed`, so a document can never land after the
/// `Removed` and bring the node back. Whether to go on.
async fn send(tx: &mpsc::Sender<AgentEvent>, ev: AgentEvent, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        r = tx.send(ev) => r.is_ok(),
    }
}

/// Follow one agent until cancelled. `node` is the node followed at this address (the
/// discovered Node, or `--agents NODE=URL`); without one, the first document names and
/// pins it. A document for any other node is refused, counted and logged, and the
/// followed node's agent counts as unreachable: no agent speaks for another node
/// (issue 10). An agent without a name that cannot be reached is counted and logged,
/// never published (its URL is not a node, and not a valid ConfigMap key).
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
    let mut conn = Target::parse(&base).map(|t| Conn::new(t, client.connect_timeout));
    loop {
        let path = match generation {
            Some(g) => format!(
                "/v1/health?wait_generation={g}&timeout_ms={}",
                POLL_WAIT.as_millis()
            ),
            None => "/v1/health".to_string(),
        };
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = async {
                match &mut conn {
                    Ok(c) => fetch(c, &path).await,
                    Err(e) => Err(FetchError::Url(base.clone(), e.to_string())),
                }
            } => r,
        };
        let r = r.and_then(|doc| admit(doc, &mut node));
        match r {
            Ok(doc) => {
                metrics.agent_poll("ok");
                backoff = Duration::from_millis(500);
                generation = Some(doc.generation);
                if !send(&tx, AgentEvent::Document(Box::new(doc)), &cancel).await {
                    return;
                }
            }
            Err(error) => {
                metrics.agent_poll("error");
                metrics.agent_poll_error(error.metric_label());
                let refused = matches!(error, FetchError::Identity { .. } | FetchError::Invalid(_));
                let error = error.to_string();
                generation = None;
                if refused {
                    tracing::warn!(agent = %base, %error, "agent document refused");
                } else {
                    tracing::debug!(agent = %base, %error, "agent unreachable");
                }
                match &node {
                    Some(node) => {
                        let gone = AgentEvent::Unreachable {
                            node: node.clone(),
                            error,
                        };
                        if !send(&tx, gone, &cancel).await {
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use axum::routing::get;

    /// An agent that says it serves whatever node `name` holds at each answer.
    async fn agent(name: Arc<Mutex<String>>) -> String {
        let app = axum::Router::new().route(
            "/v1/health",
            get(move || {
                let name = name.lock().unwrap().clone();
                async move {
                    axum::Json(NodeHealth {
                        schema_version: faultline_common::document::SCHEMA_VERSION.into(),
                        generation: 1,
                        timestamp: "2026-12-01T00:00:00Z".into(),
                        node: name,
                        agent_version: "0".into(),
                        npus: vec![],
                        summary: Default::default(),
                        sources: vec![],
                        unattributed_xids: vec![],
                    })
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        url
    }

    async fn next(rx: &mut mpsc::Receiver<AgentEvent>) -> AgentEvent {
        tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("an event within 20 s")
            .expect("the follower is running")
    }

    /// Issue 10, finding 1: the agent at a discovered node's address cannot speak for
    /// another node; its document is refused and counted, and the followed node's
    /// agent counts as unreachable.
    #[tokio::test]
    async fn an_agent_cannot_speak_for_another_node() {
        let url = agent(Arc::new(Mutex::new("victim".into()))).await;
        let (tx, mut rx) = mpsc::channel(8);
        let metrics = Arc::new(Metrics::new());
        let cancel = CancellationToken::new();
        tokio::spawn(follow(
            url,
            Some("n1".into()),
            client(),
            tx,
            metrics.clone(),
            cancel.clone(),
        ));
        match next(&mut rx).await {
            AgentEvent::Unreachable { node, error } => {
                assert_eq!(node, "n1");
                assert!(error.contains("identity mismatch"), "{error}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(metrics
            .encode()
            .contains(r#"agent_poll_errors_total{kind="identity"} 1"#));
        cancel.cancel();
    }

    /// Issue 10, finding 1: without a name from discovery or `--agents NODE=URL`, the
    /// first document pins the node; a later document for another node is refused (a
    /// name that changes on every answer cannot grow the pipeline).
    #[tokio::test]
    async fn the_first_document_pins_the_node() {
        let name = Arc::new(Mutex::new("a".to_string()));
        let url = agent(name.clone()).await;
        let (tx, mut rx) = mpsc::channel(8);
        let cancel = CancellationToken::new();
        tokio::spawn(follow(
            url,
            None,
            client(),
            tx,
            Arc::new(Metrics::new()),
            cancel.clone(),
        ));
        match next(&mut rx).await {
            AgentEvent::Document(d) => assert_eq!(d.node, "a"),
            other => panic!("{other:?}"),
        }
        *name.lock().unwrap() = "b".into();
        // The long poll returns the next document after the agent's poll wait at the
        // latest; the test agent answers at once.
        match next(&mut rx).await {
            AgentEvent::Unreachable { node, error } => {
                assert_eq!(node, "a");
                assert!(error.contains("\"b\""), "{error}");
            }
            other => panic!("{other:?}"),
        }
        cancel.cancel();
    }
}
