//! The differential check: the same scripted requests go to a real
//! kube-apiserver (with its controllers) and to the test API server
//! (`tests/apiserver`), for the behaviours the test server models and faultline relies
//! on, and their answers are compared: the status code and the fields faultline reads.
//! A divergence fails, unless it is in [`ACCEPTED`], each with why it stays (the same
//! list is in tests/apiserver/README.md); an accepted divergence that no longer
//! diverges fails too, so the list stays true.

use std::time::{Duration, Instant};

use faultline_controlplane::{ControlPlane, Delays, FakeNode, Kubelet, Options, Release};
use faultline_test_apiserver::Bootstrap;
use http_body_util::BodyExt;
use serde_json::{json, Value};

/// Divergences that stay, by case name: none today. (Add `("case", "why")`.)
const ACCEPTED: &[(&str, &str)] = &[];

/// One request: method, path, body.
struct Step {
    case: &'static str,
    method: &'static str,
    path: String,
    body: Option<Value>,
    /// The fields of the answer compared besides the status code (JSON pointers).
    fields: &'static [&'static str],
    /// A controller's effect: the request is repeated (10 s at most) until this field
    /// of the answer is set, then compared.
    wait_for: Option<&'static str>,
}

fn step(
    case: &'static str,
    method: &'static str,
    path: impl Into<String>,
    body: Option<Value>,
) -> Step {
    Step {
        case,
        method,
        path: path.into(),
        body,
        fields: &[],
        wait_for: None,
    }
}

/// (status, body).
async fn send(
    client: &kube::Client,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value) {
    let content = if method == "PATCH" {
        "application/json-patch+json"
    } else {
        "application/json"
    };
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", content)
        .header("accept", "application/json")
        .body(kube::client::Body::from(
            body.map(|b| b.to_string().into_bytes()).unwrap_or_default(),
        ))
        .unwrap();
    let Ok(resp) = tokio::time::timeout(Duration::from_secs(10), client.send(req)).await else {
        eprintln!("no answer within 10 s: {method} {path}");
        return (0, Value::Null);
    };
    let resp = resp.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    if path.contains("watch=true") {
        // A watch stream: one event per line, as (type, name).
        let events: Vec<Value> = String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|e| json!([e["type"], e["object"]["metadata"]["name"]]))
            .collect();
        return (status, json!({"events": events}));
    }
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A value's shape for comparing: numbers and strings as they are, except opaque ones.
fn field(v: &Value, pointer: &str) -> Value {
    let f = v.pointer(pointer).cloned().unwrap_or(Value::Null);
    match (pointer, &f) {
        // An opaque token: only whether there is one.
        (p, Value::String(s)) if p.ends_with("/continue") => json!(!s.is_empty()),
        (p, Value::Array(a)) if p.ends_with("/items") => json!(a.len()),
        _ => f,
    }
}

/// Each server's setup, then the steps. The pods are Running and Ready as a kubelet
/// reports them (on the real one, run by the test's kubelet on a real scheduler's
/// binding; on the test server, created so).
fn script() -> Vec<Step> {
    let ns = "/api/v1/namespaces/diff";
    let mut s = Vec::new();
    // The disruption controller's status of each budget, as eviction reads it.
    let budgets = "/apis/policy/v1/namespaces/diff/poddisruptionbudgets";
    for (case, name) in [
        ("budget status: minAvailable over a bare pod", "guarded"),
        ("budget status: maxUnavailable over a Job's pod", "job"),
    ] {
        s.push(Step {
            fields: &[
                "/status/disruptionsAllowed",
                "/status/currentHealthy",
                "/status/desiredHealthy",
                "/status/expectedPods",
                "/status/conditions/0/type",
                "/status/conditions/0/status",
                "/status/conditions/0/reason",
            ],
            ..step(case, "GET", format!("{budgets}/{name}"), None)
        });
    }
    // Paging (limit and continue, remainingItemCount) and label selectors.
    for i in 0..5 {
        let app = if i < 3 { "a" } else { "b" };
        s.push(step("configmap create", "POST", format!("{ns}/configmaps"),
            Some(json!({"metadata": {"name": format!("cm-{i}"), "labels": {"app": app}}, "data": {"k": "v"}}))));
    }
    s.push(Step {
        fields: &[
            "/items",
            "/metadata/continue",
            "/metadata/remainingItemCount",
        ],
        ..step(
            "list page 1 of 3",
            "GET",
            format!("{ns}/configmaps?limit=2"),
            None,
        )
    });
    s.push(Step {
        fields: &["/items"],
        ..step(
            "label selector in",
            "GET",
            format!("{ns}/configmaps?labelSelector=app%20in%20(a)"),
            None,
        )
    });
    s.push(Step {
        fields: &["/items"],
        ..step(
            "label selector !=",
            "GET",
            format!("{ns}/configmaps?labelSelector=app!%3Da"),
            None,
        )
    });
    s.push(step(
        "label selector malformed",
        "GET",
        format!("{ns}/configmaps?labelSelector=app%20in%20("),
        None,
    ));
    // Field selectors.
    s.push(Step {
        fields: &["/items"],
        ..step(
            "pods by spec.nodeName",
            "GET",
            format!("{ns}/pods?fieldSelector=spec.nodeName%3Dn1"),
            None,
        )
    });
    s.push(step(
        "pods by an unsupported field",
        "GET",
        format!("{ns}/pods?fieldSelector=spec.foo%3D1"),
        None,
    ));
    s.push(Step {
        fields: &["/items"],
        ..step(
            "nodes by metadata.name",
            "GET",
            "/api/v1/nodes?fieldSelector=metadata.name%3Dn1",
            None,
        )
    });
    // Lease compare-and-swap.
    let lease = "/apis/coordination.k8s.io/v1/namespaces/diff/leases";
    s.push(step("lease create", "POST", lease,
        Some(json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "r1", "leaseDurationSeconds": 15}}))));
    s.push(step(
        "lease create again",
        "POST",
        lease,
        Some(json!({"metadata": {"name": "l"}})),
    ));
    s.push(step("lease update on a stale resourceVersion", "PUT", format!("{lease}/l"),
        Some(json!({"metadata": {"name": "l", "resourceVersion": "1"}, "spec": {"holderIdentity": "r2"}}))));
    s.push(step(
        "json patch whose test fails",
        "PATCH",
        format!("{lease}/l"),
        Some(
            json!([{"op": "test", "path": "/spec/holderIdentity", "value": "r9"},
                    {"op": "replace", "path": "/spec/holderIdentity", "value": "r2"}]),
        ),
    ));
    // Evictions.
    let evict = |pod: &str| {
        (
            format!("{ns}/pods/{pod}/eviction"),
            Some(
                json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": "diff"}}),
            ),
        )
    };
    let (p, b) = evict("guarded");
    s.push(step("eviction a minAvailable budget forbids", "POST", p, b));
    let (p, mut b) = evict("free");
    b.as_mut().unwrap()["deleteOptions"] =
        json!({"preconditions": {"uid": "00000000-0000-0000-0000-000000000000"}});
    s.push(step(
        "eviction whose uid precondition names another pod",
        "POST",
        p,
        b,
    ));
    let (p, b) = evict("free");
    s.push(step("eviction of a pod no budget covers", "POST", p, b));
    let (p, b) = evict("missing");
    s.push(step("eviction of a missing pod", "POST", p, b));
    let (p, b) = evict("job-pod");
    s.push(step(
        "eviction of a Job's pod under maxUnavailable",
        "POST",
        p,
        b,
    ));
    s.extend(device_taints_and_a_watch());
    s
}

/// The script's end: DeviceTaintRule validation and the device-taint eviction
/// controller's answers; a watch from a list's resourceVersion.
fn device_taints_and_a_watch() -> Vec<Step> {
    let ns = "/api/v1/namespaces/diff";
    let mut s = Vec::new();
    // DeviceTaintRule validation (1.37: v1).
    let rules = "/apis/resource.k8s.io/v1/devicetaintrules";
    let rule = |name: &str, key: &str, effect: &str| {
        Some(json!({"metadata": {"name": name},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
                 "taint": {"key": key, "value": "xid-79", "effect": effect}}}))
    };
    s.push(Step {
        fields: &["/spec/taint/effect", "/metadata/generation"],
        ..step(
            "device taint rule at None",
            "POST",
            rules,
            rule("r-none", "faultline.io/unhealthy", "None"),
        )
    });
    s.push(step(
        "device taint rule, unknown effect",
        "POST",
        rules,
        rule("r-bad", "faultline.io/unhealthy", "Sometimes"),
    ));
    s.push(step(
        "device taint rule, bad key",
        "POST",
        rules,
        rule("r-key", "not a key!", "NoSchedule"),
    ));
    s.push(step(
        "device taint rule at NoSchedule",
        "POST",
        rules,
        rule("r-noschedule", "faultline.io/unhealthy", "NoSchedule"),
    ));
    // The device-taint eviction controller's answer to each rule: what NoExecute would
    // evict (None), or why it evicts nothing (NoSchedule).
    for (case, name) in [
        (
            "device taint controller: a None rule's prediction",
            "r-none",
        ),
        ("device taint controller: a NoSchedule rule", "r-noschedule"),
    ] {
        s.push(Step {
            fields: &[
                "/status/conditions/0/type",
                "/status/conditions/0/status",
                "/status/conditions/0/reason",
                "/status/conditions/0/message",
                "/status/conditions/0/observedGeneration",
            ],
            wait_for: Some("/status/conditions/0/type"),
            ..step(case, "GET", format!("{rules}/{name}"), None)
        });
    }
    // A watch from a list's resourceVersion ({rv}: the last list's) sees what changed
    // after it, in order, and ends at its timeout.
    s.push(Step {
        fields: &["/items"],
        ..step(
            "list before a watch",
            "GET",
            format!("{ns}/configmaps?labelSelector=app%3Da"),
            None,
        )
    });
    s.push(step(
        "configmap create after the list",
        "POST",
        format!("{ns}/configmaps"),
        Some(json!({"metadata": {"name": "cm-w", "labels": {"app": "a"}}, "data": {"k": "v"}})),
    ));
    s.push(step(
        "configmap delete after the list",
        "DELETE",
        format!("{ns}/configmaps/cm-0"),
        None,
    ));
    s.push(step(
        "configmap of another label after the list",
        "POST",
        format!("{ns}/configmaps"),
        Some(json!({"metadata": {"name": "cm-x", "labels": {"app": "b"}}, "data": {"k": "v"}})),
    ));
    s.push(Step {
        fields: &["/events"],
        ..step(
            "watch from the list's resourceVersion",
            "GET",
            format!("{ns}/configmaps?watch=true&labelSelector=app%3Da&resourceVersion={{rv}}&timeoutSeconds=1"),
            None,
        )
    });
    s
}

/// What both servers hold before the script: namespace diff, node n1, pods `guarded`
/// (under a minAvailable 1 budget), `free`, `job-pod` (a Job's, under a maxUnavailable
/// 1 budget), Running and Ready.
fn seed() -> Vec<(&'static str, Value)> {
    let pod = |name: &str, labels: Value, owner: Option<Value>| {
        json!({"metadata": {"name": name, "labels": labels,
            "ownerReferences": owner.map(|o| vec![o]).unwrap_or_default()},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}})
    };
    vec![
        ("/api/v1/namespaces", json!({"metadata": {"name": "diff"}})),
        (
            "/api/v1/namespaces/diff/pods",
            pod("guarded", json!({"app": "guarded"}), None),
        ),
        (
            "/api/v1/namespaces/diff/pods",
            pod("free", json!({"app": "free"}), None),
        ),
        (
            "/apis/policy/v1/namespaces/diff/poddisruptionbudgets",
            json!({"metadata": {"name": "guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}),
        ),
        (
            "/apis/policy/v1/namespaces/diff/poddisruptionbudgets",
            json!({"metadata": {"name": "job"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "job"}}}}),
        ),
    ]
}

/// A Job and its one pod (the Job controller's on the real server, made by hand on the
/// test server, which runs no Job controller).
fn job() -> Value {
    json!({"metadata": {"name": "train"}, "spec": {"template": {"metadata": {"labels": {"app": "job"}},
        "spec": {"restartPolicy": "Never", "nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}}}})
}

async fn ready(client: &kube::Client, pod: &str, within: Duration) {
    let start = Instant::now();
    loop {
        let (_, p) = send(
            client,
            "GET",
            &format!("/api/v1/namespaces/diff/pods/{pod}"),
            None,
        )
        .await;
        if p.pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
        {
            return;
        }
        assert!(start.elapsed() < within, "{pod} not ready: {p}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Until every budget's status is of its generation (the disruption controller ran).
async fn budgets_observed(client: &kube::Client, within: Duration) {
    let start = Instant::now();
    loop {
        let (_, l) = send(
            client,
            "GET",
            "/apis/policy/v1/namespaces/diff/poddisruptionbudgets",
            None,
        )
        .await;
        let items = l["items"].as_array().cloned().unwrap_or_default();
        if items.len() == 2
            && items.iter().all(|b| {
                b.pointer("/status/observedGeneration") == b.pointer("/metadata/generation")
                    || b.pointer("/status/conditions/0/reason") == Some(&json!("SyncFailed"))
            })
        {
            return;
        }
        assert!(start.elapsed() < within, "budgets not observed: {l}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn the_test_server_answers_as_kube_apiserver_does() {
    let test = "the_test_server_answers_as_kube_apiserver_does";
    if !faultline_controlplane::network_namespace(test) {
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(differential(test));
}

async fn differential(test: &str) {
    let Some(cp) = ControlPlane::start(test, Options::new(Release::V1_37)).await else {
        return;
    };
    // The real one: a node and its kubelet, the seed, the Job (its controller makes the
    // pod), every pod ready, every budget observed.
    eprintln!(
        "{test}: control plane up in {:.1} s",
        cp.started_in.as_secs_f64()
    );
    let real = cp.admin().await;
    let _kubelet = Kubelet::start(
        real.clone(),
        vec![FakeNode::gpu("n1", 0)],
        Delays::default(),
        None,
    )
    .await
    .unwrap();
    for (path, obj) in seed() {
        let (code, body) = send(&real, "POST", path, Some(&obj)).await;
        assert_eq!(code, 201, "{path}: {body}");
    }
    let (code, body) = send(
        &real,
        "POST",
        "/apis/batch/v1/namespaces/diff/jobs",
        Some(&job()),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    let start = Instant::now();
    let job_pod = loop {
        let (_, l) = send(
            &real,
            "GET",
            "/api/v1/namespaces/diff/pods?labelSelector=app%3Djob",
            None,
        )
        .await;
        if let Some(name) = l.pointer("/items/0/metadata/name").and_then(Value::as_str) {
            break name.to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the Job made no pod"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("{test}: the Job's pod is {job_pod}");
    for p in ["guarded", "free", job_pod.as_str()] {
        ready(&real, p, Duration::from_secs(30)).await;
    }
    budgets_observed(&real, Duration::from_secs(30)).await;
    eprintln!("{test}: the real cluster is seeded");

    // The test server, seeded alike: the Job's pod made by hand, named as the script
    // names it, owned by the Job.
    let (_server, url) = Bootstrap::new()
        .release(faultline_test_apiserver::Release::parse("1.37").unwrap())
        .spawn()
        .await;
    let mut kc = kube::Config::new(url.parse().unwrap());
    kc.default_retry = false;
    let ours = kube::Client::try_from(kc).unwrap();
    let (_, node) = send(&real, "GET", "/api/v1/nodes/n1", None).await;
    let node = json!({"metadata": {"name": "n1", "labels": node["metadata"]["labels"]}, "status": node["status"]});
    assert_eq!(
        send(&ours, "POST", "/api/v1/nodes", Some(&node)).await.0,
        201
    );
    for (path, obj) in seed() {
        let (code, body) = send(&ours, "POST", path, Some(&obj)).await;
        assert_eq!(code, 201, "{path}: {body}");
    }
    let (_, j) = send(
        &ours,
        "POST",
        "/apis/batch/v1/namespaces/diff/jobs",
        Some(&job()),
    )
    .await;
    let owner = json!({"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": j["metadata"]["uid"],
        "controller": true, "blockOwnerDeletion": true});
    let pod = json!({"metadata": {"name": "job-pod", "labels": {"app": "job"}, "ownerReferences": [owner]},
        "spec": {"nodeName": "n1", "restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}});
    assert_eq!(
        send(&ours, "POST", "/api/v1/namespaces/diff/pods", Some(&pod))
            .await
            .0,
        201
    );
    for p in ["guarded", "free", "job-pod"] {
        let status = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        let req_path = format!("/api/v1/namespaces/diff/pods/{p}/status");
        let req = hyper::Request::builder()
            .method("PATCH")
            .uri(&req_path)
            .header("content-type", "application/merge-patch+json")
            .body(kube::client::Body::from(status.to_string().into_bytes()))
            .unwrap();
        assert!(ours.send(req).await.unwrap().status().is_success(), "{p}");
    }
    // The root-ca-cert-publisher controller's ConfigMap, in every namespace.
    let ca = json!({"metadata": {"name": "kube-root-ca.crt"}, "data": {"ca.crt": "test"}});
    assert_eq!(
        send(
            &ours,
            "POST",
            "/api/v1/namespaces/diff/configmaps",
            Some(&ca)
        )
        .await
        .0,
        201
    );
    budgets_observed(&ours, Duration::from_secs(10)).await;
    eprintln!("{test}: the test server is seeded");

    // The real Job's pod has another name: the script names `job-pod`; the real one
    // is asked under its own name, then recorded under the script's.
    let theirs = run_script(&real, &job_pod).await;
    let mine = run_script(&ours, "job-pod").await;
    let mut diverged = Vec::new();
    for ((case, a_code, a_fields), (_, b_code, b_fields)) in theirs.iter().zip(&mine) {
        eprintln!("  {case}: kube-apiserver {a_code} {a_fields:?}");
        if a_code != b_code || a_fields != b_fields {
            diverged.push(format!(
                "{case}: kube-apiserver {a_code} {a_fields:?}, test server {b_code} {b_fields:?}"
            ));
        }
    }
    eprintln!(
        "{test}: {} steps compared, {} diverged",
        theirs.len(),
        diverged.len()
    );
    for d in &diverged {
        eprintln!("  {d}");
    }
    let unexpected: Vec<&String> = diverged
        .iter()
        .filter(|d| {
            !ACCEPTED
                .iter()
                .any(|(c, _)| d.starts_with(&format!("{c}:")))
        })
        .collect();
    assert!(
        unexpected.is_empty(),
        "the test server diverges from kube-apiserver: {unexpected:#?}"
    );
    for (c, _) in ACCEPTED {
        assert!(
            diverged.iter().any(|d| d.starts_with(&format!("{c}:"))),
            "accepted divergence {c:?} no longer diverges: take it off the list"
        );
    }
}

/// The script's answers from `client`, the Job's pod under the name `job_pod`.
async fn run_script(client: &kube::Client, job_pod: &str) -> Vec<(String, u16, Vec<Value>)> {
    let mut out = Vec::new();
    // The resourceVersion of the last list answered (`{rv}` in a path).
    let mut rv = String::new();
    for s in script() {
        let path = s
            .path
            .replace("/pods/job-pod/", &format!("/pods/{job_pod}/"));
        let body = s.body.as_ref().map(|b| {
            let mut b = b.clone();
            if b["metadata"]["name"] == "job-pod" {
                b["metadata"]["name"] = json!(job_pod);
            }
            b
        });
        let path = path.replace("{rv}", &rv);
        let start = Instant::now();
        let (status, answer) = loop {
            let (status, answer) = send(client, s.method, &path, body.as_ref()).await;
            let waiting = s.wait_for.is_some_and(|f| answer.pointer(f).is_none());
            if !waiting || start.elapsed() > Duration::from_secs(10) {
                break (status, answer);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        if let Some(v) = answer
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
        {
            if answer["items"].is_array() {
                rv = v.to_string();
            }
        }
        let fields = s.fields.iter().map(|f| field(&answer, f)).collect();
        out.push((s.case.to_string(), status, fields));
    }
    out
}
