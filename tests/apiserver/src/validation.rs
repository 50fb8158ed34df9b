//! Validation the real kube-apiserver applies to what faultline writes, so a write that
//! a cluster would refuse with 422 is refused here too. Each rule names the upstream
//! file it follows; where unsure, the rule here is the stricter one.

use serde_json::Value;

/// Longest DNS-1123 subdomain (and ConfigMap key).
pub const DNS1123_SUBDOMAIN_MAX: usize = 253;
/// Longest DNS-1123 label.
pub const DNS1123_LABEL_MAX: usize = 63;

fn alnum(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// `IsDNS1123Label` (staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go):
/// lowercase alphanumerics and '-', alphanumeric at both ends, at most 63 characters.
pub fn is_dns1123_label(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= DNS1123_LABEL_MAX
        && s.chars().all(|c| alnum(c) || c == '-')
        && s.starts_with(alnum)
        && s.ends_with(alnum);
    if ok {
        Ok(())
    } else {
        Err(format!("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character, at most {DNS1123_LABEL_MAX} characters (got {s:?})"))
    }
}

/// `IsDNS1123Subdomain` (same file): dot-separated DNS-1123 labels, at most 253
/// characters.
pub fn is_dns1123_subdomain(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= DNS1123_SUBDOMAIN_MAX
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.chars().all(|c| alnum(c) || c == '-')
                && l.starts_with(alnum)
                && l.ends_with(alnum)
        });
    if ok {
        Ok(())
    } else {
        Err(format!("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character, at most {DNS1123_SUBDOMAIN_MAX} characters (got {s:?})"))
    }
}

/// `IsConfigMapKey` (same file): `[-._a-zA-Z0-9]+`, at most 253 characters, and not
/// `.`, `..` or starting with `..`.
pub fn is_configmap_key(k: &str) -> Result<(), String> {
    if k.is_empty() || k.len() > DNS1123_SUBDOMAIN_MAX {
        return Err(format!(
            "a valid config key must be 1 to {DNS1123_SUBDOMAIN_MAX} characters (got {} in {k:?})",
            k.len()
        ));
    }
    if !k
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(format!("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (got {k:?})"));
    }
    if k == "." || k == ".." || k.starts_with("..") {
        return Err(format!(
            "must not be '.' or '..' or start with '..' (got {k:?})"
        ));
    }
    Ok(())
}

/// The name of an object of `plural` (`ValidateObjectMeta` with `NameIsDNSSubdomain`
/// for most kinds; `ValidateNamespace` uses `ValidateNamespaceName`, a DNS-1123 label:
/// pkg/apis/core/validation/validation.go).
pub fn object_name(plural: &str, name: &str) -> Result<(), String> {
    match plural {
        "namespaces" => is_dns1123_label(name),
        _ => is_dns1123_subdomain(name),
    }
    .map_err(|e| format!("metadata.name: Invalid value: {name:?}: {e}"))
}

/// `ValidateConfigMap` (pkg/apis/core/validation/validation.go): every key of `data`
/// and `binaryData` is a config key, and no key is in both.
pub fn configmap(obj: &Value) -> Result<(), String> {
    let data = obj.get("data").and_then(Value::as_object);
    let binary = obj.get("binaryData").and_then(Value::as_object);
    for (field, map) in [("data", data), ("binaryData", binary)] {
        for k in map.into_iter().flat_map(|m| m.keys()) {
            is_configmap_key(k).map_err(|e| format!("{field}[{k}]: Invalid value: {k:?}: {e}"))?;
        }
    }
    if let (Some(d), Some(b)) = (data, binary) {
        if let Some(k) = d.keys().find(|k| b.contains_key(*k)) {
            return Err(format!(
                "data[{k}]: Invalid value: {k:?}: duplicate of key present in binaryData"
            ));
        }
    }
    Ok(())
}

/// `legacyValidateEvent` (pkg/apis/core/validation/events.go), which every core/v1
/// Event passes: without `eventTime`, an Event about a cluster-scoped object (no
/// `involvedObject.namespace`) lives in `""` or `default`, any other in its object's
/// namespace; with `eventTime`, one about a cluster-scoped object lives in `default` or
/// `kube-system` and names its reporting controller, instance, action and reason.
pub fn event(ns: &str, obj: &Value) -> Result<(), String> {
    let involved_ns = obj
        .pointer("/involvedObject/namespace")
        .and_then(Value::as_str)
        .unwrap_or("");
    let has_event_time = obj
        .get("eventTime")
        .is_some_and(|t| !t.is_null() && t.as_str() != Some(""));
    let mismatch = || {
        format!("involvedObject.namespace: Invalid value: {involved_ns:?}: does not match event.namespace ({ns:?})")
    };
    if !has_event_time {
        let ok = if involved_ns.is_empty() {
            ns.is_empty() || ns == "default"
        } else {
            ns == involved_ns
        };
        if !ok {
            return Err(mismatch());
        }
    } else {
        if involved_ns.is_empty() && ns != "default" && ns != "kube-system" {
            return Err(mismatch());
        }
        for f in [
            "reportingComponent",
            "reportingInstance",
            "action",
            "reason",
        ] {
            if obj.get(f).and_then(Value::as_str).unwrap_or("").is_empty() {
                return Err(format!("{f}: Required value"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_as_upstream_validates_them() {
        // staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go
        for ok in ["n1", "gpu-node-1.rack-3.example.internal", "a", "0abc"] {
            assert!(is_dns1123_subdomain(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Gpu", "a_b", "-a", "a-", "a..b", ".a", &"a".repeat(254)] {
            assert!(is_dns1123_subdomain(bad).is_err(), "{bad}");
        }
        assert!(is_dns1123_label("faultline").is_ok());
        assert!(is_dns1123_label("a.b").is_err());
        assert!(is_dns1123_label(&"a".repeat(64)).is_err());
        assert!(object_name("namespaces", "a.b").is_err());
        assert!(object_name("nodes", "a.b").is_ok());
    }

    #[test]
    fn configmap_keys_as_upstream_validates_them() {
        for ok in [
            "fault.json",
            "gpu-node-1.json",
            "a_b",
            "..a".trim_start_matches('.'),
        ] {
            assert!(is_configmap_key(ok).is_ok(), "{ok}");
        }
        // An agent URL as a node name gives such a key (issue 9, bug 1).
        for bad in [
            "http://10.0.0.7:8081.json",
            "",
            ".",
            "..",
            "..data",
            "a/b",
            &"k".repeat(254),
        ] {
            assert!(is_configmap_key(bad).is_err(), "{bad}");
        }
        assert!(configmap(&json!({"data": {"ok.json": "x", "bad key": "y"}})).is_err());
        assert!(configmap(&json!({"data": {"a": "x"}, "binaryData": {"a": "eA=="}})).is_err());
        assert!(configmap(&json!({"data": {"a": "x"}})).is_ok());
    }

    #[test]
    fn events_about_nodes_live_in_default() {
        // pkg/apis/core/validation/events.go legacyValidateEvent
        let node_event = json!({"involvedObject": {"kind": "Node", "name": "n1"}, "reason": "X"});
        assert!(event("default", &node_event).is_ok());
        assert!(event("", &node_event).is_ok());
        assert!(event("faultline", &node_event).is_err());
        let pod_event = json!({"involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns"}});
        assert!(event("ns", &pod_event).is_ok());
        assert!(event("default", &pod_event).is_err());
        let mut timed = node_event.clone();
        timed["eventTime"] = json!("2026-11-30T00:00:00.000000Z");
        assert!(
            event("kube-system", &timed).is_err(),
            "a timed event needs its reporter"
        );
        for f in ["reportingComponent", "reportingInstance", "action"] {
            timed[f] = json!("x");
        }
        assert!(event("kube-system", &timed).is_ok());
        assert!(event("faultline", &timed).is_err());
    }
}
