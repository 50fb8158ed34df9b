//! LIST, with `resourceVersion`, `resourceVersionMatch`, `limit` and `continue` as
//! kube-apiserver v1.34 serves them.
//!
//! Which state a list shows (staging/src/k8s.io/apiserver/pkg/storage/cacher/delegator.go
//! `shouldDelegateList`, cacher.go `GetList`, etcd3/store.go `GetList`):
//! - `resourceVersion` unset: a consistent read, the current state;
//! - `resourceVersion=0`, or `N` with `resourceVersionMatch=NotOlderThan` (or unset
//!   and no `limit`): the watch cache, at least as new as `N`: the current state here
//!   (a future `N` is a 504 "Too large resource version", cacher's
//!   `NewTooLargeResourceVersionError`, answered at once instead of after the cacher's
//!   3 s wait);
//! - `resourceVersion=N` (N > 0) with a `limit` and no `resourceVersionMatch`, or with
//!   `resourceVersionMatch=Exact`: etcd at exactly revision N (`withRev`): the state at
//!   N, rebuilt from the history; N older than the history is a 410 Expired "The
//!   resourceVersion for the provided list is too old." (etcd3/errors.go), N in the
//!   future a 500 (etcd's `ErrFutureRev`);
//! - `continue`: etcd at the token's revision, from the token's key on; a token older
//!   than the history is a 410 Expired whose Status carries a new token at the latest
//!   revision (etcd3/errors.go `handleCompactedErrorForPaging`); a malformed token is a
//!   400 "invalid continue token: ..." (staging/src/k8s.io/apiserver/pkg/storage/continue.go
//!   `DecodeContinue`); a `resourceVersion` other than `""` or `0` with it is a 400.
//!
//! `limit` (cacher.go `computeListLimit`): honoured, except with `resourceVersion=0`,
//! where the watch cache ignores it and returns every item ("as of today, the limit is
//! ignored for requests that set RV == 0"). A page holds at most `limit` items, in key
//! order (`/registry/<resource>/[<namespace>/]<name>`); when items remain, the list's
//! `metadata.continue` is an opaque token (base64url of
//! `{"v":"meta.k8s.io/v1","rv":REV,"start":"<last key>\u0000"}`, continue.go
//! `EncodeContinue`) and, without selectors, `remainingItemCount` counts the items
//! after this page (`storage.PrepareContinueToken`; with selectors it is omitted, as
//! upstream cannot count them). A page filtered by selectors may come back short, or
//! empty with a token, as upstream's can.
//!
//! The options are validated first (staging/src/k8s.io/apimachinery/pkg/apis/meta/internalversion/validation/validation.go
//! `ValidateListOptions`, a 422 on `ListOptions.meta.k8s.io`).

use std::collections::BTreeMap;

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::kinds::api_version;
use crate::request::ListParams;
use crate::selectors::Selection;
use crate::{b64, ApiError, ApiServer, Inner, Kind};

/// The continue token (continue.go `continueToken`; missing fields decode empty, as
/// Go's `json.Unmarshal` leaves them).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Token {
    #[serde(rename = "v")]
    version: String,
    #[serde(rename = "rv")]
    resource_version: i64,
    #[serde(rename = "start")]
    start: String,
}

fn encode_token(start: &str, rv: i64) -> String {
    let t = Token {
        version: "meta.k8s.io/v1".into(),
        resource_version: rv,
        start: start.into(),
    };
    b64::encode_url(&serde_json::to_vec(&t).unwrap_or_default())
}

/// `DecodeContinue`: the key to start from (relative to the list's prefix) and the
/// revision (-1: the latest).
fn decode_token(token: &str) -> Result<(String, i64), String> {
    const INVALID: &str = "continue key is not valid";
    let data = b64::decode_url(token).map_err(|e| format!("{INVALID}: {e}"))?;
    let t: Token = serde_json::from_slice(&data).map_err(|e| format!("{INVALID}: {e}"))?;
    if t.version != "meta.k8s.io/v1" {
        return Err(format!(
            "{INVALID}: server does not recognize this encoded version {}",
            t.version
        ));
    }
    if t.resource_version == 0 {
        return Err(format!(
            "{INVALID}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        ));
    }
    if t.start.is_empty() {
        return Err(format!(
            "{INVALID}: encoded start key empty (version meta.k8s.io/v1)"
        ));
    }
    // path.Clean must leave the key as it is: no traversal out of the prefix.
    let key = if t.start.starts_with('/') {
        t.start.clone()
    } else {
        format!("/{}", t.start)
    };
    let clean = !key[1..]
        .split('/')
        .any(|p| p.is_empty() || p == "." || p == "..");
    if !clean {
        return Err(format!("{INVALID}: {}", t.start));
    }
    Ok((key[1..].to_string(), t.resource_version))
}

/// `ValidateListOptions` (422 on `ListOptions.meta.k8s.io`).
pub(crate) fn validate_options(p: &ListParams) -> Result<(), ApiError> {
    let rv = p.resource_version.as_deref().unwrap_or("");
    let mut errs = Vec::new();
    let forbidden = |why: &str| format!("resourceVersionMatch: Forbidden: {why}");
    if let Some(m) = p
        .resource_version_match
        .as_deref()
        .filter(|m| !m.is_empty())
    {
        if matches!(p.watch.as_deref(), Some("true" | "1")) {
            errs.push(forbidden("resourceVersionMatch is forbidden for watch"));
        } else {
            if rv.is_empty() {
                errs.push(forbidden(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            }
            if p.continue_token.as_deref().is_some_and(|c| !c.is_empty()) {
                errs.push(forbidden(
                    "resourceVersionMatch is forbidden when continue is provided",
                ));
            }
            if m != "Exact" && m != "NotOlderThan" {
                errs.push(format!("resourceVersionMatch: Unsupported value: {m:?}: supported values: \"Exact\", \"NotOlderThan\", \"\""));
            }
            if m == "Exact" && rv == "0" {
                errs.push(forbidden(
                    "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
                ));
            }
        }
    }
    if errs.is_empty() {
        return Ok(());
    }
    let why = if errs.len() == 1 {
        errs.remove(0)
    } else {
        format!("[{}]", errs.join(", "))
    };
    Err(ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("ListOptions.meta.k8s.io \"\" is invalid: {why}"),
    ))
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", message)
}

fn expired(message: &str) -> ApiError {
    ApiError::new(StatusCode::GONE, "Expired", message)
}

/// Which revision to list at, where to start, and whether `limit` applies.
struct Plan {
    rv: u64,
    start: Option<String>,
    limit: Option<usize>,
}

fn plan(g: &mut Inner, p: &ListParams) -> Result<Plan, ApiError> {
    let rv_param = p.resource_version.as_deref().unwrap_or("");
    let limit = p.limit.filter(|l| *l > 0).map(|l| l as usize);
    let future = || {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "",
            "etcdserver: mvcc: required revision is a future revision",
        )
    };
    if let Some(token) = p.continue_token.as_deref().filter(|t| !t.is_empty()) {
        let (start, rv) =
            decode_token(token).map_err(|e| bad_request(format!("invalid continue token: {e}")))?;
        if !rv_param.is_empty() && rv_param != "0" {
            return Err(bad_request(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let rv = if rv < 0 { g.rv } else { rv as u64 };
        if rv < g.oldest_servable() {
            let mut e = expired("The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.");
            e.metadata = Some(Box::new(json!({"continue": encode_token(&start, -1)})));
            return Err(e);
        }
        if rv > g.rv {
            return Err(future());
        }
        return Ok(Plan {
            rv,
            start: Some(start),
            limit,
        });
    }
    if rv_param.is_empty() {
        return Ok(Plan {
            rv: g.rv,
            start: None,
            limit,
        });
    }
    let n: u64 = rv_param
        .parse()
        .map_err(|_| bad_request(format!("invalid resource version: {rv_param:?}")))?;
    let exact = match p.resource_version_match.as_deref().unwrap_or("") {
        "Exact" => true,
        "" => limit.is_some() && n > 0,
        _ => false,
    };
    if exact {
        if n < g.oldest_servable() {
            return Err(expired(
                "The resourceVersion for the provided list is too old.",
            ));
        }
        if n > g.rv {
            return Err(future());
        }
        return Ok(Plan {
            rv: n,
            start: None,
            limit,
        });
    }
    if n > g.rv {
        let mut e = ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            format!(
                "Timeout: Too large resource version: {n}, current: {}",
                g.rv
            ),
        );
        e.details = Some(
            json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1}),
        );
        return Err(e);
    }
    Ok(Plan {
        rv: cached_rv(g, n),
        start: None,
        // computeListLimit: the watch cache ignores the limit for resourceVersion=0.
        limit: if rv_param == "0" { None } else { limit },
    })
}

/// The revision the watch cache serves a list from, at least `n`: the newest, or with
/// [`crate::Faults::stale_list_ms`] the one it stood at a lag drawn up to that long ago
/// (the last change made by then), never older than the history can rebuild.
fn cached_rv(g: &mut Inner, n: u64) -> u64 {
    use rand::Rng;
    let most = g.faults.stale_list_ms;
    if most == 0 {
        return g.rv;
    }
    let lag = g.rng.random_range(0..=most);
    let then = crate::clock::now_ms().saturating_sub(lag);
    let newer = g
        .history
        .iter()
        .rev()
        .take_while(|e| e.at_ms > then)
        .count();
    let at = match g.history.len() - newer {
        0 => g.oldest_servable(),
        i => g.history[i - 1].rv,
    };
    at.max(n).max(g.oldest_servable())
}

/// The objects of kind `k` in `ns` (every namespace when empty) as they were at `rv`,
/// by their key under the list's prefix (`NAME`, or `NAMESPACE/NAME` across
/// namespaces), in key order. Changes after `rv` are undone from the history.
fn state_at<'a>(g: &'a Inner, k: &Kind, ns: &str, rv: u64) -> Vec<(String, &'a Value)> {
    let across = k.namespaced && ns.is_empty();
    let rel = |obj_ns: &str, name: &str| {
        if across {
            format!("{obj_ns}/{name}")
        } else {
            name.to_string()
        }
    };
    let mine = |p: &str, n: &str| p == k.plural && (ns.is_empty() || n == ns);
    let from = (k.plural.to_string(), ns.to_string(), String::new());
    let mut items: BTreeMap<String, Option<&Value>> = g
        .objects
        .range(from..)
        .take_while(|((p, n, _), _)| mine(p, n))
        .map(|((_, n, name), v)| (rel(n, name), Some(v)))
        .collect();
    for e in g.history.iter().rev().take_while(|e| e.rv > rv) {
        if mine(&e.key.0, &e.key.1) {
            let before = match e.event {
                "ADDED" => None,
                _ => Some(e.prev.as_ref().unwrap_or(&e.object)),
            };
            items.insert(rel(&e.key.1, &e.key.2), before);
        }
    }
    items
        .into_iter()
        .filter_map(|(key, v)| v.map(|v| (key, v)))
        .collect()
}

/// A whole list of the current state: the objects as stored, filtered first, so only
/// the selected ones are keyed and copied (the watch cache filters its store the same
/// way, and pods by `spec.nodeName` through an index: cacher.go `GetList`,
/// pkg/registry/core/pod/strategy.go `NodeNameIndexFunc`; here `Inner::pods_by_node`).
/// Rebuilding every key for a list of one node's pods out of 20,000 held the server's
/// lock for milliseconds each, and a storm of them stalled the Lease calls behind it;
/// reading every pod to find one node's still did.
fn current<'a>(g: &'a Inner, k: &Kind, ns: &str, rv: u64, sel: &Selection) -> Value {
    let across = k.namespaced && ns.is_empty();
    let from = (k.plural.to_string(), ns.to_string(), String::new());
    let mine = |(p, n, _): &crate::Key| p == k.plural && (ns.is_empty() || n == ns);
    let keyed = |((_, n, name), obj): (&crate::Key, &'a Value)| {
        let key = if across {
            format!("{n}/{name}")
        } else {
            name.clone()
        };
        (key, obj)
    };
    let node = (k.plural == "pods").then(|| sel.node_name()).flatten();
    let mut items: Vec<(String, &Value)> = match node {
        // One node's pods, from the index.
        Some(node) => g
            .pods_by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter(|key| mine(key))
            .filter_map(|key| g.objects.get_key_value(key))
            .filter(|(_, obj)| sel.matches(k, obj))
            .map(keyed)
            .collect(),
        None => g
            .objects
            .range(from..)
            .take_while(|(key, _)| mine(key))
            .filter(|(_, obj)| sel.matches(k, obj))
            .map(keyed)
            .collect(),
    };
    // In key order (`NAMESPACE/NAME` across namespaces), as a list is.
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let items: Vec<Value> = items.into_iter().map(|(_, o)| o.clone()).collect();
    json!({"kind": format!("{}List", k.kind), "apiVersion": api_version(k), "metadata": {"resourceVersion": rv.to_string()}, "items": items})
}

/// A page of the current state within one namespace, or of a cluster-scoped kind: read
/// from the store in key order from `start`, as etcd ranges over its keys with a limit
/// (staging/src/k8s.io/apiserver/pkg/storage/etcd3/store.go `GetList`), instead of
/// rebuilding every key at the revision first. There the keys are the names, so the
/// store's order is the list's (across namespaces `NAMESPACE/NAME` orders differently
/// from the store's tuples, and [`state_at`] serves it). A `limit=1` list of 20,000
/// Nodes, to read `remainingItemCount`, held the server's lock for tens of
/// milliseconds (a page update waited behind it).
fn current_page(
    g: &Inner,
    k: &Kind,
    ns: &str,
    rv: u64,
    start: Option<&str>,
    limit: Option<usize>,
    sel: &Selection,
) -> Value {
    let from = (
        k.plural.to_string(),
        ns.to_string(),
        start.unwrap_or("").to_string(),
    );
    let mut range = g
        .objects
        .range(from..)
        .take_while(|((p, n, _), _)| p == k.plural && n == ns);
    let mut items = Vec::new();
    let mut last: Option<&str> = None;
    let mut more = false;
    for ((_, _, name), obj) in range.by_ref() {
        if limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        if sel.matches(k, obj) {
            items.push(obj.clone());
            last = Some(name);
        }
    }
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let (true, Some(last)) = (more, last) {
        meta["continue"] = json!(encode_token(&format!("{last}\u{0}"), rv as i64));
        if sel.is_empty() {
            // The one read past the page, and the rest.
            meta["remainingItemCount"] = json!(1 + range.count());
        }
    }
    json!({"kind": format!("{}List", k.kind), "apiVersion": api_version(k), "metadata": meta, "items": items})
}

/// A LIST request (see the module comment): the list object, or its error.
pub(crate) fn list(
    s: &ApiServer,
    k: &Kind,
    ns: &str,
    p: &ListParams,
    sel: &Selection,
) -> Result<Value, ApiError> {
    let mut g = s.lock();
    let Plan { rv, start, limit } = plan(&mut g, p)?;
    if rv == g.rv && start.is_none() && limit.is_none() {
        return Ok(current(&g, k, ns, rv, sel));
    }
    if rv == g.rv && !(k.namespaced && ns.is_empty()) {
        return Ok(current_page(&g, k, ns, rv, start.as_deref(), limit, sel));
    }
    let all = state_at(&g, k, ns, rv);
    let from = start
        .as_deref()
        .map_or(0, |s| all.partition_point(|(key, _)| key.as_str() < s));
    let mut items = Vec::new();
    let mut last: Option<&str> = None;
    let mut more = false;
    for (key, obj) in &all[from..] {
        if limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        if sel.matches(k, obj) {
            items.push((*obj).clone());
            last = Some(key);
        }
    }
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let (true, Some(last), Some(limit)) = (more, last, limit) {
        meta["continue"] = json!(encode_token(&format!("{last}\u{0}"), rv as i64));
        if sel.is_empty() {
            meta["remainingItemCount"] = json!((all.len() - from).saturating_sub(limit));
        }
    }
    Ok(
        json!({"kind": format!("{}List", k.kind), "apiVersion": api_version(k), "metadata": meta, "items": items}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_upstreams() {
        // The JSON and base64url of continue.go's EncodeContinue.
        let t = encode_token("default/b\u{0}", 42);
        let raw = String::from_utf8(b64::decode_url(&t).unwrap()).unwrap();
        assert_eq!(
            raw,
            r#"{"v":"meta.k8s.io/v1","rv":42,"start":"default/b\u0000"}"#
        );
        assert_eq!(
            decode_token(&t).unwrap(),
            ("default/b\u{0}".to_string(), 42)
        );
        assert_eq!(decode_token(&encode_token("x", -1)).unwrap().1, -1);
        for (bad, why) in [
            ("!!", "continue key is not valid: illegal base64"),
            (
                &b64::encode_url(b"{}"),
                "continue key is not valid: server does not recognize",
            ),
            (
                &encode_token("x", 0),
                "incorrect encoded start resourceVersion",
            ),
            (&encode_token("", 5), "encoded start key empty"),
            (
                &encode_token("../kube-system/x", 5),
                "continue key is not valid: ../kube-system/x",
            ),
        ] {
            let e = decode_token(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
