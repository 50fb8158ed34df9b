//! The three patch formats the Kubernetes API takes.

use serde_json::{Map, Value};

/// RFC 7386 JSON merge patch (`application/merge-patch+json`).
pub fn merge_patch(target: &Value, patch: &Value) -> Value {
    match patch {
        Value::Object(p) => {
            let mut out = match target {
                Value::Object(t) => t.clone(),
                _ => Map::new(),
            };
            for (k, v) in p {
                if v.is_null() {
                    out.remove(k);
                } else {
                    let cur = out.get(k).cloned().unwrap_or(Value::Null);
                    out.insert(k.clone(), merge_patch(&cur, v));
                }
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

/// How strategic merge patch treats a list field, from the `patchStrategy` and
/// `patchMergeKey` tags of the Go types (staging/src/k8s.io/api/core/v1/types.go,
/// staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/types.go,
/// staging/src/k8s.io/api/policy/v1/types.go, staging/src/k8s.io/api/batch/v1/types.go).
/// A list without a tag is atomic: the patch replaces it whole. Among the kinds this
/// server serves, no field name has two strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListStrategy {
    /// Replaced whole (`+listType=atomic`, no `patchStrategy`).
    Atomic,
    /// Merged element by element on this key (`patchStrategy:"merge"`).
    MergeOn(&'static str),
    /// A list of scalars merged as a set (`finalizers`).
    MergeValues,
}

/// The strategy of list field `field`.
pub fn list_strategy(field: &str) -> ListStrategy {
    use ListStrategy::*;
    match field {
        // NodeStatus, PodStatus, PodDisruptionBudgetStatus, JobStatus.
        "conditions" => MergeOn("type"),
        // NodeStatus.addresses.
        "addresses" => MergeOn("type"),
        // PodSpec.
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "imagePullSecrets" => MergeOn("name"),
        // Container.
        "env" => MergeOn("name"),
        "ports" => MergeOn("containerPort"),
        "volumeMounts" => MergeOn("mountPath"),
        "volumeDevices" => MergeOn("devicePath"),
        // PodStatus.podIPs.
        "podIPs" => MergeOn("ip"),
        // ContainerStatus.allocatedResourcesStatus (its parent list is atomic).
        "allocatedResourcesStatus" => MergeOn("name"),
        // ObjectMeta.
        "ownerReferences" => MergeOn("uid"),
        "finalizers" => MergeValues,
        // NodeSpec.taints, PodSpec.tolerations, PodStatus.containerStatuses and the
        // rest: atomic.
        _ => Atomic,
    }
}

/// Strategic merge patch (`application/strategic-merge-patch+json`): a merge patch in
/// which lists with a merge key are merged element by element (`{"$patch": "delete"}`
/// removes one) and `$deleteFromPrimitiveList/<field>` removes values.
pub fn strategic_merge_patch(target: &Value, patch: &Value) -> Value {
    smp(target, patch, "")
}

fn smp(target: &Value, patch: &Value, field: &str) -> Value {
    match (target, patch) {
        (_, Value::Object(p)) => {
            // `$patch: replace` swaps the map for the patch's; `$patch: delete` drops it.
            match p.get("$patch").and_then(Value::as_str) {
                Some("replace") => {
                    let mut m = p.clone();
                    m.remove("$patch");
                    return Value::Object(m);
                }
                Some("delete") => return Value::Null,
                _ => {}
            }
            let mut out = match target {
                Value::Object(t) => t.clone(),
                _ => Map::new(),
            };
            for (k, v) in p {
                if let Some(list_field) = k.strip_prefix("$deleteFromPrimitiveList/") {
                    if let (Some(Value::Array(cur)), Value::Array(del)) =
                        (out.get(list_field).cloned(), v)
                    {
                        out.insert(
                            list_field.to_string(),
                            Value::Array(cur.into_iter().filter(|x| !del.contains(x)).collect()),
                        );
                    }
                    continue;
                }
                if k.starts_with('$') {
                    continue;
                }
                if v.is_null() {
                    out.remove(k);
                    continue;
                }
                let cur = out.get(k).cloned().unwrap_or(Value::Null);
                out.insert(k.clone(), smp(&cur, v, k));
            }
            Value::Object(out)
        }
        (Value::Array(cur), Value::Array(p)) => match list_strategy(field) {
            ListStrategy::MergeOn(key) => {
                let mut out = cur.clone();
                for item in p {
                    let id = item.get(key);
                    let pos = out.iter().position(|x| id.is_some() && x.get(key) == id);
                    let directive = item.get("$patch").and_then(Value::as_str);
                    if directive == Some("replace") {
                        // The list named in the patch replaces the stored one.
                        return Value::Array(
                            p.iter()
                                .filter(|x| x.get("$patch").is_none())
                                .cloned()
                                .collect(),
                        );
                    }
                    match (pos, directive == Some("delete")) {
                        (Some(i), true) => {
                            out.remove(i);
                        }
                        (None, true) => {}
                        (Some(i), false) => out[i] = smp(&out[i], item, ""),
                        (None, false) => out.push(smp(&Value::Null, item, "")),
                    }
                }
                Value::Array(out)
            }
            ListStrategy::MergeValues => {
                let mut out = cur.clone();
                for v in p {
                    if !out.contains(v) {
                        out.push(v.clone());
                    }
                }
                Value::Array(out)
            }
            ListStrategy::Atomic => Value::Array(p.clone()),
        },
        (_, other) => other.clone(),
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn pointer_parent<'a>(doc: &'a mut Value, path: &str) -> Result<(&'a mut Value, String), String> {
    let (parent, last) = path
        .rsplit_once('/')
        .ok_or_else(|| format!("invalid path {path:?}"))?;
    let p = if parent.is_empty() {
        doc
    } else {
        doc.pointer_mut(parent)
            .ok_or_else(|| format!("path {parent:?} does not exist"))?
    };
    Ok((p, unescape(last)))
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, key) = pointer_parent(doc, path)?;
    match parent {
        Value::Object(m) => {
            m.insert(key, value);
            Ok(())
        }
        Value::Array(a) => {
            if key == "-" {
                a.push(value);
                return Ok(());
            }
            let i: usize = key.parse().map_err(|_| format!("bad index {key:?}"))?;
            if i > a.len() {
                return Err(format!("index {i} out of range"));
            }
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!("cannot add under {path:?}")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, key) = pointer_parent(doc, path)?;
    match parent {
        Value::Object(m) => m
            .remove(&key)
            .ok_or_else(|| format!("path {path:?} does not exist")),
        Value::Array(a) => {
            let i: usize = key.parse().map_err(|_| format!("bad index {key:?}"))?;
            if i >= a.len() {
                return Err(format!("index {i} out of range"));
            }
            Ok(a.remove(i))
        }
        _ => Err(format!("cannot remove {path:?}")),
    }
}

/// RFC 6902 JSON patch (`application/json-patch+json`).
pub fn json_patch(target: &Value, patch: &Value) -> Result<Value, String> {
    let ops = patch
        .as_array()
        .ok_or("a JSON patch is an array of operations")?;
    let mut doc = target.clone();
    for op in ops {
        let kind = op
            .get("op")
            .and_then(Value::as_str)
            .ok_or("operation without \"op\"")?;
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or("operation without \"path\"")?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("{kind} needs a value"))
        };
        match kind {
            "add" => add(&mut doc, path, value()?)?,
            "remove" => {
                remove(&mut doc, path)?;
            }
            "replace" => {
                remove(&mut doc, path)?;
                add(&mut doc, path, value()?)?;
            }
            "test" => {
                if doc.pointer(path) != Some(&value()?) {
                    return Err(format!("test failed at {path:?}"));
                }
            }
            "move" | "copy" => {
                let from = op
                    .get("from")
                    .and_then(Value::as_str)
                    .ok_or("move/copy needs \"from\"")?;
                let v = if kind == "move" {
                    remove(&mut doc, from)?
                } else {
                    doc.pointer(from)
                        .cloned()
                        .ok_or_else(|| format!("path {from:?} does not exist"))?
                };
                add(&mut doc, path, v)?;
            }
            other => return Err(format!("unknown op {other:?}")),
        }
    }
    Ok(doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_rfc7386() {
        let t = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        let p = json!({"a": "z", "c": {"f": null}});
        assert_eq!(merge_patch(&t, &p), json!({"a": "z", "c": {"d": "e"}}));
    }

    /// The list strategies of staging/src/k8s.io/api/core/v1/types.go: conditions
    /// merge on `type`, but `taints` has no patch strategy and is replaced whole, as
    /// is `containerStatuses`; `volumeMounts` merge on `mountPath`; `finalizers`
    /// merge as a set.
    #[test]
    fn strategic_merge_follows_the_schema() {
        let node = json!({"spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        let p = json!({"spec": {"taints": [{"key": "nvidia.com/gpu-fault", "value": "true", "effect": "NoSchedule"}]},
                       "status": {"conditions": [{"type": "AcceleratorHealthy", "status": "False"}]}});
        let out = strategic_merge_patch(&node, &p);
        assert_eq!(
            out["spec"]["taints"],
            json!([{"key": "nvidia.com/gpu-fault", "value": "true", "effect": "NoSchedule"}]),
            "taints are atomic: the other taint is gone"
        );
        assert_eq!(out["status"]["conditions"].as_array().unwrap().len(), 2);
        let del = json!({"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]}});
        let out = strategic_merge_patch(&out, &del);
        assert_eq!(
            out["status"]["conditions"],
            json!([{"type": "AcceleratorHealthy", "status": "False"}])
        );

        let pod = json!({"metadata": {"finalizers": ["a"]},
            "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/x"}]}]},
            "status": {"containerStatuses": [{"name": "c", "ready": true}, {"name": "d", "ready": true}]}});
        let p = json!({"metadata": {"finalizers": ["b", "a"]},
            "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/y"}]}]},
            "status": {"containerStatuses": [{"name": "c", "ready": false}]}});
        let out = strategic_merge_patch(&pod, &p);
        assert_eq!(out["metadata"]["finalizers"], json!(["a", "b"]));
        assert_eq!(
            out["spec"]["containers"][0]["volumeMounts"]
                .as_array()
                .unwrap()
                .len(),
            2,
            "same name, another mountPath: a second mount"
        );
        assert_eq!(
            out["status"]["containerStatuses"],
            json!([{"name": "c", "ready": false}])
        );
        // `$patch: replace` on a map.
        let p = json!({"metadata": {"labels": {"$patch": "replace", "z": "1"}}});
        let out = strategic_merge_patch(&json!({"metadata": {"labels": {"a": "1"}}}), &p);
        assert_eq!(out["metadata"]["labels"], json!({"z": "1"}));
    }

    #[test]
    fn json_patch_rfc6902() {
        let t = json!({"metadata": {"labels": {"a": "1"}}, "spec": {"taints": []}});
        let p = json!([
            {"op": "test", "path": "/metadata/labels/a", "value": "1"},
            {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
            {"op": "add", "path": "/spec/taints/-", "value": {"key": "k"}},
            {"op": "remove", "path": "/metadata/labels/a"}
        ]);
        let out = json_patch(&t, &p).unwrap();
        assert_eq!(
            out,
            json!({"metadata": {"labels": {"b/c": "2"}}, "spec": {"taints": [{"key": "k"}]}})
        );
        assert!(json_patch(
            &t,
            &json!([{"op": "test", "path": "/metadata/labels/a", "value": "2"}])
        )
        .is_err());
        assert!(json_patch(&t, &json!([{"op": "remove", "path": "/nope"}])).is_err());
    }
}
