//! Seed 003's Python consumer, unmodified, reacts to the agent's document: it exits
//! with "CRITICAL: NPU <id> failed, reason: <reason>" once a device on its node fails.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test]
async fn the_seed_consumer_reacts_to_a_failed_device() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("health.json");
    let agent = spawn_agent(
        &[
            "--source",
            "sim",
            "--sim-devices",
            "8",
            "--interval",
            "200ms",
            "--health-file",
            file.to_str().unwrap(),
        ],
        &[],
    );
    wait_for(&agent, Duration::from_secs(10), "healthy", |d| {
        d.summary.healthy == 8
    })
    .await;
    let trace = dir.path().join("consumer.trace");
    let mut consumer = ChildGuard(
        Command::new("python3")
            .arg(test_path("consumer/run_consumer.py"))
            .arg(&file)
            .env("NODE_NAME", "test-node")
            .env("CONSUMER_TRACE", &trace)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 is needed for this test (.ci/run installs it)"),
    );
    // It has read the healthy document and looked again twice since.
    let t = Instant::now();
    loop {
        let (reads, checks) = faultline_common::testing::consumer_trace(&trace);
        if reads >= 1 && checks >= 2 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the consumer read nothing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        consumer.0.try_wait().unwrap().is_none(),
        "the consumer must keep running while all is healthy"
    );

    let r = request(
        "POST",
        &agent.url("/v1/sim/faults"),
        Some(r#"{"device":"gpu5","fault":"pcie-down"}"#),
    )
    .await;
    assert_eq!(r.status, 201);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = consumer.0.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = consumer.0.kill();
            panic!("the consumer did not react");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut out = String::new();
    consumer
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(status.code(), Some(1));
    assert_eq!(
        out.trim(),
        "CRITICAL: NPU gpu5 failed, reason: pcie-link-down"
    );
}
