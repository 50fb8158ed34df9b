//! A Kubernetes API server for tests and the demo: the real HTTP API for what faultline
//! uses, kept in memory. Both `kubectl` and the `kube` client work against it.
//!
//! Served: discovery (`/version`, `/api`, `/api/v1`, `/apis`, `/apis/<group>/<version>`);
//! for Nodes (and `nodes/status`), Pods (and `pods/status`, `pods/eviction`),
//! ConfigMaps, Events, Namespaces, Leases (`coordination.k8s.io/v1`) and
//! PodDisruptionBudgets (`policy/v1`): get, list and watch with resourceVersion, label
//! and field selectors (objects entering or leaving a selector are ADDED or DELETED);
//! create (409 AlreadyExists); update (409 Conflict on a stale resourceVersion); JSON,
//! merge and strategic-merge patch (list strategies from the Go types); delete, graceful
//! for pods (`lifecycle.rs`). A ConfigMap over 1 MiB is refused (422) as the real server
//! does, and so are invalid object names, ConfigMap keys and Event namespaces
//! (`validation.rs`, each rule citing upstream). Evictions are judged by the budget's
//! status, which a simulated disruption controller keeps current (`disruption.rs`,
//! after pkg/registry/core/pod/storage/eviction.go and
//! pkg/controller/disruption/disruption.go).
//!
//! Fault injection (`PUT /_faults`, JSON [`Faults`]) adds latency, 5xx, 409 and API
//! Priority and Fairness 429s to a share of calls, bumps Nodes' resourceVersion as the
//! kubelet's status updates do, and ends watches early; `GET /_calls` lists the calls
//! received.
//!
//! Tests, benchmarks and the binary start it one way: [`spawn`] (an empty cluster on
//! loopback) or a [`Bootstrap`] (namespaces, objects, manifests, RBAC, faults).

mod bootstrap;
pub mod disruption;
mod lifecycle;
pub mod patch;
pub mod rbac;
pub mod validation;

pub use bootstrap::{spawn, Bootstrap, Running};

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::broadcast;

/// ConfigMaps (data + binaryData) may not exceed this, as in the real server.
pub const CONFIGMAP_MAX_BYTES: usize = 1 << 20;
/// Watch events kept for watches that start from an older resourceVersion.
const HISTORY: usize = 100_000;

/// One kind the server knows.
#[derive(Debug, Clone, Copy)]
pub struct Kind {
    /// `""` for the core group.
    pub group: &'static str,
    /// `v1`.
    pub version: &'static str,
    /// Plural resource name.
    pub plural: &'static str,
    /// Kind name.
    pub kind: &'static str,
    /// Namespaced or cluster scoped.
    pub namespaced: bool,
    /// Short names for kubectl.
    pub short: &'static [&'static str],
}

/// Every kind served.
pub const KINDS: &[Kind] = &[
    Kind {
        group: "",
        version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
        short: &["no"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
        short: &["po"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "configmaps",
        kind: "ConfigMap",
        namespaced: true,
        short: &["cm"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        short: &["ev"],
    },
    Kind {
        group: "",
        version: "v1",
        plural: "namespaces",
        kind: "Namespace",
        namespaced: false,
        short: &["ns"],
    },
    Kind {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "batch",
        version: "v1",
        plural: "jobs",
        kind: "Job",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "roles",
        kind: "Role",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "rolebindings",
        kind: "RoleBinding",
        namespaced: true,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterroles",
        kind: "ClusterRole",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "rbac.authorization.k8s.io",
        version: "v1",
        plural: "clusterrolebindings",
        kind: "ClusterRoleBinding",
        namespaced: false,
        short: &[],
    },
    Kind {
        group: "policy",
        version: "v1",
        plural: "poddisruptionbudgets",
        kind: "PodDisruptionBudget",
        namespaced: true,
        short: &["pdb"],
    },
];

fn kind_of(group: &str, plural: &str) -> Option<&'static Kind> {
    KINDS
        .iter()
        .find(|k| k.group == group && k.plural == plural)
}

fn api_version(k: &Kind) -> String {
    if k.group.is_empty() {
        k.version.to_string()
    } else {
        format!("{}/{}", k.group, k.version)
    }
}

/// Faults to inject, each a share of calls in 0..=1.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Added to every call (or only to those whose path contains `latency_match`).
    pub latency_ms: u64,
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
struct WatchEvent {
    rv: u64,
    key: (String, String, String),
    kind: &'static str,
    event: &'static str,
    object: Value,
    /// For MODIFIED: the object before, so a watch can tell an object entering or
    /// leaving its selector.
    prev: Option<Value>,
}

struct Inner {
    rv: u64,
    /// (plural, namespace, name) -> object.
    objects: BTreeMap<(String, String, String), Value>,
    history: VecDeque<WatchEvent>,
    faults: Faults,
    rng: rand::rngs::StdRng,
    calls: Vec<Call>,
    received: Vec<Received>,
    uid: u64,
    /// With RBAC on: the users by bearer token.
    tokens: Option<rbac::Tokens>,
    /// Terminating pods and when their containers will have stopped.
    terminating: BTreeMap<(String, String, String), SystemTime>,
}

/// The server state.
#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Mutex<Inner>>,
    events: broadcast::Sender<WatchEvent>,
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
    message: String,
    /// `details` of the Status, when there are some.
    details: Option<Value>,
    /// Answered as plain text, not a Status (what API Priority and Fairness does).
    plain: bool,
    /// The `Retry-After` header, in seconds.
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            plain: false,
            retry_after: None,
        }
    }

    /// A 422 Invalid for `kind` `name`.
    fn invalid(kind: &str, name: &str, why: impl std::fmt::Display) -> Self {
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
    fn not_found(plural: &str, name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{plural} \"{name}\" not found"),
        )
    }
}

fn status_body(code: StatusCode, reason: &str, message: &str) -> Value {
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

type ApiResult = Result<Response, ApiError>;

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// `a=b,c!=d,e` label selectors (equality, inequality, existence).
pub fn labels_match(selector: &str, labels: &Value) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .all(|term| {
            let get = |k: &str| labels.get(k).and_then(Value::as_str);
            if let Some((k, v)) = term.split_once("!=") {
                get(k.trim()) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                get(k.trim()) == Some(v.trim())
            } else if let Some(k) = term.strip_prefix('!') {
                get(k.trim()).is_none()
            } else {
                get(term).is_some()
            }
        })
}

/// `metadata.name=x,spec.nodeName=y,status.phase!=Succeeded` field selectors.
pub fn fields_match(selector: &str, obj: &Value) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .all(|term| {
            let (path, want, negate) = match term.split_once("!=") {
                Some((p, v)) => (p, v, true),
                None => match term.split_once("==").or_else(|| term.split_once('=')) {
                    Some((p, v)) => (p, v, false),
                    None => return false,
                },
            };
            let mut cur = obj;
            for part in path.trim().split('.') {
                cur = cur.get(part).unwrap_or(&Value::Null);
            }
            let got = match cur {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (got == want.trim()) != negate
        })
}

/// The query parameters this server acts on; the others (limit, fieldManager, ...) are
/// accepted and ignored.
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct ListParams {
    watch: Option<String>,
    resource_version: Option<String>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    timeout_seconds: Option<u64>,
    allow_watch_bookmarks: Option<bool>,
    grace_period_seconds: Option<i64>,
}

impl ApiServer {
    /// An empty cluster with the `default` namespace.
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(65_536);
        let s = ApiServer {
            inner: Arc::new(Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                faults: Faults::default(),
                rng: rand::rngs::StdRng::seed_from_u64(0),
                calls: Vec::new(),
                received: Vec::new(),
                uid: 0,
                tokens: None,
                terminating: BTreeMap::new(),
            })),
            events,
        };
        lifecycle::start(Arc::downgrade(&s.inner), s.events.clone());
        for ns in ["default", "kube-system"] {
            let _ = s.create("namespaces", "", json!({"metadata": {"name": ns}}));
        }
        s
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Set the faults to inject.
    pub fn set_faults(&self, f: Faults) {
        let mut g = self.lock();
        g.rng = rand::rngs::StdRng::seed_from_u64(f.seed);
        g.faults = f;
    }

    /// Compact the history, as etcd compaction does: a watch from a resourceVersion
    /// before now is answered 410 Gone ("too old resource version",
    /// staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go).
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
        self.lock()
            .objects
            .iter()
            .filter(|((p, n, _), _)| p == plural && (ns.is_empty() || n == ns))
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn record(
        g: &mut Inner,
        tx: &broadcast::Sender<WatchEvent>,
        key: (String, String, String),
        kind: &'static str,
        event: &'static str,
        object: Value,
        prev: Option<Value>,
    ) {
        let e = WatchEvent {
            rv: g.rv,
            key,
            kind,
            event,
            object,
            prev,
        };
        g.history.push_back(e.clone());
        while g.history.len() > HISTORY {
            g.history.pop_front();
        }
        let _ = tx.send(e);
    }

    fn stamp(g: &mut Inner, obj: &mut Value, k: &Kind, ns: &str) {
        g.rv += 1;
        let rv = g.rv.to_string();
        obj["apiVersion"] = json!(api_version(k));
        obj["kind"] = json!(k.kind);
        let meta = obj["metadata"].as_object_mut().expect("checked by caller");
        meta.insert("resourceVersion".into(), json!(rv));
        if k.namespaced {
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
    }

    fn validate(k: &Kind, ns: &str, obj: &Value) -> Result<(), ApiError> {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        validation::object_name(k.plural, name).map_err(|e| ApiError::invalid(k.kind, name, e))?;
        match k.plural {
            "configmaps" => {
                validation::configmap(obj).map_err(|e| ApiError::invalid(k.kind, name, e))?
            }
            "events" => {
                validation::event(ns, obj).map_err(|e| ApiError::invalid(k.kind, name, e))?
            }
            _ => {}
        }
        if k.plural == "configmaps" {
            let size: usize = ["data", "binaryData"]
                .iter()
                .filter_map(|f| obj.get(*f).and_then(Value::as_object))
                .flat_map(|m| {
                    m.iter()
                        .map(|(key, v)| key.len() + v.as_str().map_or(0, str::len))
                })
                .sum();
            if size > CONFIGMAP_MAX_BYTES {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    format!(
                        "ConfigMap \"{}\" is invalid: []: Too long: must have at most {CONFIGMAP_MAX_BYTES} bytes",
                        obj.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Turn authentication and RBAC on: `tokens` maps bearer tokens to users
    /// (`system:serviceaccount:NS:NAME`, or [`rbac::ADMIN`]); from now on every API
    /// request needs a known token and a grant from the RBAC objects stored here.
    pub fn enforce_rbac(&self, tokens: &[(&str, &str)]) {
        self.lock().tokens = Some(rbac::Tokens(
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
        use serde::Deserialize;
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
    fn authorized(&self, user: &str, a: &rbac::Attributes) -> bool {
        let g = self.lock();
        let of = |plural: &'static str| {
            g.objects
                .iter()
                .filter(move |((p, _, _), _)| p == plural)
                .map(|((_, ns, name), v)| (ns.clone(), name.clone(), v))
        };
        let policy = rbac::Policy {
            cluster_roles: of("clusterroles").map(|(_, n, v)| (n, v)).collect(),
            roles: of("roles").map(|(ns, n, v)| ((ns, n), v)).collect(),
            cluster_bindings: of("clusterrolebindings").map(|(_, _, v)| v).collect(),
            bindings: of("rolebindings").map(|(ns, _, v)| (ns, v)).collect(),
        };
        policy.allows(user, a)
    }

    /// Create an object (as the API would: name, uid, resourceVersion, timestamps).
    pub fn create(&self, plural: &str, ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        if !obj.get("metadata").is_some_and(Value::is_object) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "metadata is required",
            ));
        }
        let mut g = self.lock();
        let name = match obj.pointer("/metadata/name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match obj
                .pointer("/metadata/generateName")
                .and_then(Value::as_str)
            {
                Some(prefix) => {
                    let suffix: String = (0..5)
                        .map(|_| (b'a' + g.rng.random_range(0..26u8)) as char)
                        .collect();
                    format!("{prefix}{suffix}")
                }
                None => {
                    return Err(ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        "metadata.name: Required value",
                    ))
                }
            },
        };
        let ns = if k.namespaced { ns } else { "" };
        if k.namespaced && ns.is_empty() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "a namespace is required",
            ));
        }
        let key = (plural.to_string(), ns.to_string(), name.clone());
        if g.objects.contains_key(&key) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{plural} \"{name}\" already exists"),
            ));
        }
        {
            let meta = obj["metadata"].as_object_mut().expect("checked");
            meta.insert("name".into(), json!(name));
        }
        Self::validate(k, ns, &obj)?;
        g.uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", g.uid);
        {
            let meta = obj["metadata"].as_object_mut().expect("checked");
            meta.insert("name".into(), json!(name));
            meta.insert("uid".into(), json!(uid));
            meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
            meta.remove("generateName");
        }
        if plural == "pods" && obj.pointer("/status/phase").is_none() {
            obj["status"]["phase"] = json!("Running");
        }
        // The PodDisruptionBudget strategy's PrepareForCreate: generation 1.
        if plural == "poddisruptionbudgets" {
            obj["metadata"]["generation"] = json!(1);
        }
        Self::stamp(&mut g, &mut obj, k, ns);
        g.objects.insert(key.clone(), obj.clone());
        Self::record(
            &mut g,
            &self.events,
            key,
            k.kind,
            "ADDED",
            obj.clone(),
            None,
        );
        Self::after_write(&mut g, &self.events, plural, ns);
        Ok(obj)
    }

    /// Replace an object; a stale `metadata.resourceVersion` is a 409 Conflict.
    pub fn update(
        &self,
        plural: &str,
        ns: &str,
        name: &str,
        mut obj: Value,
        subresource: Option<&str>,
    ) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        let ns = if k.namespaced { ns } else { "" };
        let key = (plural.to_string(), ns.to_string(), name.to_string());
        let mut g = self.lock();
        let cur = g
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(plural, name))?;
        if let Some(rv) = obj
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
        {
            if !rv.is_empty()
                && Some(rv)
                    != cur
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
            {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!("Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
                ));
            }
        }
        if !obj.get("metadata").is_some_and(Value::is_object) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "metadata is required",
            ));
        }
        // The status subresource changes status only; the main resource everything else.
        match subresource {
            Some("status") => {
                let status = obj.get("status").cloned().unwrap_or(Value::Null);
                obj = cur.clone();
                obj["status"] = status;
            }
            _ => {
                if let Some(st) = cur.get("status") {
                    if k.plural != "configmaps" {
                        obj["status"] = st.clone();
                    }
                }
            }
        }
        for f in [
            "uid",
            "creationTimestamp",
            "name",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            match cur.pointer(&format!("/metadata/{f}")) {
                Some(v) => obj["metadata"][f] = v.clone(),
                None => {
                    if let Some(m) = obj["metadata"].as_object_mut() {
                        m.remove(f);
                    }
                }
            }
        }
        // The PodDisruptionBudget strategy's PrepareForUpdate: a new spec is a new
        // generation (pkg/registry/policy/poddisruptionbudget/strategy.go).
        if k.plural == "poddisruptionbudgets" && obj.get("spec") != cur.get("spec") {
            let generation = cur
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            obj["metadata"]["generation"] = json!(generation + 1);
        }
        Self::validate(k, ns, &obj)?;
        Self::stamp(&mut g, &mut obj, k, ns);
        g.objects.insert(key.clone(), obj.clone());
        Self::record(
            &mut g,
            &self.events,
            key,
            k.kind,
            "MODIFIED",
            obj.clone(),
            Some(cur),
        );
        Self::after_write(&mut g, &self.events, k.plural, ns);
        Ok(obj)
    }

    /// Delete an object; returns it.
    pub fn delete(&self, plural: &str, ns: &str, name: &str) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        let ns = if k.namespaced { ns } else { "" };
        let key = (plural.to_string(), ns.to_string(), name.to_string());
        let mut g = self.lock();
        let mut obj = g
            .objects
            .remove(&key)
            .ok_or_else(|| ApiError::not_found(plural, name))?;
        g.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        g.terminating.remove(&key);
        Self::record(
            &mut g,
            &self.events,
            key,
            k.kind,
            "DELETED",
            obj.clone(),
            None,
        );
        Self::after_write(&mut g, &self.events, k.plural, ns);
        Ok(obj)
    }

    /// What the controllers do after a write: the disruption controller recomputes
    /// the budgets of the namespace when a pod or a budget changed.
    fn after_write(g: &mut Inner, tx: &broadcast::Sender<WatchEvent>, plural: &str, ns: &str) {
        if matches!(plural, "pods" | "poddisruptionbudgets") {
            lifecycle::sync_budgets(g, tx, ns);
        }
    }

    /// The Eviction subresource, as pkg/registry/core/pod/storage/eviction.go judges
    /// it: a pod that is finished, pending or terminating goes at once (`canIgnorePDB`);
    /// more than one matching PodDisruptionBudget is a 500; otherwise the one budget's
    /// `status` decides (`disruption::judge`: "still being processed", no disruption
    /// allowed, the unready-pod rule), and an allowed eviction uses one disruption
    /// before the pod is deleted gracefully with `grace` (the Eviction's
    /// `deleteOptions.gracePeriodSeconds`).
    pub fn evict(&self, ns: &str, name: &str, grace: Option<i64>) -> Result<Value, ApiError> {
        let pod = self
            .get("pods", ns, name)
            .ok_or_else(|| ApiError::not_found("pods", name))?;
        if self.lock().faults.node_churn {
            if let Some(node) = pod.pointer("/spec/nodeName").and_then(Value::as_str) {
                self.churn_node(node);
            }
        }
        let phase = pod.pointer("/status/phase").and_then(Value::as_str);
        let can_ignore = matches!(phase, Some("Succeeded" | "Failed" | "Pending"))
            || pod.pointer("/metadata/deletionTimestamp").is_some();
        if !can_ignore {
            let mut g = self.lock();
            let budgets: Vec<Value> = g
                .objects
                .iter()
                .filter(|((p, n, _), _)| p == "poddisruptionbudgets" && n == ns)
                .map(|(_, v)| v.clone())
                .collect();
            let matching = disruption::covering(&budgets, &pod);
            if matching.len() > 1 {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                ));
            }
            if let Some(pdb) = matching.first() {
                if let disruption::Judgement::Decrement(status) =
                    disruption::judge(pdb, &pod, SystemTime::now())?
                {
                    let pdb_name = pdb
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let key = ("poddisruptionbudgets".to_string(), ns.to_string(), pdb_name);
                    lifecycle::write_status(&mut g, &self.events, key, (*pdb).clone(), status);
                }
            }
        }
        self.delete_with_grace("pods", ns, name, grace)?;
        Ok(status_body(StatusCode::CREATED, "", ""))
    }

    /// Bump a Node's resourceVersion, as a kubelet status update does.
    pub fn churn_node(&self, node: &str) {
        if let Some(mut n) = self.get("nodes", "", node) {
            n["status"]["faultlineTestHeartbeat"] = json!(now_rfc3339());
            let _ = self.update("nodes", "", node, n, Some("status"));
        }
    }
}

fn kind_of_plural(plural: &str) -> Result<&'static Kind, ApiError> {
    KINDS.iter().find(|k| k.plural == plural).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({plural})"),
        )
    })
}

// ----------------------------------------------------------------------------- HTTP

/// The router, with discovery, resources and the test controls.
pub fn router(server: ApiServer) -> Router {
    Router::new()
        .route("/version", get(|| async { Json(json!({"major": "1", "minor": "34", "gitVersion": "v1.34.0-faultline-test", "platform": "linux/amd64"})) }))
        .route("/api", get(|| async { Json(json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})) }))
        .route("/api/v1", get(|| async { Json(resource_list("", "v1")) }))
        .route("/apis", get(|| async { Json(group_list()) }))
        .route("/apis/{group}/{version}", get(|Path((g, v)): Path<(String, String)>| async move {
            if KINDS.iter().any(|k| k.group == g && k.version == v) {
                Json(resource_list(&g, &v)).into_response()
            } else {
                ApiError::new(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource").into_response()
            }
        }))
        .route("/_faults", put(set_faults).get(get_faults))
        .route("/_calls", get(|State(s): State<ApiServer>| async move { Json(s.calls()) }))
        .fallback(dispatch)
        .with_state(server)
}

async fn set_faults(State(s): State<ApiServer>, Json(f): Json<Faults>) -> Json<Faults> {
    s.set_faults(f.clone());
    Json(f)
}

async fn get_faults(State(s): State<ApiServer>) -> Json<Faults> {
    Json(s.lock().faults.clone())
}

fn resource_list(group: &str, version: &str) -> Value {
    let mut resources = Vec::new();
    for k in KINDS
        .iter()
        .filter(|k| k.group == group && k.version == version)
    {
        resources.push(json!({
            "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced, "kind": k.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"], "shortNames": k.short
        }));
        if matches!(k.plural, "nodes" | "pods" | "poddisruptionbudgets") {
            resources.push(json!({"name": format!("{}/status", k.plural), "singularName": "", "namespaced": k.namespaced, "kind": k.kind, "verbs": ["get", "patch", "update"]}));
        }
        if k.plural == "pods" {
            resources.push(json!({"name": "pods/eviction", "singularName": "", "namespaced": true, "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]}));
        }
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn group_list() -> Value {
    let mut groups: Vec<Value> = Vec::new();
    for k in KINDS.iter().filter(|k| !k.group.is_empty()) {
        if groups.iter().any(|g| g["name"] == k.group) {
            continue;
        }
        let gv = format!("{}/{}", k.group, k.version);
        groups.push(json!({"name": k.group, "versions": [{"groupVersion": gv, "version": k.version}], "preferredVersion": {"groupVersion": gv, "version": k.version}}));
    }
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// A resource path, taken apart.
#[derive(Debug, PartialEq, Eq)]
struct ResourcePath {
    group: String,
    namespace: String,
    plural: String,
    name: Option<String>,
    subresource: Option<String>,
}

/// `/api/v1/[namespaces/NS/]PLURAL[/NAME[/SUB]]` and `/apis/GROUP/VERSION/...`.
fn parse_path(path: &str) -> Option<ResourcePath> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _v, rest @ ..] => ("".to_string(), rest),
        ["apis", g, _v, rest @ ..] => (g.to_string(), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (ns.to_string(), rest),
        _ => (String::new(), rest),
    };
    let (plural, name, subresource) = match rest {
        [plural] => (plural, None, None),
        [plural, name] => (plural, Some(name.to_string()), None),
        [plural, name, sub] => (plural, Some(name.to_string()), Some(sub.to_string())),
        _ => return None,
    };
    Some(ResourcePath {
        group,
        namespace,
        plural: plural.to_string(),
        name,
        subresource,
    })
}

/// Milliseconds since the Unix epoch: a call's `RequestReceived` and `ResponseComplete`
/// stage times, as an audit event's `requestReceivedTimestamp` and `stageTimestamp`
/// carry them (staging/src/k8s.io/apiserver/pkg/apis/audit/types.go; tested by
/// `path_matched_latency_and_calls_in_flight`, tests/clients.rs).
fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn dispatch(
    State(s): State<ApiServer>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received_ms = epoch_ms();
    let late = {
        let mut g = s.lock();
        g.received.push(Received {
            method: method.to_string(),
            uri: uri.to_string(),
            at_ms: received_ms,
        });
        let (rate, ms) = (g.faults.late_answer_rate, g.faults.late_answer_ms);
        let write = !matches!(method, Method::GET | Method::HEAD);
        (write && rate > 0.0 && uri.path() != "/_faults" && g.rng.random_bool(rate.min(1.0)))
            .then(|| Duration::from_millis(if ms == 0 { 3000 } else { ms }))
    };
    let resp = handle(&s, &method, &uri, &headers, body).await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    let at_ms = epoch_ms();
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(String::from);
    s.lock().calls.push(Call {
        method: method.to_string(),
        uri: uri.to_string(),
        status: resp.status().as_u16(),
        token,
        at_ms,
        received_ms,
    });
    if let Some(d) = late {
        tokio::time::sleep(d).await;
    }
    resp
}

async fn handle(
    s: &ApiServer,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> ApiResult {
    let path = uri.path();
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    };
    let ResourcePath {
        group,
        namespace: ns,
        plural,
        name,
        subresource: sub,
    } = parse_path(path).ok_or_else(not_found)?;
    let k = kind_of(&group, &plural).ok_or_else(not_found)?;
    let params: ListParams = Query::try_from_uri(uri)
        .map(|Query(p)| p)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", e.body_text()))?;
    authorize(
        s,
        method,
        headers,
        k,
        &ns,
        name.as_deref(),
        sub.as_deref(),
        &params,
    )?;

    // Injected faults.
    let (latency, fail) = {
        let mut g = s.lock();
        let f = g.faults.clone();
        // A conflict needs a precondition: an update, or a patch that names a
        // resourceVersion. A patch without one is retried by the server itself
        // (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go).
        let write = *method == Method::PUT
            || (*method == Method::PATCH
                && serde_json::from_slice::<Value>(&body)
                    .ok()
                    .is_some_and(|p| p.pointer("/metadata/resourceVersion").is_some()));
        let roll = |g: &mut Inner, p: f64| p > 0.0 && g.rng.random_bool(p.min(1.0));
        let any_write = !matches!(*method, Method::GET | Method::HEAD);
        let fail = if roll(&mut g, f.error_rate) || (any_write && roll(&mut g, f.write_error_rate))
        {
            Some(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "injected fault: internal error",
            ))
        } else if (f.throttle_match.is_empty() || path.contains(&f.throttle_match))
            && roll(&mut g, f.throttle_rate)
        {
            // maxinflight.go tooManyRequests: plain text and Retry-After, no Status.
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                "Too many requests, please try again later.",
            );
            e.plain = true;
            e.retry_after = Some(1);
            Some(e)
        } else if write && roll(&mut g, f.conflict_rate) {
            Some(ApiError::new(StatusCode::CONFLICT, "Conflict", "injected fault: the object has been modified; please apply your changes to the latest version and try again"))
        } else {
            None
        };
        let delayed = f.latency_match.is_empty() || path.contains(&f.latency_match);
        (if delayed { f.latency_ms } else { 0 }, fail)
    };
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    if let Some(e) = fail {
        return Err(e);
    }

    // Only JSON is served; clients that try protobuf or CBOR first (kubectl does for
    // built-in types) fall back to JSON on a 415.
    let body_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !body.is_empty() && (body_type.contains("protobuf") || body_type.contains("cbor")) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format - accepted media types include: application/json (got {body_type})"),
        ));
    }
    let parse_body = || -> Result<Value, ApiError> {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("invalid JSON body: {e}"),
            )
        })
    };
    match (method.clone(), name, sub.as_deref()) {
        (Method::GET, None, None) => {
            if matches!(params.watch.as_deref(), Some("true") | Some("1")) {
                Ok(watch(s, k, &ns, &params))
            } else {
                Ok(Json(list(s, k, &ns, &params)).into_response())
            }
        }
        (Method::GET, Some(n), None | Some("status")) => {
            let ns = if k.namespaced { ns } else { String::new() };
            s.get(k.plural, &ns, &n)
                .map(|o| Json(o).into_response())
                .ok_or_else(|| ApiError::not_found(k.plural, &n))
        }
        (Method::POST, None, None) => {
            let mut obj = parse_body()?;
            before_create(k, &mut obj);
            let obj = s.create(k.plural, &ns, obj)?;
            Ok((StatusCode::CREATED, Json(obj)).into_response())
        }
        (Method::POST, Some(n), Some("eviction")) if k.plural == "pods" => {
            let grace = parse_body()?
                .pointer("/deleteOptions/gracePeriodSeconds")
                .and_then(Value::as_i64);
            Ok((StatusCode::CREATED, Json(s.evict(&ns, &n, grace)?)).into_response())
        }
        (Method::PUT, Some(n), sub @ (None | Some("status"))) => {
            Ok(Json(s.update(k.plural, &ns, &n, parse_body()?, sub)?).into_response())
        }
        (Method::PATCH, Some(n), sub @ (None | Some("status"))) => {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let ns2 = if k.namespaced {
                ns.clone()
            } else {
                String::new()
            };
            let cur = s
                .get(k.plural, &ns2, &n)
                .ok_or_else(|| ApiError::not_found(k.plural, &n))?;
            let p = parse_body()?;
            let mut next = match ct.split(';').next().unwrap_or("").trim() {
                "application/json-patch+json" => patch::json_patch(&cur, &p).map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", e))?,
                "application/merge-patch+json" => patch::merge_patch(&cur, &p),
                "application/strategic-merge-patch+json" => patch::strategic_merge_patch(&cur, &p),
                "application/apply-patch+yaml" => return Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", "server-side apply is not served by this test server")),
                other => return Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"))),
            };
            // A patch that names a resourceVersion is checked like an update; one that
            // does not applies to the current object.
            if p.pointer("/metadata/resourceVersion").is_none() {
                next["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
            }
            Ok(Json(s.update(k.plural, &ns, &n, next, sub)?).into_response())
        }
        (Method::DELETE, Some(n), None) => {
            // DeleteOptions come in the body or the query.
            let grace = params.grace_period_seconds.or_else(|| {
                serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|b| b.get("gracePeriodSeconds").and_then(Value::as_i64))
            });
            Ok(Json(s.delete_with_grace(k.plural, &ns, &n, grace)?).into_response())
        }
        _ => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} is not supported on {path}"),
        )),
    }
}

/// With RBAC on: 401 without a known token, 403 for what the user's bindings do not
/// grant (see `rbac.rs`).
#[allow(clippy::too_many_arguments)]
fn authorize(
    s: &ApiServer,
    method: &Method,
    headers: &HeaderMap,
    k: &Kind,
    ns: &str,
    name: Option<&str>,
    sub: Option<&str>,
    params: &ListParams,
) -> Result<(), ApiError> {
    let Some(tokens) = s.lock().tokens.clone() else {
        return Ok(());
    };
    let header = headers.get("authorization").and_then(|v| v.to_str().ok());
    let Some(user) = tokens.user(header).map(String::from) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    };
    // requestinfo.go: the verb of a request.
    let verb = match (method.clone(), name) {
        (Method::GET, None) if matches!(params.watch.as_deref(), Some("true" | "1")) => "watch",
        (Method::GET, None) => "list",
        (Method::GET, Some(_)) => "get",
        (Method::POST, _) => "create",
        (Method::PUT, _) => "update",
        (Method::PATCH, _) => "patch",
        (Method::DELETE, _) => "delete",
        _ => "unknown",
    };
    let a = rbac::Attributes {
        verb: verb.into(),
        group: k.group.into(),
        resource: k.plural.into(),
        subresource: sub.map(String::from),
        namespace: if k.namespaced {
            ns.into()
        } else {
            String::new()
        },
        name: name.map(String::from),
    };
    if s.authorized(&user, &a) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            rbac::forbidden_message(&user, &a),
        ))
    }
}

/// What the API server does to a new object before storing it
/// (staging/src/k8s.io/apiserver/pkg/registry/rest/create.go `BeforeCreate` and the
/// kinds' `PrepareForCreate`): no deletion marks; a pod starts Pending with no status
/// from the client (pkg/registry/core/pod/strategy.go); a budget starts with no
/// status (pkg/registry/policy/poddisruptionbudget/strategy.go). Objects that tests
/// seed through [`ApiServer::create`] skip this: the test plays the kubelet.
fn before_create(k: &Kind, obj: &mut Value) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
    }
    match k.plural {
        "pods" => obj["status"] = json!({"phase": "Pending"}),
        "poddisruptionbudgets" => {
            if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        _ => {}
    }
}

fn selected(
    k: &Kind,
    ns: &str,
    key: &(String, String, String),
    obj: &Value,
    p: &ListParams,
) -> bool {
    key.0 == k.plural
        && (ns.is_empty() || key.1 == ns)
        && p.label_selector.as_deref().is_none_or(|sel| {
            labels_match(sel, obj.pointer("/metadata/labels").unwrap_or(&Value::Null))
        })
        && p.field_selector
            .as_deref()
            .is_none_or(|sel| fields_match(sel, obj))
}

/// An event as a watch with selectors sees it
/// (staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go
/// `convertToWatchEvent`): a change that brings an object into the selection is
/// ADDED, one that takes it out is DELETED (the object as it was, at the event's
/// resourceVersion), and changes outside the selection are not seen.
fn as_seen(k: &Kind, ns: &str, e: &WatchEvent, p: &ListParams) -> Option<Value> {
    if e.kind != k.kind {
        return None;
    }
    let now = selected(k, ns, &e.key, &e.object, p);
    let before = e
        .prev
        .as_ref()
        .map_or(now, |o| selected(k, ns, &e.key, o, p));
    match (e.event, now, before) {
        ("MODIFIED", true, false) => Some(json!({"type": "ADDED", "object": e.object})),
        ("MODIFIED", false, true) => {
            let mut old = e.prev.clone()?;
            old["metadata"]["resourceVersion"] = json!(e.rv.to_string());
            Some(json!({"type": "DELETED", "object": old}))
        }
        (_, true, _) => Some(json!({"type": e.event, "object": e.object})),
        _ => None,
    }
}

fn list(s: &ApiServer, k: &Kind, ns: &str, p: &ListParams) -> Value {
    let g = s.lock();
    let items: Vec<Value> = g
        .objects
        .iter()
        .filter(|(key, o)| selected(k, ns, key, o, p))
        .map(|(_, o)| o.clone())
        .collect();
    json!({"kind": format!("{}List", k.kind), "apiVersion": api_version(k), "metadata": {"resourceVersion": g.rv.to_string()}, "items": items})
}

fn watch(s: &ApiServer, k: &'static Kind, ns: &str, p: &ListParams) -> Response {
    let mut rx = s.events.subscribe();
    let (backlog, start_rv, too_old, drop_after) = {
        let g = s.lock();
        let from: Option<u64> = p
            .resource_version
            .as_deref()
            .filter(|v| !v.is_empty() && *v != "0")
            .and_then(|v| v.parse().ok());
        let oldest = g.history.front().map(|e| e.rv).unwrap_or(g.rv);
        let mut backlog = Vec::new();
        let mut too_old = false;
        match from {
            // From a point in history: replay what happened after it.
            Some(rv) if rv + 1 < oldest => too_old = true,
            Some(rv) => backlog.extend(
                g.history
                    .iter()
                    .filter(|e| e.rv > rv)
                    .filter_map(|e| as_seen(k, ns, e, p)),
            ),
            // From "any": the current objects as ADDED, then changes.
            None => backlog.extend(
                g.objects
                    .iter()
                    .filter(|(key, o)| selected(k, ns, key, o, p))
                    .map(|(_, o)| json!({"type": "ADDED", "object": o})),
            ),
        }
        (backlog, g.rv, too_old, g.faults.drop_watch_after_s)
    };
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1800).min(3600));
    let timeout = if drop_after > 0 {
        timeout.min(Duration::from_secs(drop_after))
    } else {
        timeout
    };
    let bookmarks = p.allow_watch_bookmarks.unwrap_or(false);
    let (ns, p_label, p_field) = (
        ns.to_string(),
        p.label_selector.clone(),
        p.field_selector.clone(),
    );
    let stream = async_stream(move |tx| async move {
        if too_old {
            let _ = tx.send(json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", "too old resource version")})).await;
            return;
        }
        for e in backlog {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        let params = ListParams {
            label_selector: p_label,
            field_selector: p_field,
            ..Default::default()
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last_rv = start_rv;
        loop {
            let next = tokio::time::timeout_at(deadline, rx.recv()).await;
            match next {
                Err(_) => {
                    if bookmarks {
                        let _ = tx.send(json!({"type": "BOOKMARK", "object": {"kind": k.kind, "apiVersion": api_version(k), "metadata": {"resourceVersion": last_rv.to_string()}}})).await;
                    }
                    return;
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {
                    let _ = tx.send(json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", "watch fell behind")})).await;
                    return;
                }
                Ok(Err(_)) => return,
                Ok(Ok(e)) => {
                    if e.rv <= start_rv {
                        continue;
                    }
                    let Some(seen) = as_seen(k, &ns, &e, &params) else {
                        continue;
                    };
                    last_rv = e.rv;
                    if tx.send(seen).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(stream)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A streaming body fed line by line (one JSON document per line, as watches are).
fn async_stream<F, Fut>(f: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Value>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Value>(256);
    tokio::spawn(f(tx));
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|v| {
            v.map(|v| {
                let mut line = serde_json::to_vec(&v).unwrap_or_default();
                line.push(b'\n');
                Ok::<_, Infallible>(Bytes::from(line))
            })
        })
    });
    Body::from_stream(stream)
}

/// Serve until `cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    server: ApiServer,
    cancel: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(server))
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}
