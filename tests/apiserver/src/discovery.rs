//! Discovery as kube-apiserver serves it: `/apis` (each group with its versions, the
//! preferred one first) and each version's resource list, for the release the server
//! plays.

use serde_json::{json, Value};

use crate::{Release, KINDS};

pub(crate) fn resource_list(r: &Release, group: &str, version: &str) -> Value {
    let mut resources = Vec::new();
    for k in KINDS
        .iter()
        .filter(|k| k.group == group && r.serves(k, version))
    {
        resources.push(json!({
            "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced, "kind": k.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"], "shortNames": k.short
        }));
        if matches!(
            k.plural,
            "nodes" | "pods" | "poddisruptionbudgets" | "resourceclaims" | "devicetaintrules"
        ) {
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

/// `/apis`: each group with the versions the release serves, newest first, the
/// newest preferred (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/group.go).
pub(crate) fn group_list(r: &Release) -> Value {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for k in KINDS.iter().filter(|k| !k.group.is_empty()) {
        let i = match groups.iter().position(|(g, _)| *g == k.group) {
            Some(i) => i,
            None => {
                groups.push((k.group, Vec::new()));
                groups.len() - 1
            }
        };
        for v in r.versions(k) {
            if !groups[i].1.contains(v) {
                groups[i].1.push(v);
            }
        }
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .filter(|(_, vs)| !vs.is_empty())
        .map(|(g, mut vs)| {
            vs.sort_by_key(|v| std::cmp::Reverse(version_rank(v)));
            let versions: Vec<Value> = vs
                .iter()
                .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                .collect();
            json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// How Kubernetes orders versions (GA before beta before alpha, then by number:
/// staging/src/k8s.io/apimachinery/pkg/version/helpers.go `CompareKubeAwareVersionStrings`).
fn version_rank(v: &str) -> (u8, u32, u32) {
    let Some(rest) = v.strip_prefix('v') else {
        return (0, 0, 0);
    };
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let major = rest[..digits].parse().unwrap_or(0);
    let tail = &rest[digits..];
    let (stage, minor) = if tail.is_empty() {
        (3, 0)
    } else if let Some(n) = tail.strip_prefix("beta") {
        (2, n.parse().unwrap_or(0))
    } else if let Some(n) = tail.strip_prefix("alpha") {
        (1, n.parse().unwrap_or(0))
    } else {
        (0, 0)
    };
    (stage, major, minor)
}
