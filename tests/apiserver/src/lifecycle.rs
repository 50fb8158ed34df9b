//! What happens to objects after a write, as a cluster's control plane does it:
//! graceful deletion of pods, a simulated kubelet that finishes it, and the
//! disruption controller that keeps PodDisruptionBudgets' status current.
//!
//! - Graceful deletion follows pkg/registry/core/pod/strategy.go
//!   (`CheckGracefulDelete`) and staging/src/k8s.io/apiserver/pkg/registry/rest/delete.go
//!   (`BeforeDelete`): a scheduled, unfinished pod gets `deletionTimestamp` and
//!   `deletionGracePeriodSeconds` and stays, Terminating; a second delete may only
//!   shorten the grace period; a period of 0 removes it at once.
//! - The kubelet of a node removes its terminating pods once their containers have
//!   stopped (`Faults::pod_stop_ms` after the delete, at most the grace period). A
//!   node whose Ready condition is `Unknown` has no kubelet answering: its pods stay
//!   Terminating until someone deletes them with a grace period of 0, as on a real
//!   cluster with a dead node.

use std::sync::{Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::changes::Change;
use crate::{disruption, ApiError, ApiServer, Inner, Key, WatchEvent};

/// How often the simulated kubelet and disruption controller look.
const TICK: Duration = Duration::from_millis(20);

fn terminal(pod: &Value) -> bool {
    matches!(
        pod.pointer("/status/phase").and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    )
}

impl ApiServer {
    /// DELETE as the API does it: pods go Terminating first (see the module
    /// comment); everything else is removed at once. `grace` is
    /// `DeleteOptions.gracePeriodSeconds`.
    pub fn delete_with_grace(
        &self,
        plural: &str,
        ns: &str,
        name: &str,
        grace: Option<i64>,
    ) -> Result<Value, ApiError> {
        if plural != "pods" {
            return self.delete(plural, ns, name);
        }
        let key: Key = (plural.to_string(), ns.to_string(), name.to_string());
        let mut g = self.lock();
        let pod = g
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(plural, name))?;
        // strategy.go CheckGracefulDelete.
        let mut period = grace
            .or_else(|| {
                pod.pointer("/spec/terminationGracePeriodSeconds")
                    .and_then(Value::as_i64)
            })
            .unwrap_or(30);
        let scheduled = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .is_some_and(|n| !n.is_empty());
        if !scheduled || terminal(&pod) {
            period = 0;
        }
        if period < 0 {
            period = 1;
        }
        // delete.go BeforeDelete: an object already being deleted may only have its
        // grace period shortened.
        if pod.pointer("/metadata/deletionTimestamp").is_some() {
            let current = pod
                .pointer("/metadata/deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if current != 0 && grace.is_none_or(|p| p >= current) {
                return Ok(pod);
            }
            period = grace.unwrap_or(0).min(current);
        }
        if period == 0 {
            drop(g);
            return self.delete(plural, ns, name);
        }
        let now = crate::clock::now();
        let mut obj = pod;
        obj["metadata"]["deletionTimestamp"] = json!(humantime::format_rfc3339_seconds(
            now + Duration::from_secs(period as u64)
        )
        .to_string());
        obj["metadata"]["deletionGracePeriodSeconds"] = json!(period);
        g.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let prev = g.put(key.clone(), obj.clone());
        let stop =
            Duration::from_millis(g.faults.pod_stop_ms).min(Duration::from_secs(period as u64));
        g.terminating.insert(key.clone(), now + stop);
        Self::record(
            &mut g,
            &self.events,
            Change {
                key,
                kind: "Pod",
                event: "MODIFIED",
                object: obj.clone(),
                prev,
                charge: Some(("delete", "pods".to_string())),
            },
        );
        sync_budgets(&mut g, &self.events, ns);
        Ok(obj)
    }
}

/// Whether the kubelet of `node` answers: not when the Node's Ready condition is
/// `Unknown` (the node lifecycle controller's mark for a silent kubelet).
fn kubelet_up(g: &Inner, node: &str) -> bool {
    let Some(n) = g
        .objects
        .get(&("nodes".to_string(), String::new(), node.to_string()))
    else {
        return true;
    };
    !n.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("Unknown")
            })
        })
}

/// One look by the kubelets and the disruption controller.
fn tick(g: &mut Inner, tx: &broadcast::Sender<WatchEvent>) {
    g.kubelet_looks += 1;
    let now = crate::clock::now();
    let due: Vec<Key> = g
        .terminating
        .iter()
        .filter(|(_, at)| **at <= now)
        .map(|(k, _)| k.clone())
        .collect();
    let mut namespaces = Vec::new();
    for key in due {
        let Some(pod) = g.objects.get(&key) else {
            g.terminating.remove(&key);
            continue;
        };
        let node = pod
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if !kubelet_up(g, &node) {
            continue;
        }
        g.terminating.remove(&key);
        if let Some(prev) = g.take(&key) {
            g.rv += 1;
            let mut obj = prev.clone();
            obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
            namespaces.push(key.1.clone());
            let change = Change {
                key,
                kind: "Pod",
                event: "DELETED",
                object: obj,
                prev: Some(prev),
                charge: None,
            };
            ApiServer::record(g, tx, change);
        }
    }
    for ns in namespaces {
        sync_budgets(g, tx, &ns);
    }
}

/// Start the simulated kubelets; they stop when the server is dropped.
pub(crate) fn start(inner: Weak<Mutex<Inner>>, tx: broadcast::Sender<WatchEvent>) {
    crate::clock::every("apiserver-kubelet", TICK, move || {
        let Some(inner) = inner.upgrade() else {
            return false;
        };
        let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
        tick(&mut g, &tx);
        true
    });
}

/// The disruption controller's pass over the budgets of `ns`: write each one's
/// status where it changed (disruption.go `updatePdbStatus` writes only changes).
pub(crate) fn sync_budgets(g: &mut Inner, tx: &broadcast::Sender<WatchEvent>, ns: &str) {
    if g.faults.disruption_controller_paused {
        return;
    }
    // The keys sort by kind, then namespace: a range each. No budget, nothing to do:
    // the disruption controller works per PodDisruptionBudget (pkg/controller/
    // disruption/disruption.go `sync(key)`, queued by each budget a pod change
    // matches), so a namespace without one costs it nothing (and 8,000 pods are not
    // copied on every pod's change here).
    let of = |kind: &str| (kind.to_string(), ns.to_string(), String::new());
    let budgets: Vec<(Key, Value)> = g
        .objects
        .range(of("poddisruptionbudgets")..)
        .take_while(|((p, n, _), _)| p == "poddisruptionbudgets" && n == ns)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if budgets.is_empty() {
        return;
    }
    let pods: Vec<Value> = g
        .objects
        .range(of("pods")..)
        .take_while(|((p, n, _), _)| p == "pods" && n == ns)
        .map(|(_, v)| v.clone())
        .collect();
    let now = crate::clock::now();
    for (key, pdb) in budgets {
        let status = disruption::budget_status(&pdb, &pods, now);
        if pdb.get("status") == Some(&status) {
            continue;
        }
        write_status(g, tx, key, pdb, status);
    }
}

/// Write a budget's status (the controller's and the eviction's `UpdateStatus`).
pub(crate) fn write_status(
    g: &mut Inner,
    tx: &broadcast::Sender<WatchEvent>,
    key: Key,
    pdb: Value,
    status: Value,
) {
    let mut obj = pdb.clone();
    obj["status"] = status;
    g.rv += 1;
    obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
    g.put(key.clone(), obj.clone());
    ApiServer::record(
        g,
        tx,
        Change {
            key,
            kind: "PodDisruptionBudget",
            event: "MODIFIED",
            object: obj,
            prev: Some(pdb),
            charge: Some(("update", "poddisruptionbudgets/status".to_string())),
        },
    );
}
