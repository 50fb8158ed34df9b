//! Discovery without full Nodes. The agents are found from the EndpointSlices
//! of their headless Service (seeded here as the endpointslice controller writes them,
//! pkg/controller/endpointslice: the label `kubernetes.io/service-name`, one endpoint per
//! agent pod with its `nodeName` and `ready` condition): every endpoint of the Service is
//! followed, ready or not (an agent pod starting or stopping is still its
//! node's); a node whose endpoint goes is kept until its Node is found gone
//! (`--agent-gone-check` after), and no Node is read until then.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::*;

fn slice(name: &str, node: &str, port: u16, ready: bool) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "kubernetes.io/service-name": "faultline-agent",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"
            }
        },
        "addressType": "IPv4",
        "endpoints": [{
            "addresses": ["127.0.0.1"],
            "conditions": {"ready": ready, "serving": ready, "terminating": false},
            "nodeName": node,
            "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("faultline-agent-{node}")}
        }],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_found_from_endpointslices_and_a_node_is_read_only_once_its_agent_left() {
    let w = Scenario::new()
        .agent("gpu-7")
        .agent("gpu-8")
        .unlisted()
        .start()
        .await;
    let server = &w.server;
    let (p7, p8) = (w.agent("gpu-7").addr.port(), w.agent("gpu-8").addr.port());
    server
        .create(
            "endpointslices",
            NS,
            slice("faultline-agent-a", "gpu-7", p7, true),
        )
        .unwrap();
    server
        .create(
            "endpointslices",
            NS,
            slice("faultline-agent-b", "gpu-8", p8, false),
        )
        .unwrap();
    // A slice of another Service names no agent.
    let mut other = slice("web-x", "gpu-9", p8, true);
    other["metadata"]["labels"]["kubernetes.io/service-name"] = json!("web");
    server.create("endpointslices", NS, other).unwrap();
    // Nor does a slice of the agents' Service that the endpointslice controller did not
    // write (made by hand in the namespace), nor an endpoint with no pod behind it.
    let mut forged = slice("faultline-agent-forged", "gpu-10", p8, true);
    forged["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("endpointslice.kubernetes.io/managed-by");
    server.create("endpointslices", NS, forged).unwrap();
    let mut podless = slice("faultline-agent-podless", "gpu-11", p8, true);
    podless["endpoints"][0]
        .as_object_mut()
        .unwrap()
        .remove("targetRef");
    server.create("endpointslices", NS, podless).unwrap();
    let agg = w
        .configmap("r1", 1)
        .args(&["--agent-gone-check", "1s"])
        .start()
        .await;
    until(Duration::from_secs(20), "gpu-7 published", || {
        node_entry(server, 1, "gpu-7").filter(|e| e.summary.healthy == 4)
    })
    .await;
    // Two more rounds of polls: any other agent it followed would have been polled.
    grows(agg.addr, &[("faultline_aggregator_agent_polls_total", 2)]).await;
    let nodes =
        |s: &faultline_common::fault::ShardIndex| s.nodes.keys().cloned().collect::<Vec<_>>();
    until(Duration::from_secs(20), "gpu-8 published", || {
        node_entry(server, 1, "gpu-8").filter(|e| e.summary.healthy == 4)
    })
    .await;
    assert_eq!(
        nodes(&shard_doc(server, 0).unwrap()),
        ["gpu-7", "gpu-8"],
        "gpu-8 unready is followed all the same; gpu-9, gpu-10 and gpu-11 are not agents"
    );
    // (Remediation's watch of the quarantined Nodes, those with the devices label,
    // reads none here: no node is quarantined.)
    assert!(
        !server
            .calls()
            .iter()
            .any(|c| c.uri.starts_with("/api/v1/nodes") && !c.uri.contains("unhealthy-devices")),
        "a Node was read while every agent had its endpoint"
    );

    // gpu-8's agent turns ready; gpu-7's slice goes.
    server
        .update(
            "endpointslices",
            NS,
            "faultline-agent-b",
            slice("faultline-agent-b", "gpu-8", p8, true),
            None,
        )
        .unwrap();
    until(Duration::from_secs(20), "gpu-8 published", || {
        node_entry(server, 1, "gpu-8").filter(|e| e.summary.healthy == 4)
    })
    .await;
    server
        .delete("endpointslices", NS, "faultline-agent-a")
        .unwrap();
    // No Node gpu-7 in this cluster: forgotten once looked up.
    until(Duration::from_secs(20), "gpu-7 forgotten", || {
        shard_doc(server, 0).filter(|d| !d.nodes.contains_key("gpu-7"))
    })
    .await;

    let calls = server.calls();
    let node_reads: Vec<&str> = calls
        .iter()
        .filter(|c| c.uri.starts_with("/api/v1/nodes") && !c.uri.contains("unhealthy-devices"))
        .map(|c| c.uri.as_str())
        .collect();
    assert!(
        !node_reads.is_empty()
            && node_reads
                .iter()
                .all(|u| u.contains("fieldSelector=metadata.name%3Dgpu-7")),
        "only gpu-7's Node is looked up, by name: {node_reads:?}"
    );
    let lists: Vec<&str> = calls
        .iter()
        .filter(|c| c.uri.contains("/endpointslices?") && !c.uri.contains("watch=true"))
        .map(|c| c.uri.as_str())
        .collect();
    assert_eq!(lists.len(), 1, "{lists:?}");
    assert!(lists[0].contains("resourceVersion=0"), "{lists:?}");
    assert!(
        lists[0].contains("labelSelector=kubernetes.io%2Fservice-name%3Dfaultline-agent"),
        "{lists:?}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
}
