//! Isolation of a node whose accelerator failed (first part of issue 4): the quarantine
//! record, a taint, a label, a node condition and an Event, each idempotent against the
//! live Node.
//!
//! The record lives in the Node's own annotation `faultline.io/quarantine` (JSON): it is
//! readable with `kubectl get node -o yaml`, it goes away with the Node, and a new leader
//! reads it back instead of starting over. It lists which taint and label faultline
//! itself added, so a release removes only those and never what someone else put there.
//! Writes go as a JSON patch that first tests the Node's resourceVersion, so a change
//! made in between is never overwritten: the patch fails with 409 (or 422 on the test)
//! and the next pass starts from the live Node again.
//!
//! `dry-run` records nothing on the Node: it logs and emits an Event saying what it
//! would do. `off` does nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Event, EventSource, Node, ObjectReference, Pod, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};

/// The annotation holding the record.
pub const RECORD_ANNOTATION: &str = "faultline.io/quarantine";
/// The label listing the unhealthy devices (dot separated ids).
pub const DEVICES_LABEL: &str = "faultline.io/unhealthy-devices";
/// The node condition type.
pub const CONDITION: &str = "AcceleratorHealthy";
/// How long after a quarantine a missing announcement is still made up for.
const ANNOUNCE_RETRY_SECS: f64 = 1800.0;
/// Actions a record keeps: the first few and the latest.
const ACTIONS_KEEP: (usize, usize) = (8, 56);
/// Bytes of history a Node keeps at most (annotations share 256 KiB per object).
const HISTORY_MAX_BYTES: usize = 64 * 1024;
/// The label of canary pods (never evicted by faultline).
pub const CANARY_LABEL: &str = "faultline.io/canary";
/// Released records, newest last (JSON list, the last [`HISTORY_KEEP`]).
pub const HISTORY_ANNOTATION: &str = "faultline.io/quarantine-history";
/// How many released records a Node keeps.
pub const HISTORY_KEEP: usize = 10;
/// A person asks for a release: `all` (or empty), or device ids/UUIDs, comma separated.
pub const RELEASE_ANNOTATION: &str = "faultline.io/release";
/// Who asks for the release (set by `faultline release`).
pub const RELEASE_BY_ANNOTATION: &str = "faultline.io/release-by";
/// Why (set by `faultline release --reason`).
pub const RELEASE_REASON_ANNOTATION: &str = "faultline.io/release-reason";

/// What remediation may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Nothing.
    Off,
    /// Log and announce what would be done; change nothing.
    DryRun,
    /// Act.
    Enforce,
}

/// One failed device in a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordDevice {
    /// Device id on the node.
    pub id: String,
    /// UUID, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// PCI bus id, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Why it failed.
    pub reason: String,
    /// What said so: `agent` (the aggregator's own verdict), `alert` (the intake) or
    /// `kubelet` (a pod's allocatedResourcesStatus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The metric and its value behind the verdict, where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    /// The metric's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

impl RecordDevice {
    /// A device judged by the aggregator's own pipeline.
    pub fn new(id: impl Into<String>, reason: impl Into<String>) -> Self {
        RecordDevice {
            id: id.into(),
            uuid: None,
            pci_bus_id: None,
            reason: reason.into(),
            source: None,
            metric: None,
            value: None,
        }
    }

    /// Whether `key` (an id, a UUID or a bus id) names this device.
    pub fn is(&self, key: &str) -> bool {
        self.id == key
            || self.uuid.as_deref() == Some(key)
            || self
                .pci_bus_id
                .as_deref()
                .and_then(faultline_common::reading::normalize_bus_id)
                .is_some_and(|b| {
                    faultline_common::reading::normalize_bus_id(key).as_deref() == Some(b.as_str())
                })
    }
}

/// How a record ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// When (RFC 3339).
    pub at: String,
    /// Who: a user (`user:NAME`) or a replica (auto release).
    pub actor: String,
    /// Why.
    pub reason: String,
    /// A person asked for it: the same fault is not acted on again within the dedup
    /// window, so the release is not undone by a reading that still says failed.
    pub manual: bool,
}

/// The canary of an auto release: a probe Job pinned to the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryRun {
    /// `namespace/name` of the Job.
    pub job: String,
    /// When it was created.
    pub started: String,
    /// `running`, `succeeded` or `failed`.
    pub state: String,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
}

/// An action taken, for the record's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// `taint`, `label`, `condition`.
    pub action: String,
    /// When (RFC 3339).
    pub at: String,
    /// Who (the replica).
    pub actor: String,
}

/// The quarantine record of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineRecord {
    /// Node name.
    pub node: String,
    /// The failed devices.
    pub devices: Vec<RecordDevice>,
    /// Where the verdict came from (`faultline-aggregator`).
    pub source: String,
    /// Stable identity of this fault: node and sorted (device, reason) pairs.
    pub fingerprint: String,
    /// First and last time it was seen.
    pub first_seen: String,
    /// Last time it was seen.
    pub last_seen: String,
    /// Who quarantined (a replica, or a user).
    pub actor: String,
    /// When the quarantine ends by itself, if ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry: Option<String>,
    /// The taint faultline added (absent: it was there already, not ours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned_taint: Option<String>,
    /// Whether faultline added the devices label.
    #[serde(default)]
    pub owned_label: bool,
    /// What was done, in order.
    pub actions: Vec<Action>,
    /// Pods evicted for this fault (`namespace/name/uid`): each at most once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evicted: Vec<String>,
    /// Pods whose eviction a PodDisruptionBudget refuses, and since when.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub eviction_blocked: BTreeMap<String, String>,
    /// Tainted only because devices were unknown too long: nothing is evicted for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown_only: bool,
    /// Devices a person released while the rest stay quarantined, and when: not acted
    /// on again within the dedup window.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub released_devices: BTreeMap<String, String>,
    /// The last canary of an auto release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryRun>,
    /// Canaries started for this record (names each Job apart).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub canary_attempts: u32,
    /// Set when the record ends (it then moves to the history annotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<Released>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The fingerprint of a set of failed devices on a node.
pub fn fingerprint(node: &str, devices: &[RecordDevice]) -> String {
    let mut parts: Vec<String> = devices
        .iter()
        .map(|d| format!("{}={}", d.id, d.reason))
        .collect();
    parts.sort();
    format!("{node}/{}", parts.join(","))
}

/// One structured audit line per action (target `faultline::audit`): the action, the
/// node, each device with its UUID, bus id and reason, the actor and the object acted on.
fn audit(action: &str, node: &str, devices: &[RecordDevice], actor: &str, object: &str) {
    let devices = serde_json::to_string(devices).unwrap_or_default();
    tracing::warn!(
        target: "faultline::audit",
        action, node, devices = %devices, actor, object, source = "faultline-aggregator", at = %now(),
        "remediation action"
    );
}

/// A JSON patch of a live Node that first tests its resourceVersion, so a change made
/// since it was read makes the whole patch fail instead of being overwritten.
struct NodePatch {
    ops: Vec<serde_json::Value>,
    has_spec: bool,
    has_labels: bool,
    has_annotations: bool,
}

impl NodePatch {
    fn on(live: &Node) -> Self {
        NodePatch {
            ops: vec![serde_json::json!({
                "op": "test", "path": "/metadata/resourceVersion", "value": live.metadata.resource_version
            })],
            has_spec: live.spec.is_some(),
            has_labels: live.metadata.labels.is_some(),
            has_annotations: live.metadata.annotations.is_some(),
        }
    }

    fn add(&mut self, path: String, value: serde_json::Value) {
        self.ops
            .push(serde_json::json!({"op": "add", "path": path, "value": value}));
    }

    fn taints(&mut self, taints: &[Taint]) {
        if !std::mem::replace(&mut self.has_spec, true) {
            self.add("/spec".into(), serde_json::json!({}));
        }
        self.add("/spec/taints".into(), serde_json::json!(taints));
    }

    fn label(&mut self, key: &str, value: &str) {
        if !std::mem::replace(&mut self.has_labels, true) {
            self.add("/metadata/labels".into(), serde_json::json!({}));
        }
        self.add(
            format!("/metadata/labels/{}", escape(key)),
            serde_json::json!(value),
        );
    }

    fn remove(&mut self, path: String) {
        self.ops
            .push(serde_json::json!({"op": "remove", "path": path}));
    }

    fn annotation(&mut self, key: &str, value: String) {
        if !std::mem::replace(&mut self.has_annotations, true) {
            self.add("/metadata/annotations".into(), serde_json::json!({}));
        }
        self.add(
            format!("/metadata/annotations/{}", escape(key)),
            serde_json::json!(value),
        );
    }

    fn record(&mut self, record: &QuarantineRecord) {
        if !std::mem::replace(&mut self.has_annotations, true) {
            self.add("/metadata/annotations".into(), serde_json::json!({}));
        }
        let mut record = record.clone();
        let (head, tail) = ACTIONS_KEEP;
        if record.actions.len() > head + tail {
            let cut = record.actions.len() - tail;
            record.actions.drain(head..cut);
        }
        let value = serde_json::to_string(&record).unwrap_or_default();
        self.add(
            format!("/metadata/annotations/{}", escape(RECORD_ANNOTATION)),
            serde_json::json!(value),
        );
    }
}

/// What a pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Remediation is off.
    Off,
    /// Dry run: announced, nothing changed.
    Announced,
    /// The node was already isolated for this fault: nothing to do.
    AlreadyDone,
    /// Isolated now.
    Isolated,
    /// Not isolated: a budget is spent (why).
    HeldBack(String),
    /// Not isolated: the circuit breaker is open.
    BreakerOpen,
    /// The node itself is not Ready: Kubernetes' node lifecycle handles it.
    LeftToKubernetes,
    /// A person released these devices within the dedup window: not acted on again.
    Suppressed,
    /// Released now (all devices, or the named ones).
    Released,
    /// Not released yet: why (health, cool-down, canary).
    Waiting(String),
}

/// A node's device as the pipeline sees it, for release decisions.
#[derive(Debug, Clone)]
pub struct DeviceView {
    /// Its identities (id, UUID, bus id).
    pub device: RecordDevice,
    /// Smoothed state.
    pub status: faultline_common::DeviceStatus,
    /// Clean samples in a row.
    pub clean_streak: u32,
    /// Since when it has had this state (ms since the epoch).
    pub since_ms: u64,
}

/// When a quarantine ends by itself.
#[derive(Debug, Clone)]
pub struct ReleasePolicy {
    /// `--release auto`: after health, cool-down and (if set) the canary. `manual`
    /// (false): only when a person asks. Unknown-only taints lift by themselves either
    /// way once the devices are seen healthy again: they were a guard, not a verdict.
    pub auto: bool,
    /// Clean samples in a row every device needs.
    pub healthy_samples: u32,
    /// How long every device must have been healthy (and since a failed canary).
    pub cooldown: std::time::Duration,
    /// The probe Job (a template) that must succeed on the node first.
    pub canary: Option<CanarySpec>,
    /// How long a person's release holds against the same fault (default 15 min); also
    /// the window of the intake's dedup.
    pub dedup_window: std::time::Duration,
    /// A record's expiry: when it is due for review; one that cannot be released then
    /// is extended by as much again and announced.
    pub expiry: std::time::Duration,
}

impl Default for ReleasePolicy {
    fn default() -> Self {
        ReleasePolicy {
            auto: false,
            healthy_samples: 30,
            cooldown: std::time::Duration::from_secs(600),
            canary: None,
            dedup_window: std::time::Duration::from_secs(900),
            expiry: std::time::Duration::from_secs(86_400),
        }
    }
}

/// The canary: a Job template, run pinned to the node, tolerating faultline's taint.
#[derive(Debug, Clone)]
pub struct CanarySpec {
    /// The Job as written by the operator (name and nodeName are set by faultline).
    pub template: k8s_openapi::api::batch::v1::Job,
    /// Where the Jobs run.
    pub namespace: String,
    /// A canary not done by then has failed.
    pub timeout: std::time::Duration,
}

/// A release a person asked for.
#[derive(Debug, Clone, Default)]
pub struct ReleaseRequest {
    /// Devices (ids, UUIDs or bus ids) to release; empty: all of them.
    pub devices: Vec<String>,
    /// Who (`user:NAME`).
    pub actor: String,
    /// Why.
    pub reason: String,
}

impl ReleaseRequest {
    /// The request written on a Node (`faultline.io/release` and friends), if any.
    pub fn of(node: &Node) -> Option<Self> {
        let a = node.metadata.annotations.as_ref()?;
        let v = a.get(RELEASE_ANNOTATION)?;
        let devices = v
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty() && *d != "all" && *d != "true")
            .map(String::from)
            .collect();
        let who = a
            .get(RELEASE_BY_ANNOTATION)
            .map(String::as_str)
            .filter(|w| !w.is_empty())
            .unwrap_or("unknown");
        Some(ReleaseRequest {
            devices,
            actor: format!("user:{who}"),
            reason: a
                .get(RELEASE_REASON_ANNOTATION)
                .cloned()
                .unwrap_or_else(|| "released by a person".into()),
        })
    }
}

/// The circuit breaker: when very many nodes fail within a short time it is usually the
/// monitoring, not the hardware. Once `nodes` distinct nodes failed within `window`,
/// the breaker opens: a ConfigMap `<name>-breaker` with `state: open`, which every
/// replica reads before acting. Nothing is isolated or evicted until a person closes it
/// (`kubectl patch cm <name>-breaker --type merge -p '{"data":{"state":"closed"}}'`).
pub struct Breaker {
    api: Api<k8s_openapi::api::core::v1::ConfigMap>,
    name: String,
    nodes: usize,
    window: std::time::Duration,
    recent: std::sync::Mutex<std::collections::VecDeque<(String, std::time::Instant)>>,
    /// Open when last read: a person closing it also clears the failures counted.
    was_open: std::sync::atomic::AtomicBool,
}

impl Breaker {
    /// A breaker stored in the ConfigMap `name` through `api`.
    pub fn new(
        api: Api<k8s_openapi::api::core::v1::ConfigMap>,
        name: String,
        nodes: usize,
        window: std::time::Duration,
    ) -> Self {
        Breaker {
            api,
            name,
            nodes: nodes.max(1),
            window,
            recent: Default::default(),
            was_open: Default::default(),
        }
    }

    /// Whether it is open now (a person has not closed it).
    pub async fn is_open(&self) -> Result<bool, RemediateError> {
        let open = self
            .api
            .get_opt(&self.name)
            .await?
            .and_then(|cm| cm.data)
            .is_some_and(|d| d.get("state").map(String::as_str) == Some("open"));
        if self
            .was_open
            .swap(open, std::sync::atomic::Ordering::AcqRel)
            && !open
        {
            // Closed by a person: count afresh, or the next failure reopens it.
            self.recent
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        Ok(open)
    }

    /// Note that `node` failed now; opens the breaker when too many did.
    pub async fn note_failure(&self, node: &str) -> Result<bool, RemediateError> {
        self.is_open().await?;
        let (count, trip) = {
            let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            let now = std::time::Instant::now();
            while r
                .front()
                .is_some_and(|(_, t)| now.duration_since(*t) > self.window)
            {
                r.pop_front();
            }
            if !r.iter().any(|(n, _)| n == node) {
                r.push_back((node.to_string(), now));
            }
            (r.len(), r.len() >= self.nodes)
        };
        if trip && !self.is_open().await? {
            let data = BTreeMap::from([
                ("state".to_string(), "open".to_string()),
                ("since".to_string(), now()),
                (
                    "reason".to_string(),
                    format!("{count} nodes failed within {}s", self.window.as_secs()),
                ),
            ]);
            let cm = k8s_openapi::api::core::v1::ConfigMap {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                data: Some(data.clone()),
                ..Default::default()
            };
            match self.api.get_opt(&self.name).await? {
                Some(mut cur) => {
                    cur.data = Some(data);
                    self.api
                        .replace(&self.name, &PostParams::default(), &cur)
                        .await?;
                }
                None => {
                    self.api.create(&PostParams::default(), &cm).await?;
                }
            }
            tracing::error!(count, window = ?self.window, "circuit breaker opened: remediation stopped until a person closes it");
        }
        Ok(trip)
    }
}

/// How much may be quarantined at once, cluster-wide.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Nodes quarantined at most.
    pub max_nodes: usize,
    /// Share of accelerator nodes quarantined at most, in percent.
    pub max_percent: f64,
    /// Nodes whose label names the failure domain (rack, zone) and how many of one
    /// domain may be quarantined at most.
    pub per_domain: Option<(String, usize)>,
    /// Label selector of the accelerator nodes (the percentage's base).
    pub node_selector: String,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_nodes: 5,
            max_percent: 10.0,
            per_domain: None,
            node_selector: String::new(),
        }
    }
}

/// Why a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum RemediateError {
    /// The API said no (409/422 on a concurrent change: try again from the live Node).
    #[error("API: {0}")]
    Api(#[from] kube::Error),
    /// This replica no longer holds the node's shard.
    #[error("not the holder of the node's shard")]
    NotHolder,
    /// The record on the Node does not parse.
    #[error("unreadable quarantine record on {0}: {1}")]
    Record(String, String),
}

/// Isolates nodes and evicts the pods on failed devices.
pub struct Remediator {
    client: kube::Client,
    nodes: Api<Node>,
    events: Api<Event>,
    mode: Mode,
    taint: Taint,
    actor: String,
    /// Extended resources that are accelerators (`nvidia.com/gpu`, `huawei.com/Ascend910`).
    resources: Vec<String>,
    /// How long a PodDisruptionBudget may hold an eviction back before an alert.
    eviction_deadline: std::time::Duration,
    budget: Budget,
    /// One budget decision at a time.
    budget_turn: tokio::sync::Mutex<()>,
    breaker: Option<Breaker>,
    /// Evictions per minute at most (a token bucket; 0: no limit).
    evictions_per_minute: f64,
    eviction_tokens: std::sync::Mutex<(f64, std::time::Instant)>,
    /// Nodes held back by the budget (announced once each).
    held_back: std::sync::Mutex<std::collections::BTreeSet<String>>,
    release: ReleasePolicy,
    notifier: Option<std::sync::Arc<crate::notify::Notifier>>,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    /// Nodes with a record, as last listed (the release pass's work list).
    quarantined: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Events known to be recorded (by name): not sent again.
    announced: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Delete a pod whose budget refused eviction past the deadline (off by default).
    force_delete: bool,
}

/// What an eviction pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Evictions {
    /// Evicted now.
    pub evicted: Vec<String>,
    /// Refused by a budget (429), to retry.
    pub blocked: Vec<String>,
    /// Refused past the deadline: announced and left alone.
    pub given_up: Vec<String>,
}

/// Why a pod is (not) evicted for a fault on `failed` devices.
fn wants_eviction(pod: &Pod, resources: &[String], failed: &[RecordDevice]) -> bool {
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if pod.metadata.deletion_timestamp.is_some() || finished {
        return false;
    }
    if pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"))
    {
        return false;
    }
    if pod
        .metadata
        .owner_references
        .as_ref()
        .is_some_and(|o| o.iter().any(|r| r.kind == "DaemonSet"))
    {
        return false;
    }
    // faultline's own canary runs on the quarantined node on purpose.
    if pod
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(CANARY_LABEL))
    {
        return false;
    }
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let uses_accelerator = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .any(|c| {
            c.resources.as_ref().is_some_and(|r| {
                [r.limits.as_ref(), r.requests.as_ref()]
                    .into_iter()
                    .flatten()
                    .any(|m| m.keys().any(|k| resources.contains(k)))
            })
        });
    if !uses_accelerator {
        return false;
    }
    // KEP-4680: where the kubelet says which devices the pod holds, evict only the pods
    // that hold a failed one.
    let held: Vec<String> = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|cs| cs.allocated_resources_status.iter().flatten())
        .filter(|rs| resources.contains(&rs.name))
        .flat_map(|rs| rs.resources.iter().flatten().map(|r| r.resource_id.clone()))
        .collect();
    if held.is_empty() {
        return true;
    }
    held.iter().any(|id| {
        failed.iter().any(|d| {
            d.uuid.as_deref() == Some(id.as_str())
                || d.id == *id
                || d.pci_bus_id.as_deref() == Some(id.as_str())
        })
    })
}

/// The released records kept on a Node, oldest first.
pub fn history_of(node: &Node) -> Vec<QuarantineRecord> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(HISTORY_ANNOTATION))
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default()
}

/// The devices label's value: the ids joined by dots when that is a valid label value
/// (63 characters of `[A-Za-z0-9._-]`, alphanumeric at both ends), else the count and
/// a hash (a bus id has colons, two UUIDs are too long); the record has the details.
pub fn label_value<S: AsRef<str>>(ids: &[S]) -> String {
    let joined = ids.iter().map(|s| s.as_ref()).collect::<Vec<_>>().join(".");
    let valid = !joined.is_empty()
        && joined.len() <= 63
        && joined
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        && joined.starts_with(|c: char| c.is_ascii_alphanumeric())
        && joined.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        joined
    } else {
        format!(
            "{}-devices-{:08x}",
            ids.len(),
            faultline_common::fault::fnv1a64(joined.as_bytes()) & 0xffff_ffff
        )
    }
}

/// Devices for a message: id, UUID, bus id, reason, source and metric=value.
pub fn describe(devices: &[RecordDevice]) -> String {
    devices
        .iter()
        .map(|d| {
            let ids: Vec<&str> = [d.uuid.as_deref(), d.pci_bus_id.as_deref()]
                .into_iter()
                .flatten()
                .collect();
            let mut s = d.id.clone();
            if !ids.is_empty() {
                s.push_str(&format!(" ({})", ids.join(", ")));
            }
            s.push_str(&format!(" {}", d.reason));
            if let Some(src) = &d.source {
                s.push_str(&format!(" via {src}"));
            }
            if let (Some(m), Some(v)) = (&d.metric, &d.value) {
                s.push_str(&format!(" [{m}={v}]"));
            }
            s
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn named_or_all(named: &[RecordDevice], all: &[RecordDevice]) -> Vec<RecordDevice> {
    if named.is_empty() {
        all.to_vec()
    } else {
        named.to_vec()
    }
}

/// Remove a person's release request from the Node (it has been acted on).
fn clear_request(patch: &mut NodePatch, live: &Node) {
    let a = live.metadata.annotations.clone().unwrap_or_default();
    for key in [
        RELEASE_ANNOTATION,
        RELEASE_BY_ANNOTATION,
        RELEASE_REASON_ANNOTATION,
    ] {
        if a.contains_key(key) {
            patch.remove(format!("/metadata/annotations/{}", escape(key)));
        }
    }
}

/// The canary Job: the template, named, pinned to the node, tolerating faultline's
/// taint, never restarted in place, cleaned up an hour after it ends.
fn canary_job(
    template: &k8s_openapi::api::batch::v1::Job,
    name: &str,
    node: &str,
    taint_key: &str,
) -> k8s_openapi::api::batch::v1::Job {
    let mut job = template.clone();
    job.metadata.name = Some(name.to_string());
    job.metadata.generate_name = None;
    job.metadata.namespace = None;
    job.metadata.resource_version = None;
    job.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("app.kubernetes.io/managed-by".into(), "faultline".into());
    job.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("faultline.io/canary-node".into(), node.to_string());
    let spec = job.spec.get_or_insert_with(Default::default);
    spec.template
        .metadata
        .get_or_insert_with(Default::default)
        .labels
        .get_or_insert_with(Default::default)
        .insert(CANARY_LABEL.into(), "true".into());
    spec.backoff_limit.get_or_insert(0);
    spec.ttl_seconds_after_finished.get_or_insert(3600);
    let pod = spec.template.spec.get_or_insert_with(Default::default);
    pod.node_name = Some(node.to_string());
    if pod.restart_policy.is_none() {
        pod.restart_policy = Some("Never".into());
    }
    pod.tolerations.get_or_insert_with(Default::default).push(
        k8s_openapi::api::core::v1::Toleration {
            key: Some(taint_key.to_string()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        },
    );
    job
}

/// Seconds since an RFC 3339 time (negative when it is in the future).
fn age_secs(at: &str) -> Option<f64> {
    at.parse::<Timestamp>()
        .ok()
        .map(|t| Timestamp::now().duration_since(t).as_secs_f64())
}

fn now() -> String {
    Timestamp::now().to_string()
}

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

impl Remediator {
    /// `taint_key` e.g. `nvidia.com/gpu-fault` (value `true`, effect NoSchedule); Events
    /// go to `event_namespace`.
    pub fn new(
        client: kube::Client,
        mode: Mode,
        taint_key: &str,
        event_namespace: &str,
        actor: &str,
    ) -> Self {
        Remediator {
            nodes: Api::all(client.clone()),
            events: Api::namespaced(client.clone(), event_namespace),
            client,
            resources: [
                "nvidia.com/gpu",
                "huawei.com/Ascend910",
                "huawei.com/Ascend910B",
                "huawei.com/Ascend310P",
            ]
            .map(String::from)
            .to_vec(),
            eviction_deadline: std::time::Duration::from_secs(600),
            budget: Budget::default(),
            budget_turn: tokio::sync::Mutex::new(()),
            breaker: None,
            evictions_per_minute: 0.0,
            eviction_tokens: std::sync::Mutex::new((0.0, std::time::Instant::now())),
            held_back: Default::default(),
            release: ReleasePolicy::default(),
            notifier: None,
            metrics: None,
            quarantined: Default::default(),
            announced: Default::default(),
            force_delete: false,
            mode,
            taint: Taint {
                key: taint_key.to_string(),
                value: Some("true".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            },
            actor: actor.to_string(),
        }
    }

    /// The record on a Node, if any.
    pub fn record_of(node: &Node) -> Result<Option<QuarantineRecord>, RemediateError> {
        let name = node.metadata.name.clone().unwrap_or_default();
        match node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(RECORD_ANNOTATION))
        {
            Some(s) => serde_json::from_str(s)
                .map(Some)
                .map_err(|e| RemediateError::Record(name, e.to_string())),
            None => Ok(None),
        }
    }

    /// Accelerator resource names to look for in pods (default: NVIDIA and Ascend).
    pub fn with_resources(
        mut self,
        resources: Vec<String>,
        eviction_deadline: std::time::Duration,
    ) -> Self {
        if !resources.is_empty() {
            self.resources = resources;
        }
        self.eviction_deadline = eviction_deadline;
        self
    }

    /// Past the eviction deadline, delete a pod its disruption budget still protects
    /// (off by default: then it is announced and left).
    pub fn with_force_delete(mut self, force: bool) -> Self {
        self.force_delete = force;
        self
    }

    /// The quarantine budget.
    pub fn with_budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    /// The circuit breaker and the eviction rate (per minute; 0: no limit).
    pub fn with_breaker(mut self, breaker: Option<Breaker>, evictions_per_minute: f64) -> Self {
        self.breaker = breaker;
        self.evictions_per_minute = evictions_per_minute;
        *self
            .eviction_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = (evictions_per_minute, std::time::Instant::now());
        self
    }

    /// The accelerator resource names looked for in pods.
    pub fn resources(&self) -> &[String] {
        &self.resources
    }

    /// How quarantines end.
    pub fn with_release(mut self, release: ReleasePolicy) -> Self {
        self.release = release;
        self
    }

    /// Where announcements go besides Events, and where actions are counted.
    pub fn with_reporting(
        mut self,
        notifier: Option<std::sync::Arc<crate::notify::Notifier>>,
        metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    ) -> Self {
        self.notifier = notifier;
        self.metrics = metrics;
        self
    }

    /// The dedup window (a person's release holds this long; the intake's dedup).
    pub fn dedup_window(&self) -> std::time::Duration {
        self.release.dedup_window
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Nodes with a record as last listed by [`Remediator::list_quarantined`].
    pub fn known_quarantined(&self) -> Vec<String> {
        self.quarantined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// The devices of `devices` a person has not released within the dedup window.
    fn not_suppressed(
        &self,
        live: &Node,
        record: Option<&QuarantineRecord>,
        devices: Vec<RecordDevice>,
    ) -> Vec<RecordDevice> {
        let window = self.release.dedup_window.as_secs_f64();
        let recent = |at: &str| age_secs(at).is_some_and(|a| a < window);
        let mut released: Vec<&RecordDevice> = Vec::new();
        let history = history_of(live);
        if let Some(last) = history.last() {
            if last
                .released
                .as_ref()
                .is_some_and(|r| r.manual && recent(&r.at))
            {
                released.extend(last.devices.iter());
            }
        }
        let partly: Vec<&String> = record
            .map(|r| {
                r.released_devices
                    .iter()
                    .filter(|(_, at)| recent(at))
                    .map(|(id, _)| id)
                    .collect()
            })
            .unwrap_or_default();
        devices
            .into_iter()
            .filter(|d| {
                let gone = released.iter().any(|r| {
                    r.reason == d.reason && (d.is(&r.id) || r.uuid.as_deref().is_some_and(|u| d.is(u)))
                }) || partly.iter().any(|id| d.is(id));
                if gone {
                    tracing::debug!(device = %d.id, "released by a person within the dedup window: not acted on");
                }
                !gone
            })
            .collect()
    }

    /// List the nodes with a record (they carry the devices label), remember them and
    /// update the quarantine gauges.
    pub async fn list_quarantined(&self) -> Result<Vec<Node>, RemediateError> {
        let nodes = self
            .nodes
            .list(&ListParams::default().labels(DEVICES_LABEL))
            .await?
            .items;
        let with_record: Vec<Node> = nodes
            .into_iter()
            .filter(|n| {
                Self::record_of(n).ok().flatten().is_some() || ReleaseRequest::of(n).is_some()
            })
            .collect();
        let devices: usize = with_record
            .iter()
            .filter_map(|n| Self::record_of(n).ok().flatten())
            .map(|r| r.devices.len())
            .sum();
        *self.quarantined.lock().unwrap_or_else(|p| p.into_inner()) = with_record
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        if let Some(m) = &self.metrics {
            m.set_quarantined(with_record.len(), devices);
            m.set_breaker(self.breaker_open().await.unwrap_or(false));
            m.set_held_back(self.held_back().len());
        }
        Ok(with_record)
    }

    /// One release pass over a quarantined node: a person's request first; else, for
    /// unknown-only records or with `--release auto`, a release once `views` (the
    /// pipeline's devices of the node) prove health, after the cool-down and the canary.
    ///
    /// A record past its expiry that cannot be released is extended by another
    /// `--quarantine-expiry` and announced (seed 004: a failed check extends the
    /// quarantine; nothing is released without proof).
    pub async fn release_pass_fenced(
        &self,
        node: &str,
        views: &[DeviceView],
        now_ms: u64,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        if self.mode == Mode::Off {
            return Ok(Outcome::Off);
        }
        let live = self.nodes.get(node).await?;
        if let Some(req) = ReleaseRequest::of(&live) {
            return self.release_fenced(&live, req, true, fence).await;
        }
        let Some(record) = Self::record_of(&live)? else {
            return Ok(Outcome::AlreadyDone);
        };
        let outcome = self
            .release_check(&live, record.clone(), views, now_ms, fence)
            .await?;
        let expired = record
            .expiry
            .as_deref()
            .is_some_and(|e| age_secs(e).is_some_and(|a| a >= 0.0));
        if let (Outcome::Waiting(why), true, Mode::Enforce) = (&outcome, expired, self.mode) {
            // Read again: the check may have written the record (a canary).
            let live = self.nodes.get(node).await?;
            if let Some(mut r) = Self::record_of(&live)? {
                let old = r.expiry.clone().unwrap_or_default();
                r.expiry = Some(self.expiry_from_now());
                r.actions.push(Action {
                    action: format!("extend: {why}"),
                    at: now(),
                    actor: self.actor.clone(),
                });
                let mut patch = NodePatch::on(&live);
                patch.record(&r);
                self.apply(node, patch, fence).await?;
                self.metric("extend", "ok");
                self.event(
                    node,
                    "FaultlineQuarantineExtended",
                    &old,
                    format!(
                        "quarantine expired and extended to {}: {why}",
                        r.expiry.as_deref().unwrap_or("")
                    ),
                    true,
                    &r.devices,
                )
                .await;
            }
        }
        Ok(outcome)
    }

    /// A new record of `devices` on `node`, first seen `now`, by this replica: nothing
    /// owned or done yet.
    fn new_record(&self, node: &str, devices: Vec<RecordDevice>, now: &str) -> QuarantineRecord {
        QuarantineRecord {
            node: node.to_string(),
            fingerprint: fingerprint(node, &devices),
            devices,
            source: "faultline-aggregator".into(),
            first_seen: now.to_string(),
            last_seen: now.to_string(),
            actor: self.actor.clone(),
            expiry: Some(self.expiry_from_now()),
            owned_taint: None,
            owned_label: false,
            actions: vec![],
            evicted: vec![],
            eviction_blocked: BTreeMap::new(),
            unknown_only: false,
            released_devices: BTreeMap::new(),
            canary: None,
            canary_attempts: 0,
            released: None,
        }
    }

    fn expiry_from_now(&self) -> String {
        let secs = self.release.expiry.as_secs().min(100 * 365 * 86_400) as i64;
        Timestamp::now()
            .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(secs))
            .unwrap_or(Timestamp::MAX)
            .to_string()
    }

    async fn release_check(
        &self,
        live: &Node,
        mut record: QuarantineRecord,
        views: &[DeviceView],
        now_ms: u64,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        let node = live.metadata.name.as_deref().unwrap_or_default();
        if !record.unknown_only && !self.release.auto {
            return Ok(Outcome::Waiting(
                "manual release (faultline release)".into(),
            ));
        }
        // Every device of the record seen, healthy, clean long enough.
        for d in &record.devices {
            let Some(v) = views
                .iter()
                .find(|v| d.is(&v.device.id) || d.uuid.as_deref().is_some_and(|u| v.device.is(u)))
            else {
                return Ok(Outcome::Waiting(format!(
                    "{} not reported by the agent",
                    d.id
                )));
            };
            if v.status != faultline_common::DeviceStatus::Healthy
                || v.clean_streak < self.release.healthy_samples
            {
                return Ok(Outcome::Waiting(format!(
                    "{} {} with {} clean samples of {}",
                    d.id,
                    v.status.as_str(),
                    v.clean_streak,
                    self.release.healthy_samples
                )));
            }
            let healthy_for = std::time::Duration::from_millis(now_ms.saturating_sub(v.since_ms));
            if !record.unknown_only && healthy_for < self.release.cooldown {
                return Ok(Outcome::Waiting(format!(
                    "{} healthy for {}s of the {}s cool-down",
                    d.id,
                    healthy_for.as_secs(),
                    self.release.cooldown.as_secs()
                )));
            }
        }
        let auto = ReleaseRequest {
            devices: vec![],
            actor: self.actor.clone(),
            reason: if record.unknown_only {
                "devices seen healthy again".into()
            } else {
                format!(
                    "{} clean samples and {}s cool-down",
                    self.release.healthy_samples,
                    self.release.cooldown.as_secs()
                )
            },
        };
        let Some(canary) = self.release.canary.clone().filter(|_| !record.unknown_only) else {
            return self.release_fenced(live, auto, false, fence).await;
        };
        // The canary: start one, or read the one running.
        let jobs: Api<k8s_openapi::api::batch::v1::Job> =
            Api::namespaced(self.client.clone(), &canary.namespace);
        let since = |at: &str| age_secs(at).unwrap_or(f64::MAX);
        match record.canary.clone() {
            Some(c) if c.state == "running" => {
                let name = c.job.rsplit('/').next().unwrap_or_default().to_string();
                let job = jobs.get_opt(&name).await?;
                let status = job
                    .as_ref()
                    .and_then(|j| j.status.clone())
                    .unwrap_or_default();
                let (ok, failed) = (
                    status.succeeded.unwrap_or(0) > 0,
                    status.failed.unwrap_or(0) > 0
                        || since(&c.started) > canary.timeout.as_secs_f64(),
                );
                if ok {
                    let mut r = auto;
                    r.reason = format!("{}; canary {} succeeded", r.reason, c.job);
                    record.canary = Some(CanaryRun {
                        state: "succeeded".into(),
                        finished: Some(now()),
                        ..c
                    });
                    return self.release_record(live, record, r, false, fence).await;
                }
                if job.is_none() || failed {
                    // Gone (deleted by someone) counts as failed too: start over after
                    // the cool-down.
                    record.canary = Some(CanaryRun {
                        state: "failed".into(),
                        finished: Some(now()),
                        ..c.clone()
                    });
                    record.actions.push(Action {
                        action: format!("canary {} failed", c.job),
                        at: now(),
                        actor: self.actor.clone(),
                    });
                    let mut patch = NodePatch::on(live);
                    patch.record(&record);
                    self.apply(node, patch, fence).await?;
                    if job.is_some() {
                        let _ = jobs
                            .delete(&name, &kube::api::DeleteParams::background())
                            .await;
                    }
                    self.metric("canary", "failed");
                    self.event(node, "FaultlineCanaryFailed", &c.job, format!("canary {} failed: the node stays quarantined; another try after the cool-down", c.job), true, &record.devices).await;
                    return Ok(Outcome::Waiting(format!("canary {} failed", c.job)));
                }
                Ok(Outcome::Waiting(format!("canary {} running", c.job)))
            }
            last => {
                if let Some(c) = last.as_ref().filter(|c| c.state == "failed") {
                    let waited = c.finished.as_deref().map(since).unwrap_or(f64::MAX);
                    if waited < self.release.cooldown.as_secs_f64() {
                        return Ok(Outcome::Waiting(format!(
                            "canary {} failed {}s ago; cool-down {}s",
                            c.job,
                            waited as u64,
                            self.release.cooldown.as_secs()
                        )));
                    }
                }
                if !fence() {
                    return Err(RemediateError::NotHolder);
                }
                if self.mode == Mode::DryRun {
                    self.metric("canary", "dry-run");
                    self.event(
                        node,
                        "FaultlineWouldRunCanary",
                        &record.first_seen,
                        "dry-run: would run the canary Job, then release".into(),
                        false,
                        &record.devices,
                    )
                    .await;
                    return Ok(Outcome::Announced);
                }
                let attempt = record.canary_attempts;
                record.canary_attempts += 1;
                let name = format!(
                    "faultline-canary-{:012x}",
                    faultline_common::fault::fnv1a64(
                        format!("{node}/{}/{attempt}", record.first_seen).as_bytes()
                    ) & 0xffff_ffff_ffff
                );
                let job = canary_job(&canary.template, &name, node, &self.taint.key);
                match jobs.create(&PostParams::default(), &job).await {
                    Ok(_) => {}
                    // Created by a pass whose answer was lost: it is ours.
                    Err(kube::Error::Api(e)) if e.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
                let job_ref = format!("{}/{name}", canary.namespace);
                record.canary = Some(CanaryRun {
                    job: job_ref.clone(),
                    started: now(),
                    state: "running".into(),
                    finished: None,
                });
                record.actions.push(Action {
                    action: format!("canary {job_ref}"),
                    at: now(),
                    actor: self.actor.clone(),
                });
                let mut patch = NodePatch::on(live);
                patch.record(&record);
                self.apply(node, patch, fence).await?;
                self.metric("canary", "started");
                audit("canary", node, &record.devices, &self.actor, &job_ref);
                self.event(node, "FaultlineCanaryStarted", &job_ref, format!("devices healthy past the cool-down: canary Job {job_ref} must succeed before the release"), false, &record.devices).await;
                Ok(Outcome::Waiting(format!("canary {job_ref} started")))
            }
        }
    }

    /// Release a node as a person asked (`faultline release`, or the annotation).
    pub async fn release(
        &self,
        node: &str,
        req: ReleaseRequest,
    ) -> Result<Outcome, RemediateError> {
        let live = self.nodes.get(node).await?;
        self.release_fenced(&live, req, true, &|| true).await
    }

    /// Release `live` (all devices, or those `req` names), removing only the taint and
    /// label faultline added, and keeping the record as history.
    async fn release_fenced(
        &self,
        live: &Node,
        req: ReleaseRequest,
        manual: bool,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        let node = live.metadata.name.clone().unwrap_or_default();
        let Some(record) = Self::record_of(live)? else {
            // Nothing to release: clear the request so it does not linger.
            if ReleaseRequest::of(live).is_some() && self.mode == Mode::Enforce {
                let mut patch = NodePatch::on(live);
                clear_request(&mut patch, live);
                self.apply(&node, patch, fence).await?;
                tracing::info!(node = %node, "release asked for a node without a quarantine record; request cleared");
            }
            return Ok(Outcome::AlreadyDone);
        };
        self.release_record(live, record, req, manual, fence).await
    }

    async fn release_record(
        &self,
        live: &Node,
        mut record: QuarantineRecord,
        req: ReleaseRequest,
        manual: bool,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        let node = live.metadata.name.clone().unwrap_or_default();
        let t0 = std::time::Instant::now();
        if !fence() {
            return Err(RemediateError::NotHolder);
        }
        let named: Vec<RecordDevice> = record
            .devices
            .iter()
            .filter(|d| req.devices.iter().any(|k| d.is(k)))
            .cloned()
            .collect();
        let partial = !req.devices.is_empty() && named.len() < record.devices.len();
        if !req.devices.is_empty() && named.is_empty() {
            tracing::warn!(node = %node, asked = ?req.devices, "release names no quarantined device; request cleared");
            if self.mode == Mode::Enforce {
                let mut patch = NodePatch::on(live);
                clear_request(&mut patch, live);
                self.apply(&node, patch, fence).await?;
            }
            self.event(
                &node,
                "FaultlineReleaseIgnored",
                &format!("{}/{}", record.first_seen, req.devices.join(",")),
                format!(
                    "release of {} ignored: not quarantined here",
                    req.devices.join(", ")
                ),
                true,
                &record.devices,
            )
            .await;
            return Ok(Outcome::AlreadyDone);
        }
        let what = if partial {
            named
                .iter()
                .map(|d| d.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            "all devices".to_string()
        };
        if self.mode == Mode::DryRun {
            self.metric("release", "dry-run");
            self.event(
                &node,
                "FaultlineWouldRelease",
                &format!("{}/{}", record.first_seen, what),
                format!("dry-run: would release {what} ({})", req.reason),
                false,
                &record.devices,
            )
            .await;
            return Ok(Outcome::Announced);
        }
        let at = now();
        let mut patch = NodePatch::on(live);
        clear_request(&mut patch, live);
        record.actions.push(Action {
            action: format!("release {what}: {}", req.reason),
            at: at.clone(),
            actor: req.actor.clone(),
        });
        if partial {
            record.devices.retain(|d| !named.contains(d));
            for d in &named {
                record.released_devices.insert(d.id.clone(), at.clone());
            }
            record.fingerprint = fingerprint(&node, &record.devices);
            if record.owned_label {
                let ids: Vec<&str> = record.devices.iter().map(|d| d.id.as_str()).collect();
                patch.label(DEVICES_LABEL, &label_value(&ids));
            }
            patch.record(&record);
        } else {
            // Only what faultline added: its own taint (key and NoSchedule), its label.
            if let Some(key) = &record.owned_taint {
                let taints: Vec<Taint> = live
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.clone())
                    .unwrap_or_default();
                let kept: Vec<Taint> = taints
                    .iter()
                    .filter(|t| !(t.key == *key && t.effect == "NoSchedule"))
                    .cloned()
                    .collect();
                if kept.len() != taints.len() {
                    patch.taints(&kept);
                }
            }
            let has_label = live
                .metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(DEVICES_LABEL));
            if record.owned_label && has_label {
                patch.remove(format!("/metadata/labels/{}", escape(DEVICES_LABEL)));
            }
            patch.remove(format!(
                "/metadata/annotations/{}",
                escape(RECORD_ANNOTATION)
            ));
            record.released = Some(Released {
                at: at.clone(),
                actor: req.actor.clone(),
                reason: req.reason.clone(),
                manual,
            });
            let mut history = history_of(live);
            history.push(record.clone());
            let mut skip = history.len().saturating_sub(HISTORY_KEEP);
            let mut text = serde_json::to_string(&history[skip..]).unwrap_or_default();
            while text.len() > HISTORY_MAX_BYTES && skip + 1 < history.len() {
                skip += 1;
                text = serde_json::to_string(&history[skip..]).unwrap_or_default();
            }
            patch.annotation(HISTORY_ANNOTATION, text);
        }
        self.apply(&node, patch, fence).await?;
        if !partial {
            let condition = serde_json::json!({"status": {"conditions": [{
                "type": CONDITION, "status": "True", "reason": "Released",
                "message": format!("released by {}: {}", req.actor, req.reason),
                "lastTransitionTime": at, "lastHeartbeatTime": at,
            }]}});
            // The record is gone already: a failure here leaves only a stale condition,
            // which the next quarantine overwrites.
            if let Err(e) = self
                .nodes
                .patch_status(&node, &PatchParams::default(), &Patch::Strategic(condition))
                .await
            {
                tracing::warn!(node = %node, error = %e, "released, but the condition was not updated");
            }
        }
        self.metric("release", "ok");
        if let Some(m) = &self.metrics {
            m.action_time("release", t0.elapsed().as_secs_f64());
        }
        audit(
            "release",
            &node,
            &named_or_all(&named, &record.devices),
            &req.actor,
            &what,
        );
        self.event(
            &node,
            "FaultlineReleased",
            &format!("{}/{}/{at}", record.first_seen, what),
            format!(
                "released {what} by {}: {} ({})",
                req.actor,
                req.reason,
                describe(&named_or_all(&named, &record.devices))
            ),
            false,
            &named_or_all(&named, &record.devices),
        )
        .await;
        Ok(Outcome::Released)
    }

    /// Note a node whose device just turned failed, if it is not quarantined for a
    /// failure already (an unknown-only guard does not count): a repeated verdict or a
    /// second device of a quarantined node is not a new failed node for the breaker.
    pub async fn note_new_failure(&self, node: &str) -> Result<(), RemediateError> {
        if self.breaker.is_none() {
            return Ok(());
        }
        let live = self.nodes.get(node).await?;
        if Self::record_of(&live)?.is_some_and(|r| !r.unknown_only) {
            return Ok(());
        }
        self.note_failure(node).await
    }

    /// Note a node that just failed (feeds the breaker).
    pub async fn note_failure(&self, node: &str) -> Result<(), RemediateError> {
        if let Some(b) = &self.breaker {
            b.note_failure(node).await?;
        }
        Ok(())
    }

    async fn breaker_open(&self) -> Result<bool, RemediateError> {
        match &self.breaker {
            Some(b) => b.is_open().await,
            None => Ok(false),
        }
    }

    fn take_eviction_token(&self) -> bool {
        if self.evictions_per_minute <= 0.0 {
            return true;
        }
        let mut g = self
            .eviction_tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        let refill = now.duration_since(g.1).as_secs_f64() * self.evictions_per_minute / 60.0;
        // At least one token fits, or a rate under 1 per minute would never evict.
        g.0 = (g.0 + refill).min(self.evictions_per_minute.max(1.0));
        g.1 = now;
        if g.0 >= 1.0 {
            g.0 -= 1.0;
            true
        } else {
            false
        }
    }

    /// Why quarantining `node` now would exceed a budget, if it would. Counted from the
    /// Nodes themselves (the devices label), so every replica sees the same count.
    async fn over_budget(&self, node: &Node) -> Result<Option<String>, RemediateError> {
        let quarantined = self
            .nodes
            .list(&ListParams::default().labels(DEVICES_LABEL))
            .await?
            .items;
        let b = &self.budget;
        if quarantined.len() >= b.max_nodes {
            return Ok(Some(format!(
                "{} nodes quarantined, budget {}",
                quarantined.len(),
                b.max_nodes
            )));
        }
        let mut lp = ListParams::default();
        if !b.node_selector.is_empty() {
            lp = lp.labels(&b.node_selector);
        }
        let total = self.nodes.list(&lp).await?.items.len().max(1);
        // The share applies from the second node on: one quarantine is always allowed
        // (within max_nodes), or a small cluster could never isolate anything.
        let share = (quarantined.len() + 1) as f64 * 100.0 / total as f64;
        if !quarantined.is_empty() && share > b.max_percent {
            return Ok(Some(format!(
                "{} of {total} nodes would be quarantined ({share:.0}%), budget {}%",
                quarantined.len() + 1,
                b.max_percent
            )));
        }
        if let Some((label, max)) = &b.per_domain {
            let domain = node
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label))
                .cloned()
                .unwrap_or_default();
            let same = quarantined
                .iter()
                .filter(|n| n.metadata.labels.as_ref().and_then(|l| l.get(label)) == Some(&domain))
                .count();
            if same >= *max {
                return Ok(Some(format!(
                    "{same} nodes of {label}={domain} quarantined, budget {max}"
                )));
            }
        }
        Ok(None)
    }

    /// Record and announce a node held back by the budget: once per node, and one
    /// alert for the first node held back while others pass.
    async fn hold_back(
        &self,
        node: &str,
        why: String,
        devices: &[RecordDevice],
    ) -> Result<Outcome, RemediateError> {
        let (first_for_node, first_overall, count) = {
            let mut g = self.held_back.lock().unwrap_or_else(|p| p.into_inner());
            let overall = g.is_empty();
            (g.insert(node.to_string()), overall, g.len())
        };
        if let Some(m) = &self.metrics {
            m.set_held_back(count);
        }
        self.metric("quarantine", "held-back");
        // One Event per node and hour at most, across replicas and restarts.
        let hour = now().get(..13).unwrap_or_default().to_string();
        if first_for_node {
            tracing::warn!(node, %why, "quarantine held back by the budget");
            self.event(
                node,
                "FaultlineHeldBack",
                &format!("{}/{hour}", fingerprint(node, devices)),
                format!("not quarantined: {why}"),
                true,
                devices,
            )
            .await;
        }
        if first_overall {
            tracing::error!(%why, "quarantine budget exhausted: further failed nodes are held back");
            self.event(node, "FaultlineBudgetExhausted", &hour, format!("quarantine budget exhausted ({why}); failed nodes are held back until quarantines are released"), true, devices).await;
        }
        Ok(Outcome::HeldBack(why))
    }

    /// Nodes held back by the budget now.
    pub fn held_back(&self) -> Vec<String> {
        self.held_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Devices unknown for longer than the tolerance: the node may get the NoSchedule
    /// taint (value `unknown`) so no new work lands on devices nobody can see, but
    /// nothing is ever evicted for it, and a node that is itself NotReady is left to
    /// Kubernetes' node lifecycle. Within the budget and the breaker, like isolation.
    pub async fn guard_unknown_fenced(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        if self.mode == Mode::Off || devices.is_empty() {
            return Ok(Outcome::Off);
        }
        if self.breaker_open().await? {
            return Ok(Outcome::BreakerOpen);
        }
        let live = self.nodes.get(node).await?;
        let devices = self.not_suppressed(&live, Self::record_of(&live)?.as_ref(), devices);
        if devices.is_empty() {
            return Ok(Outcome::Suppressed);
        }
        let ready = live
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status == "True");
        // No Ready condition at all (a node object without a kubelet) is not "NotReady".
        if ready == Some(false) {
            return Ok(Outcome::LeftToKubernetes);
        }
        let taints = live
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        if taints.iter().any(|t| t.key == self.taint.key) || Self::record_of(&live)?.is_some() {
            return Ok(Outcome::AlreadyDone);
        }
        let _turn = self.budget_turn.lock().await;
        if let Some(why) = self.over_budget(&live).await? {
            return self.hold_back(node, why, &devices).await;
        }
        let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        if !fence() {
            return Err(RemediateError::NotHolder);
        }
        if self.mode == Mode::DryRun {
            self.metric("taint-unknown", "dry-run");
            self.event(
                node,
                "FaultlineWouldCordonUnknown",
                &fingerprint(node, &devices),
                format!(
                    "dry-run: would taint {}=unknown: {} unknown past the tolerance",
                    self.taint.key,
                    ids.join(", ")
                ),
                true,
                &devices,
            )
            .await;
            return Ok(Outcome::Announced);
        }
        let now = now();
        // The label only if nobody else set it: what faultline did not add it never removes.
        let label_free = !live
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(DEVICES_LABEL));
        let record = QuarantineRecord {
            owned_taint: Some(self.taint.key.clone()),
            owned_label: label_free,
            actions: vec![Action {
                action: "taint-unknown".into(),
                at: now.clone(),
                actor: self.actor.clone(),
            }],
            unknown_only: true,
            ..self.new_record(node, devices.clone(), &now)
        };
        let mut t = taints;
        t.push(Taint {
            value: Some("unknown".into()),
            ..self.taint.clone()
        });
        let mut patch = NodePatch::on(&live);
        patch.taints(&t);
        if label_free {
            patch.label(DEVICES_LABEL, "unknown");
        }
        patch.record(&record);
        self.apply(node, patch, fence).await?;
        audit(
            "taint-unknown",
            node,
            &devices,
            &self.actor,
            &self.taint.key,
        );
        self.metric("taint-unknown", "ok");
        self.event(
            node,
            "FaultlineUnknownCordoned",
            &format!("{}/{}", record.fingerprint, record.first_seen),
            format!(
                "tainted {}=unknown:NoSchedule: {} unknown past the tolerance; nothing evicted",
                self.taint.key,
                ids.join(", ")
            ),
            true,
            &devices,
        )
        .await;
        Ok(Outcome::Isolated)
    }

    /// Evict, through the Eviction API, the pods on `node` that use a failed device,
    /// each at most once per fault (the record on the Node remembers), never DaemonSet,
    /// mirror, finished or terminating pods. A 429 (a PodDisruptionBudget) is retried by
    /// later passes until the deadline, then announced and left; a 404 counts as done.
    pub async fn evict_fenced(
        &self,
        node: &str,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Evictions, RemediateError> {
        let mut out = Evictions::default();
        if self.mode == Mode::Off || self.breaker_open().await? {
            return Ok(out);
        }
        let live = self.nodes.get(node).await?;
        let Some(mut record) = Self::record_of(&live)?.filter(|r| !r.unknown_only) else {
            return Ok(out);
        };
        let all: Api<Pod> = Api::all(self.client.clone());
        let pods = all
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?;
        let mut changed = false;
        for pod in pods
            .items
            .iter()
            .filter(|p| wants_eviction(p, &self.resources, &record.devices))
        {
            let (Some(name), Some(ns)) = (
                pod.metadata.name.as_deref(),
                pod.metadata.namespace.as_deref(),
            ) else {
                continue;
            };
            let key = format!("{ns}/{name}/{}", pod.metadata.uid.as_deref().unwrap_or(""));
            if record.evicted.contains(&key) {
                continue;
            }
            if self.mode == Mode::DryRun {
                self.metric("evict", "dry-run");
                self.event(
                    node,
                    "FaultlineWouldEvict",
                    &key,
                    format!("dry-run: would evict {ns}/{name}"),
                    true,
                    &record.devices,
                )
                .await;
                continue;
            }
            if !fence() {
                return Err(RemediateError::NotHolder);
            }
            // Past the eviction rate the pod waits for a later pass.
            if !self.take_eviction_token() {
                out.blocked.push(key);
                continue;
            }
            let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
            match api.evict(name, &EvictParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(kube::Error::Api(e)) if e.code == 429 => {
                    let since = record
                        .eviction_blocked
                        .entry(key.clone())
                        .or_insert_with(now)
                        .clone();
                    changed = true;
                    let waited = age_secs(&since).unwrap_or(0.0);
                    if waited >= self.eviction_deadline.as_secs_f64() && self.force_delete {
                        // Explicitly configured: past the deadline the pod is deleted
                        // (with its grace period), its budget notwithstanding.
                        match api.delete(name, &kube::api::DeleteParams::default()).await {
                            Ok(_) => {}
                            Err(kube::Error::Api(e)) if e.code == 404 => {}
                            Err(e) => return Err(e.into()),
                        }
                        audit("delete", node, &record.devices, &self.actor, &key);
                        self.metric("evict", "deleted");
                        record.eviction_blocked.remove(&key);
                        record.evicted.push(key.clone());
                        record.actions.push(Action {
                            action: format!(
                                "delete {ns}/{name} (budget refused past the deadline)"
                            ),
                            at: now(),
                            actor: self.actor.clone(),
                        });
                        self.event(node, "FaultlinePodDeleted", &key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; deleted (--force-delete-after-deadline)", waited as u64), true, &record.devices).await;
                        self.pod_event(pod, &record.devices).await;
                        out.evicted.push(key);
                    } else if waited >= self.eviction_deadline.as_secs_f64() {
                        self.metric("evict", "given-up");
                        self.event(node, "FaultlineEvictionBlocked", &key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; left alone", waited as u64), true, &record.devices).await;
                        record.evicted.push(key.clone());
                        out.given_up.push(key);
                    } else {
                        out.blocked.push(key);
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
            audit("evict", node, &record.devices, &self.actor, &key);
            record.eviction_blocked.remove(&key);
            record.evicted.push(key.clone());
            record.actions.push(Action {
                action: format!("evict {ns}/{name}"),
                at: now(),
                actor: self.actor.clone(),
            });
            changed = true;
            self.metric("evict", "ok");
            self.event(
                node,
                "FaultlineEvicted",
                &key,
                format!(
                    "evicted {ns}/{name} from a failed device: {}",
                    describe(&record.devices)
                ),
                true,
                &record.devices,
            )
            .await;
            self.pod_event(pod, &record.devices).await;
            out.evicted.push(key);
        }
        if changed {
            // The record first tests the Node's resourceVersion: a pass that raced
            // another writer fails here and the next pass starts from the live Node
            // (the evictions it made are then seen as 404s or already gone pods).
            let mut patch = NodePatch::on(&live);
            patch.record(&record);
            self.apply(node, patch, fence).await?;
        }
        Ok(out)
    }

    /// Send a node patch, the shard Lease checked right before.
    async fn apply(
        &self,
        node: &str,
        patch: NodePatch,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), RemediateError> {
        let p: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(patch.ops))
            .map_err(|e| RemediateError::Record(node.to_string(), e.to_string()))?;
        if !fence() {
            return Err(RemediateError::NotHolder);
        }
        self.nodes
            .patch(node, &PatchParams::default(), &Patch::Json::<()>(p))
            .await?;
        Ok(())
    }

    /// Announce on the Node: one Event (and one notification) per `key`. The Event's
    /// name is derived from the node, reason and key, so a pass that repeats (after an
    /// error, a timeout or a leader change) meets a 409 and announces nothing twice.
    /// Best effort: a failing Events API is logged and counted, never stops a pass.
    async fn event(
        &self,
        node: &str,
        reason: &str,
        key: &str,
        message: String,
        warning: bool,
        devices: &[RecordDevice],
    ) -> bool {
        let name = format!(
            "{node}.faultline.{:016x}",
            faultline_common::fault::fnv1a64(format!("{reason}\0{key}").as_bytes())
        );
        if self
            .announced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&name)
        {
            return false;
        }
        let ev = self.event_object(
            name.clone(),
            ObjectReference {
                kind: Some("Node".into()),
                name: Some(node.to_string()),
                api_version: Some("v1".into()),
                ..Default::default()
            },
            reason,
            message.clone(),
            warning,
        );
        let mut created = false;
        for attempt in 0..3u32 {
            match self.events.create(&PostParams::default(), &ev).await {
                Ok(_) => {
                    created = true;
                    break;
                }
                Err(kube::Error::Api(e)) if e.code == 409 => break,
                Err(e) => {
                    if attempt == 2 {
                        // Not known to be recorded: the next pass that reaches this
                        // point tries again (the name keeps it to one).
                        self.metric("event", "error");
                        tracing::warn!(node, reason, error = %e, "cannot record the Event; the next pass retries");
                        return false;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200 << attempt)).await;
                }
            }
        }
        {
            let mut a = self.announced.lock().unwrap_or_else(|p| p.into_inner());
            if a.len() > 10_000 {
                a.clear();
            }
            a.insert(name);
        }
        if created {
            if let Some(n) = &self.notifier {
                n.send(crate::notify::Notification {
                    kind: reason.to_string(),
                    severity: if warning { "warning" } else { "info" }.into(),
                    node: node.to_string(),
                    devices: devices.to_vec(),
                    message,
                    actor: self.actor.clone(),
                    at: now(),
                });
            }
        }
        created
    }

    /// An Event named `name` about `object`, reported by this replica.
    fn event_object(
        &self,
        name: String,
        object: ObjectReference,
        reason: &str,
        message: String,
        warning: bool,
    ) -> Event {
        let t = Time(Timestamp::now());
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                ..Default::default()
            },
            involved_object: object,
            reason: Some(reason.to_string()),
            message: Some(message),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            source: Some(EventSource {
                component: Some("faultline-aggregator".into()),
                host: None,
            }),
            first_timestamp: Some(t.clone()),
            last_timestamp: Some(t),
            count: Some(1),
            reporting_component: Some("faultline-aggregator".into()),
            reporting_instance: Some(self.actor.clone()),
            ..Default::default()
        }
    }

    /// The Event on the evicted Pod itself (its owners see it with `kubectl describe`).
    /// Best effort and named by the pod's UID, like the Node's Events.
    async fn pod_event(&self, pod: &Pod, devices: &[RecordDevice]) {
        let (Some(name), Some(ns)) = (
            pod.metadata.name.as_deref(),
            pod.metadata.namespace.as_deref(),
        ) else {
            return;
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ev = self.event_object(
            format!(
                "{name}.faultline.{:016x}",
                faultline_common::fault::fnv1a64(format!("evicted\0{uid}").as_bytes())
            ),
            ObjectReference {
                kind: Some("Pod".into()),
                name: Some(name.to_string()),
                namespace: Some(ns.to_string()),
                uid: Some(uid),
                api_version: Some("v1".into()),
                ..Default::default()
            },
            "FaultlineEvicted",
            format!(
                "evicted from {}: {}",
                pod.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .unwrap_or(""),
                describe(devices)
            ),
            true,
        );
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        match api.create(&PostParams::default(), &ev).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => tracing::debug!(pod = name, error = %e, "cannot record the Pod's Event"),
        }
    }

    fn metric(&self, action: &str, result: &str) {
        if let Some(m) = &self.metrics {
            m.action(action, result);
        }
    }

    /// Isolate `node` for `devices` (all failed). Idempotent: a second pass for the same
    /// fault changes nothing and announces nothing.
    pub async fn isolate(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
    ) -> Result<Outcome, RemediateError> {
        self.isolate_fenced(node, devices, &|| true).await
    }

    /// [`Remediator::isolate`], with `fence` asked before every write: the caller's
    /// shard Lease. A pass that loses it stops where it is.
    pub async fn isolate_fenced(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
        fence: &(dyn Fn() -> bool + Sync),
    ) -> Result<Outcome, RemediateError> {
        if self.mode == Mode::Off || devices.is_empty() {
            return Ok(Outcome::Off);
        }
        if self.breaker_open().await? {
            return Ok(Outcome::BreakerOpen);
        }
        let live = self.nodes.get(node).await?;
        let existing = Self::record_of(&live)?;
        let fresh = self.not_suppressed(&live, existing.as_ref(), devices);
        if fresh.is_empty() {
            return Ok(Outcome::Suppressed);
        }
        // Devices join a record and leave it only by a release: a device that is no
        // longer failed in this pass (or came from an alert the agents do not see)
        // stays until someone, or the auto release, proves it healthy.
        let mut devices: Vec<RecordDevice> = existing
            .as_ref()
            .filter(|r| !r.unknown_only)
            .map(|r| r.devices.clone())
            .unwrap_or_default();
        for d in fresh {
            if !devices
                .iter()
                .any(|x| x.is(&d.id) || d.uuid.as_deref().is_some_and(|u| x.is(u)))
            {
                devices.push(d);
            }
        }
        let fp = fingerprint(node, &devices);
        let taints = live
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        let has_taint = taints
            .iter()
            .any(|t| t.key == self.taint.key && t.effect == self.taint.effect);
        let has_condition = live
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == CONDITION && c.status == "False")
            });
        let same_fault = existing.as_ref().is_some_and(|r| r.fingerprint == fp);
        if same_fault && has_taint && has_condition {
            // A pass cut short after the condition (an answer lost) has not announced
            // yet: do it now. Known Events cost nothing; one this replica has not seen
            // costs one create answered 409.
            // Only while the record is young: Events expire (1 h by default), and an old
            // quarantine was announced long ago.
            let young = existing
                .as_ref()
                .is_some_and(|r| age_secs(&r.first_seen).is_some_and(|a| a < ANNOUNCE_RETRY_SECS));
            if let Some(r) = existing.as_ref().filter(|r| !r.unknown_only && young) {
                self.event(
                    node,
                    "FaultlineQuarantined",
                    &format!("{}/{}", r.fingerprint, r.first_seen),
                    format!(
                        "tainted {} ({} failed)",
                        self.taint.key,
                        r.devices
                            .iter()
                            .map(|d| format!("{}={}", d.id, d.reason))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    true,
                    &r.devices,
                )
                .await;
            }
            return Ok(Outcome::AlreadyDone);
        }
        // A node not yet quarantined is quarantined only within the budget. Decisions
        // are taken one at a time in this replica (check, then write), so concurrent
        // passes cannot all see room for one more. (Replicas decide for their own shards;
        // across replicas the count can exceed the budget by at most replicas - 1.)
        let _budget_turn = if existing.is_none() && !has_taint && self.mode == Mode::Enforce {
            let turn = self.budget_turn.lock().await;
            if let Some(why) = self.over_budget(&live).await? {
                return self.hold_back(node, why, &devices).await;
            }
            Some(turn)
        } else {
            None
        };
        let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        let summary = format!(
            "{} failed on {node}: {}",
            ids.join(", "),
            describe(&devices)
        );
        if !fence() {
            return Err(RemediateError::NotHolder);
        }
        if self.mode == Mode::DryRun {
            tracing::warn!(node, devices = ?ids, taint = %self.taint.key, "dry-run: would quarantine");
            self.metric("quarantine", "dry-run");
            self.event(
                node,
                "FaultlineWouldQuarantine",
                &fp,
                format!("dry-run: would taint {} ({summary})", self.taint.key),
                true,
                &devices,
            )
            .await;
            return Ok(Outcome::Announced);
        }

        let now = now();
        let mut record = existing.unwrap_or_else(|| self.new_record(node, vec![], &now));
        record.unknown_only = false;
        record.devices = devices;
        record.fingerprint = fp;
        record.last_seen = now.clone();
        let mut patch = NodePatch::on(&live);
        if !has_taint {
            let mut t = taints.clone();
            t.push(self.taint.clone());
            patch.taints(&t);
            record.owned_taint = Some(self.taint.key.clone());
            record.actions.push(Action {
                action: "taint".into(),
                at: now.clone(),
                actor: self.actor.clone(),
            });
        }
        let labels = live.metadata.labels.clone().unwrap_or_default();
        let label_value = label_value(&ids);
        let label_ok = labels.get(DEVICES_LABEL).is_some_and(|v| *v == label_value);
        if !label_ok && (record.owned_label || !labels.contains_key(DEVICES_LABEL)) {
            patch.label(DEVICES_LABEL, &label_value);
            record.owned_label = true;
            record.actions.push(Action {
                action: "label".into(),
                at: now.clone(),
                actor: self.actor.clone(),
            });
        }
        patch.record(&record);
        // Taint, label and record in one write, unless only the condition was missing.
        if !(same_fault && has_taint) {
            self.apply(node, patch, fence).await?;
        }
        if !fence() {
            return Err(RemediateError::NotHolder);
        }

        // The condition lives in status; conditions merge by type.
        let condition = serde_json::json!({"status": {"conditions": [{
            "type": CONDITION, "status": "False", "reason": "AcceleratorFailed", "message": summary,
            "lastTransitionTime": now, "lastHeartbeatTime": now,
        }]}});
        self.nodes
            .patch_status(node, &PatchParams::default(), &Patch::Strategic(condition))
            .await?;
        self.held_back
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
        if !(same_fault && has_taint) {
            self.metric("quarantine", "ok");
            audit(
                "quarantine",
                node,
                &record.devices,
                &self.actor,
                &self.taint.key,
            );
        }
        // Also when only the condition was missing: a pass cut short before its Event
        // announces now, and one that did meets the Event's name and stays quiet.
        self.event(
            node,
            "FaultlineQuarantined",
            &format!("{}/{}", record.fingerprint, record.first_seen),
            format!("tainted {} ({summary})", self.taint.key),
            true,
            &record.devices,
        )
        .await;
        Ok(Outcome::Isolated)
    }
}
