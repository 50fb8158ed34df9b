//! Device taints as a cluster acts on them:
//!
//! - kube-controller-manager's device-taint eviction controller
//!   (pkg/controller/devicetainteviction/device_taint_eviction.go), run as a client of
//!   this server, as it runs against kube-apiserver: for a rule with effect `None` it
//!   reports once per generation what `NoExecute` would evict (condition
//!   `EvictionInProgress`, status False, reason `NoEffect`, upstream's message); for
//!   `NoSchedule` it reports `OtherEffect`; for `NoExecute` it marks each pod whose
//!   claim holds a tainted device and does not tolerate the taint with the
//!   `DisruptionTarget` condition and **deletes** it: no Eviction API, so no
//!   PodDisruptionBudget is asked. Tolerations are the claim's, from its allocation
//!   results; the pods are those the claim is reserved for.
//! - the scheduler's view ([`ApiServer::allocatable_devices`]): a device tainted
//!   `NoSchedule` or `NoExecute`, by its slice or by a rule, is not allocated to a claim
//!   that does not tolerate it
//!   (staging/src/k8s.io/dynamic-resource-allocation/structured/allocator.go).
//!
//! Devices are those of each pool's newest generation (the pools of
//! staging/src/k8s.io/dynamic-resource-allocation/structured/pools.go). A rule with no
//! selector selects nothing; each selector field set must match.
//!
//! Simplifications, stated where made: a toleration with `tolerationSeconds` never
//! spares a pod (upstream evicts it once they have passed); the controller runs on a 10 ms tick after any
//! change, not on informer events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::{costs, now_rfc3339, ApiServer, Inner, WatchEvent};

const TICK: Duration = Duration::from_millis(10);

/// (driver, pool, device).
type Device = (String, String, String);

fn text<'a>(v: &'a Value, p: &str) -> &'a str {
    v.pointer(p).and_then(Value::as_str).unwrap_or("")
}

/// The devices of each pool's newest generation: (device, its node, its slice taints).
fn published(slices: &[Value]) -> Vec<(Device, String, Vec<Value>)> {
    let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for s in slices {
        let g = s
            .pointer("/spec/pool/generation")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let e = newest
            .entry((text(s, "/spec/driver"), text(s, "/spec/pool/name")))
            .or_insert(g);
        *e = (*e).max(g);
    }
    let mut out = Vec::new();
    for s in slices {
        let (driver, pool) = (text(s, "/spec/driver"), text(s, "/spec/pool/name"));
        let g = s
            .pointer("/spec/pool/generation")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if newest.get(&(driver, pool)) != Some(&g) {
            continue;
        }
        for d in s
            .pointer("/spec/devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let taints = d
                .get("taints")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            out.push((
                (driver.into(), pool.into(), text(d, "/name").into()),
                text(s, "/spec/nodeName").into(),
                taints,
            ));
        }
    }
    out
}

/// The value at `path`, field by field: not a JSON pointer, which is parsed (and
/// allocated) on every call (28 ms a pass over 8,000 claims).
fn field<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

/// The text at `path` (empty if none).
fn name<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    field(v, path).and_then(Value::as_str).unwrap_or("")
}

/// [`selects`] on borrowed names (the controller's scan of every claim allocates
/// nothing).
fn selects_str(rule: &Value, (driver, pool, device): (&str, &str, &str)) -> bool {
    let Some(sel) = rule
        .pointer("/spec/deviceSelector")
        .filter(|s| s.is_object())
    else {
        return false;
    };
    let field = |f: &str, v: &str| sel.get(f).and_then(Value::as_str).is_none_or(|x| x == v);
    field("driver", driver) && field("pool", pool) && field("device", device)
}

/// Whether the rule's selector selects `d` (a missing selector selects nothing).
fn selects(rule: &Value, d: &Device) -> bool {
    selects_str(rule, (&d.0, &d.1, &d.2))
}

/// `DeviceToleration` against a taint (pkg/apis/resource/types.go; the core
/// toleration's rules): the key (empty with `Exists` matches every key), the effect
/// (empty matches every effect), and the value for `Equal` (the default operator).
fn tolerates(tol: &Value, taint: &Value) -> bool {
    let op = tol
        .get("operator")
        .and_then(Value::as_str)
        .unwrap_or("Equal");
    let key = text(tol, "/key");
    let key_ok = (key.is_empty() && op == "Exists") || key == text(taint, "/key");
    let effect = text(tol, "/effect");
    let effect_ok = effect.is_empty() || effect == text(taint, "/effect");
    let value_ok = op == "Exists" || text(tol, "/value") == text(taint, "/value");
    key_ok && effect_ok && value_ok
}

/// Whether the eviction controller leaves a claim for `taint` because of toleration
/// `tol` (device_taint_eviction.go `claimEvictionTime`): only a toleration whose effect
/// is `NoExecute`, written out (an empty effect, which matches every effect elsewhere,
/// does not count here), that `ToleratesTaint` the taint as `NoExecute` (a `None` rule
/// is simulated as `NoExecute`), with no `tolerationSeconds` (with them, the pod is
/// evicted later: still pending). Found by the real controller: this server
/// had honoured a toleration without an effect.
fn evicts_not(tol: &Value, taint: &Value) -> bool {
    let mut as_no_execute = taint.clone();
    as_no_execute["effect"] = json!("NoExecute");
    text(tol, "/effect") == "NoExecute"
        && tol.get("tolerationSeconds").is_none_or(Value::is_null)
        && tolerates(tol, &as_no_execute)
}

/// One allocated device of a claim: the device, the claim's tolerations for it, and
/// the pods the claim is reserved for ((namespace, name, uid)).
struct Allocated {
    device: Device,
    tolerations: Vec<Value>,
    pods: Vec<(String, String, String)>,
}

fn allocated(claims: &[Value]) -> Vec<Allocated> {
    let mut out = Vec::new();
    for c in claims {
        let ns = text(c, "/metadata/namespace");
        let pods: Vec<(String, String, String)> = c
            .pointer("/status/reservedFor")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|r| text(r, "/resource") == "pods" && text(r, "/apiGroup").is_empty())
            .map(|r| {
                (
                    ns.to_string(),
                    text(r, "/name").to_string(),
                    text(r, "/uid").to_string(),
                )
            })
            .collect();
        for r in c
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push(Allocated {
                device: (
                    text(r, "/driver").into(),
                    text(r, "/pool").into(),
                    text(r, "/device").into(),
                ),
                tolerations: r
                    .get("tolerations")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
                pods: pods.clone(),
            });
        }
    }
    out
}

/// The upstream condition message of a `None` rule (device_taint_eviction.go, with its
/// singulars).
fn none_message(published: usize, allocated: usize, pods: usize, namespaces: usize) -> String {
    let n = |k: usize, one: &str, many: &str| {
        if k == 1 {
            format!("1 {one}")
        } else {
            format!("{k} {many}")
        }
    };
    format!(
        "{} selected. {} selected. {} would be evicted in {} if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update.",
        n(published, "published device", "published devices"),
        n(allocated, "allocated device", "allocated devices"),
        n(pods, "pod", "pods"),
        if namespaces == 1 { "1 namespace".to_string() } else { format!("{namespaces} different namespaces") },
    )
}

fn condition(status: &str, reason: &str, message: String, generation: i64) -> Value {
    json!({"type": "EvictionInProgress", "status": status, "reason": reason, "message": message,
           "lastTransitionTime": now_rfc3339(), "observedGeneration": generation})
}

fn observed(rule: &Value) -> Option<i64> {
    rule.pointer("/status/conditions")
        .and_then(Value::as_array)?
        .iter()
        .find(|c| text(c, "/type") == "EvictionInProgress")?
        .get("observedGeneration")
        .and_then(Value::as_i64)
}

/// One pass of the controller over every rule.
pub(crate) fn sync(s: &ApiServer) {
    let rules = s.list("devicetaintrules", "");
    // Only rules with something to do: a generation not reported on yet, or NoExecute
    // (its pods may have changed). Upstream's controller is driven by informers and
    // looks at what changed; this one, at most, at what could matter (a fleet of
    // 8,000 claims is not read again on every write to a Lease).
    let pending = |r: &Value| {
        let generation = r
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        text(r, "/spec/taint/effect") == "NoExecute" || observed(r) != Some(generation)
    };
    let pend: Vec<&Value> = rules.iter().filter(|r| pending(r)).collect();
    if pend.is_empty() {
        return;
    }
    // Only the slices of the pools and the claims of the devices those rules select,
    // as upstream's controller reads them from its informers' caches
    // (pkg/controller/devicetainteviction/device_taint_eviction.go: a rule's devices,
    // then the claims allocated to them), copied out of the store (its lock is held
    // while it is read: copying a fleet's claims held every request up for 100 ms at
    // 8,000 claims).
    let (slices, claims) = {
        let g = s.lock();
        let kind = |k: &'static str| {
            g.objects
                .range((k.to_string(), String::new(), String::new())..)
                .take_while(move |((p, _, _), _)| p == k)
                .map(|(_, v)| v)
        };
        let pool_of = |r: &Value, slice: &Value| {
            let sel = |f: &str| field(r, &["spec", "deviceSelector", f]).and_then(Value::as_str);
            sel("driver").is_none_or(|d| d == name(slice, &["spec", "driver"]))
                && sel("pool").is_none_or(|p| p == name(slice, &["spec", "pool", "name"]))
        };
        let slices: Vec<Value> = kind("resourceslices")
            .filter(|sl| pend.iter().any(|r| pool_of(r, sl)))
            .cloned()
            .collect();
        let claims: Vec<Value> = kind("resourceclaims")
            .filter(|c| {
                field(c, &["status", "allocation", "devices", "results"])
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .any(|res| {
                        let d = (
                            name(res, &["driver"]),
                            name(res, &["pool"]),
                            name(res, &["device"]),
                        );
                        pend.iter().any(|r| selects_str(r, d))
                    })
            })
            .cloned()
            .collect();
        (slices, claims)
    };
    let published = published(&slices);
    let allocated = allocated(&claims);
    for rule in rules {
        let name = text(&rule, "/metadata/name").to_string();
        let generation = rule
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        let taint = rule.pointer("/spec/taint").cloned().unwrap_or(Value::Null);
        let hit: Vec<&Allocated> = allocated
            .iter()
            .filter(|a| selects(&rule, &a.device))
            .filter(|a| !a.tolerations.iter().any(|t| evicts_not(t, &taint)))
            .collect();
        let pods: BTreeSet<&(String, String, String)> =
            hit.iter().flat_map(|a| a.pods.iter()).collect();
        let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.0.as_str()).collect();
        let cond = match text(&taint, "/effect") {
            "None" if observed(&rule) != Some(generation) => {
                let n_published = published
                    .iter()
                    .filter(|(d, _, _)| selects(&rule, d))
                    .count();
                let n_allocated = allocated
                    .iter()
                    .filter(|a| selects(&rule, &a.device))
                    .count();
                condition(
                    "False",
                    "NoEffect",
                    none_message(n_published, n_allocated, pods.len(), namespaces.len()),
                    generation,
                )
            }
            "NoExecute" => {
                let mut evicted = 0;
                for (ns, pod, uid) in &pods {
                    let Some(p) = s.get("pods", ns, pod) else {
                        continue;
                    };
                    if text(&p, "/metadata/uid") != uid
                        || p.pointer("/metadata/deletionTimestamp").is_some()
                    {
                        continue;
                    }
                    // The DisruptionTarget condition, then the delete (no Eviction API).
                    let mut conds = p
                        .pointer("/status/conditions")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    conds.retain(|c| text(c, "/type") != "DisruptionTarget");
                    conds.push(json!({"type": "DisruptionTarget", "status": "True", "reason": "DeletionByDeviceTaintManager",
                        "message": "Device Taint manager: deleting due to NoExecute taint", "lastTransitionTime": now_rfc3339()}));
                    let mut marked = p.clone();
                    marked["status"]["conditions"] = Value::Array(conds);
                    let _ = s.update_as("update", "pods", ns, pod, marked, Some("status"));
                    if s.delete_with_grace("pods", ns, pod, None).is_ok() {
                        evicted += 1;
                    }
                }
                if evicted == 0 && observed(&rule) == Some(generation) {
                    continue;
                }
                condition(
                    "False",
                    "Completed",
                    format!("{evicted} pods evicted since starting the controller."),
                    generation,
                )
            }
            "None" => continue,
            _ if observed(&rule) != Some(generation) => condition(
                "False",
                "OtherEffect",
                "Eviction only happens for the NoExecute effect.".into(),
                generation,
            ),
            _ => continue,
        };
        let mut next = rule.clone();
        next["status"] = json!({"conditions": [cond]});
        let _ = s.update_as(
            "update",
            "devicetaintrules",
            "",
            &name,
            next,
            Some("status"),
        );
    }
}

impl ApiServer {
    /// The scheduler's view of every node that publishes devices: how many of its
    /// published devices (each pool's newest generation) a claim without tolerations
    /// could still be allocated, i.e. carry no `NoSchedule` or `NoExecute` taint from
    /// their slice or a rule (the DRA allocator skips a device with a taint the request
    /// does not tolerate: staging/src/k8s.io/dynamic-resource-allocation/structured,
    /// KEP-5055). One read of the slices and rules, whatever the fleet's size.
    pub fn allocatable_devices_all(&self) -> std::collections::BTreeMap<String, usize> {
        let rules = self.list("devicetaintrules", "");
        let slices = self.list("resourceslices", "");
        let blocks = |t: &Value| matches!(text(t, "/effect"), "NoSchedule" | "NoExecute");
        let mut out = std::collections::BTreeMap::new();
        for (d, node, taints) in published(&slices) {
            let free = !taints.iter().any(blocks)
                && !rules
                    .iter()
                    .any(|r| selects(r, &d) && r.pointer("/spec/taint").is_some_and(blocks));
            *out.entry(node.to_string()).or_insert(0) += usize::from(free);
        }
        out
    }

    /// [`ApiServer::allocatable_devices_all`] of `node` (0: it publishes none).
    pub fn allocatable_devices(&self, node: &str) -> usize {
        self.allocatable_devices_all()
            .get(node)
            .copied()
            .unwrap_or(0)
    }
}

/// Run the controller while the server lives (a thread, or a task on a virtual clock:
/// `clock::every`): a pass after each change.
pub(crate) fn start(
    inner: Weak<Mutex<Inner>>,
    tx: broadcast::Sender<WatchEvent>,
    meter: Arc<costs::Meter>,
) {
    let mut seen = 0;
    crate::clock::every("apiserver-device-taints", TICK, move || {
        let Some(inner) = inner.upgrade() else {
            return false;
        };
        let (rv, paused) = {
            let g = inner.lock().unwrap_or_else(|p| p.into_inner());
            (g.rv, g.faults.taint_eviction_paused)
        };
        // Paused (a fault): nothing is simulated, as when kube-controller-manager
        // is down; the tick goes on, and picks up every change once resumed.
        if rv == seen || paused {
            return true;
        }
        let s = ApiServer {
            inner,
            events: tx.clone(),
            meter: meter.clone(),
        };
        // What this pass saw is the state at `rv`: a change made while it ran (a rule
        // created after its list) makes the next tick pass again, as an informer
        // delivers every change to the controller's queue (device_taint_eviction.go's
        // rule and claim event handlers). (Reading rv after the pass lost that change,
        // found by quarantine-bench: a rule never got its prediction.)
        sync(&s);
        seen = rv;
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_none_message_is_upstreams() {
        assert_eq!(
            none_message(0, 3, 2, 2),
            "0 published devices selected. 3 allocated devices selected. 2 pods would be evicted in 2 different namespaces if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update."
        );
        assert!(none_message(1, 1, 1, 1).starts_with("1 published device selected. 1 allocated device selected. 1 pod would be evicted in 1 namespace if"));
    }

    #[test]
    fn tolerations_match_as_upstream_matches_them() {
        let taint =
            json!({"key": "faultline.io/unhealthy", "value": "xid-79", "effect": "NoExecute"});
        assert!(tolerates(&json!({"operator": "Exists"}), &taint));
        assert!(tolerates(
            &json!({"key": "faultline.io/unhealthy", "operator": "Exists"}),
            &taint
        ));
        assert!(tolerates(
            &json!({"key": "faultline.io/unhealthy", "value": "xid-79"}),
            &taint
        ));
        assert!(!tolerates(
            &json!({"key": "faultline.io/unhealthy", "value": "xid-48"}),
            &taint
        ));
        assert!(!tolerates(
            &json!({"key": "faultline.io/unhealthy", "operator": "Exists", "effect": "NoSchedule"}),
            &taint
        ));
        assert!(!tolerates(
            &json!({"key": "other", "operator": "Exists"}),
            &taint
        ));
    }

    #[test]
    fn only_a_no_execute_toleration_for_good_spares_a_pod() {
        let taint = json!({"key": "faultline.io/unhealthy", "value": "xid-79", "effect": "None"});
        let key = "faultline.io/unhealthy";
        assert!(evicts_not(
            &json!({"key": key, "operator": "Exists", "effect": "NoExecute"}),
            &taint
        ));
        assert!(evicts_not(
            &json!({"operator": "Exists", "effect": "NoExecute"}),
            &taint
        ));
        assert!(!evicts_not(
            &json!({"key": key, "operator": "Exists"}),
            &taint
        ));
        assert!(!evicts_not(
            &json!({"key": key, "operator": "Exists", "effect": "NoSchedule"}),
            &taint
        ));
        assert!(!evicts_not(
            &json!({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}),
            &taint
        ));
    }
}
