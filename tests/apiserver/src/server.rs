//! The server's state and its errors: objects by key, resourceVersions, the watch
//! history, injected faults, the calls received, and the API's error bodies.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::{Costs, Release, KINDS};

/// ConfigMaps (data + binaryData) may not exceed this, as in the real server.
pub const CONFIGMAP_MAX_BYTES: usize = 1 << 20;
/// Watch events kept for watches that start from an older resourceVersion.
pub(crate) const HISTORY: usize = 100_000;

/// (resource, namespace, name): where an object is kept.
pub(crate) type Key = (String, String, String);

/// Faults to inject, each a share of calls in 0..=1.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Added to every call (or only to those whose path contains `latency_match`).
    pub latency_ms: u64,
    /// Only calls of this method are delayed (empty: any), e.g. `PATCH` for writes that
    /// wait on etcd while reads are served from the watch cache.
    pub latency_method: String,
    /// Only calls whose path contains this are delayed (empty: every call). Injected,
    /// not modelled on kube-apiserver code: a slow resource, as when one kind's writes
    /// wait on etcd while others answer (what kube-apiserver reports per resource and
    /// verb in `apiserver_request_duration_seconds`,
    /// staging/src/k8s.io/apiserver/pkg/endpoints/metrics/metrics.go). The request is
    /// carried out after the delay, so its recorded `at_ms` marks its end.
    pub latency_match: String,
    /// Share of calls answered 500.
    pub error_rate: f64,
    /// Share of writes with a precondition (an update, or a patch naming a
    /// resourceVersion) answered 409 Conflict.
    pub conflict_rate: f64,
    /// Share of writes (POST/PUT/PATCH/DELETE) answered 500 without being carried out,
    /// as when etcd times out.
    pub write_error_rate: f64,
    /// Only writes whose path contains this fail so (empty: every write). Which calls
    /// fail is injected, as `latency_match` is: one resource's writes failing while
    /// others succeed, as when its etcd keys sit in a slow range. The answer follows
    /// staging/src/k8s.io/apiserver/pkg/storage/errors/storage.go
    /// (`InterpretUpdateError` on `storage.IsInternalError`: `NewInternalError`, 500).
    /// The write dice are rolled after the error dice, as before this field, so a seed
    /// replays the same faults.
    pub write_error_match: String,
    /// Share of calls answered 429 by API Priority and Fairness: a plain-text body and
    /// `Retry-After: 1`, no Status and no `DisruptionBudget` cause, as
    /// staging/src/k8s.io/apiserver/pkg/server/filters/maxinflight.go `tooManyRequests`
    /// writes it.
    pub throttle_rate: f64,
    /// Only calls whose path contains this are throttled (empty: every call).
    pub throttle_match: String,
    /// Node churn: every eviction first bumps the resourceVersion of the pod's Node, as
    /// the kubelet's status updates do between a controller's read and its write.
    pub node_churn: bool,
    /// Share of writes (POST/PUT/PATCH/DELETE) that are carried out but answered only
    /// after `late_answer_ms`: the client times out on a change that did happen.
    pub late_answer_rate: f64,
    /// How late such an answer comes (default 3 s).
    pub late_answer_ms: u64,
    /// Watches end after this many seconds (0: only at their timeout).
    pub drop_watch_after_s: u64,
    /// How long a terminating pod's containers take to stop before its kubelet
    /// removes it (at most its grace period; 0: at the kubelet's next look).
    pub pod_stop_ms: u64,
    /// The disruption controller is stopped: PodDisruptionBudgets' status is not
    /// updated, so a new or changed budget is "still being processed" (eviction.go).
    pub disruption_controller_paused: bool,
    /// The device-taint eviction controller is stopped (kube-controller-manager down,
    /// or its `DRADeviceTaints` gate off): a rule at effect `None` never gets a
    /// prediction. Injected, as `disruption_controller_paused` is: upstream's
    /// controller (pkg/controller/devicetainteviction/device_taint_eviction.go) writes
    /// the `EvictionInProgress` condition only while it runs, and kube-apiserver writes
    /// none of a rule's status itself
    /// (pkg/registry/resource/devicetaintrule/strategy.go).
    pub taint_eviction_paused: bool,
    /// The watch cache lags: a list served from it (`resourceVersion=0`, or
    /// `NotOlderThan` a revision it has passed) shows the state as it was up to this
    /// many ms ago, the lag drawn per list (never older than the revision asked for).
    /// Upstream's cacher answers such a list from its store at once, however far its
    /// watch of etcd is behind (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go
    /// `GetList`: only a list naming a revision newer than the cache waits, up to 3 s,
    /// `waitUntilFreshAndBlock`); the lag is what a busy etcd watch gives it.
    pub stale_list_ms: u64,
    /// Seed of the fault dice.
    pub seed: u64,
}

/// A call as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct Call {
    /// HTTP method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// Answered status.
    pub status: u16,
    /// The bearer token the call carried, if any: which client made it.
    pub token: Option<String>,
    /// When the call was carried out (milliseconds since the Unix epoch, taken after
    /// the server acted on it, before a late answer's delay).
    pub at_ms: u64,
    /// When the call arrived, before any injected latency: the audit log's
    /// `RequestReceived` stage ("generated as soon as the audit handler receives the
    /// request", staging/src/k8s.io/apiserver/pkg/apis/audit/types.go), where `at_ms`
    /// is its `ResponseComplete`.
    pub received_ms: u64,
}

/// A call as it arrived, before it is carried out: the audit log's `RequestReceived`
/// event (staging/src/k8s.io/apiserver/pkg/apis/audit/types.go), so a test can see a
/// call in flight.
#[derive(Debug, Clone, Serialize)]
pub struct Received {
    /// HTTP method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// When it arrived (milliseconds since the Unix epoch).
    pub at_ms: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct WatchEvent {
    pub(crate) rv: u64,
    pub(crate) key: Key,
    pub(crate) kind: &'static str,
    pub(crate) event: &'static str,
    pub(crate) object: Value,
    /// For MODIFIED and DELETED: the object before, so a watch can tell an object
    /// entering or leaving its selector and a paged list can see the past.
    pub(crate) prev: Option<Value>,
    /// When the change was made (the server's clock, ms): where a lagging watch cache
    /// stands ([`Faults::stale_list_ms`]).
    pub(crate) at_ms: u64,
}

pub(crate) struct Inner {
    pub(crate) rv: u64,
    /// (plural, namespace, name) -> object. Written only through [`Inner::put`] and
    /// [`Inner::take`], which keep `pods_by_node` in step.
    pub(crate) objects: BTreeMap<Key, Value>,
    /// The pods' keys by `spec.nodeName`: the watch cache's index for pods
    /// (pkg/registry/core/pod/strategy.go `NodeNameIndexFunc`, registered as the
    /// store's `Indexers` in pkg/registry/core/pod/storage/storage.go), which serves a
    /// list with `fieldSelector=spec.nodeName=N` from that node's pods alone
    /// (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go `GetList`, through
    /// `pred.MatcherIndex`). Unscheduled pods are under "".
    pub(crate) pods_by_node: BTreeMap<String, std::collections::BTreeSet<Key>>,
    pub(crate) history: VecDeque<WatchEvent>,
    pub(crate) faults: Faults,
    pub(crate) rng: rand::rngs::StdRng,
    pub(crate) calls: Vec<Call>,
    pub(crate) received: Vec<Received>,
    pub(crate) abandoned: Vec<Received>,
    /// Looks the simulated kubelets have taken.
    pub(crate) kubelet_looks: u64,
    pub(crate) uid: u64,
    /// With RBAC on: the users by bearer token.
    pub(crate) tokens: Option<super::rbac::Tokens>,
    /// Terminating pods and when their containers will have stopped.
    pub(crate) terminating: BTreeMap<Key, SystemTime>,
    /// The kubelets' watches on the ConfigMaps and Secrets their pods use.
    pub(crate) kubelets: super::kubelet::Kubelets,
    /// What the server sent and stored.
    pub(crate) meter: Arc<super::costs::Meter>,
    /// The Kubernetes release played: which `resource.k8s.io` versions are served.
    pub(crate) release: Release,
}

fn pod_node(obj: &Value) -> String {
    obj.pointer("/spec/nodeName")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

impl Inner {
    /// Store `obj` under `key`; returns what was there.
    pub(crate) fn put(&mut self, key: Key, obj: Value) -> Option<Value> {
        let node = (key.0 == "pods").then(|| pod_node(&obj));
        let prev = self.objects.insert(key.clone(), obj);
        if let Some(p) = &prev {
            self.unindex(&key, p);
        }
        if let Some(node) = node {
            self.pods_by_node.entry(node).or_default().insert(key);
        }
        prev
    }

    /// Remove the object under `key`; returns it.
    pub(crate) fn take(&mut self, key: &Key) -> Option<Value> {
        let prev = self.objects.remove(key)?;
        self.unindex(key, &prev);
        Some(prev)
    }

    fn unindex(&mut self, key: &Key, was: &Value) {
        if key.0 != "pods" {
            return;
        }
        let node = pod_node(was);
        if let Some(keys) = self.pods_by_node.get_mut(&node) {
            keys.remove(key);
            if keys.is_empty() {
                self.pods_by_node.remove(&node);
            }
        }
    }

    /// The oldest resourceVersion whose state the history can still show: a watch or
    /// a paged list from before it is answered 410 Gone, as after etcd's compaction.
    pub(crate) fn oldest_servable(&self) -> u64 {
        self.history
            .front()
            .map_or(self.rv, |e| e.rv.saturating_sub(1))
    }
}

/// The server state.
#[derive(Clone)]
pub struct ApiServer {
    pub(crate) inner: Arc<Mutex<Inner>>,
    pub(crate) events: broadcast::Sender<WatchEvent>,
    pub(crate) meter: Arc<super::costs::Meter>,
}

impl Default for ApiServer {
    fn default() -> Self {
        Self::new()
    }
}

/// A Kubernetes `Status` error.
#[derive(Debug)]
pub struct ApiError {
    code: StatusCode,
    reason: &'static str,
    pub(super) message: String,
    /// `details` of the Status, when there are some.
    pub(super) details: Option<Value>,
    /// Answered as plain text, not a Status (what API Priority and Fairness does).
    pub(super) plain: bool,
    /// The `Retry-After` header, in seconds.
    pub(super) retry_after: Option<u64>,
    /// `metadata` of the Status (a list's `continue` token on a 410,
    /// staging/src/k8s.io/apiserver/pkg/storage/etcd3/errors.go).
    pub(super) metadata: Option<Box<Value>>,
}

impl ApiError {
    pub(crate) fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            plain: false,
            retry_after: None,
            metadata: None,
        }
    }

    /// A 422 Invalid for `kind` `name`.
    pub(crate) fn invalid(kind: &str, name: &str, why: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: {why}"),
        )
    }

    /// The HTTP status.
    pub fn code(&self) -> u16 {
        self.code.as_u16()
    }
    pub(crate) fn not_found(plural: &str, name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{plural} \"{name}\" not found"),
        )
    }
}

pub(crate) fn status_body(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": if code.is_success() { "Success" } else { "Failure" },
        "message": message, "reason": reason, "code": code.as_u16()
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = if self.plain {
            (self.code, format!("{}\n", self.message)).into_response()
        } else {
            let mut body = status_body(self.code, self.reason, &self.message);
            if let Some(d) = self.details {
                body["details"] = d;
            }
            if let Some(m) = self.metadata {
                body["metadata"] = *m;
            }
            (self.code, Json(body)).into_response()
        };
        if let Some(s) = self.retry_after {
            if let Ok(v) = s.to_string().parse() {
                r.headers_mut().insert("retry-after", v);
            }
        }
        r
    }
}

pub(crate) type ApiResult = Result<Response, ApiError>;

/// Now on this thread's server clock, in milliseconds since the epoch: the system's, or
/// the virtual clock of a server made with [`ApiServer::new_virtual`] on this thread
/// (what its calls' `at_ms` are measured on).
pub fn clock_ms() -> u64 {
    super::clock::now_ms()
}

pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(super::clock::now()).to_string()
}

/// Whether `labels` (an object's `metadata.labels`) match a label selector, parsed as
/// kube-apiserver parses it ([`super::selectors::LabelSelector`]); a malformed selector
/// matches nothing (the server answers it 400).
pub fn labels_match(selector: &str, labels: &Value) -> bool {
    super::selectors::LabelSelector::parse(selector).is_ok_and(|s| s.matches(labels))
}

/// Whether `obj` matches a field selector (`metadata.name=x,spec.nodeName=y,
/// status.phase!=Succeeded`): the fields its kind selects on
/// ([`super::selectors::FieldSelector`]); a malformed selector, or one on a field the kind
/// does not support, matches nothing (the server answers it 400).
pub fn fields_match(selector: &str, obj: &Value) -> bool {
    let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
    let Some(k) = KINDS.iter().find(|k| k.kind == kind) else {
        return false;
    };
    super::selectors::FieldSelector::parse(k, selector).is_ok_and(|s| s.matches(k, obj))
}

impl ApiServer {
    /// [`ApiServer::new`] on a virtual clock that starts at `epoch_ms` and moves with
    /// tokio's (`clock`): for a current-thread runtime with a paused clock, where the
    /// same inputs give the same timestamps and controller ticks on every run. Call it
    /// on that runtime.
    pub fn new_virtual(epoch_ms: u64) -> Self {
        super::clock::set_virtual(epoch_ms);
        Self::new()
    }

    /// An empty cluster with the `default` namespace.
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(65_536);
        let meter = Arc::new(super::costs::Meter::default());
        let s = ApiServer {
            inner: Arc::new(Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                pods_by_node: BTreeMap::new(),
                history: VecDeque::new(),
                faults: Faults::default(),
                rng: rand::rngs::StdRng::seed_from_u64(0),
                calls: Vec::new(),
                received: Vec::new(),
                abandoned: Vec::new(),
                kubelet_looks: 0,
                uid: 0,
                tokens: None,
                terminating: BTreeMap::new(),
                kubelets: super::kubelet::Kubelets::default(),
                meter: meter.clone(),
                release: Release::default(),
            })),
            events,
            meter,
        };
        super::lifecycle::start(Arc::downgrade(&s.inner), s.events.clone());
        super::taint_eviction::start(Arc::downgrade(&s.inner), s.events.clone(), s.meter.clone());
        for ns in ["default", "kube-system"] {
            let _ = s.create("namespaces", "", json!({"metadata": {"name": ns}}));
        }
        s
    }

    /// Play `release` from now on (discovery, `/version`, the versions served).
    pub fn set_release(&self, release: Release) {
        self.lock().release = release;
    }

    /// The release played.
    pub fn release(&self) -> Release {
        self.lock().release
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set the faults to inject.
    pub fn set_faults(&self, f: Faults) {
        let mut g = self.lock();
        g.rng = rand::rngs::StdRng::seed_from_u64(f.seed);
        g.faults = f;
    }

    /// Compact the history, as etcd compaction does: a watch or a paged list from a
    /// resourceVersion before now is answered 410 Gone ("too old resource version",
    /// staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go; etcd3/errors.go).
    pub fn compact(&self) {
        self.lock().history.clear();
    }

    /// The faults injected now.
    pub fn faults(&self) -> Faults {
        self.lock().faults.clone()
    }

    /// The calls received so far.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Every call as it arrived, those still in flight included (audit stage
    /// `RequestReceived`, staging/src/k8s.io/apiserver/pkg/apis/audit/types.go).
    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    /// The calls whose client went away before they were carried out, so they never
    /// were: kube-apiserver's request context ends when the client's connection
    /// closes (Go's net/http), and the registry writes to etcd under that context
    /// (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go), so a
    /// write given up by its client while it waits is not carried out.
    pub fn abandoned(&self) -> Vec<Received> {
        self.lock().abandoned.clone()
    }

    /// The newest resourceVersion (etcd's revision): every change made until now has
    /// one at most this.
    pub fn revision(&self) -> u64 {
        self.lock().rv
    }

    /// Every change made to objects of `plural` still in the history (all of them
    /// until it holds 100,000 or is compacted), in the order made: the revision, the
    /// watch event's type (`ADDED`, `MODIFIED`, `DELETED`) and the object after it
    /// (as it was removed, for `DELETED`).
    pub fn changes(&self, plural: &str) -> Vec<(u64, &'static str, Value)> {
        self.lock()
            .history
            .iter()
            .filter(|e| e.key.0 == plural)
            .map(|e| (e.rv, e.event, e.object.clone()))
            .collect()
    }

    /// How many looks the simulated kubelets have taken: a test that checks a pod is
    /// still there waits for a look after it was due, not for a time.
    pub fn kubelet_looks(&self) -> u64 {
        self.lock().kubelet_looks
    }

    /// What the server has sent and stored since it started or since the last
    /// [`ApiServer::reset_costs`], and the kubelets' watches (see [`costs`]).
    pub fn costs(&self) -> Costs {
        self.meter.snapshot()
    }

    /// Start counting again from zero (the open kubelet watches stay: they are a
    /// gauge). Returns what was counted until now.
    pub fn reset_costs(&self) -> Costs {
        self.meter.reset()
    }

    /// One object.
    pub fn get(&self, plural: &str, ns: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(plural.into(), ns.into(), name.into()))
            .cloned()
    }

    /// A part of one object (a JSON pointer into it), cloning only that part: what a
    /// benchmark polls without copying a large ConfigMap each time. A test accessor,
    /// not an API: nothing is recorded as a call.
    pub fn get_at(&self, plural: &str, ns: &str, name: &str, pointer: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(plural.into(), ns.into(), name.into()))?
            .pointer(pointer)
            .cloned()
    }

    /// Every object of a kind (in every namespace when `ns` is empty and the kind is
    /// namespaced).
    pub fn list(&self, plural: &str, ns: &str) -> Vec<Value> {
        // The keys sort by kind first: a range of the map, not a scan of every object.
        let from = (plural.to_string(), ns.to_string(), String::new());
        self.lock()
            .objects
            .range(from..)
            .take_while(|((p, n, _), _)| p == plural && (ns.is_empty() || n == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Turn authentication and RBAC on: `tokens` maps bearer tokens to users
    /// (`system:serviceaccount:NS:NAME`, or [`super::rbac::ADMIN`]); from now on every API
    /// request needs a known token and a grant from the RBAC objects stored here.
    pub fn enforce_rbac(&self, tokens: &[(&str, &str)]) {
        self.lock().tokens = Some(super::rbac::Tokens(
            tokens
                .iter()
                .map(|(t, u)| (t.to_string(), u.to_string()))
                .collect(),
        ));
    }

    /// Create the objects of a multi-document YAML manifest that this server serves
    /// (RBAC objects among them); the others (Deployments, Services, ...) are skipped.
    /// How many were created.
    pub fn load_manifests(&self, yaml: &str) -> Result<usize, String> {
        let mut n = 0;
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let v = Value::deserialize(doc).map_err(|e| e.to_string())?;
            let Some(kind) = v.get("kind").and_then(Value::as_str) else {
                continue;
            };
            let Some(k) = KINDS.iter().find(|k| k.kind == kind) else {
                continue;
            };
            let ns = v
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            self.create(k.plural, &ns, v)
                .map_err(|e| e.message.clone())?;
            n += 1;
        }
        Ok(n)
    }

    /// Whether `user` may do `a`, from the RBAC objects stored now.
    pub(crate) fn authorized(&self, user: &str, a: &super::rbac::Attributes) -> bool {
        let g = self.lock();
        let of = |plural: &'static str| {
            g.objects
                .iter()
                .filter(move |((p, _, _), _)| p == plural)
                .map(|((_, ns, name), v)| (ns.clone(), name.clone(), v))
        };
        let policy = super::rbac::Policy {
            cluster_roles: of("clusterroles").map(|(_, n, v)| (n, v)).collect(),
            roles: of("roles").map(|(ns, n, v)| ((ns, n), v)).collect(),
            cluster_bindings: of("clusterrolebindings").map(|(_, _, v)| v).collect(),
            bindings: of("rolebindings").map(|(ns, _, v)| (ns, v)).collect(),
        };
        policy.allows(user, a)
    }
}
