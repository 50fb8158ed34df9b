//! What the server costs its clients and its storage, for benchmarks: requests and the
//! bytes sent, by verb and resource; the events and bytes of watches; the objects and
//! bytes written (the stored object, what etcd keeps); and the kubelets' ConfigMap and
//! Secret watches (`kubelet.rs`): how many are open and what each write fans out.
//!
//! Verbs are kube-apiserver's request verbs
//! (staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go: get, list,
//! watch, create, update, patch, delete, deletecollection) and resources its
//! resource/subresource pairs (`nodes/status`, `pods/eviction`), as
//! `apiserver_request_total` and `apiserver_response_sizes`
//! (staging/src/k8s.io/apiserver/pkg/endpoints/metrics/metrics.go) label them; calls
//! outside the API (discovery, `/version`) are `get` of resource `""`; the test
//! controls (`/_faults`, `/_calls`, `/_test/...`) are not counted. Bytes are those of
//! the response body (a Status on errors included), not of headers; a watch counts
//! each event's JSON line as it is sent.
//!
//! Read with [`crate::ApiServer::costs`] or `GET /_test/costs` (this module's
//! [`Costs`] as JSON); `DELETE /_test/costs` resets the counters and answers what they
//! held. Counting is a few relaxed atomic additions per response and per watch event.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Counters of one verb on one resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Requests answered (a watch counts once, when it starts).
    pub requests: u64,
    /// Of those, answered with a status of 400 or more.
    pub errors: u64,
    /// Response body bytes sent (every line of a watch included).
    pub response_bytes: u64,
    /// Watch events sent (bookmarks and in-stream errors included).
    pub watch_events: u64,
    /// Bytes of those events (each JSON line with its newline).
    pub watch_event_bytes: u64,
    /// Objects stored (create, update, patch, and a pod's graceful-deletion mark).
    pub written_objects: u64,
    /// Bytes of those objects as stored (compact JSON).
    pub written_bytes: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.requests += o.requests;
        self.errors += o.errors;
        self.response_bytes += o.response_bytes;
        self.watch_events += o.watch_events;
        self.watch_event_bytes += o.watch_event_bytes;
        self.written_objects += o.written_objects;
        self.written_bytes += o.written_bytes;
    }
}

/// What one write of a ConfigMap or Secret sent to the kubelets watching it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fanout {
    /// The watch event: ADDED, MODIFIED or DELETED.
    pub event: String,
    /// The object's resourceVersion after the write.
    pub resource_version: String,
    /// The object's size (compact JSON).
    pub object_bytes: u64,
    /// Kubelets (distinct nodes) with an open watch on it that received the event.
    pub kubelets: u64,
    /// `object_bytes * kubelets`.
    pub bytes: u64,
}

/// A snapshot of the counters ([`crate::ApiServer::costs`], `GET /_test/costs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Costs {
    /// verb -> resource -> counters.
    pub by_verb: BTreeMap<String, BTreeMap<String, Tally>>,
    /// Everything in `by_verb` added up.
    pub total: Tally,
    /// Bytes of ConfigMap and Secret writes sent to the kubelets watching them: the
    /// object's size times the nodes whose pods use it (`kubelet.rs`).
    pub kubelet_fanout_bytes: u64,
    /// Watch events those writes sent to kubelets.
    pub kubelet_fanout_events: u64,
    /// Writes of ConfigMaps and Secrets that reached at least one kubelet.
    pub kubelet_fanout_writes: u64,
    /// Kubelet watches open now, one per (node, ConfigMap or Secret): a gauge, not
    /// reset.
    pub kubelet_open_watches: u64,
    /// The last write of each ConfigMap and Secret written since the reset, by
    /// `"configmaps/NAMESPACE/NAME"` or `"secrets/NAMESPACE/NAME"`.
    pub kubelet_last_fanout: BTreeMap<String, Fanout>,
}

impl Costs {
    /// The counters of `verb` on `resource` (zero when none).
    pub fn tally(&self, verb: &str, resource: &str) -> Tally {
        self.by_verb
            .get(verb)
            .and_then(|r| r.get(resource))
            .copied()
            .unwrap_or_default()
    }

    /// The counters of `verb` on every resource.
    pub fn verb(&self, verb: &str) -> Tally {
        let mut t = Tally::default();
        for v in self.by_verb.get(verb).into_iter().flat_map(|r| r.values()) {
            t.add(v);
        }
        t
    }

    /// The counters of every verb on `resource`.
    pub fn resource(&self, resource: &str) -> Tally {
        let mut t = Tally::default();
        for r in self.by_verb.values() {
            if let Some(v) = r.get(resource) {
                t.add(v);
            }
        }
        t
    }

    /// The last write's fan-out of a ConfigMap (`plural` "configmaps") or Secret.
    pub fn last_fanout(&self, plural: &str, ns: &str, name: &str) -> Option<&Fanout> {
        self.kubelet_last_fanout
            .get(&format!("{plural}/{ns}/{name}"))
    }
}

/// The live counters of one verb on one resource.
#[derive(Debug, Default)]
pub(crate) struct Counter {
    requests: AtomicU64,
    errors: AtomicU64,
    response_bytes: AtomicU64,
    watch_events: AtomicU64,
    watch_event_bytes: AtomicU64,
    written_objects: AtomicU64,
    written_bytes: AtomicU64,
}

impl Counter {
    /// A response with `status` and a body of `bytes` (when known: a stream's lines are
    /// counted as they go).
    pub(crate) fn response(&self, status: u16, bytes: Option<u64>) {
        self.requests.fetch_add(1, Relaxed);
        if status >= 400 {
            self.errors.fetch_add(1, Relaxed);
        }
        if let Some(b) = bytes {
            self.response_bytes.fetch_add(b, Relaxed);
        }
    }

    /// A watch event of `bytes` sent.
    pub(crate) fn watch_event(&self, bytes: u64) {
        self.watch_events.fetch_add(1, Relaxed);
        self.watch_event_bytes.fetch_add(bytes, Relaxed);
        self.response_bytes.fetch_add(bytes, Relaxed);
    }

    fn take(&self, reset: bool) -> Tally {
        let get = |a: &AtomicU64| {
            if reset {
                a.swap(0, Relaxed)
            } else {
                a.load(Relaxed)
            }
        };
        Tally {
            requests: get(&self.requests),
            errors: get(&self.errors),
            response_bytes: get(&self.response_bytes),
            watch_events: get(&self.watch_events),
            watch_event_bytes: get(&self.watch_event_bytes),
            written_objects: get(&self.written_objects),
            written_bytes: get(&self.written_bytes),
        }
    }
}

/// Every counter of a server.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    slots: Mutex<HashMap<(&'static str, String), Arc<Counter>>>,
    fanout_bytes: AtomicU64,
    fanout_events: AtomicU64,
    fanout_writes: AtomicU64,
    open_watches: AtomicU64,
    last_fanout: Mutex<BTreeMap<String, Fanout>>,
}

impl Meter {
    /// The counters of `verb` on `resource`, to keep and add to.
    pub(crate) fn slot(&self, verb: &'static str, resource: &str) -> Arc<Counter> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slots.get(&(verb, resource.to_string())) {
            return c.clone();
        }
        slots
            .entry((verb, resource.to_string()))
            .or_default()
            .clone()
    }

    /// An object of `bytes` stored by `verb` on `resource`.
    pub(crate) fn written(&self, verb: &'static str, resource: &str, bytes: u64) {
        let c = self.slot(verb, resource);
        c.written_objects.fetch_add(1, Relaxed);
        c.written_bytes.fetch_add(bytes, Relaxed);
    }

    /// A ConfigMap or Secret write and what it sent to kubelets.
    pub(crate) fn fanout(&self, key: String, f: Fanout) {
        if f.kubelets > 0 {
            self.fanout_writes.fetch_add(1, Relaxed);
            self.fanout_events.fetch_add(f.kubelets, Relaxed);
            self.fanout_bytes.fetch_add(f.bytes, Relaxed);
        }
        self.last_fanout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, f);
    }

    /// The kubelet watches open now.
    pub(crate) fn set_open_watches(&self, n: u64) {
        self.open_watches.store(n, Relaxed);
    }

    fn take(&self, reset: bool) -> Costs {
        let mut c = Costs::default();
        let slots: Vec<_> = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((verb, resource), counter)| (*verb, resource.clone(), counter.clone()))
            .collect();
        for (verb, resource, counter) in slots {
            let t = counter.take(reset);
            if t == Tally::default() {
                continue;
            }
            c.total.add(&t);
            c.by_verb
                .entry(verb.to_string())
                .or_default()
                .insert(resource, t);
        }
        let get = |a: &AtomicU64| {
            if reset {
                a.swap(0, Relaxed)
            } else {
                a.load(Relaxed)
            }
        };
        c.kubelet_fanout_bytes = get(&self.fanout_bytes);
        c.kubelet_fanout_events = get(&self.fanout_events);
        c.kubelet_fanout_writes = get(&self.fanout_writes);
        c.kubelet_open_watches = self.open_watches.load(Relaxed);
        let mut last = self.last_fanout.lock().unwrap_or_else(|p| p.into_inner());
        c.kubelet_last_fanout = if reset {
            std::mem::take(&mut *last)
        } else {
            last.clone()
        };
        c
    }

    /// A snapshot.
    pub(crate) fn snapshot(&self) -> Costs {
        self.take(false)
    }

    /// A snapshot, and every counter back to zero.
    pub(crate) fn reset(&self) -> Costs {
        self.take(true)
    }
}

/// The size of `v` as compact JSON, without building the text.
pub(crate) fn json_len(v: &Value) -> u64 {
    struct Count(u64);
    impl Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// The verb and resource of a request, as requestinfo.go names them (see the module
/// comment); `None` for the test controls, which are not counted.
pub(crate) fn classify(
    method: &axum::http::Method,
    uri: &axum::http::Uri,
) -> Option<(&'static str, String)> {
    use axum::http::Method;
    let path = uri.path();
    if path.starts_with("/_") {
        return None;
    }
    let Some(rp) = crate::request::parse_path(path) else {
        return Some(("get", String::new()));
    };
    let resource = match &rp.subresource {
        Some(sub) => format!("{}/{sub}", rp.plural),
        None => rp.plural.clone(),
    };
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match (method.clone(), rp.name.is_some()) {
        (Method::GET, false) if watch => "watch",
        (Method::GET, false) => "list",
        (Method::GET, true) => "get",
        (Method::POST, _) => "create",
        (Method::PUT, _) => "update",
        (Method::PATCH, _) => "patch",
        (Method::DELETE, true) => "delete",
        (Method::DELETE, false) => "deletecollection",
        _ => "unknown",
    };
    Some((verb, resource))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_len_is_the_encoded_size() {
        for v in [
            json!({"a": [1, 2.5, "x\"y\n"], "b": null, "é": true}),
            json!("plain"),
            json!([]),
        ] {
            assert_eq!(json_len(&v), serde_json::to_vec(&v).unwrap().len() as u64);
        }
    }

    #[test]
    fn counters_add_up_and_reset() {
        let m = Meter::default();
        m.slot("get", "nodes").response(200, Some(10));
        m.slot("get", "nodes").response(404, Some(5));
        m.slot("watch", "pods").watch_event(7);
        m.written("create", "configmaps", 100);
        m.fanout(
            "configmaps/default/x".into(),
            Fanout {
                event: "MODIFIED".into(),
                resource_version: "5".into(),
                object_bytes: 100,
                kubelets: 3,
                bytes: 300,
            },
        );
        m.set_open_watches(4);
        let c = m.reset();
        assert_eq!(
            c.tally("get", "nodes"),
            Tally {
                requests: 2,
                errors: 1,
                response_bytes: 15,
                ..Default::default()
            }
        );
        assert_eq!(c.verb("watch").watch_event_bytes, 7);
        assert_eq!(c.resource("configmaps").written_bytes, 100);
        assert_eq!(c.total.response_bytes, 22);
        assert_eq!(
            (
                c.kubelet_fanout_bytes,
                c.kubelet_fanout_events,
                c.kubelet_fanout_writes
            ),
            (300, 3, 1)
        );
        assert_eq!(
            c.last_fanout("configmaps", "default", "x")
                .unwrap()
                .kubelets,
            3
        );
        let after = m.snapshot();
        assert_eq!(after.total, Tally::default());
        assert!(after.by_verb.is_empty() && after.kubelet_last_fanout.is_empty());
        assert_eq!(after.kubelet_open_watches, 4, "a gauge is not reset");
    }

    #[test]
    fn requests_are_classified_as_requestinfo_does() {
        use axum::http::{Method, Uri};
        let c = |m: Method, u: &str| classify(&m, &u.parse::<Uri>().unwrap());
        assert_eq!(
            c(Method::GET, "/api/v1/nodes"),
            Some(("list", "nodes".into()))
        );
        assert_eq!(
            c(Method::GET, "/api/v1/nodes?watch=true&resourceVersion=1"),
            Some(("watch", "nodes".into()))
        );
        assert_eq!(
            c(Method::GET, "/api/v1/namespaces/d/pods/p"),
            Some(("get", "pods".into()))
        );
        assert_eq!(
            c(Method::PUT, "/api/v1/nodes/n/status"),
            Some(("update", "nodes/status".into()))
        );
        assert_eq!(
            c(Method::POST, "/api/v1/namespaces/d/pods/p/eviction"),
            Some(("create", "pods/eviction".into()))
        );
        assert_eq!(
            c(
                Method::PATCH,
                "/apis/coordination.k8s.io/v1/namespaces/d/leases/l"
            ),
            Some(("patch", "leases".into()))
        );
        assert_eq!(
            c(Method::DELETE, "/api/v1/namespaces/d/configmaps"),
            Some(("deletecollection", "configmaps".into()))
        );
        assert_eq!(c(Method::GET, "/version"), Some(("get", String::new())));
        assert_eq!(c(Method::GET, "/_test/costs"), None);
    }
}
