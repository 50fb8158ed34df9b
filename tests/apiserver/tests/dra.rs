//! `resource.k8s.io` as the test API server serves it at each release:
//! which versions discovery lists (`release.rs`, after kube_features.go's
//! `DRADeviceTaintRules`), objects read and written at the version asked, and the
//! validation and strategies of pkg/apis/resource/validation/validation.go and
//! pkg/registry/resource/*/strategy.go (`dra.rs`). Driven through the real `kube`
//! client.

mod common;

use faultline_test_apiserver::{fixtures, ApiServer, Bootstrap, Faults, Release};
use futures_util::StreamExt;
use kube::api::{
    Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::Client;
use serde_json::{json, Value};

async fn start(release: Release) -> (ApiServer, Client) {
    let (server, url) = Bootstrap::new().release(release).spawn().await;
    (server, common::client(&url))
}

fn rel(s: &str) -> Release {
    Release::parse(s).unwrap()
}

fn resource(version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "resource.k8s.io".into(),
        version: version.into(),
        api_version: format!("resource.k8s.io/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn rules(c: &Client, version: &str) -> Api<DynamicObject> {
    Api::all_with(
        c.clone(),
        &resource(version, "DeviceTaintRule", "devicetaintrules"),
    )
}

fn slices(c: &Client) -> Api<DynamicObject> {
    Api::all_with(
        c.clone(),
        &resource("v1", "ResourceSlice", "resourceslices"),
    )
}

fn object(v: Value) -> DynamicObject {
    serde_json::from_value(v).unwrap()
}

/// A rule quarantining `gpu-3` of node `n1` under NVIDIA's DRA driver.
fn rule(name: &str, effect: &str) -> DynamicObject {
    object(
        json!({"metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "faultline"}},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-3"},
                 "taint": {"key": "faultline.io/unhealthy", "value": "xid-79", "effect": effect}}}),
    )
}

/// A node's slice as NVIDIA's DRA driver publishes it: pool = node, `gpu-<minor>`, uuid.
fn slice(node: &str, gpus: usize, taints_per_device: usize) -> DynamicObject {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| {
            let taints: Vec<Value> = (0..taints_per_device)
                .map(|t| json!({"key": format!("gpu.nvidia.com/t{t}"), "effect": "NoSchedule"}))
                .collect();
            json!({"name": format!("gpu-{i}"),
                   "attributes": {"uuid": {"string": format!("GPU-{node}-{i}")}, "productName": {"string": "NVIDIA H200"}},
                   "capacity": {"memory": {"value": "141Gi"}}, "taints": taints})
        })
        .collect();
    object(
        json!({"metadata": {"name": format!("{node}-gpu.nvidia.com")},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}}),
    )
}

fn status_code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other:?}"),
    }
}

async fn versions_listed(c: &Client) -> Vec<String> {
    let groups = c.list_api_groups().await.unwrap();
    groups
        .groups
        .iter()
        .find(|g| g.name == "resource.k8s.io")
        .map(|g| g.versions.iter().map(|v| v.version.clone()).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn discovery_lists_what_each_release_serves() {
    // (release, resource.k8s.io versions, the one with DeviceTaintRule)
    let cases = [
        (rel("1.33"), vec![], None),
        (rel("1.34"), vec!["v1"], None),
        (rel("1.35"), vec!["v1"], None),
        (
            rel("1.35").with_device_taint_rules(true),
            vec!["v1", "v1alpha3"],
            Some("v1alpha3"),
        ),
        // 1.36: the gate is beta but off by default, on an off-by-default beta API.
        (rel("1.36"), vec!["v1"], None),
        (
            rel("1.36").with_device_taint_rules(true),
            vec!["v1", "v1beta2"],
            Some("v1beta2"),
        ),
        (rel("1.37"), vec!["v1"], Some("v1")),
        (rel("1.37").with_device_taint_rules(false), vec!["v1"], None),
    ];
    for (r, versions, rules_at) in cases {
        let (_s, c) = start(r).await;
        assert_eq!(versions_listed(&c).await, versions, "{r:?}");
        let info = c.apiserver_version().await.unwrap();
        assert_eq!(info.minor, r.minor.to_string());
        for v in &versions {
            let list = c
                .list_api_group_resources(&format!("resource.k8s.io/{v}"))
                .await
                .unwrap();
            let has = list.resources.iter().any(|x| x.name == "devicetaintrules");
            assert_eq!(has, rules_at == Some(*v), "{r:?} {v}");
        }
        // A version not served is not there, for reads and writes alike.
        for v in ["v1", "v1beta2", "v1alpha3"] {
            if rules_at != Some(v) {
                let e = rules(&c, v).list(&ListParams::default()).await.unwrap_err();
                assert_eq!(status_code(e), 404, "{r:?} {v}");
                let e = rules(&c, v)
                    .create(&PostParams::default(), &rule("r", "None"))
                    .await
                    .unwrap_err();
                assert_eq!(status_code(e), 404, "{r:?} {v}");
            }
        }
    }
}

#[tokio::test]
async fn a_rule_is_read_and_written_at_the_version_asked() {
    for (r, v) in [
        (rel("1.36").with_device_taint_rules(true), "v1beta2"),
        (rel("1.37"), "v1"),
    ] {
        let (server, c) = start(r).await;
        let api = rules(&c, v);
        let made = api
            .create(&PostParams::default(), &rule("gpu-3.n1", "None"))
            .await
            .unwrap();
        let at = format!("resource.k8s.io/{v}");
        assert_eq!(made.types.as_ref().unwrap().api_version, at);
        // The strategy's PrepareForCreate: generation 1, timeAdded set, no status.
        assert_eq!(made.metadata.generation, Some(1));
        assert!(made.data["spec"]["taint"]["timeAdded"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')));
        // Stored once, at the storage version; served at the version asked.
        assert_eq!(
            server.get("devicetaintrules", "", "gpu-3.n1").unwrap()["apiVersion"],
            "resource.k8s.io/v1"
        );
        let listed = api.list(&ListParams::default()).await.unwrap();
        assert_eq!(listed.items.len(), 1);
        let raw = c
            .request_text(
                axum::http::Request::get(format!("/apis/{at}/devicetaintrules"))
                    .body(vec![])
                    .unwrap(),
            )
            .await
            .unwrap();
        let raw: Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(raw["apiVersion"], at.as_str());
        assert_eq!(raw["items"][0]["apiVersion"], at.as_str());
        // A new effect is a new generation (PrepareForUpdate).
        let mut watch = api
            .watch(&WatchParams::default(), "0")
            .await
            .unwrap()
            .boxed();
        let p = json!({"spec": {"taint": {"effect": "NoSchedule"}}});
        let changed = api
            .patch("gpu-3.n1", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap();
        assert_eq!(changed.metadata.generation, Some(2));
        assert_eq!(changed.data["spec"]["taint"]["effect"], "NoSchedule");
        // A status write leaves the spec (the status subresource).
        let st = json!({"status": {"conditions": [{"type": "EvictionInProgress", "status": "False", "reason": "NoEffect",
            "message": "x", "lastTransitionTime": "2026-12-05T03:00:00Z", "observedGeneration": 2}]}});
        let after = api
            .patch_status("gpu-3.n1", &PatchParams::default(), &Patch::Merge(&st))
            .await
            .unwrap();
        assert_eq!(after.metadata.generation, Some(2));
        assert_eq!(after.data["status"]["conditions"][0]["reason"], "NoEffect");
        // Watch events carry the version asked too.
        let mut seen = 0;
        while let Some(Ok(e)) = watch.next().await {
            if let WatchEvent::Added(o) | WatchEvent::Modified(o) = e {
                assert_eq!(o.types.as_ref().unwrap().api_version, at);
                seen += 1;
                if o.metadata.generation == Some(2) {
                    break;
                }
            }
        }
        assert!(seen >= 2, "the creation and the change, at {at}");
    }
}

#[tokio::test]
async fn invalid_rules_are_refused_as_kube_apiserver_refuses_them() {
    let (_s, c) = start(rel("1.37")).await;
    let api = rules(&c, "v1");
    let bad = [
        // effect outside None|NoSchedule|NoExecute
        json!({"deviceSelector": {"driver": "gpu.nvidia.com"}, "taint": {"key": "a.io/b", "effect": "PreferNoSchedule"}}),
        json!({"deviceSelector": {"driver": "gpu.nvidia.com"}, "taint": {"key": "a.io/b"}}),
        // a key that is no label name, a value that is no label value
        json!({"deviceSelector": {"driver": "gpu.nvidia.com"}, "taint": {"key": "bad key", "effect": "None"}}),
        json!({"deviceSelector": {"driver": "gpu.nvidia.com"}, "taint": {"key": "a.io/b", "value": "x".repeat(64), "effect": "None"}}),
        // names: the driver a DNS subdomain of at most 63, the device a DNS label
        json!({"deviceSelector": {"driver": "GPU.nvidia.com"}, "taint": {"key": "a.io/b", "effect": "None"}}),
        json!({"deviceSelector": {"driver": format!("{}.io", "d".repeat(61))}, "taint": {"key": "a.io/b", "effect": "None"}}),
        json!({"deviceSelector": {"device": "gpu_3"}, "taint": {"key": "a.io/b", "effect": "None"}}),
        // the CEL and class selectors are gone since 1.35
        json!({"deviceSelector": {"deviceClassName": "gpu.nvidia.com"}, "taint": {"key": "a.io/b", "effect": "None"}}),
        json!({"deviceSelector": {"driver": "gpu.nvidia.com"}}),
    ];
    for (i, spec) in bad.into_iter().enumerate() {
        let o = object(json!({"metadata": {"name": format!("r{i}")}, "spec": spec}));
        let e = api.create(&PostParams::default(), &o).await.unwrap_err();
        assert_eq!(status_code(e), 422, "case {i}");
    }
    // Nine conditions: at most eight.
    api.create(&PostParams::default(), &rule("ok", "None"))
        .await
        .unwrap();
    let conds: Vec<Value> = (0..9)
        .map(|i| json!({"type": format!("T{i}"), "status": "True", "reason": "R", "message": "", "lastTransitionTime": "2026-12-05T03:00:00Z"}))
        .collect();
    let e = api
        .patch_status(
            "ok",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"conditions": conds}})),
        )
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 422);
    // None is no effect before 1.35.
    let (_s, c) = start(rel("1.34")).await;
    let e = slices(&c)
        .create(&PostParams::default(), &{
            let mut s = slice("n1", 1, 0);
            s.data["spec"]["devices"][0]["taints"] = json!([{"key": "a.io/b", "effect": "None"}]);
            s
        })
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 422);
}

#[tokio::test]
async fn slices_are_bounded_and_selected_by_node() {
    let (_s, c) = start(rel("1.34")).await;
    let api = slices(&c);
    // 128 devices at most; 4 taints per device in 1.34, 16 from 1.35.
    let e = api
        .create(&PostParams::default(), &slice("n0", 129, 0))
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 422);
    let e = api
        .create(&PostParams::default(), &slice("n0", 8, 5))
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 422);
    api.create(&PostParams::default(), &slice("n0", 8, 4))
        .await
        .unwrap();
    let (_s, c) = start(rel("1.36")).await;
    let api = slices(&c);
    api.create(&PostParams::default(), &slice("n0", 8, 5))
        .await
        .unwrap();
    api.create(&PostParams::default(), &slice("n1", 8, 0))
        .await
        .unwrap();
    // Exactly one node field; a pool generation and a slice count.
    let mut s = slice("n2", 1, 0);
    s.data["spec"]["allNodes"] = json!(true);
    assert_eq!(
        status_code(api.create(&PostParams::default(), &s).await.unwrap_err()),
        422
    );
    let mut s = slice("n2", 1, 0);
    s.data["spec"]["pool"]["resourceSliceCount"] = json!(0);
    assert_eq!(
        status_code(api.create(&PostParams::default(), &s).await.unwrap_err()),
        422
    );
    // Two devices of one name.
    let mut s = slice("n2", 2, 0);
    s.data["spec"]["devices"][1]["name"] = json!("gpu-0");
    assert_eq!(
        status_code(api.create(&PostParams::default(), &s).await.unwrap_err()),
        422
    );
    // The selectable fields: spec.nodeName and spec.driver.
    let on_n1 = api
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(on_n1.items.len(), 1);
    assert_eq!(on_n1.items[0].data["spec"]["nodeName"], "n1");
    let nvidia = api
        .list(&ListParams::default().fields("spec.driver=gpu.nvidia.com"))
        .await
        .unwrap();
    assert_eq!(nvidia.items.len(), 2);
    let e = api
        .list(&ListParams::default().fields("spec.pool.name=n1"))
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 400);
}

/// Seed node `n1`: its 8-GPU slice, and pods p3, p4, p5 holding gpu-3, gpu-4 and gpu-3
/// again (p5's claim tolerates every taint's NoExecute for good: the eviction
/// controller honours no other), as the scheduler and the kubelet leave them.
fn seed_node(server: &ApiServer) {
    let mut slice = fixtures::nvidia_slice("n1", 8);
    slice["metadata"]["name"] = json!("n1-gpu.nvidia.com");
    server.create("resourceslices", "", slice).unwrap();
    for (pod, device, tolerations) in [
        ("p3", "gpu-3", json!([])),
        ("p4", "gpu-4", json!([])),
        (
            "p5",
            "gpu-3",
            json!([{"operator": "Exists", "effect": "NoExecute"}]),
        ),
    ] {
        let p = server
            .create("pods", "train", fixtures::dra_pod(pod, "n1"))
            .unwrap();
        server
            .create(
                "resourceclaims",
                "train",
                fixtures::claim_for(&p, device, tolerations),
            )
            .unwrap();
    }
}

/// The rule's EvictionInProgress condition once the controller wrote it for its
/// generation (polled: the controller is another client).
async fn condition(server: &ApiServer, name: &str) -> Value {
    for _ in 0..500 {
        if let Some(r) = server.get("devicetaintrules", "", name) {
            let c = &r["status"]["conditions"][0];
            if c["observedGeneration"] == r["metadata"]["generation"] {
                return c.clone();
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("no condition on {name} for its generation");
}

#[tokio::test]
async fn a_none_rule_reports_what_no_execute_would_evict() {
    let (server, c) = start(rel("1.37")).await;
    server
        .create("namespaces", "", json!({"metadata": {"name": "train"}}))
        .unwrap();
    seed_node(&server);
    rules(&c, "v1")
        .create(&PostParams::default(), &rule("r", "None"))
        .await
        .unwrap();
    let cond = condition(&server, "r").await;
    assert_eq!(cond["reason"], "NoEffect");
    assert_eq!(cond["status"], "False");
    // gpu-3 is published once and allocated twice; p5 tolerates the taint.
    assert_eq!(
        cond["message"],
        "1 published device selected. 2 allocated devices selected. 1 pod would be evicted in 1 namespace if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update."
    );
    // Nothing was evicted, and the simulation is not repeated for the same generation.
    for p in ["p3", "p4", "p5"] {
        assert!(server.get("pods", "train", p).unwrap()["metadata"]["deletionTimestamp"].is_null());
    }
    let before =
        server.get("devicetaintrules", "", "r").unwrap()["metadata"]["resourceVersion"].clone();
    server
        .create("namespaces", "", json!({"metadata": {"name": "other"}}))
        .unwrap();
    condition(&server, "r").await;
    assert_eq!(
        server.get("devicetaintrules", "", "r").unwrap()["metadata"]["resourceVersion"],
        before
    );
}

#[tokio::test]
async fn no_execute_deletes_the_holders_without_asking_their_budget() {
    let (server, c) = start(rel("1.37")).await;
    // Containers that take a minute to stop: the deleted pod stays Terminating, to be
    // looked at (the simulated kubelet would otherwise remove it within a tick).
    server.set_faults(Faults {
        pod_stop_ms: 60_000,
        ..Faults::default()
    });
    server
        .create("namespaces", "", json!({"metadata": {"name": "train"}}))
        .unwrap();
    seed_node(&server);
    // A budget that allows no disruption: an eviction would be refused (429).
    server
        .create(
            "poddisruptionbudgets",
            "train",
            json!({"metadata": {"name": "all"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "train"}}}}),
        )
        .unwrap();
    rules(&c, "v1")
        .create(&PostParams::default(), &rule("r", "NoExecute"))
        .await
        .unwrap();
    let cond = condition(&server, "r").await;
    assert_eq!(cond["reason"], "Completed");
    let p3 = server.get("pods", "train", "p3").unwrap();
    assert!(
        p3["metadata"]["deletionTimestamp"].is_string(),
        "p3 is deleted: {p3}"
    );
    let target = p3["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "DisruptionTarget")
        .cloned();
    assert_eq!(target.unwrap()["reason"], "DeletionByDeviceTaintManager");
    // The other GPU's pod, and the pod that tolerates the taint, stay.
    for p in ["p4", "p5"] {
        assert!(
            server.get("pods", "train", p).unwrap()["metadata"]["deletionTimestamp"].is_null(),
            "{p}"
        );
    }
    // No Eviction was asked: the budget never saw one.
    assert!(server.calls().iter().all(|c| !c.uri.contains("/eviction")));
}

#[tokio::test]
async fn the_scheduler_does_not_allocate_a_tainted_device() {
    let (server, c) = start(rel("1.37")).await;
    server
        .create("namespaces", "", json!({"metadata": {"name": "train"}}))
        .unwrap();
    seed_node(&server);
    assert_eq!(server.allocatable_devices("n1"), 8);
    let api = rules(&c, "v1");
    // None reports only; NoSchedule takes the device out.
    api.create(&PostParams::default(), &rule("r", "None"))
        .await
        .unwrap();
    assert_eq!(server.allocatable_devices("n1"), 8);
    let p = json!({"spec": {"taint": {"effect": "NoSchedule"}}});
    api.patch("r", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    assert_eq!(server.allocatable_devices("n1"), 7);
    // A rule on another node's pool, or one without a selector, takes nothing here.
    let mut elsewhere = rule("r2", "NoSchedule");
    elsewhere.data["spec"]["deviceSelector"]["pool"] = json!("n2");
    api.create(&PostParams::default(), &elsewhere)
        .await
        .unwrap();
    let mut nothing = rule("r3", "NoSchedule");
    nothing.data["spec"]
        .as_object_mut()
        .unwrap()
        .remove("deviceSelector");
    api.create(&PostParams::default(), &nothing).await.unwrap();
    assert_eq!(server.allocatable_devices("n1"), 7);
    // The driver's own taint on its slice counts too.
    let mut s = server
        .get("resourceslices", "", "n1-gpu.nvidia.com")
        .unwrap();
    s["spec"]["devices"][5]["taints"] =
        json!([{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]);
    server
        .update("resourceslices", "", "n1-gpu.nvidia.com", s, None)
        .unwrap();
    assert_eq!(server.allocatable_devices("n1"), 6);
    // Deleting the rule gives the device back.
    api.delete("r", &Default::default()).await.unwrap();
    assert_eq!(server.allocatable_devices("n1"), 7);
}

#[tokio::test]
async fn a_delete_keeps_its_preconditions() {
    let (server, c) = start(rel("1.37")).await;
    let api = rules(&c, "v1");
    let made = api
        .create(&PostParams::default(), &rule("r", "None"))
        .await
        .unwrap();
    let with = |uid: Option<String>, rv: Option<String>| kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid,
            resource_version: rv,
        }),
        ..Default::default()
    };
    // staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go: a uid or
    // resourceVersion that is not the object's is a 409, and the object stays.
    let e = api
        .delete("r", &with(Some("not-the-uid".into()), None))
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 409);
    let e = api
        .delete("r", &with(None, Some("1".into())))
        .await
        .unwrap_err();
    assert_eq!(status_code(e), 409);
    assert!(server.get("devicetaintrules", "", "r").is_some());
    // Once the controller has written the rule's status, the resourceVersion holds.
    condition(&server, "r").await;
    let cur = server.get("devicetaintrules", "", "r").unwrap();
    api.delete(
        "r",
        &with(
            made.metadata.uid.clone(),
            cur["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_string),
        ),
    )
    .await
    .unwrap();
    assert!(server.get("devicetaintrules", "", "r").is_none());
}
