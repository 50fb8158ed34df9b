//! A request's vocabulary, shared by the handlers (`http.rs`), lists (`paging.rs`),
//! watches (`watch.rs`) and the cost accounting (`costs.rs`): the query parameters this
//! server acts on, a resource path taken apart, and an object as a client of another
//! version of its kind sees it.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::Kind;

/// The query parameters this server acts on; the others (fieldManager, timeout, ...)
/// are accepted and ignored.
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub(crate) struct ListParams {
    pub(crate) watch: Option<String>,
    pub(crate) resource_version: Option<String>,
    pub(crate) resource_version_match: Option<String>,
    pub(crate) label_selector: Option<String>,
    pub(crate) field_selector: Option<String>,
    pub(crate) limit: Option<i64>,
    #[serde(rename = "continue")]
    pub(crate) continue_token: Option<String>,
    pub(crate) timeout_seconds: Option<u64>,
    pub(crate) allow_watch_bookmarks: Option<bool>,
    pub(crate) grace_period_seconds: Option<i64>,
}

impl ListParams {
    pub(crate) fn is_watch(&self) -> bool {
        matches!(self.watch.as_deref(), Some("true" | "1"))
    }
}

/// An object, a list or a watch event of `k` as a client that asked for `version` sees
/// it: the versions of one kind share their fields here (`kinds.rs`), so conversion
/// is the apiVersion (pkg/apis/resource/v1beta2/conversion.go and the generated
/// conversions carry every field over).
pub(crate) fn at_version(k: &Kind, version: &str, mut v: Value) -> Value {
    if version == k.version {
        return v;
    }
    let gv = format!("{}/{version}", k.group);
    let storage = crate::kinds::api_version(k);
    let mut set = |o: &mut Value| {
        if o.get("apiVersion").and_then(Value::as_str) == Some(storage.as_str()) {
            o["apiVersion"] = json!(gv);
        }
    };
    set(&mut v);
    if let Some(items) = v.get_mut("items").and_then(Value::as_array_mut) {
        items.iter_mut().for_each(&mut set);
    }
    if let Some(o) = v.get_mut("object") {
        set(o);
    }
    v
}

/// A resource path, taken apart.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ResourcePath {
    pub(crate) group: String,
    pub(crate) version: String,
    pub(crate) namespace: String,
    pub(crate) plural: String,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
}

/// `/api/v1/[namespaces/NS/]PLURAL[/NAME[/SUB]]` and `/apis/GROUP/VERSION/...`.
pub(crate) fn parse_path(path: &str) -> Option<ResourcePath> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("".to_string(), v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (g.to_string(), v.to_string(), rest),
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
        version,
        namespace,
        plural: plural.to_string(),
        name,
        subresource,
    })
}
