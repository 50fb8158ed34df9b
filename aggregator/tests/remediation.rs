//! Isolation against the Kubernetes API test server: one taint however often it runs,
//! others' taints kept, a record readable on the Node, a condition and one Event;
//! dry-run changes nothing; a refused write is an error, not a half-done job.

mod support;

use faultline_aggregator::model::RecordDevice;
use faultline_aggregator::remediate::{
    Budget, Ledger, Mode, Outcome, Remediator, CONDITION, DEVICES_LABEL, RECORD_ANNOTATION,
};
use faultline_aggregator::shard::Fence;
use faultline_test_apiserver::{ApiServer, Faults};
use serde_json::{json, Value};
use support::{events, kube_client, record, NodeFixture, PodFixture, Scenario};

/// The API test server with `gpu-1` (someone else's taint and label on it); a client.
async fn setup() -> (ApiServer, kube::Client) {
    let w = Scenario::new()
        .node(NodeFixture::shared("gpu-1"))
        .start()
        .await;
    (w.server, kube_client(&w.kube))
}

fn failed(id: &str) -> Vec<RecordDevice> {
    vec![RecordDevice {
        // Each device its own UUID; gpu3's is the one the pods below hold.
        uuid: Some(if id == "gpu3" {
            "GPU-1234".to_string()
        } else {
            format!("GPU-{id}")
        }),
        pci_bus_id: None,
        ..RecordDevice::new(id, "xid-79")
    }]
}

fn remediator(client: kube::Client, mode: Mode) -> Remediator {
    let ledger = Ledger::new(
        kube::Api::namespaced(client.clone(), support::NS),
        "faultline-budget".into(),
    );
    Remediator::new(client, mode, "nvidia.com/gpu-fault", "default", "replica-0")
        .with_budget_ledger(Some(ledger))
}

fn budget(max_nodes: usize, max_percent: f64, per_domain: Option<(&str, usize)>) -> Budget {
    Budget {
        max_nodes,
        max_percent,
        per_domain: per_domain.map(|(l, n)| (l.to_string(), n)),
        ..Budget::default()
    }
}

/// A PodDisruptionBudget that lets no pod labelled `app` go (minAvailable 1).
fn budget_of_one(server: &ApiServer, app: &str) {
    let pdb = json!({"metadata": {"name": app},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}}});
    server
        .create("poddisruptionbudgets", "default", pdb)
        .unwrap();
}

/// gpu-1's record holds no drain intent.
fn assert_no_drains(server: &ApiServer) {
    let rec = gpu1_record(server);
    assert!(
        rec["drains"].as_object().is_none_or(|o| o.is_empty()),
        "{rec}"
    );
}

/// [`remediator`] guarded by the breaker (`faultline-breaker`: open at 3 failures within
/// 5 minutes).
fn guarded(client: kube::Client, mode: Mode) -> Remediator {
    let breaker = faultline_aggregator::remediate::Breaker::new(
        kube::Api::namespaced(client.clone(), "faultline"),
        "faultline-breaker".into(),
        3,
        std::time::Duration::from_secs(300),
    );
    remediator(client, mode).with_breaker(Some(breaker), 0.0)
}

/// Three node failures noted: the breaker opens.
async fn trip(r: &Remediator, server: &ApiServer) {
    for n in ["b0", "b1", "b2"] {
        r.note_failure(n).await.unwrap();
    }
    let cm = server.get("configmaps", "faultline", "faultline-breaker");
    assert_eq!(cm.unwrap()["data"]["state"], "open");
}

/// The ids of the devices of node `n`'s quarantine record, in its order; the record.
fn record_ids(server: &ApiServer, n: &str) -> (Vec<String>, Value) {
    let r = record(server, n).expect("a quarantine record");
    let ids = r["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["id"].as_str().map(String::from))
        .collect();
    (ids, r)
}

/// The places under `key` (`nodes` or `unknown`) of the budget's ledger, by node; none
/// before the ledger exists.
fn ledger_places(server: &ApiServer, key: &str) -> Value {
    server
        .get("configmaps", "faultline", "faultline-budget")
        .and_then(|cm| cm["data"][key].as_str().map(String::from))
        .map(|t| serde_json::from_str(&t).unwrap())
        .unwrap_or_else(|| json!({}))
}

#[tokio::test]
async fn isolation_is_idempotent_and_keeps_other_taints() {
    let (server, client) = setup().await;
    let r = remediator(client, Mode::Enforce);
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::AlreadyDone
    );

    let node: Value = server.get("nodes", "", "gpu-1").unwrap();
    let taints = node["spec"]["taints"].as_array().unwrap();
    let ours: Vec<&Value> = taints
        .iter()
        .filter(|t| t["key"] == "nvidia.com/gpu-fault")
        .collect();
    assert_eq!(ours.len(), 1, "exactly one taint: {taints:?}");
    assert_eq!(ours[0]["effect"], "NoSchedule");
    assert!(
        taints
            .iter()
            .any(|t| t["key"] == "other.example/maintenance"),
        "someone else's taint kept"
    );
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3");
    assert_eq!(node["metadata"]["labels"]["team"], "a");
    let record: Value = serde_json::from_str(
        node["metadata"]["annotations"][RECORD_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["owned_taint"], "nvidia.com/gpu-fault");
    assert_eq!(record["devices"][0]["uuid"], "GPU-1234");
    assert_eq!(record["actor"], "replica-0");
    assert_eq!(
        record["actions"].as_array().unwrap().len(),
        2,
        "taint and label, once each"
    );
    let cond = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == CONDITION)
        .cloned()
        .unwrap();
    assert_eq!(cond["status"], "False");
    assert_eq!(events(&server, "FaultlineQuarantined"), 1);

    // A second device fails: the record grows, still one taint, one more Event.
    let mut two = failed("gpu3");
    two.extend(failed("gpu5"));
    assert_eq!(
        r.isolate("gpu-1", two, &Fence::unfenced()).await.unwrap(),
        Outcome::Isolated
    );
    let node: Value = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(
        node["spec"]["taints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["key"] == "nvidia.com/gpu-fault")
            .count(),
        1
    );
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3.gpu5");
    assert_eq!(events(&server, "FaultlineQuarantined"), 2);
}

#[tokio::test]
async fn dry_run_announces_and_changes_nothing() {
    let (server, client) = setup().await;
    let before = server.get("nodes", "", "gpu-1").unwrap();
    let r = remediator(client, Mode::DryRun);
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Announced
    );
    assert_eq!(server.get("nodes", "", "gpu-1").unwrap(), before);
    assert_eq!(events(&server, "FaultlineWouldQuarantine"), 1);
}

#[tokio::test]
async fn a_refused_write_changes_nothing_and_the_next_pass_completes() {
    let (server, client) = setup().await;
    let r = remediator(client, Mode::Enforce);
    server.set_faults(Faults {
        write_error_rate: 1.0,
        ..Default::default()
    });
    assert!(r
        .isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .is_err());
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(
        node["spec"]["taints"].as_array().unwrap().len(),
        1,
        "nothing half done"
    );
    assert!(node["metadata"]["annotations"].is_null());
    server.set_faults(Faults::default());
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    assert_eq!(events(&server, "FaultlineQuarantined"), 1);
}

/// The quarantine record on `gpu-1`.
fn gpu1_record(server: &ApiServer) -> Value {
    record(server, "gpu-1").expect("gpu-1 has a quarantine record")
}

/// A pod on `gpu-1`; with `gpu` it asks for one; `allocated`: the device the kubelet
/// says it holds (Unhealthy).
fn pod(name: &str, gpu: bool, allocated: Option<&str>) -> PodFixture {
    let mut p = PodFixture::new(name, "gpu-1");
    if gpu {
        p = p.gpu();
    }
    if let Some(id) = allocated {
        p = p.holds(id, "Unhealthy");
    }
    p
}

/// An eviction that lands late, past the replica's hold (the API took 3 s to apply
/// it): meanwhile the pod it judged was evicted by the shard's new holder, and its
/// StatefulSet made it again under the same name on a healthy node. Without a uid
/// precondition the late eviction evicted the successor; with one the API refuses it
/// (409) and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_that_lands_late_never_evicts_the_pods_successor() {
    let (server, client) = setup().await;
    pod("train-0", true, Some("GPU-1234")).create(&server);
    let r = remediator(client, Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    server.set_faults(Faults {
        latency_ms: 3000,
        latency_match: "/pods/train-0/eviction".into(),
        ..Default::default()
    });
    let late = tokio::spawn(async move { r.evict("gpu-1", &[], &Fence::unfenced()).await });
    // The eviction is in the server, its processing delayed.
    support::until_received(&server, "POST", "/pods/train-0/eviction").await;
    // The new holder's eviction, and the StatefulSet's new pod on a healthy node.
    server.delete("pods", "default", "train-0").unwrap();
    PodFixture::new("train-0", "gpu-2").gpu().create(&server);
    let successor = server.get("pods", "default", "train-0").unwrap()["metadata"]["uid"].clone();
    late.await.unwrap().unwrap();
    let now = server
        .get("pods", "default", "train-0")
        .expect("the successor was evicted");
    assert_eq!(now["metadata"]["uid"], successor);
    let evictions: Vec<_> = server
        .calls()
        .into_iter()
        .filter(|c| c.uri.contains("/eviction"))
        .map(|c| (c.uri, c.status))
        .collect();
    assert!(
        now["metadata"]["deletionTimestamp"].is_null(),
        "the successor evicted: {evictions:?}"
    );
    let refused = server
        .calls()
        .iter()
        .filter(|c| c.uri.contains("/pods/train-0/eviction") && c.status == 409)
        .count();
    assert_eq!(refused, 1, "the late eviction refused on the uid");
}

/// A pass lists the node's pods from the watch cache, which may lag. There a pod
/// deleted since, one made again under its name on another node, and one terminating
/// all still look as they did. The consistent read before each eviction asks none of
/// them to leave (each is recorded gone); the pod that still runs is evicted once.
#[tokio::test]
async fn pods_a_lagging_cache_still_lists_are_read_again_before_eviction() {
    let (server, client) = setup().await;
    let names = ["gone", "replaced", "terminating", "running"];
    for name in names {
        pod(name, true, Some("GPU-1234")).create(&server);
    }
    let r = remediator(client.clone(), Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    // The cache stands here: no older revision can be served, none newer is drawn.
    server.compact();
    let stopping = Faults {
        pod_stop_ms: 600_000,
        ..Default::default()
    };
    server.set_faults(stopping.clone());
    server.delete("pods", "default", "gone").unwrap();
    server.delete("pods", "default", "replaced").unwrap();
    PodFixture::new("replaced", "gpu-2").gpu().create(&server);
    server
        .delete_with_grace("pods", "default", "terminating", Some(30))
        .unwrap();
    server.set_faults(Faults {
        stale_list_ms: 600_000,
        seed: 7,
        ..stopping
    });
    // What the pass will list: the four as they were.
    let cached = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client)
        .list(&kube::api::ListParams::default().match_any())
        .await
        .unwrap();
    let on_gpu1 = |p: &&k8s_openapi::api::core::v1::Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some("gpu-1")
            && p.metadata.deletion_timestamp.is_none()
    };
    assert_eq!(
        cached.items.iter().filter(on_gpu1).count(),
        4,
        "a lagging list"
    );

    let e = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(e.evicted.len(), 1, "{e:?}");
    assert!(e.evicted[0].starts_with("default/running/"), "{e:?}");
    assert!(support::evicted_once(&server, "running"));
    for name in ["gone", "replaced", "terminating"] {
        let asked = server
            .calls()
            .iter()
            .filter(|c| c.uri.contains(&format!("/pods/{name}/eviction")))
            .count();
        assert_eq!(asked, 0, "{name} was asked to leave");
    }
    // Each is done with: no later pass reads it again.
    let (_, rec) = record_ids(&server, "gpu-1");
    let done = rec["evicted"].to_string();
    for name in names {
        assert!(done.contains(&format!("default/{name}/")), "{name}: {done}");
    }
    assert!(
        server.get("pods", "default", "replaced").unwrap()["metadata"]["deletionTimestamp"]
            .is_null(),
        "the successor on gpu-2 runs on"
    );
}

/// The Node's record write (a JSON patch testing the resourceVersion the pass read)
/// calls to `/nodes/gpu-1` since `from` of the server's calls.
fn record_writes(server: &ApiServer, from: usize) -> Vec<u16> {
    server.calls()[from..]
        .iter()
        .filter(|c| c.method == "PATCH" && c.uri.contains("/nodes/gpu-1"))
        .map(|c| c.status)
        .collect()
}

/// The eviction pass's record write meets a Node that changes under every write (its
/// kubelet's status, another controller): it reads again and retries, 4 writes in all,
/// then gives the pass up with the error; never a fifth, never for ever. A write that
/// fails otherwise (500) is not retried at all: the next pass writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_record_retries_conflicts_four_times_and_nothing_else() {
    let (server, client) = setup().await;
    for name in ["w0", "w1", "w2", "w3"] {
        pod(name, true, Some("GPU-1234")).create(&server);
    }
    let r = remediator(client, Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let pass = |r| async move {
        tokio::time::timeout(
            std::time::Duration::from_secs(20),
            Remediator::evict(r, "gpu-1", &[], &Fence::unfenced()),
        )
        .await
        .expect("the pass ends")
    };

    // Every Node write is held 300 ms, while the Node changes every 20 ms.
    server.set_faults(Faults {
        latency_ms: 300,
        latency_method: "PATCH".into(),
        latency_match: "/nodes/gpu-1".into(),
        ..Default::default()
    });
    let churn = {
        let server = server.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let mut n = server.get("nodes", "", "gpu-1").unwrap();
                n["metadata"]["labels"]["kubelet-beat"] = json!(format!("{i}"));
                let _ = server.update("nodes", "", "gpu-1", n, None);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
    };
    let from = server.calls().len();
    let e = pass(&r).await;
    churn.abort();
    assert!(e.is_err(), "the pass gave up: {e:?}");
    let writes = record_writes(&server, from);
    assert_eq!(writes.len(), 4, "{writes:?}");
    assert!(writes.iter().all(|s| *s == 409 || *s == 422), "{writes:?}");

    // A write refused otherwise: once.
    server.set_faults(Faults {
        write_error_rate: 1.0,
        write_error_match: "/nodes/gpu-1".into(),
        ..Default::default()
    });
    pod("w4", true, Some("GPU-1234")).create(&server);
    let from = server.calls().len();
    let e = pass(&r).await;
    assert!(e.is_err(), "{e:?}");
    assert_eq!(record_writes(&server, from), vec![500]);
    // The next pass, the API well again, asks none of them again.
    server.set_faults(Faults::default());
    pass(&r).await.unwrap();
    for name in ["w0", "w1", "w2", "w3", "w4"] {
        assert!(support::evicted_once(&server, name), "{name}");
    }
}

/// Namespace reads since `from` of the server's calls.
fn namespace_reads(server: &ApiServer, from: usize) -> usize {
    server.calls()[from..]
        .iter()
        .filter(|c| c.method == "GET" && c.uri.contains("/api/v1/namespaces/default"))
        .filter(|c| !c.uri.contains("/namespaces/default/"))
        .count()
}

/// A warned pod keeps its one intent while it waits: a later pass neither asks its
/// namespace again nor writes a new intent, which would move its deadline. Once it
/// has left (deleted), the intent goes from the record, counted as left.
#[tokio::test]
async fn a_drain_intent_stands_while_the_pod_waits_and_goes_when_it_leaves() {
    let (server, client) = setup().await;
    let mut ckpt = pod("ckpt", true, Some("GPU-1234")).build();
    ckpt["metadata"]["annotations"] = json!({"faultline.io/checkpoint-grace": "300s"});
    server.create("pods", "default", ckpt).unwrap();
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_checkpoint_grace(std::time::Duration::from_secs(3600))
        .with_clock(clock.clone());
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let first = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(first.draining.len(), 1, "{first:?}");
    let intent = gpu1_record(&server)["drains"].clone();
    assert_eq!(intent.as_object().map(|o| o.len()), Some(1), "{intent}");

    clock.advance(std::time::Duration::from_secs(60));
    let from = server.calls().len();
    let second = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(second.draining.len(), 1, "{second:?}");
    assert_eq!(gpu1_record(&server)["drains"], intent, "the intent stands");
    assert_eq!(namespace_reads(&server, from), 0);
    assert_eq!(support::eviction_calls(&server, "ckpt", 201), 0);

    server.delete("pods", "default", "ckpt").unwrap();
    let third = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(third.drains, Some(vec![]), "{third:?}");
    assert_no_drains(&server);
}

/// A pod whose eviction was tried without an intent (its budget refused it) is not
/// warned later, even once its namespace asks for a checkpoint grace: its namespace is
/// not read again, and no intent is written.
#[tokio::test]
async fn a_pod_tried_without_an_intent_is_not_warned_later() {
    let (server, client) = setup().await;
    pod("guarded", true, Some("GPU-1234")).create(&server);
    budget_of_one(&server, "guarded");
    let r = remediator(client, Mode::Enforce)
        .with_checkpoint_grace(std::time::Duration::from_secs(3600));
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let first = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(first.blocked.len(), 1, "{first:?}");
    let mut ns = server.get("namespaces", "", "default").unwrap();
    ns["metadata"]["annotations"] = json!({"faultline.io/checkpoint-grace": "300s"});
    server
        .update("namespaces", "", "default", ns, None)
        .unwrap();

    let from = server.calls().len();
    let second = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(second.blocked.len(), 1, "{second:?}");
    assert!(second.draining.is_empty(), "{second:?}");
    assert_eq!(namespace_reads(&server, from), 0);
    assert_no_drains(&server);
}

/// Remediation off evicts nothing and reads nothing, even where a quarantine record
/// is on the node; an open breaker stops an acting pass's evictions.
#[tokio::test]
async fn off_or_an_open_breaker_evicts_nothing() {
    let (server, client) = setup().await;
    pod("w0", true, Some("GPU-1234")).create(&server);
    remediator(client.clone(), Mode::Enforce)
        .isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let from = server.calls().len();
    let off = remediator(client.clone(), Mode::Off);
    let out = off.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert!(out.evicted.is_empty() && out.marks.is_none(), "{out:?}");
    assert_eq!(server.calls().len(), from, "{:#?}", &server.calls()[from..]);

    let r = guarded(client, Mode::Enforce);
    trip(&r, &server).await;
    let out = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert!(out.evicted.is_empty(), "{out:?}");
    assert_eq!(support::eviction_calls(&server, "w0", 201), 0);
}

#[tokio::test]
async fn evicts_only_pods_on_the_failed_device_once_and_respects_budgets() {
    let (server, client) = setup().await;
    // On the failed GPU (KEP-4680 says so), on a healthy GPU, no GPU, a DaemonSet pod,
    // a pod whose GPU is unknown to us (no device status: evicted to be safe), and a
    // pod on the failed GPU protected by a budget that allows no disruption.
    pod("on-failed", true, Some("GPU-1234")).create(&server);
    pod("on-healthy", true, Some("GPU-9999")).create(&server);
    pod("cpu-only", false, None).create(&server);
    PodFixture::new("ds-agent", "gpu-1")
        .gpu()
        .owner("DaemonSet")
        .create(&server);
    // On the failed device too, but never evicted: a mirror pod
    // (the kubelet's static pod), a finished one and one already terminating.
    let mut mirror = pod("mirror", true, Some("GPU-1234")).build();
    mirror["metadata"]["annotations"] = json!({"kubernetes.io/config.mirror": "hash"});
    server.create("pods", "default", mirror).unwrap();
    PodFixture::new("finished", "gpu-1")
        .gpu()
        .holds("GPU-1234", "Unhealthy")
        .phase("Succeeded")
        .create(&server);
    let mut leaving = pod("terminating", true, Some("GPU-1234")).build();
    leaving["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    server.create("pods", "default", leaving).unwrap();
    pod("no-status", true, None).create(&server);
    pod("guarded", true, Some("GPU-1234")).create(&server);
    budget_of_one(&server, "guarded");

    let r = remediator(client, Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let fence = Fence::unfenced();
    let first = r.evict("gpu-1", &[], &fence).await.unwrap();
    let names = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|k| k.split('/').nth(1).unwrap().to_string())
            .collect()
    };
    let mut evicted = names(&first.evicted);
    evicted.sort();
    assert_eq!(evicted, vec!["no-status", "on-failed"]);
    assert_eq!(names(&first.blocked), vec!["guarded"]);
    for kept in [
        "on-healthy",
        "cpu-only",
        "ds-agent",
        "guarded",
        "mirror",
        "finished",
        "terminating",
    ] {
        assert!(
            server.get("pods", "default", kept).is_some(),
            "{kept} must stay"
        );
    }
    // A second pass evicts nothing new and still waits on the budget.
    let second = r.evict("gpu-1", &[], &fence).await.unwrap();
    assert!(second.evicted.is_empty());
    assert_eq!(names(&second.blocked), vec!["guarded"]);
    // The budget allows it now.
    server
        .update(
            "poddisruptionbudgets",
            "default",
            "guarded",
            {
                let mut p = server
                    .get("poddisruptionbudgets", "default", "guarded")
                    .unwrap();
                p["spec"]["minAvailable"] = json!(0);
                p
            },
            None,
        )
        .unwrap();
    let third = r.evict("gpu-1", &[], &fence).await.unwrap();
    assert_eq!(names(&third.evicted), vec!["guarded"]);
    // Each pod was asked to leave once, whatever the passes.
    let calls = server.calls();
    // The pods of the node come from the watch cache, not a quorum read.
    let pod_lists: Vec<&str> = calls
        .iter()
        .filter(|c| c.method == "GET" && c.uri.starts_with("/api/v1/pods?"))
        .map(|c| c.uri.as_str())
        .collect();
    assert!(
        !pod_lists.is_empty() && pod_lists.iter().all(|u| u.contains("resourceVersion=0")),
        "{pod_lists:?}"
    );
    for p in ["mirror", "finished", "terminating", "ds-agent"] {
        assert!(
            !calls
                .iter()
                .any(|c| c.uri.contains(&format!("/pods/{p}/eviction"))),
            "{p} must never be asked to leave"
        );
    }
    for p in ["on-failed", "no-status"] {
        let n = calls
            .iter()
            .filter(|c| c.method == "POST" && c.uri.contains(&format!("/pods/{p}/eviction")))
            .count();
        assert_eq!(n, 1, "{p} evicted {n} times");
    }
    let node = server.get("nodes", "", "gpu-1").unwrap();
    let record: Value = serde_json::from_str(
        node["metadata"]["annotations"][RECORD_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["evicted"].as_array().unwrap().len(), 3);
    assert!(record["eviction_blocked"]
        .as_object()
        .is_none_or(|m| m.is_empty()));
}

#[tokio::test]
async fn ten_failed_nodes_against_a_budget_of_three() {
    let (server, client) = setup().await;
    for i in 0..30 {
        let n = NodeFixture::new(&format!("n{i:02}")).label("rack", &format!("r{}", i % 3));
        n.create(&server);
    }
    let r = remediator(client, Mode::Enforce).with_budget(budget(3, 50.0, None));
    let mut isolated = 0;
    let mut held = 0;
    for i in 0..10 {
        // Passes repeat, as the reconcile loop does.
        for _ in 0..2 {
            match r
                .isolate(&format!("n{i:02}"), failed("gpu0"), &Fence::unfenced())
                .await
                .unwrap()
            {
                Outcome::Isolated => isolated += 1,
                Outcome::HeldBack(_) => held += 1,
                Outcome::AlreadyDone => {}
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(isolated, 3);
    assert_eq!(r.held_back().len(), 7);
    assert_eq!(
        held, 14,
        "each held-back node stays held back on every pass"
    );
    let tainted = server
        .list("nodes", "")
        .iter()
        .filter(|n| {
            n["spec"]["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["key"] == "nvidia.com/gpu-fault"))
        })
        .count();
    assert_eq!(tainted, 3);
    assert_eq!(
        events(&server, "FaultlineHeldBack"),
        7,
        "one record per held-back node"
    );
    assert_eq!(events(&server, "FaultlineBudgetExhausted"), 1, "one alert");

    // Per failure domain: at most one per rack.
    let (server, client) = setup().await;
    for i in 0..6 {
        let n = NodeFixture::new(&format!("m{i}")).label("rack", &format!("r{}", i % 2));
        n.create(&server);
    }
    let r = remediator(client, Mode::Enforce).with_budget(budget(10, 100.0, Some(("rack", 1))));
    let outcomes: Vec<bool> = futures_util::future::join_all((0..4).map(|i| {
        let r = &r;
        async move {
            matches!(
                r.isolate(&format!("m{i}"), failed("gpu0"), &Fence::unfenced())
                    .await
                    .unwrap(),
                Outcome::Isolated
            )
        }
    }))
    .await;
    assert_eq!(outcomes.iter().filter(|o| **o).count(), 2, "{outcomes:?}");
}

#[tokio::test]
async fn the_breaker_stops_everything_until_a_person_closes_it() {
    let (server, client) = setup().await;
    for i in 0..5 {
        NodeFixture::new(&format!("b{i}")).create(&server);
    }
    let breaker = faultline_aggregator::remediate::Breaker::new(
        kube::Api::namespaced(client.clone(), "faultline"),
        "faultline-breaker".into(),
        3,
        std::time::Duration::from_secs(300),
    );
    let r = remediator(client, Mode::Enforce)
        .with_budget(budget(100, 100.0, None))
        .with_breaker(Some(breaker), 0.0);
    let mut outcomes = Vec::new();
    for i in 0..5 {
        let n = format!("b{i}");
        r.note_failure(&n).await.unwrap();
        outcomes.push(
            r.isolate(&n, failed("gpu0"), &Fence::unfenced())
                .await
                .unwrap(),
        );
    }
    assert_eq!(outcomes[..2], [Outcome::Isolated, Outcome::Isolated]);
    assert!(
        outcomes[2..].iter().all(|o| *o == Outcome::BreakerOpen),
        "{outcomes:?}"
    );
    let cm = server
        .get("configmaps", "faultline", "faultline-breaker")
        .unwrap();
    assert_eq!(cm["data"]["state"], "open");
    // Nothing moves, even for a node already known, until a person closes it.
    assert_eq!(
        r.isolate("b3", failed("gpu0"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::BreakerOpen
    );
    let mut cm = cm;
    cm["data"]["state"] = json!("closed");
    server
        .update("configmaps", "faultline", "faultline-breaker", cm, None)
        .unwrap();
    assert_eq!(
        r.isolate("b3", failed("gpu0"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
}

/// A person's release (`faultline release`: the annotations on the Node) goes through
/// with the breaker open: the taint and the record go, the record moves to the Node's
/// history with the person's reason, and the request is cleared.
#[tokio::test]
async fn a_persons_release_goes_through_an_open_breaker_and_leaves_no_request() {
    use faultline_aggregator::remediate::{
        HISTORY_ANNOTATION, RELEASE_ANNOTATION, RELEASE_BY_ANNOTATION, RELEASE_REASON_ANNOTATION,
    };
    let (server, client) = setup().await;
    let r = guarded(client, Mode::Enforce);
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    trip(&r, &server).await;
    let mut n = server.get("nodes", "", "gpu-1").unwrap();
    let a = &mut n["metadata"]["annotations"];
    a[RELEASE_ANNOTATION] = json!("all");
    a[RELEASE_BY_ANNOTATION] = json!("user:alice");
    a[RELEASE_REASON_ANNOTATION] = json!("reseated the GPU");
    server.update("nodes", "", "gpu-1", n, None).unwrap();

    assert_eq!(
        r.release_pass("gpu-1", &[], 0, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Released
    );
    let n = server.get("nodes", "", "gpu-1").unwrap();
    let a = &n["metadata"]["annotations"];
    for key in [
        RECORD_ANNOTATION,
        RELEASE_ANNOTATION,
        RELEASE_BY_ANNOTATION,
        RELEASE_REASON_ANNOTATION,
    ] {
        assert!(a[key].is_null(), "{key} left: {a}");
    }
    assert!(
        a[HISTORY_ANNOTATION]
            .as_str()
            .is_some_and(|h| h.contains("reseated the GPU")),
        "{a}"
    );
    assert_eq!(support::our_taints(&server, "gpu-1"), 0);
}

/// The budget's ledger (`faultline-budget`): a quarantine's place is taken before its
/// taint and goes with its release; a place whose taint never landed (another replica's
/// pass that failed) holds room until `PLACE_TTL`, then the next decision drops it; a
/// ledger that does not parse stops quarantines with a clear error rather than
/// undercount.
#[tokio::test]
async fn the_budget_ledger_frees_places_on_release_and_expiry() {
    use faultline_aggregator::remediate::policy::PLACE_TTL;
    use faultline_aggregator::remediate::{ReleaseRequest, RemediateError};
    let (server, client) = setup().await;
    for n in ["a", "b", "c", "d"] {
        NodeFixture::new(n).create(&server);
    }
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_budget(budget(1, 100.0, None))
        .with_clock(clock.clone());
    let fence = Fence::unfenced();
    let ledger = || {
        let cm = server
            .get("configmaps", "faultline", "faultline-budget")
            .unwrap();
        let places: Value = serde_json::from_str(cm["data"]["nodes"].as_str().unwrap()).unwrap();
        (cm, places)
    };
    assert_eq!(
        r.isolate("a", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let (_, places) = ledger();
    assert_eq!(places["a"]["by"], "replica-0", "{places}");
    assert_eq!(places.as_object().unwrap().len(), 1);
    let release = ReleaseRequest {
        devices: vec![],
        actor: "user:ann".into(),
        reason: "repaired".into(),
    };
    assert_eq!(
        r.release("a", release, &fence).await.unwrap(),
        Outcome::Released
    );
    let (mut cm, places) = ledger();
    assert_eq!(places, json!({}), "the place went with the release");

    // Another replica took b's place and its taint never landed.
    let stale = json!({"b": {"at": clock.rfc3339(), "by": "replica-1"}});
    cm["data"]["nodes"] = json!(stale.to_string());
    server
        .update("configmaps", "faultline", "faultline-budget", cm, None)
        .unwrap();
    let held = r.isolate("c", failed("gpu0"), &fence).await.unwrap();
    assert!(
        matches!(&held, Outcome::HeldBack(why) if why == "1 nodes quarantined, budget 1"),
        "{held:?}"
    );
    clock.advance(PLACE_TTL - std::time::Duration::from_secs(1));
    assert!(matches!(
        r.isolate("c", failed("gpu0"), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    clock.advance(std::time::Duration::from_secs(1));
    assert_eq!(
        r.isolate("c", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let (mut cm, places) = ledger();
    assert_eq!(
        places.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["c"],
        "b's place expired"
    );

    // A ledger that does not parse: no quarantine, a clear error, nothing written.
    cm["data"]["nodes"] = json!("{not json");
    server
        .update("configmaps", "faultline", "faultline-budget", cm, None)
        .unwrap();
    let r2 = r.with_budget(budget(5, 100.0, None));
    let err = r2.isolate("d", failed("gpu0"), &fence).await.unwrap_err();
    assert!(
        matches!(&err, RemediateError::Record(name, why) if name == "faultline-budget" && why.contains("budget ledger nodes")),
        "{err}"
    );
    assert_eq!(err.metric_label(), "record");
    let d = server.get("nodes", "", "d").unwrap();
    assert!(d["spec"]["taints"].is_null(), "{d}");
}

/// Two replicas take places in the budget's ledger at once: both read it at one
/// resourceVersion, and the second write meets 409 and is made again from a fresh read
/// (the compare-and-swap), so both quarantines land with a place each. A 500 on the
/// ledger's write is no conflict: the pass fails with it at once, one write made,
/// nothing tainted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn places_taken_at_once_meet_a_conflict_and_read_again() {
    let (server, client) = setup().await;
    for n in ["a", "b", "c"] {
        NodeFixture::new(n).create(&server);
    }
    let ledger = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "faultline-budget", "namespace": "faultline"},
        "data": {"nodes": "{}"}
    });
    server.create("configmaps", "faultline", ledger).unwrap();
    let replica = |actor: &str| {
        let ledger = Ledger::new(
            kube::Api::namespaced(client.clone(), support::NS),
            "faultline-budget".into(),
        );
        Remediator::new(
            client.clone(),
            Mode::Enforce,
            "nvidia.com/gpu-fault",
            "default",
            actor,
        )
        .with_budget(budget(2, 100.0, None))
        .with_budget_ledger(Some(ledger))
    };
    let (r0, r1) = (replica("replica-0"), replica("replica-1"));
    // Both read the ledger before either write lands.
    server.set_faults(Faults {
        latency_ms: 500,
        latency_method: "PUT".into(),
        latency_match: "/configmaps/faultline-budget".into(),
        ..Default::default()
    });
    let fence = Fence::unfenced();
    let (a, b) = tokio::join!(
        r0.isolate("a", failed("gpu0"), &fence),
        r1.isolate("b", failed("gpu0"), &fence)
    );
    assert_eq!(
        (a.unwrap(), b.unwrap()),
        (Outcome::Isolated, Outcome::Isolated)
    );
    let puts: Vec<u16> = server
        .calls()
        .iter()
        .filter(|c| c.method == "PUT" && c.uri.contains("/configmaps/faultline-budget"))
        .map(|c| c.status)
        .collect();
    assert!(puts.contains(&409), "no conflict met: {puts:?}");
    let cm = server
        .get("configmaps", "faultline", "faultline-budget")
        .unwrap();
    let places: Value = serde_json::from_str(cm["data"]["nodes"].as_str().unwrap()).unwrap();
    assert_eq!(places["a"]["by"], "replica-0", "{places}");
    assert_eq!(places["b"]["by"], "replica-1", "{places}");

    // A 500 on the write: no retry, no taint.
    server.set_faults(Faults {
        write_error_rate: 1.0,
        ..Default::default()
    });
    let before = server.calls().len();
    let r0 = r0.with_budget(budget(3, 100.0, None));
    let err = r0.isolate("c", failed("gpu0"), &fence).await.unwrap_err();
    assert!(
        matches!(&err, faultline_aggregator::remediate::RemediateError::Api(kube::Error::Api(s)) if s.code == 500),
        "{err}"
    );
    let writes = server.calls()[before..]
        .iter()
        .filter(|c| c.method == "PUT" && c.uri.contains("/configmaps/faultline-budget"))
        .count();
    assert_eq!(writes, 1, "one write, not retried");
    server.set_faults(Faults::default());
    assert!(server.get("nodes", "", "c").unwrap()["spec"]["taints"].is_null());
}

/// After an upgrade the ledger is new while Nodes are already quarantined: they count
/// from the Nodes themselves (the devices label), except a node quarantined for its
/// devices alone and one the unknown guard tainted. With the budget full the share's
/// base (every accelerator Node) is not even listed; below it, the share binds through
/// the guard as in the table test.
#[tokio::test]
async fn nodes_quarantined_before_the_ledger_count_and_the_share_binds() {
    let (server, client) = setup().await;
    let q = "faultline.io/quarantine-scope";
    NodeFixture::new("old1")
        .label(DEVICES_LABEL, "gpu0")
        .create(&server);
    NodeFixture::new("old2")
        .label(DEVICES_LABEL, "gpu1")
        .create(&server);
    NodeFixture::new("dev")
        .label(DEVICES_LABEL, "gpu0")
        .label(q, "device")
        .create(&server);
    NodeFixture::new("unk")
        .label(DEVICES_LABEL, "unknown")
        .create(&server);
    for n in ["new1", "new2", "new3"] {
        NodeFixture::new(n).create(&server);
    }
    let r = remediator(client.clone(), Mode::Enforce).with_budget(budget(3, 100.0, None));
    let fence = Fence::unfenced();
    assert_eq!(
        r.isolate("new1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let before = server.calls().len();
    let held = r.isolate("new2", failed("gpu0"), &fence).await.unwrap();
    assert!(
        matches!(&held, Outcome::HeldBack(why) if why == "3 nodes quarantined, budget 3"),
        "old1, old2 and new1 count; dev and unk do not: {held:?}"
    );
    let whole = server.calls()[before..]
        .iter()
        .filter(|c| {
            c.method == "GET"
                && c.uri.starts_with("/api/v1/nodes?")
                && !c.uri.contains("labelSelector")
        })
        .count();
    assert_eq!(whole, 0, "the budget full: no list of every Node");
    // Below the count, the share: 8 nodes, 30%: a third of 8 would be 38%.
    let r = remediator(client, Mode::Enforce).with_budget(budget(10, 30.0, None));
    let held = r.isolate("new3", failed("gpu0"), &fence).await.unwrap();
    assert!(
        matches!(&held, Outcome::HeldBack(why) if why.contains("4 of 8 nodes would be quarantined (50%)")),
        "{held:?}"
    );
}

/// A pass that took a place and surely did not write gives it back at once: here the
/// fence was lost before the taint was sent.
#[tokio::test]
async fn a_place_whose_taint_surely_did_not_land_is_given_back() {
    use faultline_aggregator::remediate::RemediateError;
    use faultline_aggregator::shard::Held;
    let (server, client) = setup().await;
    NodeFixture::new("a").create(&server);
    let r = remediator(client, Mode::Enforce).with_budget(budget(1, 100.0, None));
    let places = || {
        let cm = server
            .get("configmaps", "faultline", "faultline-budget")
            .unwrap();
        serde_json::from_str::<Value>(cm["data"]["nodes"].as_str().unwrap()).unwrap()
    };
    let lost = Fence::shard(Held::default(), 0);
    let err = r.isolate("a", failed("gpu0"), &lost).await.unwrap_err();
    assert!(matches!(err, RemediateError::NotHolder), "{err}");
    assert_eq!(places(), json!({}), "the place went back");
    assert_eq!(
        r.isolate("a", failed("gpu0"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    assert_eq!(places()["a"]["by"], "replica-0");
}

/// A taint is written under its place only while the place is younger than half its
/// time to live, timed from before the ledger's write: here that write takes half the
/// TTL (the compare-and-swap can take 8 reads and writes), so the pass stops before the
/// taint, says why (metric kind `budget`), and gives the place back. A node whose place
/// is fresh is tainted as ever.
#[tokio::test]
async fn a_taint_is_not_written_under_a_place_older_than_half_its_ttl() {
    use faultline_aggregator::remediate::policy::PLACE_TTL;
    use faultline_aggregator::remediate::RemediateError;
    let (server, client) = setup().await;
    for n in ["a", "b"] {
        NodeFixture::new(n).create(&server);
    }
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_budget(budget(5, 100.0, None))
        .with_clock(clock.clone());
    let fence = Fence::unfenced();
    assert_eq!(
        r.isolate("a", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    // b's place: the ledger's write (a PUT now that it exists) answers after 500 ms,
    // while the clock moves on by half the TTL.
    server.set_faults(Faults {
        latency_ms: 500,
        latency_match: "/configmaps/faultline-budget".into(),
        latency_method: "PUT".into(),
        ..Default::default()
    });
    let (result, ()) = tokio::join!(r.isolate("b", failed("gpu0"), &fence), async {
        // The ledger's write is in the server, its answer delayed.
        support::until_received(&server, "PUT", "/configmaps/faultline-budget").await;
        clock.advance(PLACE_TTL / 2);
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, RemediateError::PlaceExpired(took) if took >= PLACE_TTL / 2),
        "{err}"
    );
    assert_eq!(err.metric_label(), "budget");
    let b = server.get("nodes", "", "b").unwrap();
    assert!(
        b["spec"]["taints"].is_null(),
        "tainted under a stale place: {b}"
    );
    let places = ledger_places(&server, "nodes");
    assert_eq!(
        places.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["a"],
        "b's place went back: {places}"
    );
    // The ledger fast again: b is quarantined.
    server.set_faults(Faults::default());
    assert_eq!(
        r.isolate("b", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
}

/// A node already quarantined takes no new place when another of its devices fails:
/// the budget counts nodes, and this one is counted. With the budget full (two
/// quarantined, the budget lowered to one since), the second device still joins the
/// record, and nothing is held back.
#[tokio::test]
async fn a_quarantined_node_is_not_held_back_for_its_next_failed_device() {
    let (server, client) = setup().await;
    for n in ["a", "b"] {
        NodeFixture::new(n).create(&server);
    }
    let fence = Fence::unfenced();
    let r = remediator(client, Mode::Enforce).with_budget(budget(2, 100.0, None));
    for n in ["a", "b"] {
        assert_eq!(
            r.isolate(n, failed("gpu0"), &fence).await.unwrap(),
            Outcome::Isolated
        );
    }
    let r = r.with_budget(budget(1, 100.0, None));
    assert_eq!(
        r.isolate("a", failed("gpu1"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let (ids, record) = record_ids(&server, "a");
    assert_eq!(ids, ["gpu0", "gpu1"], "{record}");
    assert_eq!(events(&server, "FaultlineHeldBack"), 0);
}

/// Someone else's `faultline.io/unhealthy-devices` label (another tool, or a person) is
/// theirs: a quarantine neither overwrites it nor claims it, pass after pass.
#[tokio::test]
async fn a_devices_label_set_by_someone_else_is_left_alone() {
    let (server, client) = setup().await;
    NodeFixture::new("a")
        .label(DEVICES_LABEL, "theirs")
        .create(&server);
    let r = remediator(client, Mode::Enforce);
    let fence = Fence::unfenced();
    for _ in 0..2 {
        assert!(matches!(
            r.isolate("a", failed("gpu0"), &fence).await.unwrap(),
            Outcome::Isolated | Outcome::AlreadyDone
        ));
    }
    let a = server.get("nodes", "", "a").unwrap();
    assert_eq!(a["metadata"]["labels"][DEVICES_LABEL], "theirs", "{a}");
    let record = record(&server, "a").unwrap();
    assert_eq!(record["owned_label"], false, "{record}");
    // Nor is it removed on release.
    let req = faultline_aggregator::remediate::ReleaseRequest {
        devices: vec![],
        actor: "user:bob".into(),
        reason: "fixed".into(),
    };
    assert_eq!(
        r.release("a", req, &fence).await.unwrap(),
        Outcome::Released
    );
    let a = server.get("nodes", "", "a").unwrap();
    assert_eq!(a["metadata"]["labels"][DEVICES_LABEL], "theirs", "{a}");
}

/// A person's release request (`faultline.io/release` on the Node) is cleared once
/// acted on, and only by a replica that acts: a dry run writes nothing. A request for
/// a node without a quarantine, or naming no quarantined device, is cleared (and the
/// quarantine kept); one naming every quarantined device releases the node.
#[tokio::test]
async fn release_requests_are_cleared_only_when_acting() {
    use faultline_aggregator::remediate::RELEASE_ANNOTATION;
    let (server, client) = setup().await;
    let ask = |server: &ApiServer, devices: &str| {
        let mut n = server.get("nodes", "", "gpu-1").unwrap();
        n["metadata"]["annotations"][RELEASE_ANNOTATION] = json!(devices);
        server.update("nodes", "", "gpu-1", n, None).unwrap();
    };
    let asked = |server: &ApiServer| {
        server.get("nodes", "", "gpu-1").unwrap()["metadata"]["annotations"][RELEASE_ANNOTATION]
            .as_str()
            .map(String::from)
    };
    let node_writes = |server: &ApiServer| {
        server
            .calls()
            .iter()
            .filter(|c| c.method == "PATCH" && c.uri.contains("/nodes/gpu-1"))
            .count()
    };
    let fence = Fence::unfenced();
    let dry = remediator(client.clone(), Mode::DryRun);
    let act = remediator(client, Mode::Enforce);

    // No quarantine, no request: nothing written.
    assert_eq!(
        act.release_pass("gpu-1", &[], 0, &fence).await.unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(node_writes(&server), 0);
    // No quarantine, a request: a dry run leaves it; acting clears it.
    ask(&server, "all");
    dry.release_pass("gpu-1", &[], 0, &fence).await.unwrap();
    assert_eq!(asked(&server).as_deref(), Some("all"));
    assert_eq!(node_writes(&server), 0);
    act.release_pass("gpu-1", &[], 0, &fence).await.unwrap();
    assert_eq!(asked(&server), None);

    // A quarantine of gpu3 and gpu5; a request naming neither: cleared, both kept.
    let mut two = failed("gpu3");
    two.extend(failed("gpu5"));
    assert_eq!(
        act.isolate("gpu-1", two, &fence).await.unwrap(),
        Outcome::Isolated
    );
    ask(&server, "gpu7");
    act.release_pass("gpu-1", &[], 0, &fence).await.unwrap();
    assert_eq!(asked(&server), None);
    assert_eq!(record_ids(&server, "gpu-1").0, ["gpu3", "gpu5"]);
    // A request naming both: the whole node, as `all`.
    ask(&server, "gpu3,gpu5");
    assert_eq!(
        act.release_pass("gpu-1", &[], 0, &fence).await.unwrap(),
        Outcome::Released
    );
    assert!(record(&server, "gpu-1").is_none(), "released whole");
    assert_eq!(support::our_taints(&server, "gpu-1"), 0);
}

/// The quarantines counted in `remediation_actions_total`.
fn quarantines(metrics: &faultline_aggregator::metrics::Metrics) -> u64 {
    metrics
        .encode()
        .lines()
        .find(|l| {
            l.contains("remediation_actions_total{")
                && l.contains("action=\"quarantine\",result=\"ok\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A pass whose Event was refused (the API server shedding load) has quarantined the
/// node; the next pass finds it done and announces it then. The quarantine is counted
/// once however many passes meet it, and again when another device joins it.
#[tokio::test]
async fn a_lost_announcement_is_made_by_the_next_pass_and_counted_once() {
    let (server, client) = setup().await;
    let metrics = std::sync::Arc::new(faultline_aggregator::metrics::Metrics::new());
    let r = remediator(client, Mode::Enforce).with_reporting(None, Some(metrics.clone()));
    let fence = Fence::unfenced();
    server.set_faults(Faults {
        throttle_rate: 1.0,
        throttle_match: "/events".into(),
        ..Default::default()
    });
    assert_eq!(
        r.isolate("gpu-1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(events(&server, "FaultlineQuarantined"), 0);
    assert_eq!(quarantines(&metrics), 1);
    server.set_faults(Faults::default());
    assert_eq!(
        r.isolate("gpu-1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(
        events(&server, "FaultlineQuarantined"),
        1,
        "announced by the next pass"
    );
    assert_eq!(
        quarantines(&metrics),
        1,
        "the same quarantine counted twice"
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu1"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(quarantines(&metrics), 2, "gpu1 joined the quarantine");
}

/// An old quarantine was announced long ago, and its Event may have expired (1 h by
/// default): a pass that finds it done announces nothing again, even on a replica
/// that never saw that Event.
#[tokio::test]
async fn an_old_quarantine_is_not_announced_again() {
    use faultline_aggregator::remediate::record::ANNOUNCE_RETRY_SECS;
    let (server, client) = setup().await;
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client.clone(), Mode::Enforce).with_clock(clock.clone());
    let fence = Fence::unfenced();
    assert_eq!(
        r.isolate("gpu-1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    for e in server.list("events", "default") {
        let name = e["metadata"]["name"].as_str().unwrap();
        server.delete("events", "default", name).unwrap();
    }
    clock.advance(std::time::Duration::from_secs_f64(
        ANNOUNCE_RETRY_SECS + 1.0,
    ));
    // Another replica (or this one restarted): it knows no Event of its own.
    let other = remediator(client, Mode::Enforce).with_clock(clock.clone());
    assert_eq!(
        other
            .isolate("gpu-1", failed("gpu0"), &fence)
            .await
            .unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(events(&server, "FaultlineQuarantined"), 0);
}

/// Our taint key on a node with no record of ours (put there by hand, or its record
/// lost): the unknown guard leaves the node as it is.
#[tokio::test]
async fn the_unknown_guard_leaves_a_node_with_our_taint_and_no_record() {
    let (server, client) = setup().await;
    NodeFixture::new("t")
        .taint("nvidia.com/gpu-fault", "")
        .create(&server);
    let b = Budget {
        max_unknown: 5,
        ..Budget::default()
    };
    let r = remediator(client, Mode::Enforce).with_budget(b);
    let unknown = vec![RecordDevice::new("gpu0", "no-fresh-data")];
    assert_eq!(
        r.guard_unknown("t", unknown, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::AlreadyDone
    );
    let t = server.get("nodes", "", "t").unwrap();
    assert_eq!(t["spec"]["taints"].as_array().unwrap().len(), 1, "{t}");
    assert!(
        t["metadata"]["annotations"][RECORD_ANNOTATION].is_null(),
        "{t}"
    );
}

/// The unknown guard takes its place under the ledger's `unknown` key, gives it back
/// when its taint surely did not land (the shard's Lease lost), and labels the node
/// `unknown` only where nobody labelled it.
#[tokio::test]
async fn the_unknown_guard_takes_its_place_gives_it_back_and_labels_only_free_nodes() {
    use faultline_aggregator::remediate::RemediateError;
    use faultline_aggregator::shard::Held;
    let (server, client) = setup().await;
    NodeFixture::new("u1").create(&server);
    NodeFixture::new("u2")
        .label(DEVICES_LABEL, "theirs")
        .create(&server);
    NodeFixture::new("u3").create(&server);
    let b = Budget {
        max_unknown: 5,
        ..Budget::default()
    };
    let r = remediator(client, Mode::Enforce).with_budget(b);
    let unknown = || vec![RecordDevice::new("gpu0", "no-fresh-data")];
    let places = || ledger_places(&server, "unknown");
    let lost = Fence::shard(Held::default(), 0);
    let err = r.guard_unknown("u3", unknown(), &lost).await.unwrap_err();
    assert!(matches!(err, RemediateError::NotHolder), "{err}");
    assert_eq!(places(), json!({}), "u3's place went back");
    for n in ["u1", "u2"] {
        assert_eq!(
            r.guard_unknown(n, unknown(), &Fence::unfenced())
                .await
                .unwrap(),
            Outcome::Isolated
        );
    }
    let taken = places();
    let mut names: Vec<&String> = taken.as_object().unwrap().keys().collect();
    names.sort();
    assert_eq!(names, ["u1", "u2"], "{taken}");
    let label =
        |n: &str| server.get("nodes", "", n).unwrap()["metadata"]["labels"][DEVICES_LABEL].clone();
    assert_eq!(label("u1"), "unknown");
    assert_eq!(label("u2"), "theirs");
    assert!(label("u3").is_null());
}

/// Remediation off does nothing and reads nothing, whatever failed; and a pass with no
/// device asks nothing either.
#[tokio::test]
async fn remediation_off_or_no_device_reads_and_writes_nothing() {
    let (server, client) = setup().await;
    let before = server.calls().len();
    let off = remediator(client.clone(), Mode::Off);
    assert_eq!(
        off.isolate("gpu-1", failed("gpu0"), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Off
    );
    let on = remediator(client, Mode::Enforce);
    assert_eq!(
        on.isolate("gpu-1", vec![], &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Off
    );
    let calls = server.calls();
    assert_eq!(calls.len(), before, "{:#?}", &calls[before..]);
    let n = server.get("nodes", "", "gpu-1").unwrap();
    assert!(
        n["metadata"]["annotations"][RECORD_ANNOTATION].is_null(),
        "{n}"
    );
}

/// Our condition gone (someone cleared it) while the taint and the record stay: the
/// next pass writes the condition again, though the Node has other conditions at False
/// (a healthy node's NetworkUnavailable, MemoryPressure and the rest are).
#[tokio::test]
async fn a_lost_condition_is_written_again_beside_other_false_conditions() {
    let (server, client) = setup().await;
    let r = remediator(client, Mode::Enforce);
    let fence = Fence::unfenced();
    assert_eq!(
        r.isolate("gpu-1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let mut node = server.get("nodes", "", "gpu-1").unwrap();
    node["status"]["conditions"] = json!([
        {"type": "Ready", "status": "True"},
        {"type": "MemoryPressure", "status": "False"},
        {"type": "NetworkUnavailable", "status": "False"},
    ]);
    server
        .update("nodes", "", "gpu-1", node, Some("status"))
        .unwrap();
    assert_eq!(
        r.isolate("gpu-1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let node = server.get("nodes", "", "gpu-1").unwrap();
    let ours: Vec<&Value> = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["type"] == CONDITION)
        .collect();
    assert_eq!(ours.len(), 1, "{node}");
    assert_eq!(ours[0]["status"], "False");
}

#[tokio::test]
async fn evictions_are_rate_limited_and_the_rest_wait() {
    let (server, client) = setup().await;
    for i in 0..4 {
        pod(&format!("w{i}"), true, None).create(&server);
    }
    let r = remediator(client, Mode::Enforce).with_breaker(None, 2.0);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let first = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(
        (first.evicted.len(), first.blocked.len()),
        (2, 2),
        "{first:?}"
    );
    // The evicted two are Terminating (pkg/registry/core/pod/strategy.go); the others
    // run on.
    assert_eq!(running(&server).len(), 2);
}

/// The pods not being deleted.
fn running(server: &ApiServer) -> Vec<Value> {
    server
        .list("pods", "default")
        .into_iter()
        .filter(|p| p.pointer("/metadata/deletionTimestamp").is_none())
        .collect()
}

#[tokio::test]
async fn unknown_past_the_tolerance_taints_never_evicts_and_notready_is_left_alone() {
    let (server, client) = setup().await;
    pod("w0", true, None).create(&server);
    NodeFixture::new("down").ready(false).create(&server);
    let r = remediator(client, Mode::Enforce);
    let unknown = vec![RecordDevice::new("gpu0", "no-fresh-data")];
    assert_eq!(
        r.guard_unknown("down", unknown.clone(), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::LeftToKubernetes
    );
    assert!(server.get("nodes", "", "down").unwrap()["spec"].is_null());
    assert_eq!(
        r.guard_unknown("gpu-1", unknown.clone(), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    assert_eq!(
        r.guard_unknown("gpu-1", unknown, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::AlreadyDone
    );
    let node = server.get("nodes", "", "gpu-1").unwrap();
    let ours: Vec<&Value> = node["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["key"] == "nvidia.com/gpu-fault")
        .collect();
    assert_eq!(ours.len(), 1);
    assert_eq!(
        (ours[0]["value"].as_str(), ours[0]["effect"].as_str()),
        (Some("unknown"), Some("NoSchedule"))
    );
    // No eviction for unknown, whatever pass runs.
    let e = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert!(e.evicted.is_empty() && e.blocked.is_empty(), "{e:?}");
    assert!(server.get("pods", "default", "w0").is_some());
    assert_eq!(events(&server, "FaultlineUnknownCordoned"), 1);
}

/// Found by the randomized schedules: a held-back node whose announcement the
/// API refused (a 500 on the Event) is announced by the next pass, not left silent.
#[tokio::test]
async fn a_refused_held_back_announcement_is_made_by_the_next_pass() {
    let (server, client) = setup().await;
    for n in ["h1", "h2"] {
        NodeFixture::new(n).create(&server);
    }
    let r = remediator(client, Mode::Enforce).with_budget(budget(1, 100.0, None));
    let fence = Fence::unfenced();
    assert_eq!(
        r.isolate("h1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    server.set_faults(Faults {
        write_error_rate: 1.0,
        ..Default::default()
    });
    assert!(matches!(
        r.isolate("h2", failed("gpu0"), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    assert_eq!(
        events(&server, "FaultlineHeldBack"),
        0,
        "the API refused it"
    );
    server.set_faults(Faults::default());
    assert!(matches!(
        r.isolate("h2", failed("gpu0"), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    assert_eq!(events(&server, "FaultlineHeldBack"), 1);
    assert!(matches!(
        r.isolate("h2", failed("gpu0"), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    assert_eq!(events(&server, "FaultlineHeldBack"), 1, "still one");
}

/// The breaker counts cluster-wide. Two replicas (two breakers
/// over one ConfigMap) each seeing some failures trip it together at the threshold, a
/// restarted replica (a new breaker) keeps the count, concurrent notes lose none
/// (compare-and-swap), and a person's close starts the count afresh.
#[tokio::test]
async fn the_breaker_counts_across_replicas_and_restarts() {
    let (server, client) = setup().await;
    let breaker = || {
        faultline_aggregator::remediate::Breaker::new(
            kube::Api::namespaced(client.clone(), "faultline"),
            "faultline-breaker".into(),
            4,
            std::time::Duration::from_secs(300),
        )
    };
    let (a, b) = (breaker(), breaker());
    // Concurrent notes from both replicas: none lost.
    let (x, y) = tokio::join!(a.note_failure("n1"), b.note_failure("n2"));
    assert!(!x.unwrap() && !y.unwrap());
    assert!(!a.note_failure("n1").await.unwrap(), "a node counts once");
    // Replica b restarts: a new breaker, the same count.
    let b = breaker();
    assert!(!b.note_failure("n3").await.unwrap());
    assert!(
        a.note_failure("n4").await.unwrap(),
        "the fourth node trips it"
    );
    assert!(b.is_open().await.unwrap());
    let cm = server
        .get("configmaps", "faultline", "faultline-breaker")
        .unwrap();
    assert_eq!(cm["data"]["state"], "open");
    let failures: serde_json::Map<String, Value> =
        serde_json::from_str(cm["data"]["failures"].as_str().unwrap()).unwrap();
    assert_eq!(failures.len(), 4);
    // A person closes it (by hand, without clearing the count): counting starts afresh.
    let mut cm = cm;
    cm["data"]["state"] = json!("closed");
    server
        .update("configmaps", "faultline", "faultline-breaker", cm, None)
        .unwrap();
    assert!(!b.note_failure("n5").await.unwrap());
    assert!(!a.is_open().await.unwrap());
    // Concurrent notes on the existing ConfigMap: both read it before either writes
    // (join polls a, then b, before any answer), so a replace without the
    // resourceVersion read would lose one of them.
    let (x, y) = tokio::join!(a.note_failure("n6"), b.note_failure("n7"));
    assert!(!x.unwrap() && !y.unwrap());
    let cm = server
        .get("configmaps", "faultline", "faultline-breaker")
        .unwrap();
    let failures: serde_json::Map<String, Value> =
        serde_json::from_str(cm["data"]["failures"].as_str().unwrap()).unwrap();
    assert_eq!(
        failures.keys().collect::<Vec<_>>(),
        ["n5", "n6", "n7"],
        "no note lost to a concurrent replace"
    );
}

/// The unknown guard has its own budget. It taints at most
/// `max_unknown` nodes, and the nodes it tainted do not use the quarantine budget, so
/// a blind spot cannot hold back real failures.
#[tokio::test]
async fn the_unknown_guard_has_its_own_budget() {
    let (server, client) = setup().await;
    for n in ["u1", "u2", "f1"] {
        NodeFixture::new(n).create(&server);
    }
    let b = Budget {
        max_nodes: 1,
        max_percent: 100.0,
        max_unknown: 1,
        ..Budget::default()
    };
    let r = remediator(client, Mode::Enforce).with_budget(b);
    let unknown = vec![RecordDevice::new("gpu0", "no-fresh-data")];
    let fence = Fence::unfenced();
    assert_eq!(
        r.guard_unknown("u1", unknown.clone(), &fence)
            .await
            .unwrap(),
        Outcome::Isolated
    );
    assert!(matches!(
        r.guard_unknown("u2", unknown, &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    assert!(server.get("nodes", "", "u2").unwrap()["spec"]["taints"].is_null());
    // The quarantine budget (one node) is still free for a real failure.
    assert_eq!(
        r.isolate("f1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
}

/// Found by the randomized schedules: a node the unknown guard tainted is not
/// quarantined yet, so when a device of it then fails, the quarantine asks the budget
/// like any other. It skipped it (the record and the taint were there), and a third node
/// was quarantined under a budget of two.
#[tokio::test]
async fn a_node_tainted_for_unknown_devices_asks_the_budget_when_a_device_fails() {
    let (server, client) = setup().await;
    for n in ["f1", "u1"] {
        NodeFixture::new(n).create(&server);
    }
    let b = Budget {
        max_nodes: 1,
        max_percent: 100.0,
        max_unknown: 1,
        ..Budget::default()
    };
    let r = remediator(client, Mode::Enforce).with_budget(b);
    let fence = Fence::unfenced();
    let unknown = vec![RecordDevice::new("gpu0", "no-fresh-data")];
    assert_eq!(
        r.guard_unknown("u1", unknown, &fence).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(
        r.isolate("f1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    // The budget (one node) is used: u1's failure is held back, its record stays the
    // unknown guard's.
    assert!(matches!(
        r.isolate("u1", failed("gpu0"), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
    let u1 = server.get("nodes", "", "u1").unwrap();
    let record: Value = serde_json::from_str(
        u1["metadata"]["annotations"]["faultline.io/quarantine"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["unknown_only"], true, "{record}");
    assert_eq!(events(&server, "FaultlineHeldBack"), 1);
    // Room again (a budget of two): u1's failure quarantines it, and its record
    // names the failed device alone, not the unknown guard's.
    let r = r.with_budget(Budget {
        max_nodes: 2,
        max_percent: 100.0,
        max_unknown: 1,
        ..Budget::default()
    });
    assert_eq!(
        r.isolate("u1", failed("gpu3"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    let (ids, record) = record_ids(&server, "u1");
    assert_ne!(record["unknown_only"], true, "{record}");
    assert_eq!(ids, ["gpu3"], "the unknown guard's device joined: {record}");
}

/// A quarantine past its expiry that cannot be released (manual mode, or the device
/// still failed) is extended by another period and announced once per expiry; a
/// partial release keeps the rest quarantined and holds the released device back.
#[tokio::test]
async fn an_expired_quarantine_is_extended_and_a_partial_release_keeps_the_rest() {
    use faultline_aggregator::remediate::{ReleasePolicy, ReleaseRequest};
    let (server, client) = setup().await;
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_release(ReleasePolicy {
            expiry: std::time::Duration::from_secs(1),
            ..ReleasePolicy::default()
        })
        .with_clock(clock.clone());
    let mut two = failed("gpu3");
    two.extend(failed("gpu5"));
    assert_eq!(
        r.isolate("gpu-1", two.clone(), &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    let first = gpu1_record(&server)["expiry"].as_str().unwrap().to_string();
    // Not expired yet: waiting for a person, nothing written.
    assert!(matches!(
        r.release_pass("gpu-1", &[], 0, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Waiting(_)
    ));
    assert_eq!(gpu1_record(&server)["expiry"], first);
    // Past the expiry, on the remediator's clock (moved, not slept).
    clock.advance(std::time::Duration::from_millis(1100));
    assert!(matches!(
        r.release_pass("gpu-1", &[], 0, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Waiting(_)
    ));
    let second = gpu1_record(&server)["expiry"].as_str().unwrap().to_string();
    assert!(second > first, "extended: {first} -> {second}");
    assert_eq!(events(&server, "FaultlineQuarantineExtended"), 1);
    // Again before the new expiry: nothing more.
    r.release_pass("gpu-1", &[], 0, &Fence::unfenced())
        .await
        .unwrap();
    assert_eq!(events(&server, "FaultlineQuarantineExtended"), 1);

    // A person releases gpu5 only: gpu3 stays, the label follows.
    let req = ReleaseRequest {
        devices: vec!["GPU-gpu5".into()],
        actor: "user:bob".into(),
        reason: "swapped".into(),
    };
    assert_eq!(
        r.release("gpu-1", req, &Fence::unfenced()).await.unwrap(),
        Outcome::Released
    );
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3");
    let rec = gpu1_record(&server);
    assert_eq!(rec["devices"].as_array().unwrap().len(), 1);
    assert!(rec["released_devices"]["gpu5"].is_string());
    // The pipeline still says gpu5 failed: within the dedup window it is not taken back.
    assert_eq!(
        r.isolate("gpu-1", two, &Fence::unfenced()).await.unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(gpu1_record(&server)["devices"].as_array().unwrap().len(), 1);
    // Read after that pass: still one taint of ours, the label still gpu3 alone.
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3");
    assert_eq!(
        node["spec"]["taints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["key"] == "nvidia.com/gpu-fault")
            .count(),
        1
    );
}

/// Past the eviction deadline a pod its budget protects is announced and left; with
/// force deletion configured, it is deleted instead, once.
#[tokio::test]
async fn force_deletion_past_the_deadline_only_when_configured() {
    // The force-delete component grants `pods delete` with the flag that turns it on.
    let w = Scenario::new()
        .node(NodeFixture::shared("gpu-1"))
        .component("force-delete")
        .start()
        .await;
    let (server, client) = (w.server, kube_client(&w.kube));
    pod("guarded", true, Some("GPU-1234")).create(&server);
    budget_of_one(&server, "guarded");
    let fence = Fence::unfenced();
    let deadline = std::time::Duration::from_secs(600);
    let clock = faultline_common::time::Clock::default();
    // Not configured: left alone after the deadline.
    let r = remediator(client.clone(), Mode::Enforce)
        .with_resources(vec![], deadline)
        .with_clock(clock.clone());
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    assert_eq!(
        r.evict("gpu-1", &[], &fence).await.unwrap().blocked.len(),
        1
    );
    clock.advance(deadline + std::time::Duration::from_secs(1));
    assert_eq!(
        r.evict("gpu-1", &[], &fence).await.unwrap().given_up.len(),
        1
    );
    assert!(server.get("pods", "default", "guarded").is_some());
    assert_eq!(events(&server, "FaultlineEvictionBlocked"), 1);

    // Configured: a new pod on a new fault is deleted past the deadline.
    pod("guarded-2", true, Some("GPU-gpu5")).create(&server);
    let r = remediator(client, Mode::Enforce)
        .with_resources(vec![], deadline)
        .with_force_delete(true)
        .with_clock(clock.clone());
    r.isolate("gpu-1", failed("gpu5"), &Fence::unfenced())
        .await
        .unwrap();
    let mut pdb = server
        .get("poddisruptionbudgets", "default", "guarded")
        .unwrap();
    pdb["spec"]["selector"]["matchLabels"]["app"] = json!("guarded-2");
    server
        .update("poddisruptionbudgets", "default", "guarded", pdb, None)
        .unwrap();
    assert_eq!(
        r.evict("gpu-1", &[], &fence).await.unwrap().blocked.len(),
        1
    );
    clock.advance(deadline + std::time::Duration::from_secs(1));
    let out = r.evict("gpu-1", &[], &fence).await.unwrap();
    assert_eq!(out.evicted.len(), 1, "{out:?}");
    // Deleted with its grace period: Terminating, then gone once its kubelet stops it.
    assert!(server
        .get("pods", "default", "guarded-2")
        .is_none_or(|p| p.pointer("/metadata/deletionTimestamp").is_some()));
    assert_eq!(events(&server, "FaultlinePodDeleted"), 1);
    // Nothing more on later passes.
    let out = r.evict("gpu-1", &[], &fence).await.unwrap();
    assert!(out.evicted.is_empty() && out.blocked.is_empty(), "{out:?}");
}

/// Devices known only by a bus id or a UUID (an alert's) still quarantine: the label
/// value stays valid (count and hash when the ids are not a label value).
/// A pod its budget still protects at the deadline, with force deletion configured,
/// and the remediator that will delete it: `component` loaded (force-delete: the
/// grant), or not.
async fn past_the_deadline(
    component: Option<&'static str>,
) -> (ApiServer, Remediator, faultline_common::time::Clock) {
    let mut scenario = Scenario::new().node(NodeFixture::shared("gpu-1"));
    if let Some(c) = component {
        scenario = scenario.component(c);
    }
    let w = scenario.start().await;
    let (server, client) = (w.server, kube_client(&w.kube));
    pod("guarded", true, Some("GPU-1234")).create(&server);
    budget_of_one(&server, "guarded");
    let deadline = std::time::Duration::from_secs(600);
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_resources(vec![], deadline)
        .with_force_delete(true)
        .with_clock(clock.clone());
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let first = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(first.blocked.len(), 1, "{first:?}");
    clock.advance(deadline + std::time::Duration::from_secs(1));
    (server, r, clock)
}

/// Force deletion past the deadline is as careful as an eviction. A deletion that lands
/// late, after the pod was replaced under its name on another node (a StatefulSet's),
/// is refused by its uid precondition (409): the successor runs on, and the pod judged
/// is done with. A deletion refused for another reason (403: the flag without its
/// component's grant) is the pass's error, and the pod is not taken as deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_force_deletion_spares_the_successor_and_a_refused_one_is_an_error() {
    let (server, r, _clock) = past_the_deadline(Some("force-delete")).await;
    server.set_faults(Faults {
        latency_ms: 2000,
        latency_method: "DELETE".into(),
        latency_match: "/pods/guarded".into(),
        ..Default::default()
    });
    let late = tokio::spawn(async move { r.evict("gpu-1", &[], &Fence::unfenced()).await });
    support::until_received(&server, "DELETE", "/pods/guarded").await;
    server.delete("pods", "default", "guarded").unwrap();
    PodFixture::new("guarded", "gpu-2").gpu().create(&server);
    let out = late.await.unwrap().expect("a 409 is the pod judged gone");
    assert_eq!(out.evicted.len(), 1, "{out:?}");
    let successor = server.get("pods", "default", "guarded").unwrap();
    assert!(
        successor["metadata"]["deletionTimestamp"].is_null(),
        "the successor deleted: {successor}"
    );
    let deletes: Vec<u16> = server
        .calls()
        .iter()
        .filter(|c| c.method == "DELETE" && c.uri.contains("/pods/guarded"))
        .map(|c| c.status)
        .collect();
    assert_eq!(deletes, vec![409]);

    // The flag without the grant: 403, an error, and the pod stays to be retried.
    let (server, r, _clock) = past_the_deadline(None).await;
    let e = r.evict("gpu-1", &[], &Fence::unfenced()).await;
    assert!(e.is_err(), "a refused deletion passed as done: {e:?}");
    assert!(server.get("pods", "default", "guarded").is_some());
    let done = record(&server, "gpu-1").unwrap()["evicted"].to_string();
    assert!(!done.contains("default/guarded/"), "{done}");
    assert_eq!(events(&server, "FaultlinePodDeleted"), 0);
}

#[tokio::test]
async fn devices_named_by_bus_id_or_uuid_give_a_valid_label() {
    use faultline_aggregator::remediate::label_value;
    assert_eq!(label_value(&["gpu3", "gpu5"]), "gpu3.gpu5");
    let odd = label_value(&["00000000:3B:00.0"]);
    assert!(odd.starts_with("1-devices-"), "{odd}");
    let long = label_value(&[
        "GPU-5157e000-0000-4000-8000-000000000001",
        "GPU-5157e000-0000-4000-8000-000000000002",
    ]);
    assert!(long.len() <= 63 && long.starts_with("2-devices-"), "{long}");
    let (server, client) = setup().await;
    let r = remediator(client, Mode::Enforce);
    let by_bus = vec![RecordDevice {
        pci_bus_id: Some("00000000:3B:00.0".into()),
        ..RecordDevice::new("00000000:3B:00.0", "alert:xid_error")
    }];
    assert_eq!(
        r.isolate("gpu-1", by_bus, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], odd);
}

/// Two budgets over one pod (500, pkg/registry/core/pod/storage/eviction.go) and a pod
/// whose eviction the API refuses otherwise: recorded against those pods with the
/// reason, while the pass goes on and evicts the others.
#[tokio::test]
async fn one_pods_eviction_error_does_not_stop_the_pass() {
    let (server, client) = setup().await;
    for name in ["a-two-budgets", "b-plain", "c-plain"] {
        pod(name, true, Some("GPU-1234"))
            .label("team", "x")
            .create(&server);
    }
    for (pdb, sel) in [
        ("by-app", json!({"app": "a-two-budgets"})),
        ("by-team", json!({"team": "x", "app": "a-two-budgets"})),
    ] {
        server
            .create("poddisruptionbudgets", "default", json!({"metadata": {"name": pdb}, "spec": {"maxUnavailable": 1, "selector": {"matchLabels": sel}}}))
            .unwrap();
    }
    let r = remediator(client, Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    let out = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    let names = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|k| k.split('/').nth(1).unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&out.failed), vec!["a-two-budgets"]);
    assert_eq!(
        names(&out.evicted),
        vec!["b-plain", "c-plain"],
        "the pass went on"
    );
    assert!(server.get("pods", "default", "a-two-budgets").is_some());
    let rec = gpu1_record(&server);
    assert_eq!(rec["evicted"].as_array().unwrap().len(), 2, "{rec}");
    let why = rec["eviction_failed"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap();
    assert!(
        why.as_str().unwrap().contains("HTTP 500")
            && why
                .as_str()
                .unwrap()
                .contains("more than one PodDisruptionBudget"),
        "{why}"
    );
    assert!(
        rec["eviction_blocked"].is_null(),
        "not a budget refusal: no deadline"
    );
    assert_eq!(events(&server, "FaultlineEvictionFailed"), 1);
}

/// API Priority and Fairness answers 429 too, with no DisruptionBudget cause: the pod
/// waits for a later pass, and neither the deadline nor force deletion starts
/// (staging/src/k8s.io/apiserver/pkg/server/filters/maxinflight.go).
#[tokio::test]
async fn a_load_shedding_429_is_not_a_budget() {
    let (server, client) = setup().await;
    pod("train", true, Some("GPU-1234")).create(&server);
    let clock = faultline_common::time::Clock::default();
    let r = remediator(client, Mode::Enforce)
        .with_resources(vec![], std::time::Duration::from_secs(600))
        .with_force_delete(true)
        .with_clock(clock.clone());
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    server.set_faults(Faults {
        throttle_rate: 1.0,
        throttle_match: "/eviction".into(),
        ..Default::default()
    });
    for _ in 0..3 {
        let out = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
        assert_eq!(out.blocked.len(), 1, "{out:?}");
        // Well past the deadline each time, were it counting.
        clock.advance(std::time::Duration::from_secs(700));
    }
    assert!(
        server.get("pods", "default", "train").is_some(),
        "never force-deleted"
    );
    assert!(
        gpu1_record(&server)["eviction_blocked"].is_null(),
        "the deadline never started"
    );
    server.set_faults(Faults::default());
    let out = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(out.evicted.len(), 1, "{out:?}");
    assert_eq!(events(&server, "FaultlinePodDeleted"), 0);
}

/// The kubelet updates its Node's status between the pass's read and its record write
/// (the resourceVersion test then fails with 422): the pass reads again and the record
/// keeps what it did.
#[tokio::test]
async fn the_record_survives_node_churn() {
    let (server, client) = setup().await;
    for name in ["w0", "w1"] {
        pod(name, true, Some("GPU-1234")).create(&server);
    }
    let r = remediator(client, Mode::Enforce);
    r.isolate("gpu-1", failed("gpu3"), &Fence::unfenced())
        .await
        .unwrap();
    server.set_faults(Faults {
        node_churn: true,
        ..Default::default()
    });
    let out = r.evict("gpu-1", &[], &Fence::unfenced()).await.unwrap();
    assert_eq!(out.evicted.len(), 2, "{out:?}");
    let rec = gpu1_record(&server);
    assert_eq!(rec["evicted"].as_array().unwrap().len(), 2, "{rec}");
    let evictions = rec["actions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["action"].as_str().unwrap().starts_with("evict "))
        .count();
    assert_eq!(evictions, 2);
}

/// A replica whose shard Lease is lost, or whose renewals stopped
/// (self-expiry on its own clock), never taints, evicts, releases or writes a record.
#[tokio::test]
async fn a_replica_without_its_lease_changes_nothing() {
    use faultline_aggregator::remediate::ReleaseRequest;
    use faultline_aggregator::shard::Held;
    use std::time::{Duration, Instant};
    let (server, client) = setup().await;
    pod("train", true, Some("GPU-1234")).create(&server);
    let r = remediator(client, Mode::Enforce);
    let held = Held::default();
    let fence = Fence::shard(held.clone(), 0);
    let before = server.get("nodes", "", "gpu-1").unwrap();
    // Never held.
    assert!(matches!(
        r.isolate("gpu-1", failed("gpu3"), &fence).await,
        Err(faultline_aggregator::remediate::RemediateError::NotHolder)
    ));
    assert_eq!(
        server.get("nodes", "", "gpu-1").unwrap(),
        before,
        "no write"
    );
    // Held, isolated; then the renewals stop and the Lease runs out on our own clock.
    held.grant(0, tokio::time::Instant::now() + Duration::from_millis(300));
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3"), &fence).await.unwrap(),
        Outcome::Isolated
    );
    // Nothing renews it: the fence stops holding on its own (300 ms).
    let t = Instant::now();
    while fence.holds() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the fence still holds"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let quarantined = server.get("nodes", "", "gpu-1").unwrap();
    assert!(r.evict("gpu-1", &[], &fence).await.is_err(), "no eviction");
    assert!(server.get("pods", "default", "train").is_some());
    let req = ReleaseRequest {
        devices: vec![],
        actor: "user:alice".into(),
        reason: "done".into(),
    };
    assert!(r.release("gpu-1", req, &fence).await.is_err(), "no release");
    let mut two = failed("gpu3");
    two.extend(failed("gpu5"));
    assert!(
        r.isolate("gpu-1", two, &fence).await.is_err(),
        "no record write"
    );
    assert_eq!(
        server.get("nodes", "", "gpu-1").unwrap()["metadata"]["resourceVersion"],
        quarantined["metadata"]["resourceVersion"],
        "the Node was not written after the Lease ran out"
    );
    let evictions = server
        .calls()
        .iter()
        .filter(|c| c.uri.contains("/eviction"))
        .count();
    assert_eq!(evictions, 0);
}

/// A taint put on for devices unknown past the tolerance
/// lifts by itself once they are seen healthy again (it was a guard, not a verdict),
/// even with --release manual, and not before.
#[tokio::test]
async fn an_unknown_only_taint_lifts_once_the_devices_are_healthy() {
    use faultline_aggregator::model::DeviceView;
    use faultline_common::DeviceStatus;
    let (server, client) = setup().await;
    let r = remediator(client, Mode::Enforce);
    let unknown = vec![RecordDevice::new("gpu0", "no-fresh-data")];
    assert_eq!(
        r.guard_unknown("gpu-1", unknown, &Fence::unfenced())
            .await
            .unwrap(),
        Outcome::Isolated
    );
    let view = |status: DeviceStatus, clean: u32| {
        vec![DeviceView {
            device: RecordDevice::new("gpu0", ""),
            status,
            clean_streak: clean,
            since_ms: 0,
        }]
    };
    let now = faultline_common::time::now_ms();
    // Still unknown, or healthy with too few clean samples: the guard stays.
    for v in [
        view(DeviceStatus::Unknown, 0),
        view(DeviceStatus::Healthy, 29),
    ] {
        assert!(matches!(
            r.release_pass("gpu-1", &v, now, &Fence::unfenced())
                .await
                .unwrap(),
            Outcome::Waiting(_)
        ));
    }
    let ours = |server: &ApiServer| {
        server.get("nodes", "", "gpu-1").unwrap()["spec"]["taints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["key"] == "nvidia.com/gpu-fault")
            .count()
    };
    assert_eq!(ours(&server), 1);
    assert_eq!(
        r.release_pass(
            "gpu-1",
            &view(DeviceStatus::Healthy, 30),
            now,
            &Fence::unfenced()
        )
        .await
        .unwrap(),
        Outcome::Released
    );
    assert_eq!(ours(&server), 0, "the guard's taint lifted");
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert!(node["metadata"]["labels"].get(DEVICES_LABEL).is_none());
    assert!(node["spec"]["taints"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["key"] == "other.example/maintenance"));
}
