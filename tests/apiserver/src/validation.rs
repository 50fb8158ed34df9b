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

/// `RegexError` (staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go).
fn regex_error(msg: &str, fmt: &str, examples: &[&str]) -> String {
    let mut s = format!("{msg} (e.g. ");
    for (i, e) in examples.iter().enumerate() {
        if i > 0 {
            s.push_str(" or ");
        }
        s.push_str(&format!("'{e}', "));
    }
    s + &format!("regex used for validation is '{fmt}')")
}

const QUALIFIED_NAME_FMT: &str = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]";
const QUALIFIED_NAME_MSG: &str = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`.
fn qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// `IsQualifiedName` (same file), what a label key must be: an optional DNS-1123
/// subdomain prefix and '/', then a name of at most 63 characters. The messages, empty
/// when it is one.
pub fn is_qualified_name(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else if let Err(e) = is_dns1123_subdomain(prefix) {
                errs.push(format!("prefix part {e}"));
            }
            *name
        }
        _ => {
            return vec![format!(
                "a qualified name {} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
                regex_error(QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, &["MyName", "my.name", "123-abc"])
            )]
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > DNS1123_LABEL_MAX {
        errs.push(format!(
            "name part must be no more than {DNS1123_LABEL_MAX} characters"
        ));
    }
    if !qualified_name_part(name) {
        errs.push(format!(
            "name part {}",
            regex_error(
                QUALIFIED_NAME_MSG,
                QUALIFIED_NAME_FMT,
                &["MyName", "my.name", "123-abc"]
            )
        ));
    }
    errs
}

/// `IsValidLabelValue` (same file): empty, or a qualified name's name part of at most
/// 63 characters. The messages, empty when it is one.
pub fn is_label_value(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > DNS1123_LABEL_MAX {
        errs.push(format!(
            "must be no more than {DNS1123_LABEL_MAX} characters"
        ));
    }
    if !value.is_empty() && !qualified_name_part(value) {
        errs.push(regex_error(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            &format!("({QUALIFIED_NAME_FMT})?"),
            &["MyValue", "my_value", "12345"],
        ));
    }
    errs
}

/// The largest Secret (`MaxSecretSize`, pkg/apis/core/types.go), as for ConfigMaps.
pub const SECRET_MAX_BYTES: usize = 1 << 20;

/// What the API does to a Secret before validating it: `data` is `[]byte`, so its
/// values must be padded standard base64 (`encoding/json`; anything else is a 400 at
/// decoding), `stringData` overwrites `data` and is not kept
/// (`Convert_v1_Secret_To_core_Secret`, pkg/apis/core/v1/conversion.go), and `type`
/// defaults to `Opaque` (`SetDefaults_Secret`, pkg/apis/core/v1/defaults.go).
pub fn normalize_secret(obj: &mut Value) -> Result<(), String> {
    let cannot = |e: String| format!("Secret in version \"v1\" cannot be handled as a Secret: {e}");
    if obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .is_empty()
    {
        obj["type"] = Value::String("Opaque".into());
    }
    if let Some(data) = obj.get("data").filter(|d| !d.is_null()) {
        let data = data
            .as_object()
            .ok_or_else(|| cannot("data: expected an object".into()))?;
        for (k, v) in data {
            let text = v
                .as_str()
                .ok_or_else(|| cannot(format!("data[{k}]: expected a base64 string")))?;
            crate::b64::decode_std(text).map_err(cannot)?;
        }
    }
    let string_data = obj.as_object_mut().and_then(|o| o.remove("stringData"));
    if let Some(Value::Object(sd)) = string_data {
        if !obj.get("data").is_some_and(Value::is_object) {
            obj["data"] = Value::Object(Default::default());
        }
        for (k, v) in sd {
            let text = v
                .as_str()
                .ok_or_else(|| cannot(format!("stringData[{k}]: expected a string")))?;
            obj["data"][k.as_str()] = Value::String(crate::b64::encode_std(text.as_bytes()));
        }
    }
    Ok(())
}

fn secret_bytes(obj: &Value, key: &str) -> Option<Vec<u8>> {
    crate::b64::decode_std(
        obj.pointer(&format!(
            "/data/{}",
            key.replace('~', "~0").replace('/', "~1")
        ))?
        .as_str()?,
    )
    .ok()
}

/// `ValidateSecret` (pkg/apis/core/validation/validation.go): every key of `data` is a
/// config key, the decoded values total at most 1 MiB, and the keys a type needs are
/// there (`kubernetes.io/tls`, `dockercfg`, `dockerconfigjson` (JSON), `basic-auth`,
/// `ssh-auth`, `service-account-token`'s annotation).
pub fn secret(obj: &Value) -> Result<(), String> {
    let mut total = 0;
    if let Some(data) = obj.get("data").and_then(Value::as_object) {
        for (k, v) in data {
            is_configmap_key(k).map_err(|e| format!("data[{k}]: Invalid value: {k:?}: {e}"))?;
            total += v
                .as_str()
                .and_then(|t| crate::b64::decode_std(t).ok())
                .map_or(0, |b| b.len());
        }
    }
    if total > SECRET_MAX_BYTES {
        return Err(format!(
            "data: Too long: must have at most {SECRET_MAX_BYTES} bytes"
        ));
    }
    let required = |key: &str| format!("data[{key}]: Required value");
    let has = |key: &str| secret_bytes(obj, key).is_some();
    match obj.get("type").and_then(Value::as_str).unwrap_or("") {
        "kubernetes.io/service-account-token" => {
            let name = obj
                .pointer("/metadata/annotations/kubernetes.io~1service-account.name")
                .and_then(Value::as_str)
                .unwrap_or("");
            if name.is_empty() {
                return Err(
                    "metadata.annotations[kubernetes.io/service-account.name]: Required value"
                        .into(),
                );
            }
        }
        t @ ("kubernetes.io/dockercfg" | "kubernetes.io/dockerconfigjson") => {
            let key = if t.ends_with("json") {
                ".dockerconfigjson"
            } else {
                ".dockercfg"
            };
            let bytes = secret_bytes(obj, key).ok_or_else(|| required(key))?;
            serde_json::from_slice::<serde_json::Map<String, Value>>(&bytes).map_err(|e| {
                format!("data[{key}]: Invalid value: \"<secret contents redacted>\": {e}")
            })?;
        }
        "kubernetes.io/basic-auth" if !has("username") && !has("password") => {
            return Err(format!(
                "[{}, {}]",
                required("username"),
                required("password")
            ));
        }
        "kubernetes.io/ssh-auth"
            if secret_bytes(obj, "ssh-privatekey").is_none_or(|b| b.is_empty()) =>
        {
            return Err(required("ssh-privatekey"));
        }
        "kubernetes.io/tls" => {
            for key in ["tls.crt", "tls.key"] {
                if !has(key) {
                    return Err(required(key));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// What may not change once set (pkg/apis/core/validation/validation.go
/// `ValidateConfigMapUpdate`, `ValidateSecretUpdate`, KEP-1412): a Secret's `type`;
/// and of a ConfigMap or Secret marked `immutable: true`, the mark and `data` (and a
/// ConfigMap's `binaryData`). Metadata may still change.
pub fn immutable_update(plural: &str, old: &Value, new: &Value) -> Result<(), String> {
    if !matches!(plural, "configmaps" | "secrets") {
        return Ok(());
    }
    let field = |v: &Value, f: &str| v.get(f).filter(|x| !x.is_null()).cloned();
    let mut errs = Vec::new();
    if plural == "secrets" && field(old, "type") != field(new, "type") {
        let t = new.get("type").and_then(Value::as_str).unwrap_or("");
        errs.push(format!("type: Invalid value: {t:?}: field is immutable"));
    }
    if old.get("immutable").and_then(Value::as_bool) == Some(true) {
        let forbidden =
            |f: &str| format!("{f}: Forbidden: field is immutable when `immutable` is set");
        if new.get("immutable").and_then(Value::as_bool) != Some(true) {
            errs.push(forbidden("immutable"));
        }
        let fields: &[&str] = if plural == "configmaps" {
            &["data", "binaryData"]
        } else {
            &["data"]
        };
        for f in fields {
            if field(old, f) != field(new, f) {
                errs.push(forbidden(f));
            }
        }
    }
    match errs.len() {
        0 => Ok(()),
        1 => Err(errs.remove(0)),
        _ => Err(format!("[{}]", errs.join(", "))),
    }
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
        // An agent URL as a node name gives such a key.
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

    #[test]
    fn label_keys_and_values_as_upstream_validates_them() {
        // staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go
        for ok in [
            "app",
            "nvidia.com/gpu.present",
            "feature.node.kubernetes.io/cpu-cpuid.AVX512F",
            "A_b.c-1",
        ] {
            assert!(is_qualified_name(ok).is_empty(), "{ok}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a/b/c",
            "-a",
            "a b",
            "Example.com/a",
            &"a".repeat(64),
        ] {
            assert!(!is_qualified_name(bad).is_empty(), "{bad}");
        }
        assert!(is_qualified_name("a b")[0]
            .starts_with("name part must consist of alphanumeric characters"));
        for ok in ["", "true", "NVIDIA-H100-80GB-HBM3", "12.4", "a_b"] {
            assert!(is_label_value(ok).is_empty(), "{ok}");
        }
        for bad in ["-a", "a b", "a/b", &"v".repeat(64)] {
            assert!(!is_label_value(bad).is_empty(), "{bad}");
        }
    }

    #[test]
    fn secrets_as_upstream_decodes_and_validates_them() {
        let mut s = json!({"metadata": {"name": "s"}, "data": {"a": "eA=="}, "stringData": {"b": "hello", "a": "y"}});
        normalize_secret(&mut s).unwrap();
        assert_eq!(s["type"], "Opaque");
        assert!(s.get("stringData").is_none());
        assert_eq!(s["data"], json!({"a": "eQ==", "b": "aGVsbG8="}));
        assert!(secret(&s).is_ok());
        let mut bad = json!({"metadata": {"name": "s"}, "data": {"a": "not base64!"}});
        assert!(normalize_secret(&mut bad)
            .unwrap_err()
            .contains("illegal base64"));
        let tls = json!({"type": "kubernetes.io/tls", "data": {"tls.crt": "eA=="}});
        assert_eq!(secret(&tls).unwrap_err(), "data[tls.key]: Required value");
        let big = json!({"data": {"k": crate::b64::encode_std(&vec![0u8; SECRET_MAX_BYTES + 1])}});
        assert!(secret(&big).unwrap_err().contains("Too long"));
        assert!(secret(&json!({"data": {"a/b": "eA=="}})).is_err());
    }

    #[test]
    fn immutable_configmaps_and_secrets_keep_their_data() {
        let old =
            json!({"immutable": true, "data": {"a": "1"}, "metadata": {"labels": {"x": "1"}}});
        let mut relabelled = old.clone();
        relabelled["metadata"]["labels"]["x"] = json!("2");
        assert!(immutable_update("configmaps", &old, &relabelled).is_ok());
        let mut changed = old.clone();
        changed["data"]["a"] = json!("2");
        assert_eq!(
            immutable_update("configmaps", &old, &changed).unwrap_err(),
            "data: Forbidden: field is immutable when `immutable` is set"
        );
        let mut unmarked = changed.clone();
        unmarked["immutable"] = json!(false);
        assert!(immutable_update("configmaps", &old, &unmarked)
            .unwrap_err()
            .starts_with("[immutable: Forbidden"));
        let mutable = json!({"data": {"a": "1"}});
        assert!(immutable_update("configmaps", &mutable, &changed).is_ok());
        let s = json!({"type": "Opaque"});
        let t = json!({"type": "kubernetes.io/tls"});
        assert!(immutable_update("secrets", &s, &t)
            .unwrap_err()
            .contains("field is immutable"));
    }
}
