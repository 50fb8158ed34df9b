//! Following each agent's changes. The agent's watch stream
//! (`/v1/health?watch=true`) sends each new document as a line of NDJSON the moment it
//! changes, and the current one again at a heartbeat, on one kept connection: a change
//! costs the follower one read, no request (the request a long-poll sends
//! for every document was a fifth of a replica's CPU). An agent that does not stream
//! is long-polled (`/v1/health?wait_generation=G`: answered as soon as the document
//! changes, at the poll timeout otherwise). Every wait has a deadline; failures back
//! off with jitter.

use std::sync::Arc;
use std::time::Duration;

use faultline_common::document::{DocError, DocView};
use rand::Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::http::{Conn, HttpError, Opened, Response, Target};
use crate::metrics::{Metrics, Poll};

/// Longest the agent holds a poll open.
pub const POLL_WAIT: Duration = Duration::from_secs(10);
/// Deadline of one request: the poll wait plus slack. On a stream, the longest wait
/// for the next bytes (the agent sends its heartbeat every [`POLL_WAIT`]).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// The watch request: documents as they change, and a heartbeat (a blank line) after
/// [`POLL_WAIT`] without a change.
const WATCH_PATH: &str = "/v1/health?watch=true&timeout_ms=10000";
/// A stream that ended (or an agent that does not stream) is asked again no sooner
/// than this after the last request.
const MIN_ROUND: Duration = Duration::from_secs(1);
/// Long polls to an agent that does not stream before it is asked to again.
const POLLS_BEFORE_WATCH: u32 = 60;
/// Largest document accepted from an agent.
const MAX_DOC: usize = 4 << 20;

/// What a collector reports.
#[derive(Debug)]
pub enum AgentEvent {
    /// A document as the agent followed as `node` sent it (a line of its stream, or the
    /// answer to a poll), to be read, checked ([`admit_raw`], the one gate) and judged by
    /// the core loop: parsed on the thread that judges and drops it, its memory is
    /// allocated and freed by one thread (a document parsed by a follower and
    /// freed by the core cost mimalloc's cross-thread free and collect paths a quarter of
    /// the parse).
    Raw {
        /// The node followed.
        node: Arc<str>,
        /// The document's bytes.
        body: Vec<u8>,
    },
    /// The agent at `url` (serving `node`, if known) could not be reached.
    Unreachable { node: String, error: String },
    /// The node left the cluster (or the selector).
    Removed { node: String },
}

/// How agents are reached: each follower keeps one connection to its agent
/// ([`super::http`]).
#[derive(Debug, Clone)]
pub struct AgentClient {
    /// Bound on connecting.
    pub connect_timeout: Duration,
    /// The delivery token, sent with every request: the agent keeps connections for it
    /// when the others are taken.
    pub bearer: Option<Arc<str>>,
}

/// The agents' client.
pub fn client() -> AgentClient {
    AgentClient {
        connect_timeout: Duration::from_secs(3),
        bearer: None,
    }
}

impl AgentClient {
    /// The same client, sending `token` (the delivery token) with every request.
    pub fn with_bearer(mut self, token: Option<&str>) -> Self {
        self.bearer = token.map(Arc::from);
        self
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
    Parse(DocError),
    /// The document is outside the limits (`faultline_common::document::limits`).
    #[error("document refused: {0}")]
    Invalid(DocError),
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
    /// An agent followed by URL alone names a node that another address serves.
    #[error("the document is for node {node:?}, which the agent at {by} serves; refused")]
    Claimed {
        /// The node the document names.
        node: String,
        /// Where that node's agent is followed.
        by: String,
    },
}

/// Which address serves which node, for the agents followed by URL alone
/// (finding 5: a bare `--agents URL` whose agent named node-b got node-b quarantined
/// though `node-b=URL` was listed too). The nodes named in `--agents NODE=URL` are
/// claimed from the start; a bare URL's first document claims its node if nobody has.
#[derive(Clone, Default)]
pub struct Claims(Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>);

impl Claims {
    /// `node` served at `url` (the first claim stands).
    pub fn claim(&self, node: &str, url: &str) -> Result<(), FetchError> {
        use faultline_common::sync::Locked;
        let mut m = self.0.locked();
        match m.get(node) {
            Some(by) if by != url => Err(FetchError::Claimed {
                node: node.to_string(),
                by: by.clone(),
            }),
            Some(_) => Ok(()),
            None => {
                m.insert(node.to_string(), url.to_string());
                Ok(())
            }
        }
    }
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
            FetchError::Identity { .. } | FetchError::Claimed { .. } => "identity",
        }
    }
}

fn request_error(e: HttpError) -> FetchError {
    match e {
        HttpError::Url(e) | HttpError::Io(e) => FetchError::Request(e),
        e @ (HttpError::Malformed(_) | HttpError::TooLarge(_)) => FetchError::Body(e.to_string()),
    }
}

fn status_error(resp: &Response) -> FetchError {
    let body = &resp.body[..resp.body.len().min(200)];
    FetchError::Status {
        status: resp.status,
        body: String::from_utf8_lossy(body).into_owned(),
    }
}

async fn fetch(conn: &mut Conn, path: &str) -> Result<Vec<u8>, FetchError> {
    let resp = tokio::time::timeout(REQUEST_TIMEOUT, conn.get(path, MAX_DOC))
        .await
        .map_err(|_| FetchError::Timeout(REQUEST_TIMEOUT))?
        .map_err(request_error)?;
    if !(200..300).contains(&resp.status) {
        return Err(status_error(&resp));
    }
    Ok(resp.body)
}

/// How a watch ended.
enum Watched {
    /// The agent ended the stream (a stream's life is bounded): watch again at once.
    Ended,
    /// The agent does not stream: it answered with one document (an agent that ignores
    /// the parameter, or one at its cap of waiters), or refused the parameter (an
    /// agent from before streams: 400).
    NotStreaming(Option<Result<Vec<u8>, FetchError>>),
    /// The follower was stopped.
    Stopped,
}

/// Where a follower stands with its agent.
struct Following<'a> {
    /// The node followed (pinned by the first document when not named).
    node: Option<String>,
    /// The same, shared with the raw documents sent to the core.
    pinned: Option<Arc<str>>,
    /// For an agent followed by URL alone: the nodes others serve, and this address.
    claims: Option<(Claims, &'a str)>,
    /// The last generation received.
    generation: Option<u64>,
    tx: &'a mpsc::Sender<AgentEvent>,
    metrics: &'a Metrics,
    cancel: &'a CancellationToken,
}

impl Following<'_> {
    /// A whole document (a poll's answer, or the first line of a stream from an agent
    /// followed without a name): read through the gate for the node it pins and the
    /// generation to ask after, then sent raw; the core reads it through the same gate
    /// ([`admit_raw`]). Only agents that do not stream, and a first line, are read twice.
    /// Whether to go on.
    async fn deliver(&mut self, body: Vec<u8>) -> Result<bool, FetchError> {
        let (node, generation) = {
            let doc = match &self.node {
                Some(n) => admit_raw(n, &body)?,
                None => read(&body)?,
            };
            (doc.node.into_owned(), doc.generation)
        };
        if self.node.is_none() {
            if let Some((claims, url)) = &self.claims {
                claims.claim(&node, url)?;
            }
        }
        let pinned = match &self.pinned {
            Some(p) if **p == *node => p.clone(),
            _ => Arc::from(node.as_str()),
        };
        self.node.get_or_insert(node);
        self.pinned = Some(pinned.clone());
        self.generation = Some(generation);
        let ev = AgentEvent::Raw { node: pinned, body };
        Ok(send(self.tx, ev, self.cancel).await)
    }

    /// A line of the stream: sent raw to the core once the node is known (the core
    /// reads and checks it, [`admit_raw`]); the first of an agent followed without a
    /// name is read here, to pin the node. Whether to go on.
    async fn deliver_line(&mut self, line: Vec<u8>) -> Result<bool, FetchError> {
        if self.pinned.is_none() {
            if let Some(n) = &self.node {
                self.pinned = Some(Arc::from(n.as_str()));
            }
        }
        let Some(node) = self.pinned.clone() else {
            return self.deliver(line).await;
        };
        // The generation is not read here: a stream asked for again starts from the
        // current document, which the pipeline takes as one more sample.
        self.generation = None;
        let ev = AgentEvent::Raw { node, body: line };
        Ok(send(self.tx, ev, self.cancel).await)
    }

    /// Read the agent's watch stream: each document as the agent sends it (a change,
    /// or the current one again at the heartbeat), one read and no request each.
    async fn watch(&mut self, conn: &mut Conn) -> Result<Watched, FetchError> {
        let path = match self.generation {
            Some(g) => format!("{WATCH_PATH}&wait_generation={g}"),
            None => WATCH_PATH.to_string(),
        };
        let opened = tokio::time::timeout(REQUEST_TIMEOUT, conn.open_stream(&path, MAX_DOC))
            .await
            .map_err(|_| FetchError::Timeout(REQUEST_TIMEOUT))?
            .map_err(request_error)?;
        match opened {
            Opened::Whole(resp) if resp.status == 400 => return Ok(Watched::NotStreaming(None)),
            Opened::Whole(resp) if (200..300).contains(&resp.status) => {
                return Ok(Watched::NotStreaming(Some(Ok(resp.body))))
            }
            Opened::Whole(resp) => return Err(status_error(&resp)),
            Opened::Stream => {}
        }
        // The agent sends a document or its heartbeat (a blank line) within the poll
        // wait: a line ended, either, restarts the deadline; bytes that end no line do
        // not (a byte every 5 s kept a stream, and its node, "reachable" with a
        // frozen document). One timer for the stream, moved on only when it fires
        // (a timeout armed for each read was a timer wheel insertion and
        // removal per document).
        let mut last_read = tokio::time::Instant::now();
        let mut ended = conn.lines_ended();
        let deadline = tokio::time::sleep(REQUEST_TIMEOUT);
        tokio::pin!(deadline);
        loop {
            let mut lines = Vec::new();
            let mut keep = |line: &[u8]| lines.push(line.to_vec());
            let read = loop {
                tokio::select! {
                    biased;
                    r = conn.next_lines(MAX_DOC, &mut keep) => break r,
                    _ = &mut deadline => {
                        if last_read.elapsed() >= REQUEST_TIMEOUT {
                            return Err(FetchError::Timeout(REQUEST_TIMEOUT));
                        }
                        deadline.as_mut().reset(last_read + REQUEST_TIMEOUT);
                    }
                }
            }
            .map_err(request_error)?;
            if conn.lines_ended() != ended {
                ended = conn.lines_ended();
                last_read = tokio::time::Instant::now();
            }
            for line in lines {
                if !self.deliver_line(line).await? {
                    return Ok(Watched::Stopped);
                }
            }
            if read.is_none() {
                return Ok(Watched::Ended);
            }
        }
    }

    /// An agent that could not be had: counted, logged, and its node unreachable.
    /// Whether to go on.
    async fn failed(&mut self, base: &str, error: FetchError) -> bool {
        self.metrics.agent_poll(Poll::Error);
        self.metrics.agent_poll_error(error.metric_label());
        let refused = matches!(
            error,
            FetchError::Identity { .. } | FetchError::Claimed { .. } | FetchError::Invalid(_)
        );
        let error = error.to_string();
        self.generation = None;
        if refused {
            tracing::warn!(agent = %base, %error, "agent document refused");
        } else {
            tracing::debug!(agent = %base, %error, "agent unreachable");
        }
        match &self.node {
            Some(node) => {
                let gone = AgentEvent::Unreachable {
                    node: node.clone(),
                    error,
                };
                send(self.tx, gone, self.cancel).await
            }
            None => {
                tracing::warn!(agent = %base, %error, "agent unreachable before its first answer: its node is unknown, nothing is published for it (name it with --agents NODE=URL)");
                true
            }
        }
    }
}

/// The one gate for agents' documents: the bytes received from the agent
/// followed as `node`, if they may be accepted: a node document, within the limits, and
/// for that node. Streamed and polled documents alike pass here, and nothing
/// downstream checks them again with other rules.
pub fn admit_raw<'a>(node: &str, body: &'a [u8]) -> Result<DocView<'a>, FetchError> {
    let doc = read(body)?;
    if doc.node != node {
        return Err(FetchError::Identity {
            expected: node.to_string(),
            got: doc.node.into_owned(),
        });
    }
    Ok(doc)
}

/// The gate short of the identity check: a node document within the limits. Only the
/// first document of an agent followed without a name, which then pins its node, is read
/// so; every document the core judges passes [`admit_raw`].
fn read(body: &[u8]) -> Result<DocView<'_>, FetchError> {
    let doc = DocView::parse(body).map_err(FetchError::Parse)?;
    doc.check_bounds().map_err(FetchError::Invalid)?;
    Ok(doc)
}

/// Send `ev` unless the follower was stopped first: whoever stops it (its shard was
/// handed back) cancels, then sends `Removed`, so a document can never land after the
/// `Removed` and bring the node back. Whether to go on.
async fn send(tx: &mpsc::Sender<AgentEvent>, ev: AgentEvent, cancel: &CancellationToken) -> bool {
    // Room in the channel (the usual case): sent without waiting, or registering a
    // waiter on the token, for each document.
    let ev = match tx.try_send(ev) {
        Ok(()) => return true,
        Err(mpsc::error::TrySendError::Closed(_)) => return false,
        Err(mpsc::error::TrySendError::Full(ev)) => ev,
    };
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        r = tx.send(ev) => r.is_ok(),
    }
}

/// Follow one agent until cancelled. `node` is the node followed at this address (the
/// discovered Node, or `--agents NODE=URL`); without one, the first document names and
/// pins it. A document for any other node is refused, counted and logged, and the
/// followed node's agent counts as unreachable: no agent speaks for another node.
/// An agent without a name that cannot be reached is counted and logged,
/// never published (its URL is not a node, and not a valid ConfigMap key).
pub async fn follow(
    base: String,
    node: Option<String>,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    follow_claimed(base, node, None, client, tx, metrics, cancel).await
}

/// [`follow`], for an agent followed by URL alone: its first document may name only a
/// node no other address serves (`claims`), else it is refused and counted.
pub async fn follow_unnamed(
    base: String,
    claims: Claims,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    follow_claimed(base, None, Some(claims), client, tx, metrics, cancel).await
}

async fn follow_claimed(
    base: String,
    node: Option<String>,
    claims: Option<Claims>,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut f = Following {
        node,
        pinned: None,
        claims: claims.map(|c| (c, base.as_str())),
        generation: None,
        tx: &tx,
        metrics: &metrics,
        cancel: &cancel,
    };
    let mut backoff = Duration::from_millis(500);
    let mut conn = Target::parse(&base)
        .map(|t| Conn::new(t, client.connect_timeout).with_bearer(client.bearer.clone()));
    // Long polls left before the stream is tried again (0: watch).
    let mut polls_left = 0u32;
    loop {
        let round = tokio::time::Instant::now();
        let r = tokio::select! {
            _ = cancel.cancelled() => return,
            r = async {
                let c = match &mut conn {
                    Ok(c) => c,
                    Err(e) => return Err(FetchError::Url(base.clone(), e.to_string())),
                };
                if polls_left == 0 {
                    match f.watch(c).await? {
                        Watched::Ended => Ok(None),
                        Watched::Stopped => Ok(Some(Err(()))),
                        Watched::NotStreaming(doc) => {
                            f.metrics.agent_watch_fallback();
                            polls_left = POLLS_BEFORE_WATCH;
                            match doc {
                                Some(doc) => Ok(Some(Ok(doc?))),
                                None => Ok(None),
                            }
                        }
                    }
                } else {
                    polls_left -= 1;
                    let path = match f.generation {
                        Some(g) => format!(
                            "/v1/health?wait_generation={g}&timeout_ms={}",
                            POLL_WAIT.as_millis()
                        ),
                        None => "/v1/health".to_string(),
                    };
                    fetch(c, &path).await.map(|d| Some(Ok(d)))
                }
            } => r,
        };
        let error = match r {
            // The stream ended, or the agent does not stream: on at once.
            Ok(None) => {
                backoff = Duration::from_millis(500);
                // An agent that ends its streams at once is not asked again in a loop.
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(round + MIN_ROUND) => {}
                }
                continue;
            }
            Ok(Some(Err(()))) => return,
            Ok(Some(Ok(doc))) => match f.deliver(doc).await {
                Ok(true) => {
                    backoff = Duration::from_millis(500);
                    continue;
                }
                Ok(false) => return,
                Err(e) => e,
            },
            Err(e) => e,
        };
        if !f.failed(&base, error).await {
            return;
        }
        // After an error, the stream is tried first (the agent may have been upgraded).
        polls_left = 0;
        // Jitter spreads a fleet's retries after a network blip.
        let jitter = rand::rng().random_range(0.8..1.2);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff.mul_f64(jitter)) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use axum::routing::get;
    use faultline_common::NodeHealth;

    /// An agent that says it serves whatever node `name` holds at each answer.
    async fn agent(name: Arc<Mutex<String>>) -> String {
        let app = axum::Router::new().route(
            "/v1/health",
            get(move || {
                let name = name.lock().unwrap().clone();
                async move { axum::Json(doc_of(&name, 1)) }
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

    /// The agent at a discovered node's address cannot speak for
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

    /// An agent followed by URL alone may not name a node that
    /// another address serves; its documents are refused and counted, none reaches the
    /// core. One naming a node nobody serves is followed as before.
    #[tokio::test]
    async fn a_bare_url_cannot_take_a_node_another_address_serves() {
        let claims = Claims::default();
        claims.claim("node-b", "http://10.0.0.2:8081").unwrap();
        let hostile = agent(Arc::new(Mutex::new("node-b".into()))).await;
        let honest = agent(Arc::new(Mutex::new("node-c".into()))).await;
        let (tx, mut rx) = mpsc::channel(8);
        let metrics = Arc::new(Metrics::new());
        let cancel = CancellationToken::new();
        tokio::spawn(follow_unnamed(
            hostile,
            claims.clone(),
            client(),
            tx.clone(),
            metrics.clone(),
            cancel.clone(),
        ));
        let needle = r#"agent_poll_errors_total{kind="identity"}"#;
        let start = std::time::Instant::now();
        while !metrics.encode().contains(needle) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no refusal counted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::spawn(follow_unnamed(
            honest,
            claims.clone(),
            client(),
            tx,
            metrics.clone(),
            cancel.clone(),
        ));
        match next(&mut rx).await {
            AgentEvent::Raw { node, .. } => assert_eq!(&*node, "node-c", "only node-c's"),
            other => panic!("expected node-c's document, got {other:?}"),
        }
        assert!(matches!(
            claims.claim("node-b", "http://elsewhere:1"),
            Err(FetchError::Claimed { by, .. }) if by == "http://10.0.0.2:8081"
        ));
        cancel.cancel();
    }

    /// Without a name from discovery or `--agents NODE=URL`, the
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
            AgentEvent::Raw { node, body } => {
                assert_eq!(&*node, "a");
                assert_eq!(admit_raw(&node, &body).unwrap().node, "a");
            }
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

    /// Node `node`'s document at `generation`, without devices.
    fn doc_of(node: &str, generation: u64) -> NodeHealth {
        faultline_common::testing::node(node)
            .generation(generation)
            .build()
    }

    /// The requests an agent double saw (path and query), in order.
    type Seen = Arc<Mutex<Vec<String>>>;

    /// The follower reads the agent's watch stream: each line is handed to
    /// the core raw, for the node followed, and read and checked there ([`admit_raw`]:
    /// a line that is not a document is refused, as is a document for another node);
    /// a blank line (the heartbeat) is none; when the agent ends the stream, it asks
    /// again.
    #[tokio::test]
    async fn a_watch_stream_hands_each_line_over_and_asks_again_at_its_end() {
        let seen: Seen = Arc::default();
        let s2 = seen.clone();
        let app = axum::Router::new().route(
            "/v1/health",
            get(move |uri: axum::http::Uri| {
                let seen = s2.clone();
                async move {
                    let q = uri.query().unwrap_or("").to_string();
                    let n = {
                        let mut s = seen.lock().unwrap();
                        s.push(q);
                        s.len()
                    };
                    let line = |g| {
                        let mut l = serde_json::to_vec(&doc_of("n1", g)).unwrap();
                        l.push(b'\n');
                        Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(l))
                    };
                    let lines = match n {
                        1 => vec![line(1), Ok("\n".into()), line(2)],
                        2 => vec![line(3), Ok("not json\n".into())],
                        _ => vec![],
                    };
                    (
                        [("content-type", "application/x-ndjson")],
                        axum::body::Body::from_stream(futures_util::stream::iter(lines)),
                    )
                }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
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
        let mut got = Vec::new();
        for _ in 0..4 {
            match next(&mut rx).await {
                AgentEvent::Raw { node, body } => {
                    assert_eq!(&*node, "n1");
                    got.push(admit_raw(&node, &body).map(|d| d.generation));
                }
                other => panic!("expected a raw document: {other:?}"),
            }
        }
        assert!(matches!(got[..3], [Ok(1), Ok(2), Ok(3)]), "{got:?}");
        assert!(matches!(got[3], Err(FetchError::Parse(_))), "{got:?}");
        // The same line for another node is refused.
        let other = serde_json::to_vec(&doc_of("n2", 4)).unwrap();
        assert!(matches!(
            admit_raw("n1", &other),
            Err(FetchError::Identity { .. })
        ));
        cancel.cancel();
        let seen = seen.lock().unwrap().clone();
        assert!(seen.len() >= 2, "asked again: {seen:?}");
        assert!(
            seen.iter().all(|q| q == "watch=true&timeout_ms=10000"),
            "{seen:?}"
        );
        let text = metrics.encode();
        assert!(text.contains("agent_watch_fallbacks_total 0"), "{text}");
    }

    /// A stream kept open by a byte every few seconds, which never ends a line,
    /// does not keep its node reachable with a frozen document: past the request timeout
    /// without a whole line (a document or the heartbeat) it is given up.
    #[tokio::test]
    async fn a_trickled_stream_is_given_up() {
        use futures_util::StreamExt;
        let app = axum::Router::new().route(
            "/v1/health",
            get(|| async {
                let first = {
                    let mut l = serde_json::to_vec(&doc_of("n1", 1)).unwrap();
                    l.push(b'\n');
                    l
                };
                let trickle = futures_util::stream::unfold(0u32, |i| async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    (i < 100).then(|| {
                        (
                            Ok::<_, std::convert::Infallible>(axum::body::Bytes::from_static(b" ")),
                            i + 1,
                        )
                    })
                });
                let body = futures_util::stream::once(async move {
                    Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(first))
                })
                .chain(trickle);
                (
                    [("content-type", "application/x-ndjson")],
                    axum::body::Body::from_stream(body),
                )
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        let (tx, mut rx) = mpsc::channel(8);
        let cancel = CancellationToken::new();
        tokio::spawn(follow(
            url,
            Some("n1".into()),
            client(),
            tx,
            Arc::new(Metrics::new()),
            cancel.clone(),
        ));
        assert!(matches!(next(&mut rx).await, AgentEvent::Raw { .. }));
        let start = tokio::time::Instant::now();
        match next(&mut rx).await {
            AgentEvent::Unreachable { node, error } => {
                assert_eq!(node, "n1");
                assert!(error.contains("no answer within"), "{error}");
            }
            other => panic!("expected the stream given up, got {other:?}"),
        }
        assert!(start.elapsed() <= REQUEST_TIMEOUT + Duration::from_secs(3));
        cancel.cancel();
    }

    /// An agent from before streams refuses `watch` (400: it knows no such parameter):
    /// the follower long-polls it, counted, and never marks it unreachable for that.
    #[tokio::test]
    async fn an_agent_that_does_not_stream_is_long_polled() {
        let seen: Seen = Arc::default();
        let s2 = seen.clone();
        let app = axum::Router::new().route(
            "/v1/health",
            get(move |uri: axum::http::Uri| {
                let seen = s2.clone();
                async move {
                    let q = uri.query().unwrap_or("").to_string();
                    seen.lock().unwrap().push(q.clone());
                    if q.contains("watch") {
                        return (axum::http::StatusCode::BAD_REQUEST, "unknown field `watch`")
                            .into_response();
                    }
                    if q.contains("wait_generation") {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    axum::Json(doc_of("n1", 5)).into_response()
                }
            }),
        );
        use axum::response::IntoResponse;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
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
        for _ in 0..3 {
            match next(&mut rx).await {
                AgentEvent::Raw { node, body } => {
                    assert_eq!(admit_raw(&node, &body).unwrap().generation, 5)
                }
                other => panic!("{other:?}"),
            }
        }
        cancel.cancel();
        let seen = seen.lock().unwrap().clone();
        assert!(seen[0].starts_with("watch=true"), "{seen:?}");
        assert_eq!(seen[1], "", "then a plain read: {seen:?}");
        assert!(
            seen[2].starts_with("wait_generation=5"),
            "then long polls: {seen:?}"
        );
        assert_eq!(seen.iter().filter(|q| q.contains("watch")).count(), 1);
        let text = metrics.encode();
        assert!(text.contains("agent_watch_fallbacks_total 1"), "{text}");
        assert!(!text.contains("agent_poll_errors_total{"), "{text}");
    }
}
