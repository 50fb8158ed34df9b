//! What the server costs (`costs.rs`): bytes sent per verb and resource as they cross
//! the wire, watch events line by line, bytes written; the kubelets' ConfigMap and
//! Secret watches and the fan-out of each write (`kubelet.rs`, after
//! pkg/kubelet/util/manager/watch_based_manager.go); Secrets as the API stores them;
//! and a realistic GPU Node (`fixtures.rs`) through the create path.

mod common;

use std::time::Duration;

use common::{client, http};
use faultline_test_apiserver::{fixtures, spawn, ApiServer, Costs, Tally};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

fn stored_len(s: &ApiServer, plural: &str, ns: &str, name: &str) -> u64 {
    serde_json::to_vec(&s.get(plural, ns, name).unwrap())
        .unwrap()
        .len() as u64
}

/// Every response's body bytes, counted by verb and resource as requestinfo.go names
/// them (staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go), equal to
/// the bytes the client read; the stored object's size on each write.
#[tokio::test]
async fn bytes_sent_and_written_per_verb_and_resource() {
    let (s, url) = spawn().await;
    s.reset_costs();
    let base = "/api/v1/namespaces/default/configmaps";
    let json_body = "application/json";
    let created = http(
        &url,
        "POST",
        base,
        Some((json_body, r#"{"metadata":{"name":"c"},"data":{"k":"v"}}"#)),
    )
    .await;
    assert_eq!(created.status, 201);
    let got = http(&url, "GET", &format!("{base}/c"), None).await;
    let listed = http(&url, "GET", base, None).await;
    let patched = http(
        &url,
        "PATCH",
        &format!("{base}/c"),
        Some((
            "application/merge-patch+json",
            r#"{"data":{"k":"longer value"}}"#,
        )),
    )
    .await;
    assert_eq!(patched.status, 200);
    let after_patch = stored_len(&s, "configmaps", "default", "c");
    let mut put = patched.json();
    put["data"]["k"] = json!("put");
    let updated = http(
        &url,
        "PUT",
        &format!("{base}/c"),
        Some((json_body, &put.to_string())),
    )
    .await;
    assert_eq!(updated.status, 200);
    let after_put = stored_len(&s, "configmaps", "default", "c");
    let missing = http(&url, "GET", &format!("{base}/nope"), None).await;
    assert_eq!(missing.status, 404);
    let deleted = http(&url, "DELETE", &format!("{base}/c"), None).await;
    let discovery = http(&url, "GET", "/api/v1", None).await;
    let c = s.costs();
    let len = |a: &common::Answer| a.body.len() as u64;
    assert_eq!(
        c.tally("create", "configmaps"),
        Tally {
            requests: 1,
            response_bytes: len(&created),
            written_objects: 1,
            written_bytes: len(&created),
            ..Default::default()
        },
        "the created object is what was stored and what came back"
    );
    assert_eq!(
        c.tally("get", "configmaps"),
        Tally {
            requests: 2,
            errors: 1,
            response_bytes: len(&got) + len(&missing),
            ..Default::default()
        }
    );
    assert_eq!(c.tally("list", "configmaps").response_bytes, len(&listed));
    let patch = c.tally("patch", "configmaps");
    assert_eq!(
        (patch.requests, patch.response_bytes, patch.written_bytes),
        (1, len(&patched), after_patch)
    );
    assert_eq!(c.tally("update", "configmaps").written_bytes, after_put);
    let delete = c.tally("delete", "configmaps");
    assert_eq!(
        (
            delete.requests,
            delete.response_bytes,
            delete.written_objects
        ),
        (1, len(&deleted), 0),
        "etcd keeps nothing of a deletion"
    );
    assert_eq!(c.tally("get", "").response_bytes, len(&discovery));
    let sent: u64 = [
        &created, &got, &listed, &patched, &updated, &missing, &deleted, &discovery,
    ]
    .iter()
    .map(|a| len(a))
    .sum();
    assert_eq!(c.total.response_bytes, sent);
    assert_eq!(c.total.requests, 8);
}

/// A watch counts once as a request and then each event as the JSON line it is
/// (cache_watcher.go sends one encoded event per line), the bookmark included.
#[tokio::test]
async fn watch_events_are_counted_line_by_line() {
    let (s, url) = spawn().await;
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "before"}}),
    )
    .unwrap();
    s.reset_costs();
    let writer = s.clone();
    tokio::spawn(async move {
        // Once the watch has arrived, so these are events of the watch.
        while !writer
            .received()
            .iter()
            .any(|r| r.uri.contains("watch=true"))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for n in ["a", "b"] {
            writer
                .create(
                    "configmaps",
                    "default",
                    json!({"metadata": {"name": n}, "data": {"x": "1"}}),
                )
                .unwrap();
        }
    });
    let w = http(
        &url,
        "GET",
        "/api/v1/namespaces/default/configmaps?watch=true&timeoutSeconds=1&allowWatchBookmarks=true",
        None,
    )
    .await;
    let lines = w.lines();
    let types: Vec<String> = lines
        .iter()
        .map(|l| {
            serde_json::from_slice::<Value>(l).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(types, ["ADDED", "ADDED", "ADDED", "BOOKMARK"]);
    let t = s.costs().tally("watch", "configmaps");
    assert_eq!(t.requests, 1);
    assert_eq!(t.watch_events, 4);
    assert_eq!(
        t.watch_event_bytes,
        w.body.len() as u64,
        "each line and its newline"
    );
    assert_eq!(t.response_bytes, w.body.len() as u64);
}

/// The counters over HTTP for out-of-process benchmarks: `GET /_test/costs` is the
/// library's snapshot as JSON (test controls are not counted), `DELETE` resets.
#[tokio::test]
async fn costs_are_served_over_http_and_reset() {
    let (s, url) = spawn().await;
    let nodes: Api<Node> = Api::all(client(&url));
    nodes.list(&ListParams::default()).await.unwrap();
    let served: Costs =
        serde_json::from_slice(&http(&url, "GET", "/_test/costs", None).await.body).unwrap();
    assert_eq!(served, s.costs());
    assert_eq!(served.tally("list", "nodes").requests, 1);
    assert!(
        served.tally("create", "namespaces").written_bytes > 0,
        "the default namespaces"
    );
    let reset: Costs =
        serde_json::from_slice(&http(&url, "DELETE", "/_test/costs", None).await.body).unwrap();
    assert_eq!(reset.tally("list", "nodes").requests, 1);
    assert_eq!(s.costs().total, Tally::default());
    let raw = http(&url, "GET", "/_test/costs", None).await.json();
    for field in [
        "by_verb",
        "total",
        "kubelet_fanout_bytes",
        "kubelet_fanout_events",
        "kubelet_fanout_writes",
        "kubelet_open_watches",
        "kubelet_last_fanout",
    ] {
        assert!(raw.get(field).is_some(), "{field}: {raw}");
    }
}

fn pod(name: &str, node: &str, spec: Value) -> Value {
    let mut p = json!({"metadata": {"name": name}, "spec": spec, "status": {"phase": "Running"}});
    if !node.is_empty() {
        p["spec"]["nodeName"] = json!(node);
    }
    if p["spec"].get("containers").is_none() {
        p["spec"]["containers"] = json!([{"name": "c", "image": "x"}]);
    }
    p
}

fn volume_cm(name: &str) -> Value {
    json!({"volumes": [{"name": "v", "configMap": {"name": name}}]})
}

/// pkg/kubelet/util/manager/watch_based_manager.go: one watch per node and referenced
/// ConfigMap, whatever the number of pods (and ways) that use it; unbound and
/// terminated pods are not registered; a write is sent once to each watching node.
#[tokio::test]
async fn a_configmap_write_fans_out_once_per_node_that_uses_it() {
    let (s, url) = spawn().await;
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "shared"}, "data": {"k": "v"}}),
    )
    .unwrap();
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "other"}, "data": {"k": "v"}}),
    )
    .unwrap();
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "unused"}}),
    )
    .unwrap();
    let env_from = json!({"containers": [{"name": "c", "image": "x", "envFrom": [{"configMapRef": {"name": "shared"}}]}]});
    let projected = json!({"volumes": [{"name": "p", "projected": {"sources": [{"configMap": {"name": "shared"}}]}}]});
    let env = json!({"containers": [{"name": "c", "image": "x", "env": [{"name": "K", "valueFrom": {"configMapKeyRef": {"name": "other", "key": "k"}}}]}]});
    for (name, node, spec) in [
        ("p1", "n1", volume_cm("shared")),
        ("p2", "n1", env_from),
        ("p3", "n2", projected),
        ("p4", "n3", env),
        ("unbound", "", volume_cm("shared")),
    ] {
        s.create("pods", "default", pod(name, node, spec)).unwrap();
    }
    let mut done = pod("done", "n4", volume_cm("shared"));
    done["status"]["phase"] = json!("Succeeded");
    s.create("pods", "default", done).unwrap();
    assert_eq!(
        s.costs().kubelet_open_watches,
        3,
        "n1 and n2 on shared, n3 on other"
    );
    s.reset_costs();

    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    cms.patch(
        "shared",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v2"}})),
    )
    .await
    .unwrap();
    let size = stored_len(&s, "configmaps", "default", "shared");
    let c = s.costs();
    let f = c.last_fanout("configmaps", "default", "shared").unwrap();
    assert_eq!(
        (f.event.as_str(), f.kubelets, f.object_bytes, f.bytes),
        ("MODIFIED", 2, size, 2 * size)
    );
    assert_eq!(
        (
            c.kubelet_fanout_bytes,
            c.kubelet_fanout_events,
            c.kubelet_fanout_writes
        ),
        (2 * size, 2, 1)
    );

    cms.patch(
        "other",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v2"}})),
    )
    .await
    .unwrap();
    cms.patch(
        "unused",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v2"}})),
    )
    .await
    .unwrap();
    let c = s.costs();
    assert_eq!(
        c.last_fanout("configmaps", "default", "other")
            .unwrap()
            .kubelets,
        1
    );
    assert_eq!(
        c.last_fanout("configmaps", "default", "unused")
            .unwrap()
            .kubelets,
        0
    );
    assert_eq!(
        c.kubelet_fanout_writes, 2,
        "a write no kubelet watches is not a fan-out"
    );

    // Pods leaving: n2's only user goes, n1 keeps the watch while p2 runs there.
    s.delete("pods", "default", "p3").unwrap();
    let mut p1 = s.get("pods", "default", "p1").unwrap();
    p1["status"]["phase"] = json!("Succeeded");
    s.update("pods", "default", "p1", p1, Some("status"))
        .unwrap();
    assert_eq!(s.costs().kubelet_open_watches, 2);
    cms.patch(
        "shared",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v3"}})),
    )
    .await
    .unwrap();
    assert_eq!(
        s.costs()
            .last_fanout("configmaps", "default", "shared")
            .unwrap()
            .kubelets,
        1
    );
    // Deleting the object reaches the same watch.
    cms.delete("shared", &Default::default()).await.unwrap();
    let f = s
        .costs()
        .last_fanout("configmaps", "default", "shared")
        .cloned()
        .unwrap();
    assert_eq!((f.event.as_str(), f.kubelets), ("DELETED", 1));
}

/// KEP-1412 and watch_based_manager.go `objectCache.Get`: an immutable ConfigMap or
/// Secret is read once and not watched; one made immutable sends that last write and
/// is watched no more; its data can no longer change
/// (pkg/apis/core/validation/validation.go `ValidateConfigMapUpdate`).
#[tokio::test]
async fn immutable_objects_are_read_once_and_never_change() {
    let (s, url) = spawn().await;
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "frozen"}, "immutable": true, "data": {"k": "v"}}),
    )
    .unwrap();
    s.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "thawed"}, "data": {"k": "v"}}),
    )
    .unwrap();
    for (name, node) in [("a", "n1"), ("b", "n2")] {
        let spec = json!({"volumes": [{"name": "f", "configMap": {"name": "frozen"}}, {"name": "t", "configMap": {"name": "thawed"}}]});
        s.create("pods", "default", pod(name, node, spec)).unwrap();
    }
    assert_eq!(s.costs().kubelet_open_watches, 2, "only thawed is watched");
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    cms.patch(
        "frozen",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"seen": "yes"}}})),
    )
    .await
    .unwrap();
    assert_eq!(
        s.costs()
            .last_fanout("configmaps", "default", "frozen")
            .unwrap()
            .kubelets,
        0
    );
    let refused = cms
        .patch(
            "frozen",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"k": "changed"}})),
        )
        .await
        .unwrap_err();
    match refused {
        kube::Error::Api(st) => {
            assert_eq!(st.code, 422);
            assert!(
                st.message
                    .contains("data: Forbidden: field is immutable when `immutable` is set"),
                "{}",
                st.message
            );
        }
        other => panic!("{other:?}"),
    }
    cms.patch(
        "thawed",
        &PatchParams::default(),
        &Patch::Merge(json!({"immutable": true})),
    )
    .await
    .unwrap();
    let c = s.costs();
    assert_eq!(
        c.last_fanout("configmaps", "default", "thawed")
            .unwrap()
            .kubelets,
        2,
        "the write that seals it is delivered"
    );
    assert_eq!(c.kubelet_open_watches, 0);
    cms.patch(
        "thawed",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .unwrap();
    assert_eq!(
        s.costs()
            .last_fanout("configmaps", "default", "thawed")
            .unwrap()
            .kubelets,
        0
    );
}

/// pkg/api/v1/pod/util.go `VisitPodSecretNames`: Secrets reach kubelets through env,
/// envFrom, volumes and imagePullSecrets; pkg/apis/core/v1/conversion.go: `stringData`
/// is stored as base64 `data`; an undecodable value is a 400.
#[tokio::test]
async fn secrets_are_stored_as_upstream_and_fan_out_to_their_users() {
    let (s, url) = spawn().await;
    let secrets: Api<Secret> = Api::namespaced(client(&url), "default");
    let created = http(
        &url,
        "POST",
        "/api/v1/namespaces/default/secrets",
        Some((
            "application/json",
            r#"{"metadata":{"name":"creds"},"stringData":{"token":"hunter2"}}"#,
        )),
    )
    .await
    .json();
    assert_eq!(created["data"], json!({"token": "aHVudGVyMg=="}));
    assert_eq!(created["type"], "Opaque");
    assert!(created.get("stringData").is_none());
    let typed = secrets.get("creds").await.unwrap();
    assert_eq!(typed.data.unwrap()["token"].0, b"hunter2");
    let bad = http(
        &url,
        "POST",
        "/api/v1/namespaces/default/secrets",
        Some((
            "application/json",
            r#"{"metadata":{"name":"bad"},"data":{"k":"not base64!"}}"#,
        )),
    )
    .await;
    assert_eq!(bad.status, 400);
    let opaque = secrets
        .list(&ListParams::default().fields("type=Opaque"))
        .await
        .unwrap();
    assert_eq!(opaque.items.len(), 1);

    let specs = [
        json!({"imagePullSecrets": [{"name": "creds"}]}),
        json!({"containers": [{"name": "c", "image": "x", "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}]}]}),
        json!({"volumes": [{"name": "s", "secret": {"secretName": "creds"}}]}),
    ];
    for (i, spec) in specs.into_iter().enumerate() {
        s.create(
            "pods",
            "default",
            pod(&format!("p{i}"), &format!("n{i}"), spec),
        )
        .unwrap();
    }
    secrets
        .patch(
            "creds",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"token": "rotated"}})),
        )
        .await
        .unwrap();
    let size = stored_len(&s, "secrets", "default", "creds");
    let f = s
        .costs()
        .last_fanout("secrets", "default", "creds")
        .cloned()
        .unwrap();
    assert_eq!((f.kubelets, f.bytes), (3, 3 * size));
    let retyped = secrets
        .patch(
            "creds",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"type": "kubernetes.io/basic-auth", "data": {"username": "YQ=="}}),
            ),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(retyped, kube::Error::Api(st) if st.code == 422 && st.message.contains("type: Invalid value: \"kubernetes.io/basic-auth\": field is immutable"))
    );
}

/// fixtures.rs: a GPU node of about 26 KB goes through the create path over HTTP
/// (validation included) and decodes as a typed Node; what is stored is what is
/// charged as written.
#[tokio::test]
async fn a_realistic_gpu_node_is_accepted_by_the_create_path() {
    let (s, url) = spawn().await;
    let node = fixtures::realistic_node("gpu-node-0001", "10.0.12.7");
    let body = serde_json::to_string(&node).unwrap();
    assert!(
        (15_000..=40_000).contains(&body.len()),
        "{} bytes",
        body.len()
    );
    s.reset_costs();
    let created = http(
        &url,
        "POST",
        "/api/v1/nodes",
        Some(("application/json", &body)),
    )
    .await;
    assert_eq!(
        created.status,
        201,
        "{}",
        String::from_utf8_lossy(&created.body)
    );
    let stored = stored_len(&s, "nodes", "", "gpu-node-0001");
    assert!(
        stored >= body.len() as u64,
        "stored with uid, timestamps and resourceVersion"
    );
    assert_eq!(s.costs().tally("create", "nodes").written_bytes, stored);
    let nodes: Api<Node> = Api::all(client(&url));
    let typed = nodes.get("gpu-node-0001").await.unwrap();
    let status = typed.status.unwrap();
    assert_eq!(status.capacity.unwrap()["nvidia.com/gpu"].0, "8");
    assert_eq!(status.images.unwrap().len(), 50);
    assert_eq!(status.addresses.unwrap()[0].address, "10.0.12.7");
    assert_eq!(typed.metadata.managed_fields.unwrap().len(), 6);
    let gpus = nodes
        .list(
            &ListParams::default()
                .labels("nvidia.com/gpu.present=true,nvidia.com/gpu.count in (8)"),
        )
        .await
        .unwrap();
    assert_eq!(gpus.items.len(), 1);
    // A second one, made with another name, is another node.
    nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(fixtures::realistic_node("gpu-node-0002", "10.0.12.8"))
                .unwrap(),
        )
        .await
        .unwrap();
}
