//! PodDisruptionBudgets as a cluster runs them: the disruption controller writes each
//! budget's `status` from the pods' Ready condition
//! (pkg/controller/disruption/disruption.go), and the eviction subresource judges a pod
//! by that status alone (pkg/registry/core/pod/storage/eviction.go).
//!
//! One simplification, stated where it is made: this server serves no workload
//! controllers, so a controller's scale (`getExpectedScale`) is the number of pods
//! that name it as their controller; a Job, CronJob or DaemonSet has no scale
//! subresource, and a budget that needs one fails (no disruption), as upstream.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::ApiError;

/// How long a pod stays in `disruptedPods` waiting to be deleted
/// (disruption.go `DeletionTimeout`).
pub const DELETION_TIMEOUT: Duration = Duration::from_secs(120);
/// eviction.go `MaxDisruptedPodSize`.
pub const MAX_DISRUPTED_PODS: usize = 2000;

/// `IsPodReady` (pkg/api/v1/pod/util.go): the Ready condition is True.
pub fn pod_ready(pod: &Value) -> bool {
    pod.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("True")
            })
        })
}

/// Whether the budget's selector matches `labels`. `None`: the selector cannot be
/// read (disruption.go and eviction.go skip such a budget). A nil or empty selector
/// matches nothing (eviction.go `getPodDisruptionBudgets`; the controller's
/// `getPodsForPdb` agrees).
fn selects(pdb: &Value, labels: &Value) -> Option<bool> {
    let sel = pdb.pointer("/spec/selector")?;
    let mut terms = 0;
    if let Some(ml) = sel.get("matchLabels").and_then(Value::as_object) {
        for (k, v) in ml {
            terms += 1;
            if labels.get(k) != Some(v) {
                return Some(false);
            }
        }
    }
    if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
        for e in exprs {
            terms += 1;
            let key = e.get("key")?.as_str()?;
            let values: Vec<&str> = e
                .get("values")
                .and_then(Value::as_array)
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let got = labels.get(key).and_then(Value::as_str);
            let ok = match e.get("operator")?.as_str()? {
                "In" => got.is_some_and(|g| values.contains(&g)),
                "NotIn" => got.is_none_or(|g| !values.contains(&g)),
                "Exists" => got.is_some(),
                "DoesNotExist" => got.is_none(),
                _ => return None,
            };
            if !ok {
                return Some(false);
            }
        }
    }
    Some(terms > 0)
}

/// The budgets of `budgets` that cover `pod`.
pub fn covering<'a>(budgets: &'a [Value], pod: &Value) -> Vec<&'a Value> {
    let labels = pod
        .pointer("/metadata/labels")
        .cloned()
        .unwrap_or(json!({}));
    budgets
        .iter()
        .filter(|b| selects(b, &labels) == Some(true))
        .collect()
}

/// `intstr.GetScaledValueFromIntOrPercent` with rounding up.
fn scaled(v: &Value, total: i64) -> Result<i64, String> {
    match v {
        Value::Number(n) => n.as_i64().ok_or_else(|| format!("invalid value {n}")),
        Value::String(s) => {
            let pct: i64 = s
                .strip_suffix('%')
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("invalid value for IntOrString: invalid value {s:?}"))?;
            Ok((pct * total + 99) / 100)
        }
        other => Err(format!("invalid value {other}")),
    }
}

/// `getExpectedScale`: the sum of the scales of the pods' controllers; pods without a
/// controller are not counted (newer disruption.go collects them as unmanaged). A
/// controller whose kind has no scale subresource (a Job, a DaemonSet) is an error
/// (`getScaleController`: "jobs.batch does not implement the scale subresource"), so
/// the budget allows no disruption at all (found by the differential check against the
/// real disruption controller: this server had counted a Job's pods).
fn expected_scale(pods: &[&Value]) -> Result<i64, String> {
    let mut scale: BTreeMap<String, i64> = BTreeMap::new();
    for p in pods {
        let controller = p
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .and_then(|refs| {
                refs.iter()
                    .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
            });
        let Some(c) = controller else { continue };
        let kind = c.get("kind").and_then(Value::as_str).unwrap_or("");
        let group = c
            .get("apiVersion")
            .and_then(Value::as_str)
            .and_then(|v| v.split_once('/').map(|(g, _)| g))
            .unwrap_or("");
        let unscalable = match (group, kind) {
            ("batch", "Job") => Some("jobs.batch"),
            ("batch", "CronJob") => Some("cronjobs.batch"),
            ("apps", "DaemonSet") => Some("daemonsets.apps"),
            _ => None,
        };
        if let Some(resource) = unscalable {
            return Err(format!(
                "{resource} does not implement the scale subresource"
            ));
        }
        if let Some(uid) = c.get("uid").and_then(Value::as_str) {
            // This server's stand-in for the controller's scale: its pods.
            *scale.entry(uid.to_string()).or_default() += 1;
        }
    }
    Ok(scale.values().sum())
}

/// `getExpectedPodCount`: (expectedCount, desiredHealthy).
fn expected_and_desired(pdb: &Value, pods: &[&Value]) -> Result<(i64, i64), String> {
    if let Some(max) = pdb.pointer("/spec/maxUnavailable") {
        let expected = expected_scale(pods)?;
        let max = scaled(max, expected)?;
        Ok((expected, (expected - max).max(0)))
    } else if let Some(min) = pdb.pointer("/spec/minAvailable") {
        match min {
            Value::Number(_) => Ok((pods.len() as i64, scaled(min, 0)?)),
            _ => {
                let expected = expected_scale(pods)?;
                Ok((expected, scaled(min, expected)?))
            }
        }
    } else {
        Ok((0, 0))
    }
}

fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s.trim_end_matches('Z')).ok()
}

/// The status the disruption controller writes for `pdb`, given every pod of its
/// namespace (`trySync` → `updatePdbStatus`; on an error, `failSafe`: no disruption
/// allowed).
pub fn budget_status(pdb: &Value, pods: &[Value], now: SystemTime) -> Value {
    let generation = pdb
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let mut status = pdb.get("status").cloned().unwrap_or(json!({}));
    let covered: Vec<&Value> = pods
        .iter()
        .filter(|p| {
            let labels = p.pointer("/metadata/labels").cloned().unwrap_or(json!({}));
            selects(pdb, &labels) == Some(true)
        })
        .collect();
    let (expected, desired) = match expected_and_desired(pdb, &covered) {
        Ok(v) => v,
        Err(why) => {
            // failSafe: disruptionsAllowed 0, the condition says why; the observed
            // generation stays where it was.
            status["disruptionsAllowed"] = json!(0);
            status["conditions"] = json!([{"type": "DisruptionAllowed", "status": "False", "reason": "SyncFailed", "message": why,
                "lastTransitionTime": humantime::format_rfc3339_seconds(now).to_string()}]);
            return status;
        }
    };
    // buildDisruptedPodMap: keep the pods still there, not deleting, within the timeout.
    let before = status
        .get("disruptedPods")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut disrupted = serde_json::Map::new();
    for p in &covered {
        if p.pointer("/metadata/deletionTimestamp").is_some() {
            continue;
        }
        let name = p
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        if let Some(at) = before.get(name) {
            let fresh = at
                .as_str()
                .and_then(parse_time)
                .is_some_and(|t| t + DELETION_TIMEOUT > now);
            if fresh {
                disrupted.insert(name.to_string(), at.clone());
            }
        }
    }
    // countHealthyPods.
    let healthy = covered
        .iter()
        .filter(|p| p.pointer("/metadata/deletionTimestamp").is_none())
        .filter(|p| {
            let name = p.pointer("/metadata/name").and_then(Value::as_str);
            name.is_none_or(|n| !disrupted.contains_key(n))
        })
        .filter(|p| pod_ready(p))
        .count() as i64;
    let mut allowed = healthy - desired;
    if expected <= 0 || allowed <= 0 {
        allowed = 0;
    }
    // pdbhelper.UpdateDisruptionAllowedCondition with apimeta.SetStatusCondition: the
    // transition time moves only when the condition's status does.
    let (cond_status, reason) = if allowed > 0 {
        ("True", "SufficientPods")
    } else {
        ("False", "InsufficientPods")
    };
    let since = status
        .pointer("/conditions/0")
        .filter(|c| c.get("status").and_then(Value::as_str) == Some(cond_status))
        .and_then(|c| c.get("lastTransitionTime").cloned())
        .unwrap_or_else(|| json!(humantime::format_rfc3339_seconds(now).to_string()));
    let condition = json!({"type": "DisruptionAllowed", "status": cond_status, "reason": reason,
        "message": "", "observedGeneration": generation, "lastTransitionTime": since});
    json!({
        "currentHealthy": healthy,
        "desiredHealthy": desired,
        "expectedPods": expected,
        "disruptionsAllowed": allowed,
        "disruptedPods": disrupted,
        "observedGeneration": generation,
        "conditions": [condition],
    })
}

/// What the eviction subresource decides about one budget.
#[derive(Debug, PartialEq)]
pub enum Judgement {
    /// Delete the pod; the budget is left as it is (an unready pod).
    DeleteUnready,
    /// Delete the pod after writing this status (one disruption used, the pod in
    /// `disruptedPods`).
    Decrement(Value),
}

fn status_i64(pdb: &Value, field: &str) -> i64 {
    pdb.pointer(&format!("/status/{field}"))
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

/// eviction.go's 429: the Status names the `DisruptionBudget` cause.
fn too_many_requests(cause: String) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
    );
    e.details = Some(json!({"causes": [{"reason": "DisruptionBudget", "message": cause}]}));
    e
}

/// The part of eviction.go's `Create` after `canIgnorePDB`, for the one budget that
/// covers `pod`: an unready pod goes without touching the budget when the policy is
/// `AlwaysAllow` or the budget is healthy (`currentHealthy >= desiredHealthy > 0`);
/// otherwise `checkAndDecrement`.
pub fn judge(pdb: &Value, pod: &Value, now: SystemTime) -> Result<Judgement, ApiError> {
    let name = pdb
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !pod_ready(pod) {
        let policy = pdb
            .pointer("/spec/unhealthyPodEvictionPolicy")
            .and_then(Value::as_str);
        let (current, desired) = (
            status_i64(pdb, "currentHealthy"),
            status_i64(pdb, "desiredHealthy"),
        );
        if policy == Some("AlwaysAllow") || (current >= desired && desired > 0) {
            return Ok(Judgement::DeleteUnready);
        }
    }
    // checkAndDecrement.
    let generation = pdb
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    if status_i64(pdb, "observedGeneration") < generation {
        return Err(too_many_requests(format!(
            "The disruption budget {name} is still being processed by the server."
        )));
    }
    let allowed = status_i64(pdb, "disruptionsAllowed");
    if allowed < 0 {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("poddisruptionbudget.policy \"{name}\" is forbidden: pdb disruptions allowed is negative"),
        ));
    }
    let disrupted = pdb
        .pointer("/status/disruptedPods")
        .and_then(Value::as_object)
        .map_or(0, |m| m.len());
    if disrupted > MAX_DISRUPTED_PODS {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("poddisruptionbudget.policy \"{name}\" is forbidden: DisruptedPods map too big - too many evictions not confirmed by PDB controller"),
        ));
    }
    if allowed == 0 {
        return Err(too_many_requests(format!(
            "The disruption budget {name} needs {} healthy pods and has {} currently",
            status_i64(pdb, "desiredHealthy"),
            status_i64(pdb, "currentHealthy")
        )));
    }
    let mut status = pdb.get("status").cloned().unwrap_or(json!({}));
    status["disruptionsAllowed"] = json!(allowed - 1);
    let pod_name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !status.get("disruptedPods").is_some_and(Value::is_object) {
        status["disruptedPods"] = json!({});
    }
    status["disruptedPods"][pod_name] = json!(humantime::format_rfc3339_seconds(now).to_string());
    Ok(Judgement::Decrement(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ready: bool, owner: Option<&str>) -> Value {
        let mut p = json!({"metadata": {"name": name, "labels": {"app": "train"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}});
        if let Some(uid) = owner {
            p["metadata"]["ownerReferences"] =
                json!([{"kind": "ReplicaSet", "name": "rs", "uid": uid, "controller": true}]);
        }
        p
    }

    fn pdb(spec: Value) -> Value {
        let mut spec = spec;
        spec["selector"] = json!({"matchLabels": {"app": "train"}});
        json!({"metadata": {"name": "train", "generation": 1}, "spec": spec})
    }

    fn synced(mut b: Value, pods: &[Value]) -> Value {
        b["status"] = budget_status(&b, pods, SystemTime::now());
        b
    }

    /// disruption.go `countHealthyPods` counts Ready pods only; `minAvailable` as a
    /// number expects every matching pod (`getExpectedPodCount`).
    #[test]
    fn status_counts_ready_pods() {
        let pods = [
            pod("a", true, None),
            pod("b", true, None),
            pod("c", false, None),
        ];
        let s = budget_status(&pdb(json!({"minAvailable": 1})), &pods, SystemTime::now());
        assert_eq!(s["currentHealthy"], 2);
        assert_eq!(s["desiredHealthy"], 1);
        assert_eq!(s["expectedPods"], 3);
        assert_eq!(s["disruptionsAllowed"], 1);
        assert_eq!(s["observedGeneration"], 1);
    }

    /// disruption.go `getScaleController`: a Job has no scale subresource, so a
    /// `maxUnavailable` or percentage budget over a Job's pods fails its sync and
    /// allows nothing; `minAvailable` as a number needs no scale and allows as usual.
    #[test]
    fn a_jobs_pods_get_no_disruption_under_max_unavailable() {
        let mut pods = [pod("a", true, None), pod("b", true, None)];
        for p in &mut pods {
            p["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "j1", "controller": true}]);
        }
        let s = budget_status(&pdb(json!({"maxUnavailable": 1})), &pods, SystemTime::now());
        assert_eq!(s["disruptionsAllowed"], 0);
        assert_eq!(s["conditions"][0]["reason"], "SyncFailed");
        assert_eq!(
            s["conditions"][0]["message"],
            "jobs.batch does not implement the scale subresource"
        );
        let s = budget_status(
            &pdb(json!({"minAvailable": "50%"})),
            &pods,
            SystemTime::now(),
        );
        assert_eq!(s["disruptionsAllowed"], 0);
        let s = budget_status(&pdb(json!({"minAvailable": 1})), &pods, SystemTime::now());
        assert_eq!(s["disruptionsAllowed"], 1);
    }

    /// disruption.go `getExpectedScale`: `maxUnavailable` needs controllers; pods
    /// without one do not count, so a budget over bare pods allows nothing.
    #[test]
    fn max_unavailable_counts_controlled_pods_only() {
        let bare = [pod("a", true, None), pod("b", true, None)];
        let s = budget_status(&pdb(json!({"maxUnavailable": 1})), &bare, SystemTime::now());
        assert_eq!(s["disruptionsAllowed"], 0, "{s}");
        let owned = [
            pod("a", true, Some("rs-1")),
            pod("b", true, Some("rs-1")),
            pod("c", true, Some("rs-1")),
        ];
        let s = budget_status(
            &pdb(json!({"maxUnavailable": "34%"})),
            &owned,
            SystemTime::now(),
        );
        // 34% of 3 rounded up is 2: desired 1, allowed 2.
        assert_eq!(
            (
                s["desiredHealthy"].as_i64(),
                s["disruptionsAllowed"].as_i64()
            ),
            (Some(1), Some(2))
        );
    }

    /// eviction.go `checkAndDecrement`: a budget whose status has not caught up with
    /// its generation refuses with 429 "still being processed".
    #[test]
    fn unprocessed_budget_refuses() {
        let b = pdb(json!({"minAvailable": 0}));
        let e = judge(&b, &pod("a", true, None), SystemTime::now()).unwrap_err();
        assert_eq!(e.code(), 429);
        assert!(e
            .details
            .unwrap()
            .to_string()
            .contains("still being processed"));
    }

    /// eviction.go: an eviction uses one disruption and names the pod in
    /// `disruptedPods`; the controller keeps it unhealthy there until it is deleted
    /// or two minutes pass (`buildDisruptedPodMap`, `countHealthyPods`).
    #[test]
    fn eviction_decrements_and_the_controller_remembers() {
        let pods = [pod("a", true, None), pod("b", true, None)];
        let b = synced(pdb(json!({"minAvailable": 1})), &pods);
        let Judgement::Decrement(status) = judge(&b, &pods[0], SystemTime::now()).unwrap() else {
            panic!("expected a decrement");
        };
        assert_eq!(status["disruptionsAllowed"], 0);
        let mut b = b;
        b["status"] = status;
        // Pod a is not deleted yet: the controller still counts it out.
        let s = budget_status(&b, &pods, SystemTime::now());
        assert_eq!(
            (
                s["currentHealthy"].as_i64(),
                s["disruptionsAllowed"].as_i64()
            ),
            (Some(1), Some(0))
        );
        // Two minutes later it is counted again.
        let later = SystemTime::now() + DELETION_TIMEOUT + Duration::from_secs(1);
        let s = budget_status(&b, &pods, later);
        assert_eq!(s["disruptionsAllowed"], 1);
        // A second eviction now is refused with the DisruptionBudget cause.
        let mut b2 = b.clone();
        b2["status"] = budget_status(&b, &pods, SystemTime::now());
        let e = judge(&b2, &pods[1], SystemTime::now()).unwrap_err();
        assert_eq!(e.code(), 429);
        assert!(e
            .details
            .unwrap()
            .to_string()
            .contains("needs 1 healthy pods and has 1 currently"));
    }

    /// eviction.go: an unready pod is evicted without using a disruption only while
    /// the budget is healthy (`currentHealthy >= desiredHealthy > 0`) or its
    /// `unhealthyPodEvictionPolicy` is `AlwaysAllow`.
    #[test]
    fn unready_pods_follow_the_budget_health() {
        let pods = [pod("a", true, None), pod("sick", false, None)];
        let healthy = synced(pdb(json!({"minAvailable": 1})), &pods);
        assert_eq!(
            judge(&healthy, &pods[1], SystemTime::now()).unwrap(),
            Judgement::DeleteUnready
        );
        let short = synced(pdb(json!({"minAvailable": 2})), &pods);
        assert_eq!(
            judge(&short, &pods[1], SystemTime::now())
                .unwrap_err()
                .code(),
            429
        );
        let mut always =
            pdb(json!({"minAvailable": 2, "unhealthyPodEvictionPolicy": "AlwaysAllow"}));
        always = synced(always, &pods);
        assert_eq!(
            judge(&always, &pods[1], SystemTime::now()).unwrap(),
            Judgement::DeleteUnready
        );
    }

    /// eviction.go `getPodDisruptionBudgets`: an empty selector matches nothing;
    /// matchExpressions are honoured.
    #[test]
    fn selectors() {
        let p = pod("a", true, None);
        let mut empty = pdb(json!({}));
        empty["spec"]["selector"] = json!({});
        assert!(covering(&[empty], &p).is_empty());
        let mut expr = pdb(json!({}));
        expr["spec"]["selector"] = json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["train", "eval"]}]});
        assert_eq!(covering(std::slice::from_ref(&expr), &p).len(), 1);
        expr["spec"]["selector"] =
            json!({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["train"]}]});
        assert!(covering(&[expr], &p).is_empty());
    }
}
