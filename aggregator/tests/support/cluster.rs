//! What the tests read back from the Kubernetes API test server: faultline's taints,
//! quarantine records and Events on Nodes, evictions, the shard Leases and ConfigMaps.
//! Names and keys are spelled out here, as a cluster's user sees them, not taken from
//! the aggregator's constants.

use faultline_common::fault::{shard_of, NodeFaults, ShardIndex};
use faultline_test_apiserver::ApiServer;
use serde_json::Value;

use super::NS;

/// The taint faultline puts on a quarantined node.
pub const TAINT: &str = "nvidia.com/gpu-fault";

/// Node `n`'s taints.
/// Whether a Lease reads released the way client-go's leader election releases one:
/// holder `""`, a duration of 1 s, a renew time (before, the holder and renew time
/// were nulled, which client-go never writes).
pub fn released_as_client_go_does(lease: &Value) -> bool {
    let spec = &lease["spec"];
    spec["holderIdentity"] == ""
        && spec["leaseDurationSeconds"] == 1
        && spec["renewTime"].is_string()
}

pub fn taints(server: &ApiServer, n: &str) -> Vec<Value> {
    server.get("nodes", "", n).unwrap()["spec"]["taints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// How many of node `n`'s taints are faultline's.
pub fn our_taints(server: &ApiServer, n: &str) -> usize {
    taints(server, n)
        .iter()
        .filter(|t| t["key"] == TAINT)
        .count()
}

/// The keys of node `n`'s taints, in order.
pub fn taint_keys(server: &ApiServer, n: &str) -> Vec<String> {
    taints(server, n)
        .iter()
        .map(|t| t["key"].as_str().unwrap_or("").to_string())
        .collect()
}

/// Events in `default` with this reason, about anything.
pub fn events(server: &ApiServer, reason: &str) -> usize {
    server
        .list("events", "default")
        .iter()
        .filter(|e| e["reason"] == reason)
        .count()
}

/// Events in `default` with this reason about the object named `name` (a Node).
pub fn events_on(server: &ApiServer, name: &str, reason: &str) -> usize {
    server
        .list("events", "default")
        .iter()
        .filter(|e| e["reason"] == reason && e["involvedObject"]["name"] == name)
        .count()
}

/// Eviction requests for a pod answered `status`.
pub fn eviction_calls(server: &ApiServer, pod: &str, status: u16) -> usize {
    server
        .calls()
        .iter()
        .filter(|c| {
            c.method == "POST"
                && c.uri.contains(&format!("/pods/{pod}/eviction"))
                && c.status == status
        })
        .count()
}

/// Successful eviction requests for a pod. (The test server deletes an evicted pod at
/// once, so a second request would be answered 404: see [`evicted_once`].)
pub fn evictions(server: &ApiServer, pod: &str) -> usize {
    eviction_calls(server, pod, 201)
}

/// The pod was evicted, and never asked to leave again once gone.
pub fn evicted_once(server: &ApiServer, pod: &str) -> bool {
    evictions(server, pod) == 1 && eviction_calls(server, pod, 404) == 0
}

/// Node `n`'s quarantine record, if it has one.
pub fn record(server: &ApiServer, n: &str) -> Option<Value> {
    server.get("nodes", "", n).unwrap()["metadata"]["annotations"]["faultline.io/quarantine"]
        .as_str()
        .map(|s| serde_json::from_str(s).unwrap())
}

/// Node `n`'s released quarantine records, oldest first.
pub fn history(server: &ApiServer, n: &str) -> Vec<Value> {
    server.get("nodes", "", n).unwrap()["metadata"]["annotations"]
        ["faultline.io/quarantine-history"]
        .as_str()
        .map(|s| serde_json::from_str(s).unwrap())
        .unwrap_or_default()
}

/// Who holds shard `shard`'s Lease.
pub fn holder(server: &ApiServer, shard: u32) -> Option<String> {
    let l = server.get("leases", NS, &format!("faultline-shard-{shard}"))?;
    l["spec"]["holderIdentity"].as_str().map(String::from)
}

/// Wait (10 s at most) until `replica` holds shard 0's Lease; the Lease.
pub async fn holds(server: &ApiServer, replica: &str) -> Value {
    super::until(
        std::time::Duration::from_secs(10),
        "the replica holds the shard",
        || {
            server
                .get("leases", NS, "faultline-shard-0")
                .filter(|l| l["spec"]["holderIdentity"] == replica)
        },
    )
    .await
    .0
}

/// Shard `shard`'s index document as published.
pub fn shard_doc(server: &ApiServer, shard: u32) -> Option<ShardIndex> {
    let cm = server.get("configmaps", NS, &format!("faultline-shard-{shard}"))?;
    serde_json::from_str(cm["data"]["fault.json"].as_str()?).ok()
}

/// The pod UIDs of an entry's `drain[]` (a `fault.json` as JSON), in order.
pub fn drain_uids(entry: &serde_json::Value) -> Vec<&str> {
    entry["drain"]
        .as_array()
        .map(|d| d.iter().filter_map(|d| d["uid"].as_str()).collect())
        .unwrap_or_default()
}

/// Node `node`'s published entry, in the shard of `shards` its name hashes to.
pub fn node_entry(server: &ApiServer, shards: u32, node: &str) -> Option<NodeFaults> {
    // On whichever page of its shard holds it (`--pages`; page 0 alone by default).
    (0..16)
        .map_while(|p| {
            let name = faultline_common::fault::page_name("faultline", shard_of(node, shards), p);
            server.get("configmaps", NS, &name)
        })
        .find_map(|cm| serde_json::from_str(cm["data"][format!("{node}.json")].as_str()?).ok())
}

/// Whether `node`'s published entry shows device `id` failed.
pub fn published_failed(server: &ApiServer, shards: u32, node: &str, id: &str) -> bool {
    node_entry(server, shards, node).is_some_and(|e| {
        e.npus
            .iter()
            .any(|d| d.id == id && d.status == faultline_common::DeviceStatus::Failed)
    })
}

/// The calls refused by authentication or RBAC so far, as `STATUS METHOD URI`.
pub fn refused(server: &ApiServer) -> Vec<String> {
    server
        .calls()
        .into_iter()
        .filter(|c| c.status == 401 || c.status == 403)
        .map(|c| format!("{} {} {}", c.status, c.method, c.uri))
        .collect()
}

/// Nothing the aggregator asked was refused by RBAC: the shipped manifest grants every
/// call the code made (a missing verb in deploy/base/aggregator.yaml fails here).
pub fn assert_no_forbidden(server: &ApiServer) {
    let refused = refused(server);
    assert!(refused.is_empty(), "refused by RBAC: {refused:?}");
}

/// Until the server has received a `method` call whose path contains `path` (audit
/// stage `RequestReceived`: a call whose processing is delayed is seen at once); at most
/// 10 s.
pub async fn until_received(server: &ApiServer, method: &str, path: &str) {
    let start = std::time::Instant::now();
    while !server
        .received()
        .iter()
        .any(|c| c.method == method && c.uri.contains(path))
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "no {method} {path} received within 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
