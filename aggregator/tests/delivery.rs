//! Node-local delivery. The aggregator hands each node's entry to the node's
//! agent (`PUT /v1/fault`, bearer token), which keeps it as the node's own
//! `fault.json` (the file of `--fault-dir`, and `GET /v1/fault` on `--fault-listen`):
//! a fault reaches it without a ConfigMap write or a kubelet refresh; only the token
//! sets it; the pod port serves it read-only; once the aggregator falls silent the file
//! says so and calls no device healthy. With a signing key, what a node holds (the
//! shared token, the public key) cannot set a neighbour's verdict, and the keys rotate
//! without a restart.

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

/// Two nodes, signed deliveries. Node n2's credentials (the token every agent holds,
/// the public key) cannot set n1's verdict; the aggregator's key, rotated on disk,
/// keeps n1's verdict fresh without a restart of either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_neighbours_credentials_cannot_set_a_verdict_and_keys_rotate_live() {
    use faultline_common::seal::SigningKey;
    let tmp = tempfile::tempdir().unwrap();
    let path = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    std::fs::write(path("token"), format!("{TOKEN}\n")).unwrap();
    let (old_private, old_public) = SigningKey::generate_pem().unwrap();
    let (new_private, new_public) = SigningKey::generate_pem().unwrap();
    std::fs::write(path("signing.pem"), &old_private).unwrap();
    std::fs::write(path("public.pem"), &old_public).unwrap();
    let mut agents = Vec::new();
    for n in ["n1", "n2"] {
        std::fs::create_dir(path(n)).unwrap();
        let args = [
            "--fault-dir",
            &path(n),
            "--delivery-token-file",
            &path("token"),
            "--delivery-key-file",
            &path("public.pem"),
            "--verdict-stale-after",
            "30s",
        ];
        agents.push(agent_with(n, &args).await);
    }
    let dir = tmp.path().join("n1");
    let list = format!("n1=http://{},n2=http://{}", agents[0].addr, agents[1].addr);
    let w = Scenario::new().agents_flag(&list).start().await;
    let agg = w
        .configmap("r1", 1)
        .args(&[
            "--delivery-token-file",
            &path("token"),
            "--delivery-signing-key-file",
            &path("signing.pem"),
            "--delivery-confirm",
            "300ms",
        ])
        .start()
        .await;
    let fresh_from_r1 = |d: &NodeFaults| {
        d.verdict
            .as_ref()
            .is_some_and(|v| !v.stale && v.writer.as_deref() == Some("r1"))
    };
    until(
        Duration::from_secs(20),
        "n1's signed verdict, all healthy",
        || node_file(&dir).filter(|d| fresh_from_r1(d) && d.summary.healthy == 4),
    )
    .await;
    inject(&agents[0], r#"{"device":"gpu1","fault":"xid","xid":79}"#).await;
    let (failed, _) = until(Duration::from_secs(5), "gpu1 failed on n1", || {
        node_file(&dir).filter(|d| d.summary.failed == 1)
    })
    .await;

    // n2's root holds the token and the public key. It writes n1 a "healthy" entry
    // under the real writer, a higher sequence, its node and a fresh time: unsigned,
    // and signed with a key of its own making. Both 401; n1 still reads failed.
    let api = format!("http://{}/v1/fault", agents[0].addr);
    let mut healthy = failed.clone();
    for d in &mut healthy.npus {
        d.status = DeviceStatus::Healthy;
        d.reason = None;
    }
    healthy.verdict = None;
    healthy.readings_at = None;
    let forged = serde_json::json!({
        "writer": "r1", "sequence": u64::MAX, "published": "2026-12-02T00:00:00.000Z",
        "stale_after_ms": 60_000, "node": "n1", "sent_ms": u64::MAX / 2,
        "digest": healthy.digest(), "entry": healthy,
    })
    .to_string();
    let bearer = format!("Bearer {TOKEN}");
    let (mine, _) = SigningKey::generate_pem().unwrap();
    let own_sig = SigningKey::from_pem(&mine).unwrap().sign(forged.as_bytes());
    for sig in [None, Some(own_sig.as_str()), Some("ed25519=AAAA")] {
        let mut h = vec![("authorization", bearer.as_str())];
        h.extend(sig.map(|s| ("faultline-signature", s)));
        let (status, body) = call_with("PUT", &api, &h, forged.clone()).await;
        assert_eq!(status, 401, "signature {sig:?}: {body}");
    }
    assert_eq!(
        node_file(&dir).unwrap().summary.failed,
        1,
        "nothing forged got in"
    );

    // Rotation: the agents take the new public key beside the old, then the aggregator
    // signs with the new key, then the old public key goes. No restart. After each
    // step, a confirmation sent once both sides have looked at their files again (each
    // at most every second) is taken; the verdict stays fresh and failed throughout.
    let confirmed_since = |at_ms: u64| {
        let dir = dir.clone();
        move || {
            let d = node_file(&dir)?;
            assert!(
                fresh_from_r1(&d) && d.summary.failed == 1,
                "{:?}",
                d.verdict
            );
            let confirmed = d.verdict.as_ref()?.confirmed.as_deref()?;
            (faultline_common::time::parse_rfc3339_ms(confirmed)? >= at_ms).then_some(d)
        }
    };
    let steps = [
        ("public.pem", format!("{old_public}{new_public}")),
        ("signing.pem", new_private.clone()),
        ("public.pem", new_public.clone()),
    ];
    for (file, text) in steps {
        std::fs::write(path(file), text).unwrap();
        let after = faultline_common::time::now_ms() + 1_500;
        let what = format!("a confirmation taken after {file} changed");
        until(Duration::from_secs(10), &what, confirmed_since(after)).await;
    }
    let text = metrics(agg.addr).await;
    let refused: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("faultline_aggregator_deliveries_total")
                && l.contains("result=\"refused\"")
        })
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    assert!(
        refused.is_empty(),
        "no delivery refused across the rotation: {refused:?}"
    );
    assert!(
        text.contains("faultline_aggregator_deliveries_total{kind=\"confirm\",result=\"ok\"}"),
        "{text}"
    );
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
    for a in agents {
        a.shutdown().await;
    }
}

/// The flood: 20 loopback addresses, 20 connections each to `to`, every one sending
/// half a request head and holding on until closed, then again, until `stop`;
/// `opened` counts its connections.
fn flood(
    to: std::net::SocketAddr,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
    opened: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut flood = Vec::new();
    for a in 2..22u8 {
        for _ in 0..20 {
            let (stop, opened) = (stop.clone(), opened.clone());
            flood.push(tokio::spawn(async move {
                let from = std::net::SocketAddr::from(([127, 0, 0, a], 0));
                while !stop.load(Ordering::Relaxed) {
                    let s = tokio::net::TcpSocket::new_v4().unwrap();
                    if s.bind(from).is_err() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    let Ok(Ok(mut c)) =
                        tokio::time::timeout(Duration::from_secs(1), s.connect(to)).await
                    else {
                        continue;
                    };
                    opened.fetch_add(1, Ordering::Relaxed);
                    let _ = c.write_all(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n").await;
                    let mut b = [0u8; 256];
                    let _ = tokio::time::timeout(Duration::from_secs(5), c.read(&mut b)).await;
                }
            }));
        }
    }
    flood
}

/// The same flood on the pods' port (`--fault-listen`): a pod reading its node's
/// `fault.json` from its own address is answered every time (half of such reads
/// failed: the crowd held every slot, and a newcomer was refused; now it takes the
/// slot of a crowd connection waiting for its head, its peer holding more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_port_answers_its_pods_through_a_connection_flood() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let agent = agent_with(
        "n1",
        &[
            "--fault-listen",
            "127.0.0.1:0",
            "--http-max-connections",
            "32",
            "--http-header-timeout",
            "1s",
        ],
    )
    .await;
    let pod_port = agent.fault_addr.expect("--fault-listen bound");
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let opened = std::sync::Arc::new(AtomicU64::new(0));
    let crowd = flood(pod_port, &stop, &opened);
    while opened.load(Ordering::Relaxed) < 400 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut answered = 0;
    for _ in 0..50 {
        let (code, body) =
            support::real::request_from("127.0.0.99", "GET", pod_port, "/v1/fault", "").await;
        answered += usize::from(code == 200 && body.contains("\"node\":\"n1\""));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for f in crowd {
        f.abort();
    }
    let m = metrics(agent.addr).await;
    eprintln!(
        "pod port flood: {} connections opened; {answered} of 50 reads answered; {}",
        opened.load(Ordering::Relaxed),
        m.lines()
            .filter(|l| l.starts_with("faultline_agent_http_connections_"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert_eq!(answered, 50, "every read of a pod answered");
    agent.shutdown().await;
}

/// 400 slow connections from 20 addresses, each under the per-peer cap, keep every
/// slot of the agent's port (and of those kept for the aggregator) taken. Deliveries
/// ride the aggregator's established connection: none fails, the verdict stays fresh,
/// and a GPU that fails meanwhile reaches the node's file during the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_ride_their_connection_through_a_connection_flood() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let dir = tmp.path().join("node");
    std::fs::create_dir(&dir).unwrap();
    // gpu1 fails 12 s after the agent starts: during the flood.
    let scenario = tmp.path().join("scenario.json");
    std::fs::write(
        &scenario,
        r#"[{"at_s": 12, "device": "gpu1", "fault": "xid", "xid": 79}]"#,
    )
    .unwrap();
    let started = Instant::now();
    let agent = agent_with(
        "n1",
        &[
            "--fault-dir",
            dir.to_str().unwrap(),
            "--delivery-token-file",
            token.to_str().unwrap(),
            "--sim-scenario",
            scenario.to_str().unwrap(),
            "--http-max-connections",
            "32",
            "--http-header-timeout",
            "1s",
        ],
    )
    .await;
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
            "2s",
        ])
        .start()
        .await;
    until(Duration::from_secs(10), "a fresh verdict", || {
        node_file(&dir).filter(|d| d.verdict.as_ref().is_some_and(|v| !v.stale))
    })
    .await;

    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let opened = std::sync::Arc::new(AtomicU64::new(0));
    let flood = flood(agent.addr, &stop, &opened);
    let count = |text: &str, result: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with("faultline_aggregator_deliveries_total")
                    && l.contains(&format!("result=\"{result}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            + 0.0
    };
    let before = metrics(agg.addr).await;
    let failed_at = Instant::now();
    let mut fault_seen = None;
    // Until the failure is in the node's file and four more deliveries went through
    // (8 s of confirmations, past the verdict's 6 s without one), the verdict never
    // stale meanwhile.
    let after = loop {
        let d = node_file(&dir).unwrap();
        let v = d.verdict.as_ref().unwrap();
        assert!(!v.stale, "the verdict went stale during the flood: {v:?}");
        if fault_seen.is_none() && d.summary.failed == 1 {
            fault_seen = Some(started.elapsed());
        }
        let now = metrics(agg.addr).await;
        if fault_seen.is_some() && count(&now, "ok") >= count(&before, "ok") + 4.0 {
            break now;
        }
        assert!(
            failed_at.elapsed() < Duration::from_secs(40),
            "no failure or no deliveries within 40 s of flood: {fault_seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.store(true, Ordering::Relaxed);
    for f in flood {
        f.abort();
    }
    let flood_for = failed_at.elapsed();
    eprintln!(
        "flood: {} connections opened in {flood_for:?}; deliveries ok {} -> {}, failed {} -> {}; gpu1 failed in the node's file at {fault_seen:?} after the agent started (injected at 12 s)",
        opened.load(Ordering::Relaxed),
        count(&before, "ok"),
        count(&after, "ok"),
        count(&before, "unreachable") + count(&before, "error"),
        count(&after, "unreachable") + count(&after, "error"),
    );
    assert!(opened.load(Ordering::Relaxed) > 400, "the flood ran");
    assert!(
        count(&after, "ok") >= count(&before, "ok") + 4.0,
        "confirmations went through"
    );
    assert_eq!(
        count(&after, "unreachable") + count(&after, "error"),
        count(&before, "unreachable") + count(&before, "error"),
        "no delivery failed during the flood"
    );
    assert!(
        fault_seen.is_some(),
        "the failure reached the node's file during the flood"
    );
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
    agent.shutdown().await;
}
