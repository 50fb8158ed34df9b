//! Field selectors, as staging/src/k8s.io/apimachinery/pkg/fields/selector.go parses
//! them and each kind's field-label conversion and selectable fields apply them (the
//! sources are listed in `selectors.rs`).

use serde_json::Value;

use crate::Kind;

/// A parsed field selector: every term must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// (field, value, negated: `!=`), fields as the kind's conversion names them.
    pub terms: Vec<(String, String, bool)>,
}

/// `splitTerms`: split on commas not escaped with `\`.
fn split_terms(s: &str) -> Vec<&str> {
    if s.is_empty() {
        return Vec::new();
    }
    let mut terms = Vec::new();
    let (mut start, mut in_slash) = (0, false);
    for (i, c) in s.char_indices() {
        if in_slash {
            in_slash = false;
        } else if c == '\\' {
            in_slash = true;
        } else if c == ',' {
            terms.push(&s[start..i]);
            start = i + 1;
        }
    }
    terms.push(&s[start..]);
    terms
}

/// `splitTerm`: at the first operator, trying `!=`, `==`, `=` at each position.
fn split_term(term: &str) -> Option<(&str, &str, &str)> {
    for (i, _) in term.char_indices() {
        for op in ["!=", "==", "="] {
            if term[i..].starts_with(op) {
                return Some((&term[..i], op, &term[i + op.len()..]));
            }
        }
    }
    None
}

/// `UnescapeValue`.
fn unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut in_slash = false;
    for c in s.chars() {
        if in_slash {
            if !matches!(c, '\\' | ',' | '=') {
                return Err(format!(
                    "invalid field selector: invalid escape sequence: \\{c}"
                ));
            }
            out.push(c);
            in_slash = false;
        } else if c == '\\' {
            in_slash = true;
        } else if matches!(c, ',' | '=') {
            return Err(format!(
                "invalid field selector: unescaped character in value: {}",
                c as u32
            ));
        } else {
            out.push(c);
        }
    }
    if in_slash {
        return Err("invalid field selector: invalid escape sequence: \\".into());
    }
    Ok(out)
}

/// The kind's field-label conversion: the field it selects on, or the error upstream
/// answers (see the module comment for the files).
pub fn convert_field(k: &Kind, field: &str) -> Result<String, String> {
    let supported: &[&str] = match k.plural {
        "pods" => {
            if field == "spec.host" {
                // "backwards compatibility with old v1 clients which send spec.host".
                return Ok("spec.nodeName".into());
            }
            &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.podIPs",
                "status.nominatedNodeName",
            ]
        }
        "nodes" => &["metadata.name", "spec.unschedulable"],
        "events" => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "metadata.namespace",
            "metadata.name",
        ],
        "namespaces" => &["status.phase", "metadata.name"],
        "secrets" => &["type", "metadata.namespace", "metadata.name"],
        "jobs" => &["metadata.name", "metadata.namespace", "status.successful"],
        // pkg/registry/resource/resourceslice/strategy.go `toSelectableFields`.
        "resourceslices" => &["metadata.name", "spec.nodeName", "spec.driver"],
        _ => {
            return match field {
                "metadata.name" | "metadata.namespace" => Ok(field.into()),
                _ => Err(format!(
                    "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                )),
            }
        }
    };
    if supported.contains(&field) {
        Ok(field.into())
    } else {
        Err(format!("field label not supported: {field}"))
    }
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

/// The value of a selectable field of `obj` (`""` where the object has none, as a
/// `fields.Set` answers for a missing key).
pub fn field_value(k: &Kind, obj: &Value, field: &str) -> String {
    let at = |p: &str| text(obj.pointer(p));
    match (k.plural, field) {
        (_, "metadata.name") => at("/metadata/name"),
        (_, "metadata.namespace") if k.namespaced => at("/metadata/namespace"),
        ("pods", "spec.hostNetwork") => {
            (obj.pointer("/spec/hostNetwork").and_then(Value::as_bool) == Some(true)).to_string()
        }
        ("pods", "status.podIP") => {
            // The internal PodStatus keeps podIPs; a lone v1 podIP becomes podIPs[0]
            // (pkg/apis/core/v1/conversion.go).
            match obj.pointer("/status/podIPs/0/ip") {
                Some(ip) => text(Some(ip)),
                None => at("/status/podIP"),
            }
        }
        ("pods", f) if f != "status.podIPs" => at(&format!("/{}", f.replace('.', "/"))),
        ("nodes", "spec.unschedulable") => {
            (obj.pointer("/spec/unschedulable").and_then(Value::as_bool) == Some(true)).to_string()
        }
        ("events", "source") => {
            let component = at("/source/component");
            if component.is_empty() {
                at("/reportingComponent")
            } else {
                component
            }
        }
        ("events", f) => at(&format!("/{}", f.replace('.', "/"))),
        ("resourceslices", "spec.nodeName") => at("/spec/nodeName"),
        ("resourceslices", "spec.driver") => at("/spec/driver"),
        ("namespaces", "status.phase") => at("/status/phase"),
        ("secrets", "type") => at("/type"),
        ("jobs", "status.successful") => obj
            .pointer("/status/succeeded")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            .to_string(),
        _ => String::new(),
    }
}

impl FieldSelector {
    /// `fields.ParseSelector` and `Transform` with the kind's conversion: the selector,
    /// or upstream's error text.
    pub fn parse(k: &Kind, selector: &str) -> Result<Self, String> {
        let mut parts = split_terms(selector);
        parts.sort_unstable();
        let mut raw = Vec::new();
        for part in parts.into_iter().filter(|p| !p.is_empty()) {
            let Some((lhs, op, rhs)) = split_term(part) else {
                return Err(format!(
                    "invalid selector: '{selector}'; can't understand '{part}'"
                ));
            };
            raw.push((lhs, unescape(rhs)?, op == "!="));
        }
        let mut terms = Vec::new();
        for (field, value, negated) in raw {
            terms.push((convert_field(k, field)?, value, negated));
        }
        Ok(FieldSelector { terms })
    }

    /// Whether `obj`, of kind `k`, matches.
    pub fn matches(&self, k: &Kind, obj: &Value) -> bool {
        self.terms
            .iter()
            .all(|(f, v, negated)| (field_value(k, obj, f) == *v) != *negated)
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }
}
