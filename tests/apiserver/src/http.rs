//! The HTTP API: discovery, the resource paths of
//! staging/src/k8s.io/apiserver/pkg/endpoints (request info, authorization, the
//! handlers of get, list, watch, create, update, patch and delete), the test controls
//! (`/_faults`, `/_calls`, `/_test/costs`) and the byte accounting of every response
//! (`costs.rs`).

use std::time::Duration;

use axum::body::{Bytes, HttpBody};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use rand::Rng;
use serde_json::{json, Value};

use crate::discovery::{group_list, resource_list};
use crate::kinds::kind_of;
use crate::request::{at_version, parse_path, ListParams, ResourcePath};
use crate::selectors::Selection;
use crate::{
    costs, paging, patch, rbac, watch, ApiError, ApiResult, ApiServer, Call, Costs, Faults, Inner,
    Kind, Received, KINDS,
};

/// The router, with discovery, resources and the test controls.
pub fn router(server: ApiServer) -> Router {
    Router::new()
        .route("/version", get(|State(s): State<ApiServer>| async move {
            let r = s.release();
            Json(json!({"major": "1", "minor": r.minor.to_string(), "gitVersion": r.git_version(), "platform": "linux/amd64"}))
        }))
        .route("/api", get(|| async { Json(json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})) }))
        .route("/api/v1", get(|State(s): State<ApiServer>| async move { Json(resource_list(&s.release(), "", "v1")) }))
        .route("/apis", get(|State(s): State<ApiServer>| async move { Json(group_list(&s.release())) }))
        .route("/apis/{group}/{version}", get(|State(s): State<ApiServer>, Path((g, v)): Path<(String, String)>| async move {
            let r = s.release();
            if KINDS.iter().any(|k| k.group == g && r.serves(k, &v)) {
                Json(resource_list(&r, &g, &v)).into_response()
            } else {
                ApiError::new(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource").into_response()
            }
        }))
        .route("/_faults", put(set_faults).get(get_faults))
        .route("/_calls", get(|State(s): State<ApiServer>| async move { Json(s.calls()) }))
        .route("/_test/costs", get(|State(s): State<ApiServer>| async move { Json(s.costs()) }).delete(reset_costs))
        .fallback(dispatch)
        .layer(axum::middleware::from_fn_with_state(server.clone(), count))
        .with_state(server)
}

async fn reset_costs(State(s): State<ApiServer>) -> Json<Costs> {
    Json(s.reset_costs())
}

/// Count a response (`costs.rs`): its verb and resource, status and body size. A
/// streamed body (a watch) has no known size: its lines are counted as they are sent.
async fn count(State(s): State<ApiServer>, req: Request, next: Next) -> Response {
    let Some((verb, resource)) = costs::classify(req.method(), req.uri()) else {
        return next.run(req).await;
    };
    let resp = next.run(req).await;
    let bytes = resp.body().size_hint().exact();
    s.meter
        .slot(verb, &resource)
        .response(resp.status().as_u16(), bytes);
    resp
}

async fn set_faults(State(s): State<ApiServer>, Json(f): Json<Faults>) -> Json<Faults> {
    s.set_faults(f.clone());
    Json(f)
}

async fn get_faults(State(s): State<ApiServer>) -> Json<Faults> {
    Json(s.lock().faults.clone())
}

/// Milliseconds since the Unix epoch: a call's `RequestReceived` and `ResponseComplete`
/// stage times, as an audit event's `requestReceivedTimestamp` and `stageTimestamp`
/// carry them (staging/src/k8s.io/apiserver/pkg/apis/audit/types.go; tested by
/// `path_matched_latency_and_calls_in_flight`, tests/clients.rs).
fn epoch_ms() -> u64 {
    crate::clock::now_ms()
}

async fn dispatch(
    State(s): State<ApiServer>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received_ms = epoch_ms();
    let late = {
        let mut g = s.lock();
        g.received.push(Received {
            method: method.to_string(),
            uri: uri.to_string(),
            at_ms: received_ms,
        });
        let (rate, ms) = (g.faults.late_answer_rate, g.faults.late_answer_ms);
        let write = !matches!(method, Method::GET | Method::HEAD);
        (write && rate > 0.0 && uri.path() != "/_faults" && g.rng.random_bool(rate.min(1.0)))
            .then(|| Duration::from_millis(if ms == 0 { 3000 } else { ms }))
    };
    // Dropped with this future when the client goes away first (hyper drops the
    // handler of a closed connection): the call is noted as abandoned, not carried out.
    let mut pending = Abandoned {
        server: &s,
        call: Some(Received {
            method: method.to_string(),
            uri: uri.to_string(),
            at_ms: received_ms,
        }),
    };
    let resp = handle(&s, &method, &uri, &headers, body).await;
    pending.call = None;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    let at_ms = epoch_ms();
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(String::from);
    s.lock().calls.push(Call {
        method: method.to_string(),
        uri: uri.to_string(),
        status: resp.status().as_u16(),
        token,
        at_ms,
        received_ms,
    });
    if let Some(d) = late {
        tokio::time::sleep(d).await;
    }
    resp
}

/// A call in the server, noted as abandoned if dropped before it was carried out.
struct Abandoned<'a> {
    server: &'a ApiServer,
    call: Option<Received>,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.call.take() {
            self.server.lock().abandoned.push(c);
        }
    }
}

/// The faults injected into this call: a delay, and an error to answer instead.
fn injected(s: &ApiServer, method: &Method, path: &str, body: &Bytes) -> (u64, Option<ApiError>) {
    let mut g = s.lock();
    let f = g.faults.clone();
    // A conflict needs a precondition: an update, or a patch that names a
    // resourceVersion. A patch without one is retried by the server itself
    // (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go).
    let write = *method == Method::PUT
        || (*method == Method::PATCH
            && serde_json::from_slice::<Value>(body)
                .ok()
                .is_some_and(|p| p.pointer("/metadata/resourceVersion").is_some()));
    let roll = |g: &mut Inner, p: f64| p > 0.0 && g.rng.random_bool(p.min(1.0));
    let any_write = !matches!(*method, Method::GET | Method::HEAD);
    // The dice in the order they always were (a schedule's seed replays as before):
    // the error roll first, the write roll only for a write that may fail. The answer
    // is what staging/src/k8s.io/apiserver/pkg/storage/errors/storage.go's
    // Interpret{Get,Create,Update,Delete}Error make of storage.IsInternalError:
    // apierrors.NewInternalError, 500 with reason InternalError (its message reads
    // "Internal error occurred: ..."; faultline reads the code, never the words). An
    // etcd that cannot be reached is storage.IsUnreachable there: a 504 ServerTimeout,
    // which this does not play.
    let write_may_fail =
        any_write && (f.write_error_match.is_empty() || path.contains(&f.write_error_match));
    let fail = if roll(&mut g, f.error_rate) || (write_may_fail && roll(&mut g, f.write_error_rate))
    {
        Some(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "injected fault: internal error",
        ))
    } else if (f.throttle_match.is_empty() || path.contains(&f.throttle_match))
        && roll(&mut g, f.throttle_rate)
    {
        // maxinflight.go tooManyRequests: plain text and Retry-After, no Status.
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            "Too many requests, please try again later.",
        );
        e.plain = true;
        e.retry_after = Some(1);
        Some(e)
    } else if write && roll(&mut g, f.conflict_rate) {
        Some(ApiError::new(StatusCode::CONFLICT, "Conflict", "injected fault: the object has been modified; please apply your changes to the latest version and try again"))
    } else {
        None
    };
    let delayed = (f.latency_match.is_empty() || path.contains(&f.latency_match))
        && (f.latency_method.is_empty() || f.latency_method == method.as_str());
    (if delayed { f.latency_ms } else { 0 }, fail)
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("invalid JSON body: {e}"),
        )
    })
}

async fn handle(
    s: &ApiServer,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> ApiResult {
    let path = uri.path();
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    };
    let ResourcePath {
        group,
        version,
        namespace: ns,
        plural,
        name,
        subresource: sub,
    } = parse_path(path).ok_or_else(not_found)?;
    // A kind at a version the release does not serve is not there
    // (staging/src/k8s.io/apiserver/pkg/server/storage/resource_config.go).
    let k = kind_of(&group, &plural)
        .filter(|k| s.release().serves(k, &version))
        .ok_or_else(not_found)?;
    let conv = |v: Value| at_version(k, &version, v);
    let params: ListParams = Query::try_from_uri(uri)
        .map(|Query(p)| p)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", e.body_text()))?;
    authorize(
        s,
        method,
        headers,
        k,
        &ns,
        name.as_deref(),
        sub.as_deref(),
        &params,
    )?;

    let (latency, fail) = injected(s, method, path, &body);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    if let Some(e) = fail {
        return Err(e);
    }

    // Only JSON is served; clients that try protobuf or CBOR first (kubectl does for
    // built-in types) fall back to JSON on a 415.
    let body_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !body.is_empty() && (body_type.contains("protobuf") || body_type.contains("cbor")) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format - accepted media types include: application/json (got {body_type})"),
        ));
    }
    let ns_of = |ns: &str| {
        if k.namespaced {
            ns.to_string()
        } else {
            String::new()
        }
    };
    match (method.clone(), name, sub.as_deref()) {
        (Method::GET, None, None) => {
            // get.go ListResource: the selectors are decoded (a malformed one is a
            // 400) and the fields converted for the kind (an unsupported one is a 400).
            let sel = Selection::parse(
                k,
                params.label_selector.as_deref(),
                params.field_selector.as_deref(),
            )
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", e))?;
            paging::validate_options(&params)?;
            if params.is_watch() {
                watch::watch(s, k, &ns, &params, sel, &version)
            } else {
                let list = conv(paging::list(s, k, &ns, &params, &sel)?);
                Ok(Json(match metadata_only(headers) {
                    Some(Partial::List) => partial_list(list),
                    _ => list,
                })
                .into_response())
            }
        }
        (Method::GET, Some(n), None | Some("status")) => s
            .get(k.plural, &ns_of(&ns), &n)
            .map(|o| match metadata_only(headers) {
                Some(Partial::Object) => Json(partial(o)).into_response(),
                _ => Json(conv(o)).into_response(),
            })
            .ok_or_else(|| ApiError::not_found(k.plural, &n)),
        (Method::POST, None, None) => {
            let mut obj = parse_json(&body)?;
            before_create(k, &mut obj);
            let obj = s.create(k.plural, &ns, obj)?;
            Ok((StatusCode::CREATED, Json(conv(obj))).into_response())
        }
        (Method::POST, Some(n), Some("eviction")) if k.plural == "pods" => {
            let b = parse_json(&body)?;
            let grace = b
                .pointer("/deleteOptions/gracePeriodSeconds")
                .and_then(Value::as_i64);
            let uid = b
                .pointer("/deleteOptions/preconditions/uid")
                .and_then(Value::as_str);
            Ok((StatusCode::CREATED, Json(s.evict(&ns, &n, grace, uid)?)).into_response())
        }
        (Method::PUT, Some(n), sub @ (None | Some("status"))) => Ok(Json(conv(s.update(
            k.plural,
            &ns,
            &n,
            parse_json(&body)?,
            sub,
        )?))
        .into_response()),
        (Method::PATCH, Some(n), sub @ (None | Some("status"))) => {
            let ct = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            Ok(Json(conv(apply_patch(s, k, &ns_of(&ns), &n, sub, ct, &body)?)).into_response())
        }
        (Method::DELETE, Some(n), None) => {
            // DeleteOptions come in the body or the query.
            let grace = params.grace_period_seconds.or_else(|| {
                serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|b| b.get("gracePeriodSeconds").and_then(Value::as_i64))
            });
            // DeleteOptions.preconditions (staging/src/k8s.io/apiserver/pkg/registry/
            // generic/registry/store.go `Delete`, `checkPreconditions`): a uid or
            // resourceVersion that is not the object's is a 409 and nothing is deleted.
            let pre = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|b| b.get("preconditions").cloned());
            if let Some(pre) = pre {
                let cur = s
                    .get(k.plural, &ns_of(&ns), &n)
                    .ok_or_else(|| ApiError::not_found(k.plural, &n))?;
                for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
                    let want = pre.get(field).and_then(Value::as_str);
                    let have = cur
                        .pointer(&format!("/metadata/{field}"))
                        .and_then(Value::as_str);
                    if let Some(want) = want.filter(|w| Some(*w) != have) {
                        return Err(ApiError::new(
                            StatusCode::CONFLICT,
                            "Conflict",
                            format!("Precondition failed: {what} in precondition: {want}, {what} in object meta: {}", have.unwrap_or("")),
                        ));
                    }
                }
            }
            Ok(Json(conv(s.delete_with_grace(k.plural, &ns, &n, grace)?)).into_response())
        }
        _ => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} is not supported on {path}"),
        )),
    }
}

/// What a client asked for with `Accept: application/json;as=...;g=meta.k8s.io;v=v1`
/// (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/rest.go, the target of the
/// content negotiation; response.go `transformResponseObject`): the objects' metadata
/// only, as kube's `list_metadata` and `get_metadata` ask.
enum Partial {
    List,
    Object,
}

fn metadata_only(headers: &HeaderMap) -> Option<Partial> {
    let accept = headers.get("accept")?.to_str().ok()?;
    accept.split(',').find_map(|media| {
        let params: Vec<&str> = media.split(';').map(str::trim).collect();
        let has = |p: &str| params.contains(&p);
        if !has("g=meta.k8s.io") || !(has("v=v1") || has("v=v1beta1")) {
            return None;
        }
        if has("as=PartialObjectMetadataList") {
            Some(Partial::List)
        } else if has("as=PartialObjectMetadata") {
            Some(Partial::Object)
        } else {
            None
        }
    })
}

/// An object as `PartialObjectMetadata` (response.go `asPartialObjectMetadata`): its
/// metadata, managedFields included, and nothing else.
fn partial(obj: Value) -> Value {
    serde_json::json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": obj.get("metadata").cloned().unwrap_or(Value::Null),
    })
}

/// A list as `PartialObjectMetadataList` (response.go `asPartialObjectMetadataList`):
/// the list's metadata (resourceVersion, continue, remainingItemCount) kept.
fn partial_list(list: Value) -> Value {
    let items: Vec<Value> = list
        .get("items")
        .and_then(Value::as_array)
        .map(|a| a.iter().cloned().map(partial).collect())
        .unwrap_or_default();
    serde_json::json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadataList",
        "metadata": list.get("metadata").cloned().unwrap_or(Value::Null),
        "items": items,
    })
}

/// PATCH (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go): the patch
/// applied to the current object, then stored as an update. A patch that names a
/// resourceVersion is checked like an update; one that does not applies to the current
/// object.
fn apply_patch(
    s: &ApiServer,
    k: &Kind,
    ns: &str,
    name: &str,
    sub: Option<&str>,
    content_type: &str,
    body: &Bytes,
) -> Result<Value, ApiError> {
    let p = parse_json(body)?;
    // A patch that names no resourceVersion is applied to the object as it is when
    // written: a write that lands between the read and the write is a conflict the
    // server retries, never the client's (staging/src/k8s.io/apiserver/pkg/endpoints/
    // handlers/patch.go applies the patch inside the storage's `GuaranteedUpdate`,
    // which retries on a conflict). One that names a resourceVersion gets its 409.
    let pinned = p.pointer("/metadata/resourceVersion").is_some();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match apply_patch_once(s, k, ns, name, sub, content_type, &p) {
            Err(e) if e.code() == 409 && !pinned && attempt < 16 => continue,
            other => return other,
        }
    }
}

fn apply_patch_once(
    s: &ApiServer,
    k: &Kind,
    ns: &str,
    name: &str,
    sub: Option<&str>,
    content_type: &str,
    p: &Value,
) -> Result<Value, ApiError> {
    let cur = s
        .get(k.plural, ns, name)
        .ok_or_else(|| ApiError::not_found(k.plural, name))?;
    let p = p.clone();
    let mut next = match content_type.split(';').next().unwrap_or("").trim() {
        "application/json-patch+json" => patch::json_patch(&cur, &p).map_err(|e| ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", e))?,
        "application/merge-patch+json" => patch::merge_patch(&cur, &p),
        "application/strategic-merge-patch+json" => patch::strategic_merge_patch(&cur, &p),
        "application/apply-patch+yaml" => return Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", "server-side apply is not served by this test server")),
        other => return Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"))),
    };
    if p.pointer("/metadata/resourceVersion").is_none() {
        next["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
    }
    s.update_as("patch", k.plural, ns, name, next, sub)
}

/// With RBAC on: 401 without a known token, 403 for what the user's bindings do not
/// grant (see `rbac.rs`).
#[allow(clippy::too_many_arguments)]
fn authorize(
    s: &ApiServer,
    method: &Method,
    headers: &HeaderMap,
    k: &Kind,
    ns: &str,
    name: Option<&str>,
    sub: Option<&str>,
    params: &ListParams,
) -> Result<(), ApiError> {
    let Some(tokens) = s.lock().tokens.clone() else {
        return Ok(());
    };
    let header = headers.get("authorization").and_then(|v| v.to_str().ok());
    let Some(user) = tokens.user(header).map(String::from) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    };
    // requestinfo.go: the verb of a request.
    let verb = match (method.clone(), name) {
        (Method::GET, None) if params.is_watch() => "watch",
        (Method::GET, None) => "list",
        (Method::GET, Some(_)) => "get",
        (Method::POST, _) => "create",
        (Method::PUT, _) => "update",
        (Method::PATCH, _) => "patch",
        (Method::DELETE, _) => "delete",
        _ => "unknown",
    };
    let a = rbac::Attributes {
        verb: verb.into(),
        group: k.group.into(),
        resource: k.plural.into(),
        subresource: sub.map(String::from),
        namespace: if k.namespaced {
            ns.into()
        } else {
            String::new()
        },
        name: name.map(String::from),
    };
    if s.authorized(&user, &a) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            rbac::forbidden_message(&user, &a),
        ))
    }
}

/// What the API server does to a new object before storing it
/// (staging/src/k8s.io/apiserver/pkg/registry/rest/create.go `BeforeCreate` and the
/// kinds' `PrepareForCreate`): no deletion marks; a pod starts Pending with no status
/// from the client (pkg/registry/core/pod/strategy.go); a budget starts with no
/// status (pkg/registry/policy/poddisruptionbudget/strategy.go). Objects that tests
/// seed through [`ApiServer::create`] skip this: the test plays the kubelet.
fn before_create(k: &Kind, obj: &mut Value) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
    }
    match k.plural {
        "pods" => obj["status"] = json!({"phase": "Pending"}),
        "poddisruptionbudgets" => {
            if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        _ => {}
    }
}

/// Serve until `cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    server: ApiServer,
    cancel: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(server))
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}
