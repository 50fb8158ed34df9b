//! The aggregator against the Kubernetes API test server: shard ConfigMaps written by the
//! Lease holder within a second of a fault, Node discovery, failover to another replica
//! within the lease duration, and no write from a replica after it lost its Lease.

mod support;

use std::time::{Duration, Instant};

use faultline_common::fault::shard_of;
use faultline_common::DeviceStatus;
use faultline_test_apiserver::ApiServer;
use serde_json::{json, Value};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_fault_reaches_the_shard_configmap_within_a_second() {
    let w = Scenario::new()
        .agent("n1")
        .agent("n2")
        .agent("n3")
        .pods(
            [
                ("train-0", "n2", "Running"),
                ("train-1", "n2", "Running"),
                ("done", "n2", "Succeeded"),
                ("other", "n1", "Running"),
            ]
            .map(|(name, node, phase)| PodFixture::new(name, node).phase(phase)),
        )
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 2)
        // The pods live in default: the shards are published there, and only pods of
        // publish namespaces are nudged.
        .args(&["--publish-namespaces", "default"])
        .start()
        .await;
    let (_, _) = until(
        Duration::from_secs(20),
        "every node healthy in its shard",
        || {
            ["n1", "n2", "n3"]
                .iter()
                .all(|n| node_entry(server, 2, n).is_some_and(|e| e.summary.healthy == 4))
                .then_some(())
        },
    )
    .await;
    // Each shard holds exactly its nodes.
    for s in 0..2 {
        let doc = shard_doc(server, s).unwrap();
        assert_eq!((doc.shard, doc.shards, doc.writer.as_str()), (s, 2, "r1"));
        for n in doc.nodes.keys() {
            assert_eq!(shard_of(n, 2), s);
        }
    }
    assert_eq!(holder(server, 0).as_deref(), Some("r1"));
    // A change is written to its own shard alone (the other one is not
    // rewritten with it, so a fault never waits behind the other shards' writes).
    let other = 1 - shard_of("n2", 2);
    let rv = |s: u32| {
        server
            .get("configmaps", NS, &format!("faultline-shard-{s}"))
            .unwrap()["metadata"]["resourceVersion"]
            .clone()
    };
    let other_rv = rv(other);

    let t0 = Instant::now();
    inject(w.agent("n2"), r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    let (entry, _) = until(Duration::from_secs(5), "gpu1 failed in n2's entry", || {
        node_entry(server, 2, "n2").filter(|e| {
            e.npus
                .iter()
                .any(|d| d.id == "gpu1" && d.status == DeviceStatus::Failed)
        })
    })
    .await;
    let latency = t0.elapsed();
    assert!(
        latency < Duration::from_secs(5),
        "in the ConfigMap after {latency:?} (a sanity bound on a loaded machine; the figure is measured in benches/)"
    );
    assert_eq!(rv(other), other_rv, "the other shard was not rewritten");
    assert_eq!(
        entry
            .npus
            .iter()
            .find(|d| d.id == "gpu1")
            .unwrap()
            .reason
            .as_deref(),
        Some("xid-79")
    );

    // The running pods on n2 are nudged so kubelet refreshes their mounted ConfigMap now
    // rather than in 60-90 s; the finished pod and the pod on n1 are left alone.
    let annotated = |name: &str| {
        server.get("pods", "default", name).unwrap()["metadata"]["annotations"]
            ["faultline.io/fault-refresh"]
            .is_string()
    };
    until(Duration::from_secs(5), "train pods nudged", || {
        (annotated("train-0") && annotated("train-1")).then_some(())
    })
    .await;
    assert!(!annotated("done") && !annotated("other"));

    // The whole document over the API, built when asked (all shards this replica holds).
    assert!(get_text(&format!("http://{}/readyz", agg.addr))
        .await
        .contains("\"ready\":true"));
    let whole: Value =
        serde_json::from_str(&get_text(&format!("http://{}/v1/faults", agg.addr)).await).unwrap();
    assert_eq!(whole["summary"]["total"], 12);
    assert_eq!(whole["summary"]["failed"], 1);
    assert!(whole["nodes"]["n2"]["npus"]
        .as_array()
        .unwrap()
        .iter()
        .any(|d| d["id"] == "gpu1" && d["status"] == "failed"));
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nudging_can_be_turned_off() {
    let w = Scenario::new()
        .agent("n1")
        .object(
            "pods",
            "default",
            json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}}),
        )
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&["--nudge-rate", "0", "--publish-namespaces", "default"])
        .start()
        .await;
    until(Duration::from_secs(10), "healthy", || {
        node_entry(server, 1, "n1").filter(|e| e.summary.healthy == 4)
    })
    .await;
    inject(w.agent("n1"), r#"{"device":"gpu0","fault":"lost"}"#).await;
    until(Duration::from_secs(5), "failed", || {
        node_entry(server, 1, "n1").filter(|e| e.summary.failed == 1)
    })
    .await;
    // Two of the replica's Lease passes (a second) after the write: no nudge.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 2)]).await;
    let pod = server.get("pods", "default", "p").unwrap();
    assert!(pod["metadata"]["annotations"].is_null(), "{pod}");
    // Published into the workload namespace too (pods mount ConfigMaps of their own
    // namespace only), with the same content.
    let here = server.get("configmaps", NS, "faultline-shard-0").unwrap();
    let there = until(Duration::from_secs(5), "copy in default", || {
        server
            .get("configmaps", "default", "faultline-shard-0")
            .filter(|c| c["data"]["n1.json"] == here["data"]["n1.json"])
    })
    .await
    .0;
    assert!(there["data"]["fault.json"].is_string());
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A nudge runs beside the writes. With every pod list answered 8 s late, a
/// fault on n1 (whose pod is nudged) and one on n2 right after it are both in the shard
/// well within those 8 s (5 s, a bound a loaded machine keeps); before, the second
/// waited for the first's nudge (its pod list and patch) and came 8 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_nudge_does_not_hold_back_the_next_fault() {
    let w = Scenario::new()
        .agent("n1")
        .agent("n2")
        .pods([
            PodFixture::new("train-0", "n1"),
            PodFixture::new("train-1", "n2"),
        ])
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&["--publish-namespaces", "default"])
        .start()
        .await;
    until(Duration::from_secs(20), "both nodes healthy", || {
        ["n1", "n2"]
            .iter()
            .all(|n| node_entry(server, 1, n).is_some_and(|e| e.summary.healthy == 4))
            .then_some(())
    })
    .await;
    // Only the nudges' pod lists (cluster-wide, by spec.nodeName) are slow; the pod
    // patches (/api/v1/namespaces/...) are not.
    server.set_faults(faultline_test_apiserver::Faults {
        latency_ms: 8_000,
        latency_match: "/api/v1/pods".into(),
        ..Default::default()
    });
    let failed = |node: &str| node_entry(server, 1, node).filter(|e| e.summary.failed == 1);
    let t0 = Instant::now();
    inject(w.agent("n1"), r#"{"device":"gpu0","fault":"lost"}"#).await;
    until(Duration::from_secs(5), "n1 failed", || failed("n1")).await;
    inject(w.agent("n2"), r#"{"device":"gpu0","fault":"lost"}"#).await;
    until(Duration::from_secs(10), "n2 failed", || failed("n2")).await;
    let both = t0.elapsed();
    assert!(
        both < Duration::from_secs(5),
        "the second fault waited for the first one's nudge: both in the shard after {both:?}"
    );
    // The nudges themselves still happen, once their lists come back.
    let annotated = |name: &str| {
        server.get("pods", "default", name).unwrap()["metadata"]["annotations"]
            ["faultline.io/fault-refresh"]
            .is_string()
    };
    until(Duration::from_secs(15), "both pods nudged", || {
        (annotated("train-0") && annotated("train-1")).then_some(())
    })
    .await;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_are_discovered_and_forgotten() {
    let w = Scenario::new()
        .node(
            NodeFixture::new("gpu-7")
                .label("accelerator", "nvidia")
                .address("127.0.0.1"),
        )
        .node(NodeFixture::new("cpu-1").address("127.0.0.1"))
        .agent("gpu-7")
        .unlisted()
        .component("node-discovery")
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--discovery",
            "nodes",
            "--node-selector",
            "accelerator=nvidia",
            "--agent-port",
            &w.agent("gpu-7").addr.port().to_string(),
        ])
        .start()
        .await;
    until(Duration::from_secs(20), "gpu-7 in the shard", || {
        node_entry(server, 1, "gpu-7").filter(|e| e.summary.healthy == 4)
    })
    .await;
    assert!(node_entry(server, 1, "cpu-1").is_none(), "not selected");
    server.delete("nodes", "", "gpu-7").unwrap();
    until(Duration::from_secs(20), "gpu-7 gone", || {
        shard_doc(server, 0)
            .filter(|d| d.nodes.is_empty())
            .map(|_| ())
    })
    .await;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// Urgent writes of different shards run side by side. A fault on `na`
/// (shard 0, whose ConfigMap calls are slowed to `SLOW` each) is being written when a
/// fault on `nb` (shard 1) comes: `nb`'s is in shard 1 within a second, long before
/// shard 0's write is done (before, it waited for it: the benchmark's faults that took
/// 80 ms more than the others). The slowness is injected (`Faults::latency_match`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_writes_of_two_shards_do_not_wait_for_each_other() {
    const SLOW: u64 = 3_000;
    let quiet = ["n1", "n2", "n3", "n4", "n5"];
    let na = *quiet.iter().find(|n| shard_of(n, 2) == 0).unwrap();
    let nb = *quiet.iter().find(|n| shard_of(n, 2) == 1).unwrap();
    let w = Scenario::new().agent(na).agent(nb).start().await;
    let server = &w.server;
    // Routine writes 5 s apart: only an urgent write can bring the fault out sooner.
    let agg = w
        .configmap("r1", 2)
        .args(&["--write-interval", "5s"])
        .start()
        .await;
    until(Duration::from_secs(20), "both nodes healthy", || {
        [na, nb]
            .iter()
            .all(|n| node_entry(server, 2, n).is_some_and(|e| e.summary.healthy == 4))
            .then_some(())
    })
    .await;
    server.set_faults(faultline_test_apiserver::Faults {
        latency_ms: SLOW,
        latency_match: "/configmaps/faultline-shard-0".into(),
        ..Default::default()
    });
    let failed = |node: &str| node_entry(server, 2, node).filter(|e| e.summary.failed == 1);
    let since = faultline_common::time::now_ms();
    inject(w.agent(na), r#"{"device":"gpu0","fault":"lost"}"#).await;
    until(
        Duration::from_secs(5),
        "shard 0's urgent PUT in flight",
        || {
            server.received().into_iter().find(|r| {
                r.method == "PUT"
                    && r.at_ms >= since
                    && r.uri.contains("/configmaps/faultline-shard-0")
            })
        },
    )
    .await;
    let t0 = Instant::now();
    inject(w.agent(nb), r#"{"device":"gpu0","fault":"lost"}"#).await;
    until(Duration::from_secs(10), "nb failed in shard 1", || {
        failed(nb)
    })
    .await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(SLOW / 2),
        "shard 1's fault waited for shard 0's write ({SLOW} ms a call): {took:?}"
    );
    assert!(failed(na).is_none(), "shard 0's write is still in flight");
    until(Duration::from_secs(15), "na failed in shard 0", || {
        failed(na)
    })
    .await;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A fault is written by an urgent write of its own shard, beside a write of
/// another shard already in flight, not after it (it waited behind other shards'
/// writes: the tail of the benchmark's fault latency). ConfigMap calls are slowed to
/// `SLOW` each. The server records each call as received and as carried out (the audit
/// stages `RequestReceived` and `ResponseComplete`,
/// staging/src/k8s.io/apiserver/pkg/apis/audit/types.go): the fault is posted once the
/// other shard's PUT is in flight, and its own PUT must arrive before that one is done.
/// The slowness is injected (`Faults::latency_match`), not kube-apiserver behaviour: one
/// resource slow while others answer, as `apiserver_request_duration_seconds`
/// (staging/src/k8s.io/apiserver/pkg/endpoints/metrics/metrics.go) shows per resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_is_written_beside_another_shards_write_in_flight() {
    const SLOW: u64 = 2_000;
    let quiet = ["n1", "n2", "n3", "n4", "n5"];
    let na = *quiet.iter().find(|n| shard_of(n, 2) == 0).unwrap();
    let nb = *quiet.iter().find(|n| shard_of(n, 2) == 1).unwrap();
    let mut w = Scenario::new().agent(na).agent(nb).start().await;
    let server = &w.server;
    let agg = w.configmap("r1", 2).start().await;
    until(Duration::from_secs(20), "both nodes healthy", || {
        [na, nb]
            .iter()
            .all(|n| node_entry(server, 2, n).is_some_and(|e| e.summary.healthy == 4))
            .then_some(())
    })
    .await;
    // The first writes of both shards done: 4 Lease passes (2 s) later.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 4)]).await;
    server.set_faults(faultline_test_apiserver::Faults {
        latency_ms: SLOW,
        latency_match: "/configmaps/".into(),
        ..Default::default()
    });
    let since = faultline_common::time::now_ms();
    let put_of = |shard: u32| format!("/configmaps/faultline-shard-{shard}");
    let received = |shard: u32, after: u64| {
        server
            .received()
            .into_iter()
            .find(|r| r.method == "PUT" && r.at_ms >= after && r.uri.contains(&put_of(shard)))
    };
    // `na`'s agent goes away: its shard is written (a change, not urgent), slowly.
    w.agents.take(na).shutdown().await;
    let (other, _) = until(Duration::from_secs(20), "shard 0's PUT in flight", || {
        received(0, since)
    })
    .await;
    let posted = faultline_common::time::now_ms();
    inject(w.agent(nb), r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    until(Duration::from_secs(15), "gpu1 failed in nb's entry", || {
        node_entry(server, 2, nb).filter(|e| {
            e.npus
                .iter()
                .any(|d| d.id == "gpu1" && d.status == DeviceStatus::Failed)
        })
    })
    .await;
    let (other_done, _) = until(Duration::from_secs(10), "shard 0's PUT done", || {
        server
            .calls()
            .into_iter()
            .find(|c| c.method == "PUT" && c.received_ms == other.at_ms && c.uri == other.uri)
            .map(|c| c.at_ms)
    })
    .await;
    let fault = received(1, posted).expect("a PUT of shard 1 after the fault");
    assert!(
        fault.at_ms < other_done,
        "the fault's write (received at {}) began inside the other shard's \
         (received at {}, done at {other_done}, {SLOW} ms each)",
        fault.at_ms,
        other.at_ms
    );
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holder_is_replaced_within_the_lease_duration() {
    let w = Scenario::new().agent("n1").start().await;
    let server = &w.server;
    let r1 = w.configmap("r1", 1).start().await;
    until(Duration::from_secs(10), "r1 holds the shard", || {
        (holder(server, 0).as_deref() == Some("r1")).then_some(())
    })
    .await;
    let r2 = w.configmap("r2", 1).start().await;
    until(Duration::from_secs(10), "r1 writes", || {
        shard_doc(server, 0).filter(|d| d.writer == "r1")
    })
    .await;
    grows(r2.addr, &[("faultline_aggregator_lease_passes_total", 3)]).await;
    assert_eq!(
        holder(server, 0).as_deref(),
        Some("r1"),
        "r2 must not take a held shard"
    );

    // r1 dies without a word (no release): its lease runs out, r2 takes over.
    let t0 = Instant::now();
    r1.abort();
    let (_, took) = until(Duration::from_secs(10), "r2 holds the shard", || {
        (holder(server, 0).as_deref() == Some("r2")).then_some(())
    })
    .await;
    assert!(
        took < Duration::from_millis(3000 + 5000),
        "took {took:?}, lease duration 3 s (a sanity bound; the takeover time is measured in benches/)"
    );
    let (doc, _) = until(Duration::from_secs(5), "r2 writes", || {
        shard_doc(server, 0).filter(|d| d.writer == "r2")
    })
    .await;
    assert!(
        doc.nodes.contains_key("n1"),
        "{:?}",
        doc.nodes.keys().collect::<Vec<_>>()
    );
    let _ = t0;
    r2.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_its_lease_writes_nothing_more() {
    let w = Scenario::new().agent("n1").start().await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&["--refresh", "1s"])
        .start()
        .await;
    until(Duration::from_secs(10), "r1 writes", || {
        shard_doc(server, 0).filter(|d| d.writer == "r1")
    })
    .await;

    // Another party takes the Lease (as a replica would after a partition) and keeps it.
    let steal = |server: &ApiServer| {
        let mut l = server.get("leases", NS, "faultline-shard-0").unwrap();
        l["spec"]["holderIdentity"] = json!("intruder");
        l["spec"]["renewTime"] =
            json!(humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string());
        server
            .update("leases", NS, "faultline-shard-0", l, None)
            .is_ok()
    };
    let keep = {
        let server = server.clone();
        tokio::spawn(async move {
            loop {
                let _ = steal(&server);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // It notices at its next renewal (500 ms); after that nothing of r1's lands, even
    // though its agent keeps changing and its --refresh is 1 s.
    metric_until(
        agg.addr,
        "faultline_aggregator_lease_held{shard=\"0\"} 0",
        Duration::from_secs(10),
    )
    .await;
    let rv_before = server.get("configmaps", NS, "faultline-shard-0").unwrap()["metadata"]
        ["resourceVersion"]
        .clone();
    inject(w.agent("n1"), r#"{"device":"gpu0","fault":"lost"}"#).await;
    grows(
        agg.addr,
        &[
            ("faultline_aggregator_writes_skipped_total", 2),
            ("faultline_aggregator_lease_passes_total", 3),
        ],
    )
    .await;
    let cm: Value = server.get("configmaps", NS, "faultline-shard-0").unwrap();
    assert_eq!(
        cm["metadata"]["resourceVersion"], rv_before,
        "r1 wrote after losing its lease"
    );
    let m = metrics(agg.addr).await;
    assert!(
        m.contains("faultline_aggregator_lease_held{shard=\"0\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("faultline_aggregator_writes_skipped_total{sink=\"configmap\",shard=\"0\"}"),
        "{m}"
    );
    keep.abort();
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A replica whose renewals go unanswered (every Lease call
/// refused, as in a partition from the API server) stops acting once its Lease runs out
/// on its own clock (duration less a margin), though nobody else holds it: no taint, no
/// ConfigMap write. Without the self-expiry it would act on a Lease it may have lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_renewals_fail_stops_acting_on_its_own_clock() {
    let w = Scenario::ready_nodes(&["n1"]).start().await;
    let server = &w.server;
    let agg = w.healing("r1").args(&["--refresh", "1s"]).start().await;
    until(Duration::from_secs(10), "r1 writes", || {
        shard_doc(server, 0).filter(|d| d.writer == "r1")
    })
    .await;
    // Every Lease call is refused from now on (429, as API Priority and Fairness does).
    server.set_faults(faultline_test_apiserver::Faults {
        throttle_rate: 1.0,
        throttle_match: "/leases".into(),
        ..Default::default()
    });
    // The Lease is 3 s, renewed every 500 ms, with a 1.5 s margin: r1 stops counting it
    // as held within 2 s of its last renewal.
    metric_until(
        agg.addr,
        "faultline_aggregator_lease_held{shard=\"0\"} 0",
        Duration::from_secs(10),
    )
    .await;
    let rv_before = server.get("configmaps", NS, "faultline-shard-0").unwrap()["metadata"]
        ["resourceVersion"]
        .clone();
    fail(w.agent("n1"), "gpu1").await;
    grows(
        agg.addr,
        &[
            ("faultline_aggregator_transitions_total", 1),
            ("faultline_aggregator_reconciles_total", 3),
        ],
    )
    .await;
    let node = server.get("nodes", "", "n1").unwrap();
    assert!(
        node["spec"]["taints"]
            .as_array()
            .is_none_or(|t| t.is_empty()),
        "r1 tainted n1 on a Lease it could not renew: {}",
        node["spec"]
    );
    let cm: Value = server.get("configmaps", NS, "faultline-shard-0").unwrap();
    assert_eq!(
        cm["metadata"]["resourceVersion"], rv_before,
        "r1 wrote on a Lease it could not renew"
    );
    let m = metrics(agg.addr).await;
    assert!(
        m.contains("faultline_aggregator_lease_held{shard=\"0\"} 0"),
        "{m}"
    );
    // Answered again: r1 renews (nobody else took it) and acts.
    server.set_faults(Default::default());
    until(
        Duration::from_secs(10),
        "r1 acts once it holds the Lease again",
        || {
            let node = server.get("nodes", "", "n1")?;
            node["spec"]["taints"]
                .as_array()
                .filter(|t| !t.is_empty())
                .map(|_| ())
        },
    )
    .await;
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_converge_through_conflicts_and_server_errors() {
    let w = Scenario::new().agent("n1").start().await;
    let server = &w.server;
    let agg = w.configmap("r1", 1).start().await;
    until(Duration::from_secs(10), "healthy", || {
        node_entry(server, 1, "n1").filter(|e| e.summary.healthy == 4)
    })
    .await;
    server.set_faults(faultline_test_apiserver::Faults {
        conflict_rate: 0.3,
        error_rate: 0.1,
        seed: 3,
        ..Default::default()
    });
    // A few lease renewals and heartbeats through the faults first.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 6)]).await;
    fail(w.agent("n1"), "gpu2").await;
    let (entry, _) = until(
        Duration::from_secs(20),
        "the fault lands despite 409s and 500s",
        || node_entry(server, 1, "n1").filter(|e| e.summary.failed == 1),
    )
    .await;
    assert_eq!(
        entry
            .npus
            .iter()
            .find(|d| d.id == "gpu2")
            .unwrap()
            .reason
            .as_deref(),
        Some("row-remap-failure")
    );
    server.set_faults(Default::default());
    let calls = server.calls();
    let count = |code: u16| calls.iter().filter(|c| c.status == code).count();
    assert!(
        count(409) + count(500) > 0,
        "no injected fault was met: {} calls",
        calls.len()
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_taints_its_node_once_and_an_unreachable_agent_taints_nothing() {
    let mut w = Scenario::new()
        .nodes(["n1", "n2"].map(NodeFixture::new))
        .agents()
        .start()
        .await;
    let server = &w.server;
    // Devices go unknown 1 s after their agent is lost (not 30 s), so within the test
    // n2 really is unknown, below the default 5 min tolerance.
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "state_machine:\n  unknown_after_ms: 1000\n").unwrap();
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--remediation",
            "enforce",
            "--reconcile-interval",
            "500ms",
            "--rules",
            rules.to_str().unwrap(),
            // No share budget: only the unknown tolerance may keep n2 untainted.
            "--max-quarantined-percent",
            "100",
        ])
        .start()
        .await;
    until(Duration::from_secs(10), "healthy", || {
        (node_entry(server, 1, "n1").is_some_and(|e| e.summary.healthy == 4)
            && node_entry(server, 1, "n2").is_some_and(|e| e.summary.healthy == 4))
        .then_some(())
    })
    .await;
    inject(w.agent("n1"), r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    until(Duration::from_secs(5), "n1 tainted", || {
        (!taints(server, "n1").is_empty()).then_some(())
    })
    .await;
    // n2's agent dies: its devices turn unknown, which never isolates anything.
    w.agents.take("n2").shutdown().await;
    until(Duration::from_secs(10), "n2's devices unknown", || {
        node_entry(server, 1, "n2")
            .filter(|e| e.summary.unknown == 4)
            .map(|_| ())
    })
    .await;
    // Repeated samples and reconcile passes (every 500 ms) add nothing.
    passes(agg.addr).await;
    assert_eq!(
        node_entry(server, 1, "n2").unwrap().summary.unknown,
        4,
        "still unknown while the passes ran"
    );
    assert_eq!(taints(server, "n1").len(), 1);
    assert_eq!(taints(server, "n1")[0]["key"], "nvidia.com/gpu-fault");
    assert!(
        taints(server, "n2").is_empty(),
        "unknown alone must not taint"
    );
    assert_eq!(events(server, "FaultlineQuarantined"), 1);
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// One agent of five gone past the tolerance: its node gets the NoSchedule taint and
/// nothing is evicted. Then two more go: three of five unreachable is the aggregator
/// cut off more likely than three nodes dead, so the unknown guard stands down
/// and taints nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_gone_past_the_tolerance_gets_a_noschedule_taint_and_no_eviction() {
    let mut w = Scenario::new()
        .nodes((1..=5).map(|i| NodeFixture::new(&format!("n{i}"))))
        .pod(PodFixture::new("w", "n1").gpu())
        .agents()
        .named()
        .start()
        .await;
    let server = &w.server;
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "state_machine:\n  unknown_after_ms: 1000\n").unwrap();
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--remediation",
            "enforce",
            "--unknown-tolerance",
            "1s",
            "--reconcile-interval",
            "1s",
            "--rules",
            rules.to_str().unwrap(),
        ])
        .start()
        .await;
    until(Duration::from_secs(10), "healthy", || {
        (1..=5)
            .all(|i| {
                node_entry(server, 1, &format!("n{i}")).is_some_and(|e| e.summary.healthy == 4)
            })
            .then_some(())
    })
    .await;
    w.agents.take("n1").shutdown().await;
    let taint_of = |n: &str| {
        server.get("nodes", "", n).unwrap()["spec"]["taints"]
            .as_array()
            .and_then(|t| t.first().cloned())
    };
    let (taint, _) = until(Duration::from_secs(20), "n1 tainted for unknown", || {
        taint_of("n1")
    })
    .await;
    assert_eq!(
        (taint["key"].as_str(), taint["value"].as_str()),
        (Some("nvidia.com/gpu-fault"), Some("unknown"))
    );
    for n in ["n2", "n3"] {
        w.agents.take(n).shutdown().await;
    }
    // Well past the tolerance and several reconciles.
    metric_until(
        agg.addr,
        "faultline_aggregator_unknown_guard_standing_down 1",
        Duration::from_secs(20),
    )
    .await;
    grows(agg.addr, &[("faultline_aggregator_reconciles_total", 6)]).await;
    assert!(
        taint_of("n2").is_none() && taint_of("n3").is_none(),
        "the guard stood down"
    );
    let m = metrics(agg.addr).await;
    assert!(
        m.contains("faultline_aggregator_unknown_guard_standing_down 1"),
        "{m}"
    );
    assert!(
        server.get("pods", "default", "w").is_some(),
        "unknown never evicts"
    );
    assert_eq!(
        server.get("nodes", "", "n1").unwrap()["spec"]["taints"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// An agent that never answered is not a node: with it down from the start (a bare URL
/// in --agents), every shard is still written, with valid keys only (the API refuses a
/// ConfigMap with a key such as `http://10.0.0.7:8081.json` with 422).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_down_from_the_start_leaves_every_shard_writable() {
    let w = Scenario::new().agent("n1").unlisted().start().await;
    let server = &w.server;
    let agents = format!("{NO_AGENT},http://{},n7={NO_AGENT}", w.agent("n1").addr);
    let agg = w
        .configmap("r1", 2)
        .args(&["--agents", &agents])
        .start()
        .await;
    until(Duration::from_secs(10), "n1 published", || {
        node_entry(server, 2, "n1").filter(|e| e.summary.healthy == 4)
    })
    .await;
    // The named agent that is down is published as unreachable, under its name.
    let (n7, _) = until(Duration::from_secs(10), "n7 published", || {
        node_entry(server, 2, "n7")
    })
    .await;
    assert!(!n7.agent.reachable);
    for shard in 0..2 {
        let (cm, _) = until(Duration::from_secs(10), "every shard written", || {
            server.get("configmaps", NS, &format!("faultline-shard-{shard}"))
        })
        .await;
        for key in cm["data"].as_object().unwrap().keys() {
            faultline_test_apiserver::validation::is_configmap_key(key).unwrap();
            assert!(!key.contains("http"), "{key}");
        }
    }
    let m = metrics(agg.addr).await;
    assert!(
        !m.contains("faultline_aggregator_write_errors_total"),
        "no write refused: {m}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A holder whose clock runs an hour behind writes `renewTime`s an hour old, but keeps
/// renewing: the Lease is judged by when this replica saw it change, on its own clock,
/// so it is not taken while the holder lives, and is taken once the holder stops
/// (client-go leaderelection.go `observedTime`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_holder_keeps_its_lease_while_it_renews() {
    let skewed = || {
        json!(humantime::format_rfc3339_micros(
            std::time::SystemTime::now() - Duration::from_secs(3600)
        )
        .to_string())
    };
    let w = Scenario::new()
        .object(
            "leases",
            NS,
            json!({"metadata": {"name": "faultline-shard-0"}, "spec": {
                "holderIdentity": "skewed", "leaseDurationSeconds": 3,
                "acquireTime": skewed(), "renewTime": skewed(), "leaseTransitions": 0}}),
        )
        .start()
        .await;
    let server = &w.server;
    // The skewed holder renews every 500 ms until told to stop.
    let stop = tokio_util::sync::CancellationToken::new();
    let renewer = {
        let (server, stop) = (server.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let mut l = server.get("leases", NS, "faultline-shard-0").unwrap();
                l["spec"]["renewTime"] = skewed();
                server
                    .update("leases", NS, "faultline-shard-0", l, None)
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let agg = w.configmap("r1", 1).start().await;
    // Past the Lease's 3 s on r1's own clock: 8 passes 500 ms apart.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 8)]).await;
    assert_eq!(
        holder(server, 0).as_deref(),
        Some("skewed"),
        "a live holder's Lease was taken: two holders"
    );
    stop.cancel();
    renewer.await.unwrap();
    let t = Instant::now();
    until(
        Duration::from_secs(10),
        "r1 takes the abandoned Lease",
        || (holder(server, 0).as_deref() == Some("r1")).then_some(()),
    )
    .await;
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "taken {:?} after the last renewal; the lease lasts 3 s",
        t.elapsed()
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A quiet watch sends nothing for minutes: the watch client has no read timeout, so
/// discovery does not break its Node watch and relist every `--kube-timeout` (kube's
/// `read_timeout` cuts watch streams too), and its list is served from the API server's
/// cache (`resourceVersion=0`), not a quorum read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_node_watch_is_not_relisted() {
    // The agents listen on 127.0.0.1: the Node's address.
    let w = Scenario::new()
        .node(NodeFixture::new("gpu-7").address("127.0.0.1"))
        .agents()
        .unlisted()
        .component("node-discovery")
        .start()
        .await;
    let server = &w.server;
    let a = w.agent("gpu-7");
    assert_eq!(a.addr.ip().to_string(), "127.0.0.1");
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--discovery",
            "nodes",
            "--agent-port",
            &a.addr.port().to_string(),
            "--kube-timeout",
            "1s",
        ])
        .start()
        .await;
    until(Duration::from_secs(10), "gpu-7 followed", || {
        node_entry(server, 1, "gpu-7").filter(|e| e.agent.reachable)
    })
    .await;
    // Ten of its Lease passes (5 s) and several polls of the agent later:
    grows(
        agg.addr,
        &[
            ("faultline_aggregator_lease_passes_total", 10),
            ("faultline_aggregator_agent_polls_total", 2),
        ],
    )
    .await;
    // Discovery's watch of every Node, and remediation's of the quarantined ones
    // (by the devices label): each lists once, then watches, quiet as they are.
    for quarantined in [false, true] {
        let ours = |uri: &str| {
            uri.starts_with("/api/v1/nodes?") && uri.contains("unhealthy-devices") == quarantined
        };
        let lists: Vec<String> = server
            .calls()
            .into_iter()
            .filter(|c| c.method == "GET" && ours(&c.uri) && !c.uri.contains("watch=true"))
            .map(|c| c.uri)
            .collect();
        assert_eq!(lists.len(), 1, "one list, then one watch: {lists:?}");
        assert!(lists[0].contains("resourceVersion=0"), "{lists:?}");
        let watches = server
            .calls()
            .into_iter()
            .filter(|c| ours(&c.uri) && c.uri.contains("watch=true"))
            .count();
        assert_eq!(watches, 1, "the quiet watch was cut and opened again");
    }
    let m = metrics(agg.addr).await;
    assert!(
        m.contains("faultline_aggregator_discovery_errors_total 0"),
        "no watch error: {m}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// A default install with the ConfigMap sink is a dry run: a
/// failed device changes nothing on the cluster, and what would be done is announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_install_is_a_dry_run() {
    let w = Scenario::ready_nodes(&["n1"])
        .pod(PodFixture::new("train", "n1").gpu())
        .start()
        .await;
    let server = &w.server;
    let before = server.get("nodes", "", "n1").unwrap();
    let agg = w.configmap("r1", 1).start().await;
    fail(w.agent("n1"), "gpu1").await;
    let announced = |reason: &str| events(server, reason);
    until(Duration::from_secs(10), "dry-run announcements", || {
        (announced("FaultlineWouldQuarantine") == 1 && announced("FaultlineWouldEvict") == 1)
            .then_some(())
    })
    .await;
    // Several reconcile passes later, still nothing done, nothing announced twice.
    passes(agg.addr).await;
    assert_eq!(
        server.get("nodes", "", "n1").unwrap(),
        before,
        "the Node is untouched"
    );
    assert!(
        server.get("pods", "default", "train").is_some(),
        "nothing evicted"
    );
    assert_eq!(announced("FaultlineWouldQuarantine"), 1);
    let evictions = server
        .calls()
        .iter()
        .filter(|c| c.uri.contains("/eviction"))
        .count();
    assert_eq!(evictions, 0);
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// Writes of a shard ConfigMap so far (creates and replaces).
fn shard_writes(server: &ApiServer) -> usize {
    server
        .calls()
        .iter()
        .filter(|c| {
            (c.method == "PUT" && c.uri.contains("/configmaps/faultline-shard-0"))
                || (c.method == "POST" && c.uri.ends_with("/namespaces/faultline/configmaps"))
        })
        .count()
}

/// `sequence` continues across holders. A shard nothing changes in is never rewritten,
/// however short --refresh is (a rewrite reaches every watcher of the page: every kubelet
/// of a pod that mounts it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sequence_carries_over_and_a_quiet_shard_is_not_rewritten() {
    let w = Scenario::new().agent("n1").named().start().await;
    let server = &w.server;
    let r1 = w
        .configmap("r1", 1)
        .args(&["--write-interval", "1s", "--refresh", "2s"])
        .start()
        .await;
    until(Duration::from_secs(10), "a few writes by r1", || {
        shard_doc(server, 0).filter(|d| d.sequence >= 2)
    })
    .await;
    let seq = shard_doc(server, 0).unwrap().sequence;
    // A crash; the next holder continues the sequence from the ConfigMap.
    r1.abort();
    let r2 = w
        .configmap("r2", 1)
        .args(&["--refresh", "2s"])
        .start()
        .await;
    let (doc, _) = until(Duration::from_secs(15), "r2 writes", || {
        shard_doc(server, 0).filter(|d| d.writer == "r2")
    })
    .await;
    assert!(doc.sequence > seq, "{} after {seq}", doc.sequence);
    assert!(
        doc.sequence <= seq + 3,
        "continued, not restarted: {} after {seq}",
        doc.sequence
    );
    r2.cancel_token().cancel();
    r2.wait().await.expect("a clean stop");

    // A shard nothing changes in (its agent gone, its node unknown and steady) is
    // written once by its new holder, then never again.
    let quiet = Launch::configmap(&w.kube, "r3", 1)
        .args(&["--agents", NO_AGENT, "--refresh", "1s"])
        .start()
        .await;
    until(Duration::from_secs(15), "r3 holds the shard", || {
        shard_doc(server, 0).filter(|d| d.writer == "r3")
    })
    .await;
    // Its first contact with the missing agent may still change the entry.
    grows(
        quiet.addr,
        &[
            ("faultline_aggregator_agent_poll_errors_total", 1),
            ("faultline_aggregator_configmap_pages_unchanged_total", 1),
        ],
    )
    .await;
    let before = shard_writes(server);
    grows(
        quiet.addr,
        &[("faultline_aggregator_configmap_pages_unchanged_total", 3)],
    )
    .await;
    let rewrites = shard_writes(server) - before;
    assert_eq!(
        rewrites, 0,
        "{rewrites} rewrites of an unchanged shard over 3 unchanged pages"
    );
    assert_no_forbidden(server);
    quiet.cancel_token().cancel();
}

/// Nudges stay within --nudge-rate (bursts of twice the
/// rate) and touch only pods matching --nudge-selector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nudges_keep_to_their_rate_and_selector() {
    let w = Scenario::new()
        .agent("n2")
        .named()
        .pods(
            // "a-web" lists first (the server lists by name): without the selector it
            // would take the one token.
            [("a-web", "web"), ("train-a", "train"), ("train-b", "train")]
                .map(|(name, app)| PodFixture::new(name, "n2").label("app", app)),
        )
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--publish-namespaces",
            "default",
            // One token (a burst of twice 0.5), refilled every 2 s.
            "--nudge-rate",
            "0.5",
            "--nudge-selector",
            "app=train",
        ])
        .start()
        .await;
    until(Duration::from_secs(10), "n2 published", || {
        node_entry(server, 1, "n2").filter(|e| e.summary.healthy == 4)
    })
    .await;
    inject(w.agent("n2"), r#"{"device":"gpu1","fault":"lost"}"#).await;
    let nudged = |name: &str| {
        server.get("pods", "default", name).unwrap()["metadata"]["annotations"]
            ["faultline.io/fault-refresh"]
            .is_string()
    };
    until(Duration::from_secs(10), "a train pod nudged", || {
        (nudged("train-a") || nudged("train-b")).then_some(())
    })
    .await;
    // The rate limit is counted.
    metric_until(
        agg.addr,
        "faultline_aggregator_pod_nudges_total{result=\"rate-limited\"} 1",
        Duration::from_secs(5),
    )
    .await;
    assert!(
        !(nudged("train-a") && nudged("train-b")),
        "one token: one nudge"
    );
    assert!(!nudged("a-web"), "not matching --nudge-selector");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}

/// `--kube-qps 5 --kube-burst 2`: two calls go at once, and each after them waits its
/// token, 200 ms apart at least (a busy machine only spaces them more).
#[tokio::test]
async fn the_client_rate_spaces_calls_past_the_burst() {
    use faultline_aggregator::app::ratelimit::KubeRate;
    let w = Scenario::new().start().await;
    let rate = KubeRate::new(5.0, 2);
    let client = faultline_aggregator::app::connect_with(
        Some(&w.kube),
        Some(aggregator_token_file()),
        None,
        Some(&rate),
    )
    .await
    .unwrap();
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
    let before = w.server.calls().len();
    let start = Instant::now();
    for _ in 0..7 {
        nodes.list(&Default::default()).await.unwrap();
    }
    let took = start.elapsed();
    let at: Vec<u64> = w.server.calls()[before..]
        .iter()
        .filter(|c| c.uri.starts_with("/api/v1/nodes"))
        .map(|c| c.at_ms)
        .collect();
    assert_eq!(at.len(), 7, "{at:?}");
    assert!(
        took >= Duration::from_millis(990),
        "7 calls at 5/s after a burst of 2 took {took:?}"
    );
    for pair in at[2..].windows(2) {
        assert!(
            pair[1] - pair[0] >= 190,
            "calls past the burst closer than 1/qps: {at:?}"
        );
    }
}
