//! The intake itself: the token, the bounded body, the N-within-W window per (node,
//! device, metric), the dedup window, and each answer counted by code.

use crate::aged::Aged;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use faultline_common::sync::Locked;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::metrics::{IntakeResult, Metrics};
use crate::model::{Provenance, RecordDevice, Verdict};
use crate::shard::{lease_name, Held, URL_ANNOTATION};

use super::alert::{parse, Alert, AM_PREFIX};
pub use super::answer::*;
use super::forward::{verify_peer, ForwardError};

type Key = (String, String, String);

/// Keys (node, device, metric) counted or acted on at most; past it the oldest go
/// (counted as `evicted`), so a token holder cannot grow memory without bound.
pub const MAX_KEYS: usize = 10_000;
/// Alerts in one request at most.
pub const MAX_ALERTS: usize = 1_000;
/// Longest node name (a DNS-1123 subdomain), device id and metric name accepted; an
/// alert naming longer ones is not attributed to anything.
pub const MAX_NAME: usize = 253;
/// Longest value kept (longer ones are cut).
pub const MAX_VALUE: usize = 256;

/// An Alertmanager alert seen again within this is a retry of the same send; later it
/// is a re-send of a still-firing alert, another observation.
const REPLAY: Duration = Duration::from_secs(30);
type Seen = VecDeque<(Instant, Option<String>)>;

/// Where alerts of shards this replica does not hold go: the holder named by the
/// shard's Lease (its `faultline.io/url` annotation). Counting then happens in one
/// place per node, so N-within-W and the dedup hold with several replicas behind one
/// Service.
pub struct Route {
    /// The shards held here.
    pub held: Held,
    /// How many shards.
    pub shards: u32,
    /// The shard Leases.
    pub leases: kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    /// The replicas' Pods (the Leases' namespace): a holder's advertised URL must be
    /// its own Pod's IP.
    pub pods: kube::Api<k8s_openapi::api::core::v1::Pod>,
    /// The Leases' base name.
    pub name: String,
    /// This replica.
    pub me: String,
}

impl Route {
    /// Whether this replica holds `node`'s shard.
    fn holds(&self, node: &str) -> bool {
        self.held
            .holds(faultline_common::fault::shard_of(node, self.shards))
    }
}

/// Marks a request handed over by another replica: counted here, never passed on.
pub const FORWARDED_HEADER: &str = "x-faultline-forwarded";

/// The intake's state: counts per key and the keys recently acted on.
pub struct Intake {
    cfg: IntakeConfig,
    metrics: Arc<Metrics>,
    tx: mpsc::Sender<Verdict>,
    counts: Mutex<Aged<Key, Seen>>,
    acted: Mutex<Aged<Key, ()>>,
    route: Option<Route>,
    /// The token as last read, with the file's modification time and size: the file
    /// is read again only when it changes (a rotated Secret).
    token: Mutex<Option<(std::time::SystemTime, u64, String)>>,
    /// The clock the windows are judged by (tests move it instead of sleeping).
    clock: faultline_common::time::Clock,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<hyper::body::Bytes>,
    >,
    /// The log lines of alerts that reached the threshold, throttled: one per alert
    /// wrote 933 MB in 70 s under a flood of alerts for nodes that do not exist, and
    /// rotated the audit lines out of the container log. (Audit lines, of actions
    /// taken, are never throttled.)
    logged: Mutex<Throttle>,
}

/// At most [`LOG_LINES`] lines per [`LOG_PERIOD`]; the lines left out are counted into
/// the next one written.
#[derive(Debug, Default)]
struct Throttle {
    since: Option<std::time::Instant>,
    lines: u32,
    left_out: u64,
}

const LOG_LINES: u32 = 20;
const LOG_PERIOD: Duration = Duration::from_secs(10);

impl Throttle {
    /// Whether to write a line now: `Some(lines left out since the last one)`.
    fn allow(&mut self, now: std::time::Instant) -> Option<u64> {
        if self
            .since
            .is_none_or(|s| now.duration_since(s) >= LOG_PERIOD)
        {
            self.since = Some(now);
            self.lines = 0;
        }
        if self.lines >= LOG_LINES {
            self.left_out += 1;
            return None;
        }
        self.lines += 1;
        Some(std::mem::take(&mut self.left_out))
    }
}

/// Largest reply accepted from the holder a request was handed to.
const MAX_FORWARD_REPLY: usize = 64 << 10;

/// Whether `given` equals `secret`, in time that depends on `given`'s length only: no
/// early exit, and a length mismatch is folded into the result.
fn same(given: &[u8], secret: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != secret.len());
    for (i, g) in given.iter().enumerate() {
        let s = if secret.is_empty() {
            0
        } else {
            secret[i % secret.len()]
        };
        diff |= g ^ s;
    }
    diff == 0 && !secret.is_empty()
}

impl Intake {
    /// An intake sending its verdicts to `tx`.
    pub fn new(cfg: IntakeConfig, metrics: Arc<Metrics>, tx: mpsc::Sender<Verdict>) -> Self {
        Intake {
            cfg,
            metrics,
            tx,
            counts: Default::default(),
            acted: Default::default(),
            route: None,
            token: Default::default(),
            clock: Default::default(),
            client: hyper_util::client::legacy::Client::builder(
                hyper_util::rt::TokioExecutor::new(),
            )
            .build_http(),
            logged: Mutex::default(),
        }
    }

    /// Judge the windows by `clock` (tests move it instead of sleeping).
    pub fn with_clock(mut self, clock: faultline_common::time::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Hand alerts of shards held elsewhere to their holder.
    pub fn with_route(mut self, route: Route) -> Self {
        self.route = Some(route);
        self
    }

    /// Send `alerts` (all of `shard`) to the shard's holder; its answer.
    async fn forward(
        &self,
        route: &Route,
        shard: u32,
        alerts: &[Alert],
        token: &str,
    ) -> Result<IntakeSummary, ForwardError> {
        let lname = lease_name(&route.name, shard);
        let lease = route
            .leases
            .get_opt(&lname)
            .await
            .map_err(|source| ForwardError::Lease {
                lease: lname.clone(),
                source,
            })?
            .ok_or(ForwardError::NoHolder(shard))?;
        let holder = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default();
        if holder.is_empty() || holder == route.me {
            return Err(ForwardError::NoHolder(shard));
        }
        let url = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(URL_ANNOTATION))
            .ok_or_else(|| ForwardError::NoUrl {
                holder: holder.clone(),
                url: None,
            })?;
        verify_peer(&route.pods, &holder, url).await?;
        let answer = |why: String| ForwardError::Answer {
            holder: holder.clone(),
            url: url.clone(),
            why,
        };
        let body: Vec<Value> = alerts
            .iter()
            .map(|a| json!({"node_name": a.node, "gpu_uuid": a.uuid, "bus_id": a.bus_id, "metric": a.metric, "value": a.value, "occurrence": a.occurrence, "threshold": a.threshold, "device": a.device}))
            .collect();
        let req = hyper::Request::post(format!("{}/v1/alerts", url.trim_end_matches('/')))
            .header("content-type", "application/json")
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .header(FORWARDED_HEADER, "1")
            .body(http_body_util::Full::new(hyper::body::Bytes::from(
                Value::Array(body).to_string(),
            )))
            .map_err(|e| answer(e.to_string()))?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.client.request(req))
            .await
            .map_err(|_| answer("no answer within 5s".into()))?
            .map_err(|e| answer(e.to_string()))?;
        let status = resp.status();
        // A summary is small; a reply past the limit is refused, not buffered.
        let bytes = tokio::time::timeout(
            Duration::from_secs(5),
            http_body_util::BodyExt::collect(http_body_util::Limited::new(
                resp.into_body(),
                MAX_FORWARD_REPLY,
            )),
        )
        .await
        .map_err(|_| answer("the reply did not arrive within 5s".into()))?
        .map_err(|e| answer(e.to_string()))?
        .to_bytes();
        if status != StatusCode::ACCEPTED {
            return Err(answer(format!("answered {status}")));
        }
        serde_json::from_slice(&bytes).map_err(|e| answer(e.to_string()))
    }

    /// Handle one request: the summary of an accepted one (202), or why not.
    pub async fn handle(
        &self,
        headers: &HeaderMap,
        threshold: Option<usize>,
        body: Body,
    ) -> Result<IntakeSummary, IntakeError> {
        let token = self.authorize(headers)?;
        // A replica handing alerts over adds a few fields: its body may be larger.
        let forwarded = headers.contains_key(FORWARDED_HEADER);
        let limit = if forwarded {
            self.cfg.max_bytes.saturating_mul(4)
        } else {
            self.cfg.max_bytes
        };
        if headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .is_some_and(|n| n > limit)
        {
            return Err(IntakeError::TooLarge(limit));
        }
        let bytes = axum::body::to_bytes(body, limit)
            .await
            .map_err(|_| IntakeError::TooLarge(limit))?;
        let mut alerts = parse(&bytes).map_err(|e| IntakeError::BadRequest(e.to_string()))?;
        if alerts.len() > MAX_ALERTS {
            return Err(IntakeError::BadRequest(format!(
                "{} alerts in one request, at most {MAX_ALERTS} (Alertmanager: set max_alerts on the receiver)",
                alerts.len()
            )));
        }
        for a in &mut alerts {
            a.threshold = a.threshold.or(threshold);
        }
        let mut out = IntakeSummary {
            received: alerts.len() as u64,
            ..Default::default()
        };
        let alerts = match &self.route {
            Some(route) if !forwarded => self.hand_over(route, alerts, &token, &mut out).await?,
            Some(route) => {
                // Handed over to a replica that has lost the shard since: the sender
                // retries (and reads the Lease again).
                if let Some(a) = alerts
                    .iter()
                    .find(|a| a.firing && !a.node.is_empty() && !route.holds(&a.node))
                {
                    return Err(IntakeError::Unavailable(
                        format!("no longer the holder of {}'s shard; retry", a.node),
                        None,
                    ));
                }
                alerts
            }
            None => alerts,
        };
        for (i, a) in alerts.into_iter().enumerate() {
            // Others' turn now and then (a request's alerts, one after the
            // other on the runtime's thread, held up the Lease renewals behind them).
            if i % 64 == 63 {
                tokio::task::yield_now().await;
            }
            let result = self.one(a.clone()).await;
            self.metrics.intake_alert(result.label());
            out.count(result, &a);
        }
        Ok(out)
    }

    /// The token, when the request carries it.
    fn authorize(&self, headers: &HeaderMap) -> Result<String, IntakeError> {
        let token = match self.token() {
            Some(t) => t,
            None => {
                tracing::error!(file = %self.cfg.token_file.display(), "intake token file missing or empty: every alert is refused");
                return Err(IntakeError::Unavailable(
                    "the intake's token is not configured".into(),
                    None,
                ));
            }
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| faultline_common::names::bearer_token(v.as_bytes()));
        match given {
            None => Err(IntakeError::Unauthorized("missing bearer token")),
            Some(t) if !same(t, token.as_bytes()) => {
                Err(IntakeError::Unauthorized("invalid bearer token"))
            }
            Some(_) => Ok(token),
        }
    }

    /// The token from the file: cached, read again when the file's modification time or
    /// size changes. `None` when the file is missing or empty.
    fn token(&self) -> Option<String> {
        let meta = std::fs::metadata(&self.cfg.token_file).ok()?;
        let stamp = (meta.modified().ok()?, meta.len());
        let mut cached = self.token.locked();
        if let Some((m, l, t)) = cached.as_ref() {
            if (*m, *l) == stamp {
                return Some(t.clone());
            }
        }
        let t = std::fs::read_to_string(&self.cfg.token_file)
            .ok()?
            .trim()
            .to_string();
        if t.is_empty() {
            *cached = None;
            return None;
        }
        *cached = Some((stamp.0, stamp.1, t.clone()));
        Some(t)
    }

    /// Firing alerts of shards held elsewhere go to their holder first; if that fails
    /// nothing here is counted either, and the sender's retry of the whole body counts
    /// each alert once. The alerts to count here.
    async fn hand_over(
        &self,
        route: &Route,
        alerts: Vec<Alert>,
        token: &str,
        out: &mut IntakeSummary,
    ) -> Result<Vec<Alert>, IntakeError> {
        let (here, elsewhere): (Vec<Alert>, Vec<Alert>) = alerts
            .into_iter()
            .partition(|a| !a.firing || a.node.is_empty() || route.holds(&a.node));
        let mut by_shard: std::collections::BTreeMap<u32, Vec<Alert>> = Default::default();
        for a in elsewhere {
            by_shard
                .entry(faultline_common::fault::shard_of(&a.node, route.shards))
                .or_default()
                .push(a);
        }
        for (shard, group) in by_shard {
            match self.forward(route, shard, &group, token).await {
                Ok(answer) => out.merge_forwarded(group.len(), answer),
                Err(e) => {
                    tracing::warn!(shard, error = %e, reason = e.metric_label(), "cannot hand alerts over to the shard's holder");
                    return Err(IntakeError::Unavailable(
                        format!("alerts for shard {shard} must go to its holder: {e}; retry"),
                        Some(5),
                    ));
                }
            }
        }
        Ok(here)
    }

    /// Count one alert.
    async fn one(&self, a: Alert) -> AlertOutcome {
        let Some(device) = a
            .uuid
            .clone()
            .or_else(|| a.bus_id.clone())
            .or_else(|| a.device.clone())
        else {
            // A node-level alert names no device: nothing to isolate on a guess.
            tracing::info!(node = %a.node, metric = %a.metric, "alert without a device: not acted on");
            return AlertOutcome::Unattributed;
        };
        if a.node.is_empty() {
            return AlertOutcome::Unattributed;
        }
        if !a.firing {
            return AlertOutcome::Resolved;
        }
        if [&a.node, &device, &a.metric]
            .iter()
            .any(|s| s.len() > MAX_NAME)
        {
            tracing::warn!(node = %a.node.chars().take(64).collect::<String>(), "alert with an over-long node, device or metric name: not acted on");
            return AlertOutcome::Unattributed;
        }
        let key: Key = (a.node.clone(), device.clone(), a.metric.clone());
        let now = self.clock.instant();
        let mut evicted = 0;
        let outcome = {
            // Both maps under their locks at once (counts, then acted): the alert that
            // reaches the threshold and the one right after it cannot both count.
            let mut counts = self.counts.locked();
            let mut acted = self.acted.locked();
            acted.expire(now, self.cfg.dedup);
            if acted.contains_key(&key) {
                return AlertOutcome::Duplicate;
            }
            // Forget keys whose window passed, so the map does not grow forever; past
            // the cap, the oldest go too.
            counts.expire(now, self.cfg.window);
            if !counts.contains_key(&key) {
                evicted += counts.make_room(MAX_KEYS);
            }
            let q = counts.touch(key.clone(), now, Seen::new);
            while q
                .front()
                .is_some_and(|(t, _)| now.duration_since(*t) >= self.cfg.window)
            {
                q.pop_front();
            }
            // The same occurrence again (a sender's retry): not a new observation. A
            // GPUAlert's `time` names its sample for good; an Alertmanager alert is the
            // same send only within REPLAY of when it was last seen.
            if let Some(occ) = &a.occurrence {
                let horizon = occ.starts_with(AM_PREFIX).then_some(REPLAY);
                if q.iter().any(|(t, o)| {
                    o.as_deref() == Some(occ.as_str())
                        && horizon.is_none_or(|h| now.duration_since(*t) < h)
                }) {
                    return AlertOutcome::Duplicate;
                }
            }
            q.push_back((now, a.occurrence.clone()));
            // The sender may say fewer are enough, never more than configured.
            let threshold = a
                .threshold
                .map_or(self.cfg.threshold, |t| t.min(self.cfg.threshold))
                .max(1);
            if q.len() < threshold {
                AlertOutcome::Counted
            } else {
                counts.remove(&key);
                evicted += acted.make_room(MAX_KEYS);
                acted.touch(key, now, || ());
                AlertOutcome::Acted
            }
        };
        for _ in 0..evicted {
            self.metrics.intake_alert(IntakeResult::Evicted);
        }
        if outcome != AlertOutcome::Acted {
            return outcome;
        }
        let verdict = Verdict {
            node: a.node.clone(),
            device: RecordDevice {
                uuid: a.uuid.clone(),
                pci_bus_id: a.bus_id.clone(),
                source: Some(Provenance::Alert),
                metric: Some(a.metric.clone()),
                value: a.value.clone().map(|v| v.chars().take(MAX_VALUE).collect()),
                ..RecordDevice::new(device, format!("alert:{}", a.metric))
            },
        };
        let allowed = self.logged.locked().allow(std::time::Instant::now());
        if let Some(left_out) = allowed {
            tracing::warn!(node = %a.node, metric = %a.metric, value = ?a.value, threshold = self.cfg.threshold, left_out, "alerts reached the threshold: device judged failed (20 such lines per 10 s at most; left_out: those not written since the last)");
        }
        if self.tx.send(verdict).await.is_err() {
            tracing::error!("the core loop is gone: verdict dropped");
        }
        AlertOutcome::Acted
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
