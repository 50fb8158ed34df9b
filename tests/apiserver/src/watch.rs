//! Watches as the watch cache serves them
//! (staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go): from a
//! resourceVersion the history still holds, or from "any" (the current objects as
//! ADDED); objects entering or leaving the selection are ADDED or DELETED; a bookmark
//! when the watch ends, if asked for; 410 Gone for a resourceVersion older than the
//! history. Every event sent is counted (`costs.rs`) as the JSON line it is.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::costs::Counter;
use crate::kinds::api_version;
use crate::request::ListParams;
use crate::selectors::Selection;
use crate::{status_body, ApiResult, ApiServer, Key, Kind, WatchEvent};

/// Whether the object at `key` is of kind `k`, in `ns` (any when empty) and selected.
pub(crate) fn selected(k: &Kind, ns: &str, key: &Key, obj: &Value, sel: &Selection) -> bool {
    key.0 == k.plural && (ns.is_empty() || key.1 == ns) && sel.matches(k, obj)
}

/// An event as a watch with selectors sees it
/// (staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go
/// `convertToWatchEvent`): a change that brings an object into the selection is
/// ADDED, one that takes it out is DELETED (the object as it was, at the event's
/// resourceVersion), and changes outside the selection are not seen.
fn as_seen(k: &Kind, ns: &str, e: &WatchEvent, sel: &Selection) -> Option<Value> {
    if e.kind != k.kind {
        return None;
    }
    let now = selected(k, ns, &e.key, &e.object, sel);
    let before = e
        .prev
        .as_ref()
        .map_or(now, |o| selected(k, ns, &e.key, o, sel));
    match (e.event, now, before) {
        ("MODIFIED", true, false) => Some(json!({"type": "ADDED", "object": e.object})),
        ("MODIFIED", false, true) => {
            let mut old = e.prev.clone()?;
            old["metadata"]["resourceVersion"] = json!(e.rv.to_string());
            Some(json!({"type": "DELETED", "object": old}))
        }
        (_, true, _) => Some(json!({"type": e.event, "object": e.object})),
        _ => None,
    }
}

/// A watch of kind `k` in `ns` with the (already parsed) selection `sel`.
pub(crate) fn watch(
    s: &ApiServer,
    k: &'static Kind,
    ns: &str,
    p: &ListParams,
    sel: Selection,
    version: &str,
) -> ApiResult {
    let mut rx = s.events.subscribe();
    let (backlog, start_rv, too_old, drop_after) = {
        let g = s.lock();
        let from: Option<u64> = p
            .resource_version
            .as_deref()
            .filter(|v| !v.is_empty() && *v != "0")
            .and_then(|v| v.parse().ok());
        let mut backlog = Vec::new();
        let mut too_old = false;
        match from {
            // From a point in history: replay what happened after it.
            Some(rv) if rv < g.oldest_servable() => too_old = true,
            Some(rv) => backlog.extend(
                g.history
                    .iter()
                    .filter(|e| e.rv > rv)
                    .filter_map(|e| as_seen(k, ns, e, &sel)),
            ),
            // From "any": the current objects as ADDED, then changes.
            None => backlog.extend(
                g.objects
                    .iter()
                    .filter(|(key, o)| selected(k, ns, key, o, &sel))
                    .map(|(_, o)| json!({"type": "ADDED", "object": o})),
            ),
        }
        (backlog, g.rv, too_old, g.faults.drop_watch_after_s)
    };
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1800).min(3600));
    let timeout = if drop_after > 0 {
        timeout.min(Duration::from_secs(drop_after))
    } else {
        timeout
    };
    let bookmarks = p.allow_watch_bookmarks.unwrap_or(false);
    let ns = ns.to_string();
    let counter = s.meter.slot("watch", k.plural);
    let version = version.to_string();
    let stream = async_stream(counter, k, version, move |tx| async move {
        if too_old {
            let _ = tx.send(json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", "too old resource version")})).await;
            return;
        }
        for e in backlog {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last_rv = start_rv;
        loop {
            let next = tokio::time::timeout_at(deadline, rx.recv()).await;
            match next {
                Err(_) => {
                    if bookmarks {
                        let _ = tx.send(json!({"type": "BOOKMARK", "object": {"kind": k.kind, "apiVersion": api_version(k), "metadata": {"resourceVersion": last_rv.to_string()}}})).await;
                    }
                    return;
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => {
                    let _ = tx.send(json!({"type": "ERROR", "object": status_body(StatusCode::GONE, "Expired", "watch fell behind")})).await;
                    return;
                }
                Ok(Err(_)) => return,
                Ok(Ok(e)) => {
                    if e.rv <= start_rv {
                        continue;
                    }
                    let Some(seen) = as_seen(k, &ns, &e, &sel) else {
                        continue;
                    };
                    last_rv = e.rv;
                    if tx.send(seen).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    Ok(Response::builder()
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(stream)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// A streaming body fed line by line (one JSON document per line, as watches are),
/// each line counted on `counter` as it is sent, its object at the `version` of `k`
/// the client asked for.
fn async_stream<F, Fut>(counter: Arc<Counter>, k: &'static Kind, version: String, f: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Value>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Value>(256);
    tokio::spawn(f(tx));
    let stream = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|v| {
            v.map(|v| {
                let v = crate::request::at_version(k, &version, v);
                let mut line = serde_json::to_vec(&v).unwrap_or_default();
                line.push(b'\n');
                counter.watch_event(line.len() as u64);
                Ok::<_, Infallible>(Bytes::from(line))
            })
        })
    });
    Body::from_stream(stream)
}
