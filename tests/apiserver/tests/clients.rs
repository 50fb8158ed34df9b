//! The test API server against real clients: the `kube` crate (what faultline uses) and
//! `kubectl`.

mod common;

use std::time::Duration;

use common::client;
use faultline_test_apiserver::{spawn, Faults};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::json;

fn err_code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("not an API error: {other:?}"),
    }
}

#[tokio::test]
async fn kube_client_crud_patch_and_conflicts() {
    let (_s, url) = spawn().await;
    let c = client(&url);
    let nodes: Api<Node> = Api::all(c.clone());
    let n: Node =
        serde_json::from_value(json!({"metadata": {"name": "gpu-1", "labels": {"gpu": "true"}}}))
            .unwrap();
    let created = nodes.create(&PostParams::default(), &n).await.unwrap();
    assert!(created.metadata.uid.is_some());
    assert_eq!(
        err_code(nodes.create(&PostParams::default(), &n).await.unwrap_err()),
        409
    );
    let list = nodes
        .list(&ListParams::default().labels("gpu=true"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    assert!(nodes
        .list(&ListParams::default().labels("gpu=false"))
        .await
        .unwrap()
        .items
        .is_empty());

    // Strategic merge replaces `taints` whole: the field has no patch strategy
    // (staging/src/k8s.io/api/core/v1/types.go NodeSpec, `+listType=atomic`).
    let pp = PatchParams::default();
    nodes
        .patch(
            "gpu-1",
            &pp,
            &Patch::Strategic(json!({"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let n = nodes
        .patch(
            "gpu-1",
            &pp,
            &Patch::Strategic(json!({"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}})),
        )
        .await
        .unwrap();
    let taints = n.spec.unwrap().taints.unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "b");
    // Merge and JSON patches.
    nodes
        .patch(
            "gpu-1",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}})),
        )
        .await
        .unwrap();
    let jp: json_patch::Patch = serde_json::from_value(
        json!([{"op": "add", "path": "/metadata/annotations", "value": {"y": "2"}}]),
    )
    .unwrap();
    let n = nodes
        .patch("gpu-1", &pp, &Patch::Json::<()>(jp))
        .await
        .unwrap();
    assert_eq!(n.metadata.annotations.unwrap()["y"], "2");
    assert_eq!(n.metadata.labels.as_ref().unwrap()["x"], "1");
    // The status subresource.
    let n = nodes
        .patch_status("gpu-1", &pp, &Patch::Strategic(json!({"status": {"conditions": [{"type": "AcceleratorHealthy", "status": "False", "reason": "GpuLost"}]}})))
        .await
        .unwrap();
    assert_eq!(
        n.status.unwrap().conditions.unwrap()[0].reason.as_deref(),
        Some("GpuLost")
    );

    // Optimistic concurrency: a replace with a stale resourceVersion is a 409.
    let leases: Api<Lease> = Api::namespaced(c.clone(), "default");
    let l: Lease = serde_json::from_value(
        json!({"metadata": {"name": "shard-0"}, "spec": {"holderIdentity": "a"}}),
    )
    .unwrap();
    let first = leases.create(&PostParams::default(), &l).await.unwrap();
    let mut mine = first.clone();
    mine.spec.as_mut().unwrap().holder_identity = Some("b".into());
    leases
        .replace("shard-0", &PostParams::default(), &mine)
        .await
        .unwrap();
    let mut stale = first.clone();
    stale.spec.as_mut().unwrap().holder_identity = Some("c".into());
    assert_eq!(
        err_code(
            leases
                .replace("shard-0", &PostParams::default(), &stale)
                .await
                .unwrap_err()
        ),
        409
    );
    assert_eq!(
        leases
            .get("shard-0")
            .await
            .unwrap()
            .spec
            .unwrap()
            .holder_identity
            .as_deref(),
        Some("b")
    );

    nodes
        .delete("gpu-1", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(err_code(nodes.get("gpu-1").await.unwrap_err()), 404);
}

#[tokio::test]
async fn configmaps_over_one_mib_are_refused() {
    let (_s, url) = spawn().await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    let ok: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "a"}, "data": {"k": "x".repeat(900 << 10)}}),
    )
    .unwrap();
    cms.create(&PostParams::default(), &ok).await.unwrap();
    let big: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "b"}, "data": {"k": "x".repeat(1 << 20)}}),
    )
    .unwrap();
    assert_eq!(
        err_code(cms.create(&PostParams::default(), &big).await.unwrap_err()),
        422
    );
}

#[tokio::test]
async fn watch_from_a_resource_version() {
    let (_s, url) = spawn().await;
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    let a: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "a"}, "data": {"v": "1"}})).unwrap();
    let created = cms.create(&PostParams::default(), &a).await.unwrap();
    let rv = created.metadata.resource_version.clone().unwrap();
    let mut stream = cms
        .watch(&WatchParams::default().timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "2"}})),
    )
    .await
    .unwrap();
    cms.delete("a", &DeleteParams::default()).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match ev {
        WatchEvent::Modified(cm) => assert_eq!(cm.data.unwrap()["v"], "2"),
        other => panic!("{other:?}"),
    }
    let ev = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(ev, WatchEvent::Deleted(_)), "{ev:?}");
}

#[tokio::test]
async fn injected_faults() {
    let (s, url) = spawn().await;
    let nodes: Api<Node> = Api::all(client(&url));
    s.set_faults(Faults {
        error_rate: 1.0,
        ..Default::default()
    });
    assert_eq!(
        err_code(nodes.list(&ListParams::default()).await.unwrap_err()),
        500
    );
    s.set_faults(Faults {
        throttle_rate: 1.0,
        ..Default::default()
    });
    assert_eq!(
        err_code(nodes.list(&ListParams::default()).await.unwrap_err()),
        429
    );
    s.set_faults(Faults {
        error_rate: 0.5,
        seed: 7,
        ..Default::default()
    });
    let mut fails = 0;
    for _ in 0..100 {
        if nodes.list(&ListParams::default()).await.is_err() {
            fails += 1;
        }
    }
    assert!((25..=75).contains(&fails), "{fails} of 100");
    s.set_faults(Faults::default());
    assert!(nodes.list(&ListParams::default()).await.is_ok());
    assert!(s.calls().iter().any(|c| c.status == 500));
}

/// Injected latency limited to matching paths delays those calls only, and a delayed
/// call is seen as received (audit stage `RequestReceived`,
/// staging/src/k8s.io/apiserver/pkg/apis/audit/types.go) while still in flight, then
/// recorded once carried out (`ResponseComplete`).
#[tokio::test]
async fn path_matched_latency_and_calls_in_flight() {
    let (s, url) = spawn().await;
    let c = client(&url);
    let maps: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let nodes: Api<Node> = Api::all(c);
    s.set_faults(Faults {
        latency_ms: 1_500,
        latency_match: "/configmaps".into(),
        ..Default::default()
    });
    let t = std::time::Instant::now();
    nodes.list(&ListParams::default()).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(1_000),
        "nodes are not delayed"
    );
    let slow = tokio::spawn(async move { maps.list(&ListParams::default()).await });
    let mut seen = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let received = s.received().iter().any(|r| r.uri.contains("/configmaps"));
        let done = s.calls().iter().any(|c| c.uri.contains("/configmaps"));
        if received {
            assert!(
                !done,
                "a delayed call is seen in flight before it is recorded"
            );
            seen = true;
            break;
        }
    }
    assert!(seen, "the delayed call was received");
    slow.await.unwrap().unwrap();
    let call = s
        .calls()
        .into_iter()
        .find(|c| c.uri.contains("/configmaps"))
        .unwrap();
    assert!(
        call.at_ms >= call.received_ms + 1_400,
        "carried out after the delay: received {} done {}",
        call.received_ms,
        call.at_ms
    );
}

#[tokio::test]
async fn kubectl_works_against_it() {
    let Ok(out) = std::process::Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
    else {
        // In CI a missing tool is a failure: .ci/run installs it.
        assert!(
            std::env::var_os("CI").is_none(),
            "kubectl_works_against_it: no kubectl on PATH, and CI is set"
        );
        eprintln!("SKIPPED kubectl_works_against_it: no kubectl on PATH (.ci/run installs it)");
        return;
    };
    assert!(out.status.success());
    let (_s, url) = spawn().await;
    let c = client(&url);
    let nodes: Api<Node> = Api::all(c.clone());
    let n: Node = serde_json::from_value(json!({"metadata": {"name": "gpu-node-7"}})).unwrap();
    nodes.create(&PostParams::default(), &n).await.unwrap();
    let url2 = url.clone();
    let run = move |args: &[&str]| {
        let mut cmd = std::process::Command::new("kubectl");
        cmd.args(["--server", &url2, "--insecure-skip-tls-verify=true"])
            .args(args)
            .env("KUBECONFIG", "/dev/null");
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (ok, text) = tokio::task::spawn_blocking({
        let run = run.clone();
        move || run(&["get", "nodes"])
    })
    .await
    .unwrap();
    assert!(ok && text.contains("gpu-node-7"), "{text}");
    let (ok, text) = tokio::task::spawn_blocking({
        let run = run.clone();
        // `kubectl create configmap` (a generator) sends protobuf, which this server does
        // not decode; `-f` sends JSON.
        move || {
            let f = std::env::temp_dir().join(format!("cm-{}.json", std::process::id()));
            std::fs::write(&f, r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"fault","namespace":"default"},"data":{"fault.json":"{}"}}"#).unwrap();
            // No OpenAPI document is served, so client-side validation is off.
            let r = run(&["create", "--validate=false", "-f", f.to_str().unwrap()]);
            let _ = std::fs::remove_file(&f);
            r
        }
    })
    .await
    .unwrap();
    assert!(ok, "{text}");
    let (ok, text) = tokio::task::spawn_blocking(move || {
        run(&[
            "get",
            "cm",
            "fault",
            "-n",
            "default",
            "-o",
            "jsonpath={.data.fault\\.json}",
        ])
    })
    .await
    .unwrap();
    assert!(ok && text.trim() == "{}", "{text}");
}

#[tokio::test]
async fn watches_can_be_dropped_early() {
    let (s, url) = spawn().await;
    s.set_faults(Faults {
        drop_watch_after_s: 1,
        ..Default::default()
    });
    let cms: Api<ConfigMap> = Api::namespaced(client(&url), "default");
    let t = std::time::Instant::now();
    let mut stream = cms
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .unwrap()
        .boxed();
    // No events: the stream ends when the server drops it, well before its 60 s timeout.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = stream.next().await {
            let _ = ev;
        }
    })
    .await;
    assert!(end.is_ok(), "the watch was not dropped");
    assert!(t.elapsed() < Duration::from_secs(5));
}
