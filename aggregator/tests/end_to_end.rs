//! Simulated agents, the aggregator and the file sink over real HTTP on loopback: a hard
//! fault injected at an agent is in fault.json, read the way a pod reads a ConfigMap
//! volume, within a second; seed 003's consumer, given its node's entry, reacts.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use faultline_common::fault::{FaultDocument, NodeFaults};
use faultline_common::DeviceStatus;
use support::*;

/// Read a key the way a pod reads its mounted ConfigMap: open the path, parse.
fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(serde_json::from_str(&text).expect("a whole document, never a torn one"))
}

async fn wait_file<T: serde::de::DeserializeOwned>(
    path: &Path,
    within: Duration,
    pred: impl Fn(&T) -> bool,
) -> (T, Duration) {
    let start = Instant::now();
    loop {
        if let Some(v) = read::<T>(path) {
            if pred(&v) {
                return (v, start.elapsed());
            }
        }
        assert!(
            start.elapsed() < within,
            "timed out waiting on {}; it reads: {}",
            path.display(),
            std::fs::read_to_string(path).unwrap_or_else(|e| e.to_string())
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_fault_reaches_the_file_sink_within_a_second_and_the_consumer_reacts() {
    let (a1, a2, a3) = (agent("n1").await, agent("n2").await, agent("n3").await);
    let out = tempfile::tempdir().unwrap();
    let agg = Launch::file(&[&a1, &a2, &a3], out.path())
        .rules(None)
        .start()
        .await;
    let (doc, _) = wait_file::<FaultDocument>(
        &out.path().join("fault.json"),
        Duration::from_secs(15),
        |d| d.nodes.len() == 3 && d.summary.healthy == 12,
    )
    .await;
    assert_eq!(doc.version, "faultline.fault/v1");
    assert_eq!(doc.writer, "r1");

    // Seed 003's consumer, unmodified, watching n2's entry as its /config/fault.json.
    let trace = out.path().join("consumer.trace");
    let mut consumer = ChildGuard(
        Command::new("python3")
            .arg(repo_root().join("tests/consumer/run_consumer.py"))
            .arg(out.path().join("n2.json"))
            .env("NODE_NAME", "n2")
            .env("CONSUMER_TRACE", &trace)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 is needed (.ci/run installs it)"),
    );
    // It has read the healthy entry and looked again twice since.
    until(
        Duration::from_secs(30),
        "the consumer judged n2 healthy",
        || {
            let (reads, checks) = faultline_common::testing::consumer_trace(&trace);
            (reads >= 1 && checks >= 2).then_some(())
        },
    )
    .await;
    assert!(
        consumer.0.try_wait().unwrap().is_none(),
        "healthy: the consumer keeps running"
    );

    let t0 = Instant::now();
    inject(&a2, r#"{"device":"gpu1","fault":"lost"}"#).await;
    let (n2, _) =
        wait_file::<NodeFaults>(&out.path().join("n2.json"), Duration::from_secs(5), |n| {
            n.npus
                .iter()
                .any(|d| d.id == "gpu1" && d.status == DeviceStatus::Failed)
        })
        .await;
    let latency = t0.elapsed();
    assert!(
        latency < Duration::from_secs(5),
        "fault reached the file sink after {latency:?}"
    );
    let gpu1 = n2.npus.iter().find(|d| d.id == "gpu1").unwrap();
    assert_eq!(gpu1.reason.as_deref(), Some("gpu-lost"));
    assert_eq!(n2.summary.failed, 1);

    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = consumer.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the consumer did not react");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut text = String::new();
    std::io::Read::read_to_string(&mut consumer.0.stdout.take().unwrap(), &mut text).unwrap();
    assert_eq!(status.code(), Some(1));
    assert_eq!(text.trim(), "CRITICAL: NPU gpu1 failed, reason: gpu-lost");

    // Other nodes are untouched; the whole-shard document agrees.
    let (doc, _) = wait_file::<FaultDocument>(
        &out.path().join("fault.json"),
        Duration::from_secs(3),
        |d| d.summary.failed == 1,
    )
    .await;
    assert_eq!(doc.nodes["n1"].summary.healthy, 4);
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_dies_turns_unknown_never_failed() {
    let a1 = agent("n1").await;
    let out = tempfile::tempdir().unwrap();
    let rules = out.path().join("rules.yaml");
    // A short grace so the test is quick.
    std::fs::write(&rules, "state_machine:\n  unknown_after_ms: 2000\n").unwrap();
    let sink = out.path().join("sink");
    let agg = Launch::file(&[&a1], &sink)
        .rules(Some(&rules))
        .start()
        .await;
    wait_file::<NodeFaults>(&sink.join("n1.json"), Duration::from_secs(15), |n| {
        n.summary.healthy == 4
    })
    .await;
    a1.shutdown().await;
    let (n1, _) = wait_file::<NodeFaults>(&sink.join("n1.json"), Duration::from_secs(15), |n| {
        n.summary.unknown == 4
    })
    .await;
    assert!(!n1.agent.reachable);
    assert!(n1.agent.error.is_some());
    assert_eq!(n1.summary.failed, 0);
    agg.cancel_token().cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_reload_and_an_invalid_file_keeps_the_old_rules() {
    let a1 = agent("n1").await;
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "").unwrap();
    let sink = dir.path().join("sink");
    let agg = Launch::file(&[&a1], &sink)
        .rules(Some(&rules))
        .start()
        .await;
    wait_file::<NodeFaults>(&sink.join("n1.json"), Duration::from_secs(15), |n| {
        n.summary.healthy == 4
    })
    .await;

    // Broken: counted, logged, old rules stay.
    std::fs::write(
        &rules,
        "windows: [ {reason: x, metric: temperature_c, above: 1, count: 9, of: 2} ]\n",
    )
    .unwrap();
    let text = metric_until(
        agg.addr,
        "faultline_aggregator_rules_reloads_total{result=\"invalid\"} 1",
        Duration::from_secs(10),
    )
    .await;
    assert!(
        !text.contains("rules_reloads_total{result=\"ok\"}"),
        "{text}"
    );

    // Valid: every simulated GPU is over 20 C, and the rule degrades after 0 s held.
    std::fs::write(
        &rules,
        "windows: [ {reason: warm, metric: temperature_c, above: 20, count: 1, of: 1} ]\nstate_machine: {degraded_after_ms: 0}\n",
    )
    .unwrap();
    metric_until(
        agg.addr,
        "faultline_aggregator_rules_reloads_total{result=\"ok\"} 1",
        Duration::from_secs(10),
    )
    .await;
    let (n1, _) = wait_file::<NodeFaults>(&sink.join("n1.json"), Duration::from_secs(10), |n| {
        n.summary.degraded == 4
    })
    .await;
    assert_eq!(n1.npus[0].reason.as_deref(), Some("warm"));
    agg.cancel_token().cancel();
}

/// The pinned identity, on the watch stream (the documents are read and
/// checked by the core, not the follower): the real agent at the address followed as
/// `n1` serves node `n2`. Its documents are refused and counted; `n1` is published
/// unreachable with the reason, and no entry for `n2` appears. The agent at `n3`'s
/// address, honest, is followed on a stream (no fallback counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_document_for_another_node_is_refused() {
    let (liar, honest) = (agent("n2").await, agent("n3").await);
    let out = tempfile::tempdir().unwrap();
    let agents = format!("n1=http://{},n3=http://{}", liar.addr, honest.addr);
    let agg = Launch::file_following(&agents, out.path()).start().await;
    let (doc, _) = wait_file::<FaultDocument>(
        &out.path().join("fault.json"),
        Duration::from_secs(15),
        |d| {
            d.nodes.get("n3").is_some_and(|n| n.summary.healthy == 4)
                && d.nodes.get("n1").is_some_and(|n| {
                    n.agent
                        .error
                        .as_deref()
                        .is_some_and(|e| e.contains("identity mismatch"))
                })
        },
    )
    .await;
    assert!(!doc.nodes.contains_key("n2"), "{:?}", doc.nodes.keys());
    assert!(!doc.nodes["n1"].agent.reachable);
    let text = metrics(agg.addr).await;
    let refused = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("faultline_aggregator_agent_poll_errors_total{kind=\"identity\"} ")
        })
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(refused >= 1.0, "{text}");
    assert!(
        text.contains("faultline_aggregator_agent_watch_fallbacks_total 0"),
        "{text}"
    );
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}
