//! Hostile agents. An agent that names its own node (so every identity check
//! passes) and 512 devices under new ids in every document must stop neither its
//! shard's publication nor a real fault on another node of the same shard, and must not
//! grow what the replica keeps.

mod support;

use std::time::Duration;

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_churning_agent_stops_no_other_nodes_fault() {
    let evil = churning_agent("evil").await;
    let w = Scenario::new().agent("good").start().await;
    let server = &w.server;
    let agents = format!("evil=http://{evil},good=http://{}", w.agent("good").addr);
    let agg = w.configmap("r1", 1).set("--agents", &agents).start().await;
    until(Duration::from_secs(20), "good published healthy", || {
        node_entry(server, 1, "good").filter(|e| e.summary.healthy == 4)
    })
    .await;
    // Ten of the churning agent's documents (one a second) refused, then a real fault
    // beside it.
    grows(
        agg.addr,
        &[(
            r#"faultline_aggregator_agent_poll_errors_total{kind="device-churn"}"#,
            10,
        )],
    )
    .await;
    inject(
        w.agent("good"),
        r#"{"device":"gpu1","fault":"xid","xid":79}"#,
    )
    .await;
    until(Duration::from_secs(10), "good's fault published", || {
        published_failed(server, 1, "good", "gpu1").then_some(())
    })
    .await;
    // The churning node kept no more than its first document's devices; the shard's
    // ConfigMap stays small.
    // Published (it passed vacuously when the node never was).
    let evil_entry = node_entry(server, 1, "evil").expect("the churning node published");
    let kept = evil_entry.npus.len();
    eprintln!(
        "the churning node: {kept} devices kept, {:?}",
        evil_entry.summary
    );
    assert!(kept <= 64, "{kept} devices kept for the churning node");
    let cm = server.get("configmaps", NS, "faultline-shard-0").unwrap();
    let bytes = serde_json::to_vec(&cm["data"]).unwrap().len();
    assert!(bytes < 100 << 10, "the shard is {bytes} bytes");
    let m = metrics(agg.addr).await;
    assert!(
        m.lines()
            .any(|l| l.contains("device-churn") && !l.ends_with(" 0")),
        "refusals counted"
    );
    agg.cancel_token().cancel();
}

/// Alerts for nodes this replica does not follow (here 2,000
/// names, none a Node) wait at most 64 nodes at a time; the rest are dropped and
/// counted. The replica keeps its Lease, a real fault is still published, and no more
/// than that many nodes get a remediation pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alert_flood_for_unknown_nodes_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let w = Scenario::ready_nodes(&["good"]).start().await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&[
            "--intake-token-file",
            token.to_str().unwrap(),
            "--intake-threshold",
            "1",
        ])
        .start()
        .await;
    until(Duration::from_secs(20), "good published healthy", || {
        node_entry(server, 1, "good").filter(|e| e.summary.healthy == 4)
    })
    .await;
    let url = format!("http://{}/v1/alerts", agg.addr);
    for batch in 0..20 {
        let alerts: Vec<String> = (0..100)
            .map(|i| {
                format!(
                    r#"{{"node_name":"ghost-{batch}-{i}","gpu_uuid":"GPU-{i}","metric":"xid_error","value":"Xid 79","time":{}}}"#,
                    1_700_000_000 + i
                )
            })
            .collect();
        let (code, _) = call(
            "POST",
            &url,
            Some("s3cret"),
            format!("[{}]", alerts.join(",")),
        )
        .await;
        assert!(code < 500, "batch {batch}: {code}");
    }
    inject(
        w.agent("good"),
        r#"{"device":"gpu1","fault":"xid","xid":79}"#,
    )
    .await;
    until(Duration::from_secs(10), "good's fault published", || {
        published_failed(server, 1, "good", "gpu1").then_some(())
    })
    .await;
    let m = metrics(agg.addr).await;
    let dropped: u64 = m
        .lines()
        .find(|l| l.contains(r#"result="unfollowed-overflow""#))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0);
    let events = server.list("events", "default").len();
    eprintln!("{dropped} of 2,000 alerts for unknown nodes dropped; {events} Events");
    assert!(dropped > 0, "{dropped} dropped");
    assert!(
        m.contains("faultline_aggregator_lease_held{shard=\"0\"} 1"),
        "the Lease kept"
    );
    agg.cancel_token().cancel();
}
