//! Node-local delivery and the drain handshake on a real cluster:
//! the aggregator finds each node's agent through the real EndpointSlices and hands it
//! the node's entry; the agent keeps it as the node's own fault.json and serves it to
//! the pods; a warned pod acknowledges from its own address (the pods' range is local
//! in the test's network namespace, so the test sends from that very address).

use std::time::{Duration, Instant};

use faultline_common::fault::NodeFaults;
use faultline_common::time::parse_rfc3339_ms;
use faultline_common::DeviceStatus;
use faultline_controlplane::Release;
use serde_json::json;

use crate::support::real::{post_from, request_from, RealCluster};
use crate::support::{self};
use crate::{until, HEALING};

/// The aggregator replica of these tests.
const REPLICA: &str = "faultline-aggregator-0";

/// `node`'s own fault.json once it holds a fresh verdict of [`REPLICA`] that `ok`
/// accepts.
async fn until_file(
    c: &RealCluster,
    node: &str,
    what: &str,
    ok: impl Fn(&NodeFaults) -> bool,
) -> NodeFaults {
    until(Duration::from_secs(30), what, || {
        let doc = c.node_file(node).ok_or("no fault.json yet")?;
        let fresh = doc
            .verdict
            .as_ref()
            .is_some_and(|v| !v.stale && v.writer.as_deref() == Some(REPLICA));
        if fresh && doc.node == node && ok(&doc) {
            Ok(doc)
        } else {
            Err(format!(
                "node {}, verdict {:?}, summary {:?}, {} intents",
                doc.node,
                doc.verdict,
                doc.summary,
                doc.drain.len()
            ))
        }
    })
    .await
}

/// Pod `name` in `default` on n1 holding one GPU of the device plugin, asking `grace`
/// to checkpoint: its (uid, address) once it runs.
async fn warned_pod(c: &RealCluster, name: &str, grace: &str) -> (String, String) {
    c.apply(&json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default",
                     "annotations": {"faultline.io/checkpoint-grace": grace}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "n1"},
            "containers": [{"name": "train", "image": "train:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
    }));
    until(Duration::from_secs(60), &format!("{name} running"), || {
        let pods = c.items(&[
            "-n",
            "default",
            "pods",
            "--field-selector",
            &format!("metadata.name={name}"),
        ]);
        let p = pods.first().ok_or("no pod")?;
        match (p["status"]["phase"].as_str(), p["status"]["podIP"].as_str()) {
            (Some("Running"), Some(ip)) => Ok((
                p["metadata"]["uid"].as_str().unwrap().to_string(),
                ip.to_string(),
            )),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// The apiserver's answers to faultline's evictions of `pod`: (code, received at, ms).
fn evictions(c: &RealCluster, pod: &str) -> Vec<(u16, u64)> {
    c.cp.audit()
        .into_iter()
        .filter(|e| e.verb == "create" && e.uri.contains(&format!("/pods/{pod}/eviction")))
        .map(|e| (e.code, e.received_ms))
        .collect()
}

/// Each node's own fault.json gets its node's verdict (and no other node's) through the
/// agent the real EndpointSlice names; a fault reaches it with two drain intents; the
/// pod port serves it; a pod acknowledges its own intent from its own address (another
/// pod's is refused) and is evicted at once; the pod that never acknowledges is evicted
/// at its deadline, not before; each once. When the aggregator goes, the file says
/// stale and calls no device healthy.
async fn delivery_and_the_drain_handshake(release: Release) {
    let test = format!("delivery_and_the_drain_handshake ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, 2).await else {
        return;
    };
    let (ckpt, ckpt_ip) = warned_pod(&c, "ckpt", "300s").await;
    let (slow, _) = warned_pod(&c, "slow", "4s").await;
    let mut args = HEALING.to_vec();
    args.push("--delivery-confirm=500ms");
    let agg = c.aggregator(REPLICA, &args).await;

    for node in ["n1", "n2"] {
        until_file(&c, node, &format!("{node}'s verdict"), |d| {
            d.summary.healthy == 4
        })
        .await;
    }
    let fault = r#"{"device":"gpu1","fault":"row-remap-failure"}"#;
    let at = Instant::now();
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", fault).await,
        201
    );
    let doc = until_file(&c, "n1", "gpu1 failed, two intents", |d| {
        let failed = d
            .npus
            .iter()
            .any(|n| n.id == "gpu1" && n.status == DeviceStatus::Failed);
        failed && d.drain.len() == 2
    })
    .await;
    eprintln!(
        "{test}: fault -> n1's own fault.json with its intents: {:?}",
        at.elapsed()
    );
    let intent = |uid: &str| doc.drain.iter().find(|d| d.uid == uid).unwrap().clone();
    let (i_ckpt, i_slow) = (intent(&ckpt), intent(&slow));
    assert_eq!(
        i_ckpt.pod_ips,
        std::slice::from_ref(&ckpt_ip),
        "the pod's real address"
    );
    assert_eq!(i_ckpt.reasons, ["row-remap-failure"]);
    let n2 = c.node_file("n2").unwrap();
    assert!(
        n2.drain.is_empty() && n2.summary.failed == 0,
        "n1's news in n2's file: {n2:?}"
    );

    // The pod port serves it as a pod reads it: with that pod's own intent only,
    // found by the address it asks from.
    let pod_port = c.fault_addr("n1");
    let (code, body) = request_from(&ckpt_ip, "GET", pod_port, "/v1/fault", "").await;
    assert_eq!(code, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    let uids = support::drain_uids(&body);
    assert_eq!(uids, [ckpt.as_str()], "ckpt's alone: {body}");

    // ckpt may not speak for slow; it acknowledges its own, and is evicted at once.
    let slow_ack = json!({"uid": slow}).to_string();
    assert_eq!(
        post_from(&ckpt_ip, pod_port, "/v1/drain/ack", &slow_ack).await,
        403,
        "slow's intent acknowledged from ckpt's address"
    );
    let acked = Instant::now();
    let ckpt_ack = json!({"uid": ckpt}).to_string();
    assert_eq!(
        post_from(&ckpt_ip, pod_port, "/v1/drain/ack", &ckpt_ack).await,
        202,
        "taken (202 the first time)"
    );
    until(Duration::from_secs(15), "ckpt evicted on its word", || {
        let e = evictions(&c, "ckpt");
        e.iter()
            .any(|(code, _)| *code == 201)
            .then_some(())
            .ok_or(format!("{e:?}"))
    })
    .await;
    eprintln!("{test}: acknowledgement -> eviction {:?}", acked.elapsed());

    // slow never acknowledges: evicted at its deadline, as the apiserver's clock saw it.
    let e = until(
        Duration::from_secs(20),
        "slow evicted at its deadline",
        || {
            let e = evictions(&c, "slow");
            e.iter()
                .any(|(code, _)| *code == 201)
                .then(|| e.clone())
                .ok_or(format!("{e:?}"))
        },
    )
    .await;
    let due = parse_rfc3339_ms(&i_slow.evict_after).unwrap();
    let first = e.iter().map(|(_, at)| *at).min().unwrap();
    assert!(
        first >= due,
        "slow asked to leave {} ms before its deadline",
        due - first
    );
    for pod in ["ckpt", "slow"] {
        let ok = evictions(&c, pod)
            .iter()
            .filter(|(code, _)| *code == 201)
            .count();
        assert_eq!(ok, 1, "{pod} evicted {ok} times");
    }

    // The aggregator goes: within three confirmations n1's file says so.
    drop(agg);
    let stale = until(Duration::from_secs(15), "n1's verdict stale", || {
        let d = c.node_file("n1").ok_or("no file")?;
        if d.verdict.as_ref().is_some_and(|v| v.stale) {
            Ok(d)
        } else {
            Err(format!("{:?}", d.verdict))
        }
    })
    .await;
    assert_eq!(stale.summary.healthy, 0, "{:?}", stale.summary);
    assert!(
        stale
            .npus
            .iter()
            .any(|n| n.id == "gpu1" && n.status == DeviceStatus::Failed),
        "the failure stays"
    );
    c.assert_no_forbidden();
}

on_releases!(delivery_and_the_drain_handshake:
    delivery_and_the_drain_handshake_1_37 = V1_37,
    delivery_and_the_drain_handshake_1_36 = V1_36,
);
