//! Telling people: every remediation announcement (the same ones that become Events)
//! goes to the configured webhooks as JSON, retried with backoff, from a bounded queue
//! so a slow or dead receiver never holds remediation up (a full queue drops, counted).
//!
//! `--notify URL` posts faultline's own payload ([`Notification`]); `--notify
//! FORMAT=URL` renders for a chat tool: `slack`, `wecom` (企业微信), `dingtalk` (钉钉),
//! `feishu` (飞书). Examples of each body are in docs/remediation.md.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::model::RecordDevice;

/// The body shape a receiver expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// faultline's [`Notification`] as JSON.
    Generic,
    /// Slack incoming webhook: `{"text": ...}`.
    Slack,
    /// WeCom group robot: `{"msgtype":"text","text":{"content":...}}`.
    Wecom,
    /// DingTalk custom robot: `{"msgtype":"text","text":{"content":...}}`.
    Dingtalk,
    /// Feishu/Lark custom bot: `{"msg_type":"text","content":{"text":...}}`.
    Feishu,
}

/// One receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Where to POST.
    pub url: String,
    /// What to send.
    pub format: Format,
}

impl std::str::FromStr for Target {
    type Err = String;

    /// `URL` or `FORMAT=URL`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (format, url) = match s.split_once('=') {
            Some((f, u)) if !f.contains(':') => {
                let format = match f {
                    "generic" | "json" => Format::Generic,
                    "slack" => Format::Slack,
                    "wecom" => Format::Wecom,
                    "dingtalk" => Format::Dingtalk,
                    "feishu" | "lark" => Format::Feishu,
                    other => {
                        return Err(format!(
                        "--notify {other}=...: expected generic, slack, wecom, dingtalk or feishu"
                    ))
                    }
                };
                (format, u)
            }
            _ => (Format::Generic, s),
        };
        let uri: hyper::Uri = url.parse().map_err(|e| format!("--notify {url:?}: {e}"))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            // TLS receivers sit behind a local relay or a Service mesh; the aggregator
            // speaks plain HTTP only (no TLS stack in the binary).
            return Err(format!(
                "--notify {url:?}: expected http://HOST[:PORT]/PATH"
            ));
        }
        Ok(Target {
            url: url.to_string(),
            format,
        })
    }
}

/// How serious a notification is.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Something was done to a node, or could not be.
    Warning,
    /// For the record (a dry run, a release).
    Info,
}

impl Severity {
    /// `warning` or `info`.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Warning => "warning",
            Severity::Info => "info",
        }
    }
}

faultline_common::label_values!(
    /// What became of one notification for one receiver (`result` of
    /// `notifications_total`).
    Delivery {
        /// Accepted at the first attempt.
        Sent => "sent",
        /// Accepted after a failure.
        Retried => "retried",
        /// Refused or unreachable on every attempt.
        Failed => "failed",
        /// Not queued: the queue was full.
        Dropped => "dropped",
    }
);

/// Told of every delivery's outcome (the metrics).
pub type OnDelivery = Arc<dyn Fn(Delivery) + Send + Sync>;

/// What happened, as sent to a generic receiver.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Notification {
    /// The Event reason: `FaultlineQuarantined`, `FaultlineEvicted`, ...
    pub kind: String,
    /// `warning` or `info`.
    pub severity: Severity,
    /// The node.
    pub node: String,
    /// The devices concerned, with UUID, bus id, source, metric and value.
    pub devices: Vec<RecordDevice>,
    /// What was done or seen.
    pub message: String,
    /// Who did it (the replica, or `user:NAME`).
    pub actor: String,
    /// When (RFC 3339).
    pub at: String,
}

impl Notification {
    fn line(&self) -> String {
        format!(
            "[faultline] {} {} on {}: {}",
            self.severity.as_str().to_uppercase(),
            self.kind,
            self.node,
            self.message
        )
    }
}

/// The body for a receiver of `format`.
pub fn render(format: Format, n: &Notification) -> serde_json::Value {
    let line = n.line();
    match format {
        Format::Generic => serde_json::to_value(n).unwrap_or_default(),
        Format::Slack => serde_json::json!({ "text": line }),
        Format::Wecom | Format::Dingtalk => {
            serde_json::json!({ "msgtype": "text", "text": { "content": line } })
        }
        Format::Feishu => serde_json::json!({ "msg_type": "text", "content": { "text": line } }),
    }
}

/// Sends notifications in the background.
pub struct Notifier {
    tx: mpsc::Sender<Notification>,
    on_delivery: OnDelivery,
}

/// Attempts per notification and receiver.
const ATTEMPTS: u32 = 4;
/// Deadline of one attempt.
const TIMEOUT: Duration = Duration::from_secs(5);

impl Notifier {
    /// Start the sender; it stops with `cancel` (after the queue is drained, within
    /// one attempt's deadline per receiver).
    pub fn start(targets: Vec<Target>, on_delivery: OnDelivery, cancel: CancellationToken) -> Self {
        let (tx, mut rx) = mpsc::channel::<Notification>(1024);
        let m = on_delivery.clone();
        // A panic here is logged; what is sent after it counts as dropped.
        let worker = async move {
            let client: Client<HttpConnector, Full<Bytes>> =
                Client::builder(TokioExecutor::new()).build(HttpConnector::new());
            loop {
                let n = tokio::select! {
                    n = rx.recv() => n,
                    _ = cancel.cancelled() => rx.try_recv().ok(),
                };
                let Some(n) = n else { break };
                for t in &targets {
                    let body = render(t.format, &n).to_string();
                    let result = send(&client, &t.url, body, &cancel).await;
                    m(result);
                    if result == Delivery::Failed {
                        tracing::warn!(url = %t.url, kind = %n.kind, node = %n.node, "notification not delivered");
                    }
                }
            }
        };
        faultline_common::supervise::spawn_contained("notifier", worker, |_| {});
        Notifier { tx, on_delivery }
    }

    /// Queue a notification (dropped, and counted, when the queue is full).
    pub fn send(&self, n: Notification) {
        if self.tx.try_send(n).is_err() {
            (self.on_delivery)(Delivery::Dropped);
        }
    }
}

/// POST `body`, retried with backoff on errors and non-2xx answers.
async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: String,
    cancel: &CancellationToken,
) -> Delivery {
    let mut backoff = Duration::from_millis(500);
    for attempt in 0..ATTEMPTS {
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())));
        let Ok(req) = req else {
            return Delivery::Failed;
        };
        let ok = matches!(
            tokio::time::timeout(TIMEOUT, client.request(req)).await,
            Ok(Ok(r)) if r.status().is_success()
        );
        if ok {
            return if attempt == 0 {
                Delivery::Sent
            } else {
                Delivery::Retried
            };
        }
        if attempt + 1 < ATTEMPTS {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                // Shutting down: one more try at once, no more waiting.
                _ = cancel.cancelled() => {}
            }
            backoff *= 2;
        }
    }
    Delivery::Failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Notification {
        Notification {
            kind: "FaultlineQuarantined".into(),
            severity: Severity::Warning,
            node: "gpu-node-01".into(),
            devices: vec![RecordDevice {
                uuid: Some("GPU-123456".into()),
                pci_bus_id: Some("00000000:3B:00.0".into()),
                source: Some(crate::model::Provenance::Alert),
                metric: Some("xid_error".into()),
                value: Some("Xid 79".into()),
                ..RecordDevice::new("gpu3", "alert:xid_error")
            }],
            message: "tainted nvidia.com/gpu-fault".into(),
            actor: "faultline-0".into(),
            at: "2026-11-29T12:00:00Z".into(),
        }
    }

    #[test]
    fn targets_parse_with_and_without_a_format() {
        let t: Target = "http://hooks.local/x".parse().unwrap();
        assert_eq!(t.format, Format::Generic);
        let t: Target = "feishu=http://relay:8080/open-apis/bot/v2/hook/abc"
            .parse()
            .unwrap();
        assert_eq!(t.format, Format::Feishu);
        assert_eq!(t.url, "http://relay:8080/open-apis/bot/v2/hook/abc");
        // A query string with '=' is part of the URL, not a format.
        let t: Target = "http://relay/robot/send?access_token=abc".parse().unwrap();
        assert_eq!(t.format, Format::Generic);
        assert!("teams=http://x/".parse::<Target>().is_err());
        assert!("https://x/".parse::<Target>().is_err());
    }

    #[test]
    fn each_format_has_the_receivers_shape() {
        let n = sample();
        let g = render(Format::Generic, &n);
        assert_eq!(g["devices"][0]["uuid"], "GPU-123456");
        assert_eq!(g["devices"][0]["value"], "Xid 79");
        let line =
            "[faultline] WARNING FaultlineQuarantined on gpu-node-01: tainted nvidia.com/gpu-fault";
        assert_eq!(render(Format::Slack, &n), serde_json::json!({"text": line}));
        assert_eq!(
            render(Format::Wecom, &n),
            serde_json::json!({"msgtype": "text", "text": {"content": line}})
        );
        assert_eq!(
            render(Format::Dingtalk, &n),
            serde_json::json!({"msgtype": "text", "text": {"content": line}})
        );
        assert_eq!(
            render(Format::Feishu, &n),
            serde_json::json!({"msg_type": "text", "content": {"text": line}})
        );
    }

    /// A receiver that fails twice then accepts gets the notification once, counted
    /// as retried.
    #[tokio::test]
    async fn a_failing_receiver_is_retried() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let hits = Arc::new(AtomicUsize::new(0));
        let bodies = Arc::new(std::sync::Mutex::new(Vec::<serde_json::Value>::new()));
        let app = {
            let (hits, bodies) = (hits.clone(), bodies.clone());
            axum::Router::new().route(
                "/hook",
                axum::routing::post(move |body: axum::body::Bytes| async move {
                    if hits.fetch_add(1, Ordering::SeqCst) < 2 {
                        return axum::http::StatusCode::BAD_GATEWAY;
                    }
                    bodies
                        .lock()
                        .unwrap()
                        .push(serde_json::from_slice(&body).unwrap());
                    axum::http::StatusCode::OK
                }),
            )
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let outcomes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = outcomes.clone();
        let n = Notifier::start(
            vec![format!("slack=http://{addr}/hook").parse().unwrap()],
            Arc::new(move |d| seen.lock().unwrap().push(d)),
            CancellationToken::new(),
        );
        n.send(sample());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while bodies.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(hits.load(Ordering::SeqCst), 3);
        assert_eq!(bodies.lock().unwrap().len(), 1);
        assert!(bodies.lock().unwrap()[0]["text"]
            .as_str()
            .unwrap()
            .contains("gpu-node-01"));
        // The outcome is told after the answer: give it a moment.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while outcomes.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(*outcomes.lock().unwrap(), vec![Delivery::Retried]);
    }
}
