//! Where the test API server behaves like kube-apiserver and its controllers, each
//! test naming the upstream file it follows. Driven through the real `kube`
//! client.

mod common;

use std::time::Duration;

use faultline_test_apiserver::{ApiServer, Faults};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{
    Api, DeleteParams, EvictParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::Client;
use serde_json::{json, Value};

async fn start() -> (ApiServer, Client) {
    let (server, url) = faultline_test_apiserver::spawn().await;
    (server, common::client(&url))
}

fn api_error(e: kube::Error) -> Box<kube::core::Status> {
    match e {
        kube::Error::Api(s) => s,
        other => panic!("not an API error: {other:?}"),
    }
}

/// A running pod on `node`, Ready or not, seeded as its kubelet reports it.
fn running(name: &str, node: &str, ready: bool) -> Value {
    json!({"metadata": {"name": name, "labels": {"app": "train"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}})
}

fn budget(spec: Value) -> PodDisruptionBudget {
    let mut spec = spec;
    spec["selector"] = json!({"matchLabels": {"app": "train"}});
    serde_json::from_value(json!({"metadata": {"name": "train"}, "spec": spec})).unwrap()
}

fn cause(s: &kube::core::Status) -> String {
    s.details
        .as_ref()
        .map(|d| {
            d.causes
                .iter()
                .map(|c| format!("{}: {}", c.reason, c.message))
                .collect::<Vec<_>>()
                .join("; ")
        })
        .unwrap_or_default()
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// pkg/registry/core/pod/storage/eviction.go judges the budget's status, which
/// pkg/controller/disruption/disruption.go computes from the pods' Ready condition;
/// an evicted pod goes Terminating (pkg/registry/core/pod/strategy.go
/// `CheckGracefulDelete`) and a second eviction of it is let through (`canIgnorePDB`).
#[tokio::test]
async fn eviction_follows_the_budget_status() {
    let (s, c) = start().await;
    // Containers that take long to stop: the Terminating state can be seen.
    s.set_faults(Faults {
        pod_stop_ms: 600_000,
        ..Default::default()
    });
    for name in ["w-0", "w-1"] {
        s.create("pods", "default", running(name, "n1", true))
            .unwrap();
    }
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    pdbs.create(&PostParams::default(), &budget(json!({"minAvailable": 2})))
        .await
        .unwrap();
    let st = pdbs.get_status("train").await.unwrap().status.unwrap();
    assert_eq!(
        (
            st.current_healthy,
            st.desired_healthy,
            st.disruptions_allowed
        ),
        (2, 2, 0)
    );
    let e = api_error(
        pods.evict("w-0", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429);
    assert!(
        cause(&e).contains("DisruptionBudget: The disruption budget train needs 2 healthy pods and has 2 currently"),
        "{e:?}"
    );
    pdbs.patch(
        "train",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"minAvailable": 1}})),
    )
    .await
    .unwrap();
    let pdb = pdbs.get("train").await.unwrap();
    assert_eq!(
        pdb.metadata.generation,
        Some(2),
        "a new spec, a new generation"
    );
    assert_eq!(pdb.status.unwrap().observed_generation, Some(2));
    pods.evict("w-0", &EvictParams::default()).await.unwrap();
    let gone = pods.get("w-0").await.unwrap();
    assert!(gone.metadata.deletion_timestamp.is_some(), "Terminating");
    assert_eq!(gone.metadata.deletion_grace_period_seconds, Some(30));
    let st = pdbs.get("train").await.unwrap().status.unwrap();
    assert_eq!((st.current_healthy, st.disruptions_allowed), (1, 0));
    // A terminating pod is let through again; its sibling is protected.
    pods.evict("w-0", &EvictParams::default()).await.unwrap();
    let e = api_error(
        pods.evict("w-1", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429);
    // A grace period of 0 removes it at once.
    pods.delete("w-0", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert_eq!(api_error(pods.get("w-0").await.unwrap_err()).code, 404);
}

/// eviction.go `checkAndDecrement`: while the disruption controller has not observed
/// the budget's generation, every eviction is a 429 "still being processed".
#[tokio::test]
async fn an_unprocessed_budget_refuses_evictions() {
    let (s, c) = start().await;
    s.set_faults(Faults {
        disruption_controller_paused: true,
        ..Default::default()
    });
    s.create("pods", "default", running("w-0", "n1", true))
        .unwrap();
    s.create("pods", "default", running("w-1", "n1", true))
        .unwrap();
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    pdbs.create(&PostParams::default(), &budget(json!({"minAvailable": 0})))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let e = api_error(
        pods.evict("w-0", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429);
    assert!(cause(&e).contains("still being processed"), "{e:?}");
    // The controller catches up at its next sync.
    s.set_faults(Faults::default());
    s.update(
        "pods",
        "default",
        "w-1",
        s.get("pods", "default", "w-1").unwrap(),
        Some("status"),
    )
    .unwrap();
    pods.evict("w-0", &EvictParams::default()).await.unwrap();
}

/// eviction.go: an unready pod is evicted only while its budget is healthy
/// (`currentHealthy >= desiredHealthy > 0`), or always with `AlwaysAllow`.
#[tokio::test]
async fn unready_pods_are_evicted_only_from_a_healthy_budget() {
    let (s, c) = start().await;
    s.create("pods", "default", running("ok", "n1", true))
        .unwrap();
    s.create("pods", "default", running("sick", "n1", false))
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    pdbs.create(&PostParams::default(), &budget(json!({"minAvailable": 2})))
        .await
        .unwrap();
    let e = api_error(
        pods.evict("sick", &EvictParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 429, "1 healthy of 2 desired: the unready pod stays");
    pdbs.patch(
        "train",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"unhealthyPodEvictionPolicy": "AlwaysAllow"}})),
    )
    .await
    .unwrap();
    pods.evict("sick", &EvictParams::default()).await.unwrap();
    let st = pdbs.get("train").await.unwrap().status.unwrap();
    assert_eq!(st.disruptions_allowed, 0, "the budget was not used");
}

/// strategy.go `CheckGracefulDelete` and the kubelet: a deleted pod is Terminating
/// until its kubelet has stopped it; on a node whose kubelet is silent (Ready
/// `Unknown`) it stays until deleted with a grace period of 0. A pod that was never
/// scheduled goes at once.
#[tokio::test]
async fn pods_terminate_gracefully() {
    let (s, c) = start().await;
    s.create(
        "nodes",
        "",
        json!({"metadata": {"name": "dead"}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}),
    )
    .unwrap();
    s.set_faults(Faults {
        pod_stop_ms: 300,
        ..Default::default()
    });
    s.create("pods", "default", running("live", "n1", true))
        .unwrap();
    s.create("pods", "default", running("stuck", "dead", true))
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let unscheduled: Pod = serde_json::from_value(
        json!({"metadata": {"name": "unscheduled"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}),
    )
    .unwrap();
    let created = pods
        .create(&PostParams::default(), &unscheduled)
        .await
        .unwrap();
    assert_eq!(
        created.status.unwrap().phase.as_deref(),
        Some("Pending"),
        "a pod starts Pending, whatever status the client sent"
    );
    for name in ["live", "stuck", "unscheduled"] {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    assert!(s.get("pods", "default", "unscheduled").is_none());
    assert!(
        s.get("pods", "default", "live").is_some(),
        "Terminating first"
    );
    until("the live kubelet removes its pod", || {
        s.get("pods", "default", "live").is_none()
    })
    .await;
    // Two more looks: the one that removed `live` may have begun before `stuck` was due.
    let looked = s.kubelet_looks();
    until("two more looks by the kubelets", || {
        s.kubelet_looks() >= looked + 2
    })
    .await;
    assert!(
        s.get("pods", "default", "stuck").is_some(),
        "no kubelet, no removal"
    );
    pods.delete("stuck", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    assert!(s.get("pods", "default", "stuck").is_none());
}

/// staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go
/// `convertToWatchEvent`: an object that comes into a watch's selector is ADDED, one
/// that leaves it is DELETED.
#[tokio::test]
async fn watches_see_objects_enter_and_leave_their_selector() {
    let (s, c) = start().await;
    s.create("nodes", "", json!({"metadata": {"name": "n1"}}))
        .unwrap();
    let nodes: Api<Node> = Api::all(c.clone());
    let mut stream = nodes
        .watch(&WatchParams::default().labels("pool=gpu").timeout(30), "0")
        .await
        .unwrap()
        .boxed();
    let label = |v: Value| {
        let mut n = s.get("nodes", "", "n1").unwrap();
        n["metadata"]["labels"] = v;
        s.update("nodes", "", "n1", n, None).unwrap();
    };
    label(json!({"pool": "gpu"}));
    label(json!({"pool": "gpu", "x": "1"}));
    label(json!({"pool": "cpu"}));
    let mut seen = Vec::new();
    for _ in 0..3 {
        let ev = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push(match ev {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            WatchEvent::Deleted(n) => {
                assert_eq!(n.metadata.labels.unwrap()["pool"], "gpu", "as it was");
                "DELETED"
            }
            other => panic!("{other:?}"),
        });
    }
    assert_eq!(seen, ["ADDED", "MODIFIED", "DELETED"]);
}

/// staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go: a patch without a
/// resourceVersion is retried by the server on a conflict and never answers 409; an
/// update with a stale one does.
#[tokio::test]
async fn patches_without_a_resource_version_never_conflict() {
    let (s, c) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "a"}, "data": {"v": "1"}})).unwrap();
    let cm = cms.create(&PostParams::default(), &cm).await.unwrap();
    s.set_faults(Faults {
        conflict_rate: 1.0,
        ..Default::default()
    });
    cms.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "2"}})),
    )
    .await
    .unwrap();
    let e = api_error(
        cms.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": cm.metadata.resource_version}, "data": {"v": "3"}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, 409);
    let e = api_error(
        cms.replace("a", &PostParams::default(), &cm)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 409);
}

/// staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go: a BOOKMARK only
/// for a watch that asked for them (`allowWatchBookmarks`), and nothing on a quiet
/// watch otherwise; staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go: a
/// watch from a resourceVersion older than the (compacted) history is 410 Gone.
#[tokio::test]
async fn bookmarks_when_asked_and_gone_after_compaction() {
    let (s, c) = start().await;
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "a"}, "data": {"v": "1"}})).unwrap();
    let first = cms.create(&PostParams::default(), &cm).await.unwrap();
    let rv = first.metadata.resource_version.clone().unwrap();
    let events = |wp: WatchParams, rv: String| {
        let cms = cms.clone();
        async move {
            let mut out = Vec::new();
            let mut stream = cms.watch(&wp, &rv).await.unwrap().boxed();
            while let Ok(Some(ev)) =
                tokio::time::timeout(Duration::from_secs(5), stream.next()).await
            {
                out.push(ev.unwrap());
            }
            out
        }
    };
    let asked = events(WatchParams::default().timeout(1), rv.clone()).await;
    assert!(
        asked.iter().any(|e| matches!(e, WatchEvent::Bookmark(_))),
        "{asked:?}"
    );
    let quiet = events(
        WatchParams::default().timeout(1).disable_bookmarks(),
        rv.clone(),
    )
    .await;
    assert!(quiet.is_empty(), "{quiet:?}");
    for v in 2..5 {
        cms.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"v": v.to_string()}})),
        )
        .await
        .unwrap();
    }
    s.compact();
    let gone = events(WatchParams::default().timeout(5), rv).await;
    match gone.first() {
        Some(WatchEvent::Error(e)) => assert_eq!(e.code, 410, "{e:?}"),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}
