//! What the shard ConfigMaps cost every kubelet. The test API server models
//! kubelets as pkg/kubelet/util/manager/watch_based_manager.go runs them: one watch per
//! node for each ConfigMap its pods reference, and every write of that ConfigMap sent
//! down each of them. With a workload pod on every node mounting the shard (the small
//! cluster's path), a quiet minute fans out nothing (it was two heartbeat rewrites of
//! every page to every kubelet, ~25 GB/s modelled at 20,000 nodes), and a status change
//! costs one page to each node mounting it.

mod support;

use std::time::Duration;

use faultline_common::DeviceStatus;
use serde_json::json;
use support::*;

const NODES: [&str; 4] = ["n1", "n2", "n3", "n4"];

fn workload(node: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("train-{node}"), "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "train", "image": "python:3.12-slim",
                "volumeMounts": [{"name": "faults", "mountPath": "/config", "readOnly": true}]}],
            "volumes": [{"name": "faults", "projected": {"sources": [
                {"configMap": {"name": "faultline-shard-0", "optional": true}}
            ]}}]
        },
        "status": {"phase": "Running"}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_minute_fans_out_nothing_and_a_change_one_page_per_node() {
    let mut sc = Scenario::new();
    for n in NODES {
        sc = sc.agent(n).object("pods", "default", workload(n));
    }
    let w = sc.named().start().await;
    let server = &w.server;
    let agg = w
        .configmap("r1", 1)
        .args(&["--publish-namespaces", "default"])
        .start()
        .await;
    until(Duration::from_secs(20), "every node healthy", || {
        NODES
            .iter()
            .all(|n| node_entry(server, 1, n).is_some_and(|e| e.summary.healthy == 4))
            .then_some(())
    })
    .await;
    assert_eq!(server.costs().kubelet_open_watches, 4, "one watch per node");
    // Settled (the first writes done: 6 Lease passes, 3 s), then a quiet minute on the
    // replica's own clock: 120 Lease passes 500 ms apart, every agent polled again.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 6)]).await;
    server.reset_costs();
    grows(
        agg.addr,
        &[
            ("faultline_aggregator_lease_passes_total", 120),
            ("faultline_aggregator_agent_polls_total", 4),
        ],
    )
    .await;
    let quiet = server.costs();
    eprintln!(
        "quiet minute: {} bytes fanned out to kubelets, {} ConfigMap bytes written, {} requests",
        quiet.kubelet_fanout_bytes,
        quiet.resource("configmaps").written_bytes,
        quiet.total.requests
    );
    assert_eq!(
        quiet.kubelet_fanout_bytes, 0,
        "a quiet minute reached the kubelets"
    );
    assert_eq!(quiet.resource("configmaps").written_objects, 0);

    // One device fails: its shard page is written once, to each node mounting it.
    server.reset_costs();
    inject(w.agent("n2"), r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    until(Duration::from_secs(10), "gpu1 failed on n2", || {
        node_entry(server, 1, "n2").filter(|e| {
            e.npus
                .iter()
                .any(|d| d.id == "gpu1" && d.status == DeviceStatus::Failed)
        })
    })
    .await;
    // Four of the replica's Lease passes (2 s) later, nothing more was written.
    grows(agg.addr, &[("faultline_aggregator_lease_passes_total", 4)]).await;
    let change = server.costs();
    let last = change
        .last_fanout("configmaps", "default", "faultline-shard-0")
        .expect("the page in default was written");
    eprintln!(
        "one status change: {} bytes fanned out ({} writes), the page {} bytes to {} kubelets",
        change.kubelet_fanout_bytes, change.kubelet_fanout_writes, last.object_bytes, last.kubelets
    );
    assert_eq!(last.kubelets, 4);
    assert!(
        change.kubelet_fanout_writes <= 2,
        "{} writes fanned out",
        change.kubelet_fanout_writes
    );
    agg.cancel_token().cancel();
}
