//! Node-local delivery. The aggregator hands each node's entry to the node's
//! agent (`PUT /v1/fault`, bearer token), which keeps it as the node's own
//! `fault.json` (the file of `--fault-dir`, and `GET /v1/fault` on `--fault-listen`):
//! a fault reaches it without a ConfigMap write or a kubelet refresh; only the token
//! sets it; the pod port serves it read-only; once the aggregator falls silent the file
//! says so and calls no device healthy.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use faultline_common::fault::NodeFaults;
use faultline_common::DeviceStatus;
use support::*;

const TOKEN: &str = "delivery-token-0123456789";

fn node_file(dir: &Path) -> Option<NodeFaults> {
    serde_json::from_slice(&std::fs::read(dir.join("fault.json")).ok()?).ok()
}

fn status_of(doc: &NodeFaults, id: &str) -> Option<(DeviceStatus, Option<String>)> {
    doc.npus
        .iter()
        .find(|d| d.id == id)
        .map(|d| (d.status, d.reason.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_reaches_the_nodes_own_fault_json_and_silence_turns_it_stale() {
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let dir = tmp.path().join("node");
    std::fs::create_dir(&dir).unwrap();
    let agent = agent_with(
        "n1",
        &[
            "--fault-dir",
            dir.to_str().unwrap(),
            "--fault-listen",
            "127.0.0.1:0",
            "--delivery-token-file",
            token.to_str().unwrap(),
            "--verdict-stale-after",
            "30s",
        ],
    )
    .await;
    let pod_port = agent.fault_addr.expect("--fault-listen bound");
    let w = Scenario::new()
        .agents_flag(&format!("n1=http://{}", agent.addr))
        .start()
        .await;
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--delivery-token-file",
            token.to_str().unwrap(),
            "--delivery-confirm",
            "500ms",
        ])
        .start()
        .await;

    // Before the aggregator spoke the file was stale; then its verdict arrives.
    let (doc, _) = until(
        Duration::from_secs(20),
        "a fresh verdict, all healthy",
        || {
            node_file(&dir).filter(|d| {
                d.verdict
                    .as_ref()
                    .is_some_and(|v| !v.stale && v.writer.as_deref() == Some("r1"))
                    && d.summary.healthy == 4
            })
        },
    )
    .await;
    assert_eq!(doc.node, "n1");
    assert!(doc.readings_at.is_some());
    assert!(
        doc.npus.iter().all(|d| d.temperature_c.is_some()),
        "the agent's readings"
    );

    // A fault: in the node's file within a second, no ConfigMap or kubelet involved.
    let at = Instant::now();
    inject(&agent, r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    until(
        Duration::from_secs(5),
        "gpu1 failed in the node's fault.json",
        || {
            node_file(&dir)
                .filter(|d| status_of(d, "gpu1").is_some_and(|(s, _)| s == DeviceStatus::Failed))
        },
    )
    .await;
    let took = at.elapsed();
    eprintln!("fault -> the node's fault.json: {took:?}");
    assert!(
        took < Duration::from_secs(5),
        "{took:?} (a sanity bound on a loaded machine; the figure is measured in benches/)"
    );

    // The pod port serves it, read-only.
    let pod = format!("http://{pod_port}/v1/fault");
    let (status, body) = call("GET", &pod, None, String::new()).await;
    assert_eq!(status, 200);
    assert_eq!(body["node"], "n1");
    assert_eq!(body["summary"]["failed"], 1);
    let (status, _) = call("PUT", &pod, Some(TOKEN), "{}".into()).await;
    assert_eq!(status, 405, "no delivery through the pod port");
    let (status, _) = call(
        "GET",
        &format!("http://{pod_port}/v1/health"),
        None,
        String::new(),
    )
    .await;
    assert_eq!(status, 404, "nothing else on the pod port");

    // Only the token sets a verdict.
    let api = format!("http://{}/v1/fault", agent.addr);
    let forged = serde_json::json!({
        "writer": "mallory", "sequence": u64::MAX, "published": "2026-12-02T00:00:00.000Z",
        "stale_after_ms": 60_000, "entry": doc,
    })
    .to_string();
    for t in [None, Some("wrong-token")] {
        let (status, _) = call("PUT", &api, t, forged.clone()).await;
        assert_eq!(status, 401, "token {t:?}");
    }
    let (status, _) = call("PUT", &api, Some(TOKEN), "{\"garbage\": 1}".into()).await;
    assert_eq!(status, 400);
    let now = node_file(&dir).unwrap();
    assert_eq!(now.summary.failed, 1, "nothing forged got in");
    assert_eq!(now.verdict.unwrap().writer.as_deref(), Some("r1"));

    // The aggregator goes: within three confirmations the file says stale, and no
    // device is healthy; the failure stays.
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
    let (stale, _) = until(Duration::from_secs(10), "the verdict stale", || {
        node_file(&dir).filter(|d| d.verdict.as_ref().is_some_and(|v| v.stale))
    })
    .await;
    assert_eq!(stale.summary.healthy, 0, "{:?}", stale.summary);
    assert_eq!(
        status_of(&stale, "gpu0"),
        Some((DeviceStatus::Unknown, Some("verdict-stale".into())))
    );
    assert_eq!(
        status_of(&stale, "gpu1").map(|s| s.0),
        Some(DeviceStatus::Failed)
    );
    agent.shutdown().await;
}
