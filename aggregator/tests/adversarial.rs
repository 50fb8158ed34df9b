//! The adversarial suite: the hostile inputs at once, bounded in count and time,
//! against the aggregator binary in its own process with remediation enforced:
//!
//! - an agent that names its own node (every identity check passes) and 512 devices
//!   under new ids in every document;
//! - 40,000 alerts for nodes that do not exist, in 40 requests of the most one may
//!   carry (1,000), and 2,000 naming devices that nobody reports on a real node;
//! - hostile intake bodies: malformed JSON, a body over `--intake-max-bytes`, no token,
//!   a wrong token;
//!
//! and, while they last, a real fault on another node of the same shard. It asserts
//! that nothing acts but that fault (no taint, no eviction elsewhere), that the replica's
//! peak resident memory stays within 128 MiB, that its shard's Lease is held at every
//! look and never changes holder, and that the real fault is published and healed.
//! Forged kernel records and syslog lines are the agent's side of the suite
//! (`agent/tests/kmsg.rs`: `a_process_cannot_fail_a_gpu_end_to_end`,
//! `a_syslog_kernel_tag_degrades_at_most`).

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

const LIMIT_KIB: u64 = 128 << 10;

/// `n` alerts (GPUAlert objects), each for a node and device `name(i)` gives.
fn alerts(n: usize, name: impl Fn(usize) -> (String, String)) -> String {
    let a: Vec<String> = (0..n)
        .map(|i| {
            let (node, uuid) = name(i);
            format!(
                r#"{{"node_name":"{node}","gpu_uuid":"{uuid}","metric":"xid_error","value":"Xid 79","time":{}}}"#,
                1_700_000_000 + i
            )
        })
        .collect();
    format!("[{}]", a.join(","))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_input_at_once_moves_nothing_but_the_real_fault() {
    let evil = churning_agent("evil").await;
    let w = Scenario::new()
        .nodes(["good", "bystander", "evil"].map(|n| NodeFixture::realistic(n).ready(true)))
        .agent("good")
        .agent("bystander")
        .named()
        .pods([
            PodFixture::new("train-good", "good").gpu(),
            PodFixture::new("train-bystander", "bystander").gpu(),
            PodFixture::new("train-evil", "evil").gpu(),
        ])
        .start()
        .await;
    let server = &w.server;
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let agents = format!(
        "{},evil=http://{evil}",
        w.agents_flag().expect("the scenario's agents")
    );
    let launch = Launch::healing(&w.kube, "r1").args(&[
        "--agents",
        &agents,
        "--intake-token-file",
        token.to_str().unwrap(),
        "--intake-threshold",
        "1",
        "--intake-max-bytes",
        "1048576",
    ]);
    let (child, base) = aggregator_process(launch).await;
    let pid = child.id();
    until(Duration::from_secs(30), "good published healthy", || {
        node_entry(server, 1, "good").filter(|e| e.summary.healthy == 4)
    })
    .await;
    let holder0 = holder(server, 0).expect("the shard's Lease held");

    // The Lease, looked at every 100 ms while the attack lasts.
    let attacking = Arc::new(AtomicBool::new(true));
    let (looks, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let watcher = {
        let (attacking, looks, dropped) = (attacking.clone(), looks.clone(), dropped.clone());
        let metrics = format!("{base}/metrics");
        tokio::spawn(async move {
            while attacking.load(Ordering::Relaxed) {
                let text = get_text(&metrics).await;
                if !text.contains("faultline_aggregator_lease_held{shard=\"0\"} 1") {
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
                looks.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let url = format!("{base}/v1/alerts");
    let started = Instant::now();
    // Hostile bodies: each refused, none acted on.
    let refused = [
        ("[{not json", Some("s3cret")),
        (r#"{"alerts": "nope"}"#, Some("s3cret")),
        ("[]", None),
        ("[]", Some("wrong")),
    ];
    for (body, tok) in refused {
        let (code, _) = call("POST", &url, tok, body.into()).await;
        assert!((400..500).contains(&code), "{body:?} answered {code}");
    }
    let huge = format!("[{}]", "0,".repeat(600_000) + "0");
    let (code, _) = call("POST", &url, Some("s3cret"), huge).await;
    assert!(
        code == 413 || code == 400,
        "a body over the cap answered {code}"
    );
    // 40,000 alerts for nodes that do not exist, and 2,000 for devices nobody reports.
    for batch in 0..40 {
        let body = alerts(1_000, |i| {
            (format!("ghost-{batch}-{i}"), format!("GPU-{i}"))
        });
        let t = Instant::now();
        let (code, _) = call("POST", &url, Some("s3cret"), body).await;
        assert!(code < 500, "batch {batch}: {code}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "batch {batch} took {:?}",
            t.elapsed()
        );
    }
    for batch in 0..2 {
        let body = alerts(1_000, |i| {
            ("bystander".into(), format!("GPU-nobody-{batch}-{i}"))
        });
        let (code, _) = call("POST", &url, Some("s3cret"), body).await;
        assert!(code < 500, "bystander batch {batch}: {code}");
    }
    eprintln!("the floods sent in {:?}", started.elapsed());
    // Each ghost name cost a Node GET (4,561 a second, sustained); the checks of nodes
    // not followed are now 5 a second after a burst of 20, those found missing
    // remembered.
    let flood_s = started.elapsed().as_secs_f64();

    // The real fault, beside the churn and the floods.
    let at = Instant::now();
    inject(
        w.agent("good"),
        r#"{"device":"gpu1","fault":"xid","xid":79}"#,
    )
    .await;
    until(Duration::from_secs(10), "good's fault published", || {
        published_failed(server, 1, "good", "gpu1").then_some(())
    })
    .await;
    eprintln!("good's fault published {:?} after it", at.elapsed());
    until(
        Duration::from_secs(20),
        "good quarantined and its pod evicted",
        || {
            (our_taints(server, "good") > 0
                && server.get("pods", "default", "train-good").is_none())
            .then_some(())
        },
    )
    .await;
    attacking.store(false, Ordering::Relaxed);
    watcher.await.unwrap();

    // Nothing else acted.
    for node in ["bystander", "evil"] {
        assert_eq!(our_taints(server, node), 0, "{node} tainted");
        assert!(
            server
                .get("pods", "default", &format!("train-{node}"))
                .is_some(),
            "{node}'s pod evicted"
        );
    }
    assert_eq!(server.list("nodes", "").len(), 3, "no Node made");
    let ghost_events = server
        .list("events", "default")
        .iter()
        .filter(|e| {
            e["involvedObject"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("ghost-"))
        })
        .count();
    assert_eq!(ghost_events, 0, "Events about nodes that do not exist");
    let ghost_gets = server
        .calls()
        .iter()
        .filter(|c| c.method == "GET" && c.uri.starts_with("/api/v1/nodes/ghost-"))
        .count();
    let bound = 20.0 + 5.0 * (flood_s + at.elapsed().as_secs_f64()) + 5.0;
    eprintln!("Node GETs for ghost names: {ghost_gets} (bound {bound:.0})");
    assert!(
        (ghost_gets as f64) <= bound,
        "{ghost_gets} Node GETs for nodes that do not exist, over {bound:.0}"
    );
    assert_eq!(
        events_on(server, "bystander", "FaultlineAlertUnattributed"),
        1,
        "one Event for the bystander's unattributed alerts"
    );
    // The Lease: held at every look, by the same replica.
    let (looks, dropped) = (
        looks.load(Ordering::Relaxed),
        dropped.load(Ordering::Relaxed),
    );
    assert!(looks > 20, "{looks} looks at the Lease");
    assert_eq!(
        dropped, 0,
        "the shard not held at {dropped} of {looks} looks"
    );
    assert_eq!(holder(server, 0).as_deref(), Some(holder0.as_str()));
    // Memory: bounded.
    let peak = vm_hwm_kib(pid);
    eprintln!("peak RSS under attack: {} MiB", peak >> 10);
    assert!(peak > 0, "read /proc/{pid}/status");
    assert!(
        peak <= LIMIT_KIB,
        "peak RSS {} MiB, over 128 MiB",
        peak >> 10
    );
    let m = get_text(&format!("{base}/metrics")).await;
    assert!(
        m.lines()
            .any(|l| l.contains("device-churn") && !l.ends_with(" 0")),
        "the churn refused and counted"
    );
    assert!(
        m.contains(r#"result="no-such-node""#),
        "the ghosts' verdicts dropped and counted"
    );
}
