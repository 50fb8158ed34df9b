//! End-to-end cases over HTTP, against the Kubernetes API test server: the
//! alert intake (401/400/413, a burst of duplicates one action), the kubelet's device
//! health, manual release through the `faultline` CLI keeping someone else's taint,
//! auto release waiting for health, cool-down and the canary, a leader killed between
//! taint and evictions, and remediation converging through injected 5xx, 409 and lost
//! answers with nothing done twice.

mod support;

use std::time::Duration;

use faultline_test_apiserver::Faults;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use support::*;

/// The intake's token in a file (a mounted Secret); keep the directory alive.
fn token_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "s3cret\n").unwrap();
    (dir, file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_intake_refuses_bad_requests_and_a_burst_of_duplicates_is_one_action() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .pods([
            PodFixture::new("on-bad", "n1")
                .gpu()
                .holds("GPU-abc", "Healthy"),
            PodFixture::new("on-good", "n1")
                .gpu()
                .holds("GPU-def", "Healthy"),
            PodFixture::new("cpu-only", "n1"),
        ])
        .unlisted()
        .start()
        .await;
    let server = &w.server;
    let (_dir, token_file) = token_file();
    let agg = w
        .healing("r1")
        .args(&[
            "--intake-token-file",
            token_file.to_str().unwrap(),
            "--intake-max-bytes",
            "2048",
            "--intake-threshold",
            "3",
        ])
        .start()
        .await;
    let url = format!("http://{}/v1/alerts", agg.addr);
    let alert = r#"{"cluster":"prod","node_name":"n1","gpu_uuid":"GPU-abc","bus_id":"00000000:3B:00.0","metric":"xid_error","value":"Xid 79","time":1699999999}"#;

    let (code, body) = call("POST", &url, None, alert.into()).await;
    assert_eq!(code, 401);
    assert_eq!(body["error"], "missing bearer token");
    let (code, body) = call("POST", &url, Some("wrong"), alert.into()).await;
    assert_eq!(code, 401);
    assert_eq!(body["status"], 401);
    let (code, body) = call("POST", &url, Some("s3cret"), "{\"node_name\": ".into()).await;
    assert_eq!(code, 400);
    assert!(
        body["error"].as_str().unwrap().contains("malformed JSON"),
        "{body}"
    );
    let big = format!("[{}]", vec![alert; 20].join(","));
    assert!(big.len() > 2048);
    let (code, body) = call("POST", &url, Some("s3cret"), big).await;
    assert_eq!(code, 413);
    assert!(body["error"].as_str().unwrap().contains("2048"));
    assert_eq!(our_taints(server, "n1"), 0, "nothing acted on yet");

    // Alerts of a shard held by nobody would be refused (503): wait for the Lease, as
    // this replica itself counts it.
    lease_held(agg.addr).await;
    // A burst: 4 requests at once, 3 alerts each.
    // Three samples of the fault (three times), each batch sent 4 times at once: 12
    // alerts, 3 occurrences.
    let at = |t: u32| alert.replace("1699999999", &(1_699_999_999 + t).to_string());
    let batch = format!("[{},{},{}]", at(0), at(10), at(20));
    let mut answers = Vec::new();
    let burst: Vec<_> = (0..4)
        .map(|_| {
            let (url, batch) = (url.clone(), batch.clone());
            tokio::spawn(async move { call("POST", &url, Some("s3cret"), batch).await })
        })
        .collect();
    for b in burst {
        answers.push(b.await.unwrap());
    }
    assert!(answers.iter().all(|(c, _)| *c == 202), "{answers:?}");
    let acted: usize = answers
        .iter()
        .map(|(_, b)| b["acted"].as_array().unwrap().len())
        .sum();
    let dups: u64 = answers
        .iter()
        .map(|(_, b)| b["duplicates"].as_u64().unwrap())
        .sum();
    assert_eq!(acted, 1, "{answers:?}");
    assert_eq!(dups, 12 - 3, "{answers:?}");

    until(Duration::from_secs(10), "on-bad evicted", || {
        server
            .get("pods", "default", "on-bad")
            .is_none()
            .then_some(())
    })
    .await;
    // More duplicates and several reconcile passes later: still one of everything.
    for _ in 0..3 {
        let (code, body) = call("POST", &url, Some("s3cret"), batch.clone()).await;
        assert_eq!(code, 202);
        assert_eq!(body["duplicates"], 3);
    }
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 1);
    assert!(taint_keys(server, "n1").contains(&"other.example/maintenance".to_string()));
    assert_eq!(events_on(server, "n1", "FaultlineQuarantined"), 1);
    assert_eq!(evictions(server, "on-bad"), 1);
    assert!(evicted_once(server, "on-bad"));
    assert!(
        server.get("pods", "default", "on-good").is_some(),
        "pod on a healthy GPU stays"
    );
    assert!(
        server.get("pods", "default", "cpu-only").is_some(),
        "pod without accelerators stays"
    );
    let r = record(server, "n1").unwrap();
    assert_eq!(r["devices"][0]["uuid"], "GPU-abc");
    assert_eq!(r["devices"][0]["source"], "alert");
    assert_eq!(r["devices"][0]["metric"], "xid_error");
    assert_eq!(r["devices"][0]["value"], "Xid 79");
    let pod_events: Vec<Value> = server
        .list("events", "default")
        .into_iter()
        .filter(|e| e["involvedObject"]["kind"] == "Pod" && e["involvedObject"]["name"] == "on-bad")
        .collect();
    assert_eq!(pod_events.len(), 1, "one Event on the evicted Pod");
    let msg = pod_events[0]["message"].as_str().unwrap();
    assert!(
        msg.contains("GPU-abc") && msg.contains("xid_error=Xid 79"),
        "{msg}"
    );

    let m = metrics(agg.addr).await;
    for line in [
        "faultline_aggregator_intake_responses_total{code=\"401\"} 2",
        "faultline_aggregator_intake_responses_total{code=\"400\"} 1",
        "faultline_aggregator_intake_responses_total{code=\"413\"} 1",
        "faultline_aggregator_intake_alerts_total{result=\"acted\"} 1",
        "faultline_aggregator_remediation_actions_total{action=\"quarantine\",result=\"ok\"} 1",
        "faultline_aggregator_remediation_actions_total{action=\"evict\",result=\"ok\"} 1",
    ] {
        assert!(m.contains(line), "missing {line}");
    }
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");

    // A restart forgets the intake's counts, not what was done: the same burst again
    // is acted on by the new process and changes nothing on the cluster.
    let agg = w
        .healing("r1")
        .args(&[
            "--intake-token-file",
            token_file.to_str().unwrap(),
            "--intake-threshold",
            "3",
        ])
        .start()
        .await;
    let url = format!("http://{}/v1/alerts", agg.addr);
    // Until it holds the shard the intake answers 503 (retry): no holder to count.
    holds(server, "r1").await;
    lease_held(agg.addr).await;
    let (code, body) = call("POST", &url, Some("s3cret"), batch.clone()).await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["acted"].as_array().unwrap().len(), 1);
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 1);
    assert_eq!(events_on(server, "n1", "FaultlineQuarantined"), 1);
    assert_eq!(evictions(server, "on-bad"), 1);
    assert!(evicted_once(server, "on-bad"));
    assert!(server.get("pods", "default", "on-good").is_some());
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelets_unhealthy_device_quarantines_and_unknown_only_alerts() {
    let w = Scenario::new()
        .nodes(["n1", "n2"].map(|n| NodeFixture::shared(n).ready(true)))
        .pod(
            PodFixture::new("train", "n1")
                .gpu()
                .holds("GPU-abc", "Unhealthy"),
        )
        .pod(
            PodFixture::new("infer", "n2")
                .gpu()
                .holds("GPU-xyz", "Unknown"),
        )
        .unlisted()
        .component("pod-health")
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&["--watch-pod-health", "true"])
        .start()
        .await;
    until(
        Duration::from_secs(10),
        "n1 quarantined and train evicted",
        || {
            (our_taints(server, "n1") == 1 && server.get("pods", "default", "train").is_none())
                .then_some(())
        },
    )
    .await;
    let r = record(server, "n1").unwrap();
    assert_eq!(r["devices"][0]["source"], "kubelet");
    assert_eq!(r["devices"][0]["uuid"], "GPU-abc");
    reconciles(agg.addr).await;
    assert_eq!(our_taints(server, "n2"), 0, "Unknown never acts");
    assert!(server.get("pods", "default", "infer").is_some());
    let m = metrics(agg.addr).await;
    assert!(m.contains("faultline_aggregator_intake_alerts_total{result=\"kubelet-unknown\"} 1"));
    // The watcher lists every Pod in pages from storage, never whole from the
    // watch cache (which ignores a limit at resourceVersion=0); remediation's lists are
    // of one node's pods.
    let pod_lists: Vec<String> = server
        .calls()
        .into_iter()
        .filter(|c| {
            c.uri.starts_with("/api/v1/pods?")
                && !c.uri.contains("watch=true")
                && !c.uri.contains("fieldSelector=spec.nodeName")
        })
        .map(|c| c.uri)
        .collect();
    assert!(!pod_lists.is_empty());
    assert!(
        pod_lists
            .iter()
            .all(|u| u.contains("limit=500") && !u.contains("resourceVersion=0")),
        "{pod_lists:?}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// Wait until the aggregator at `addr` counts shard 0's Lease as its own.
async fn lease_held(addr: std::net::SocketAddr) {
    let held = "faultline_aggregator_lease_held{shard=\"0\"} 1";
    metric_until(addr, held, Duration::from_secs(10)).await;
}

/// Node n1 with its agent, replica r1 acting on it, and n1 quarantined for its gpu1.
async fn n1_quarantined() -> (World, faultline_aggregator::Aggregator) {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .agents()
        .start()
        .await;
    let agg = w.healing("r1").start().await;
    fail(w.agent("n1"), "gpu1").await;
    let server = &w.server;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (our_taints(server, "n1") == 1 && record(server, "n1").is_some()).then_some(())
    })
    .await;
    (w, agg)
}

/// `faultline release --node NODE --by alice` as an administrator, waiting for it.
async fn faultline_release(kube: &str, node: &str) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "release",
            "--node",
            node,
            "--by",
            "alice",
            "--wait",
            "20s",
            "--kube-server",
            kube,
            "--kube-token-file",
            admin_token_file().to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `faultline status` against the API server at `kube`: its standard output.
async fn faultline_status(kube: &str) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "status",
            "--kube-server",
            kube,
            "--kube-token-file",
            admin_token_file().to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Manual release through the CLI: our taint, label and record go, someone else's
/// taint stays, the record is kept as history, and the still-failed device is not
/// quarantined again within the dedup window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_release_by_the_cli_keeps_foreign_taints_and_holds() {
    let (w, agg) = n1_quarantined().await;
    let (server, kube) = (&w.server, &w.kube);
    // `faultline status` lists the node, its device, the replica and the reason.
    let stdout = faultline_status(kube).await;
    let line = stdout
        .lines()
        .find(|l| l.starts_with("n1 "))
        .unwrap_or_else(|| panic!("n1 not listed: {stdout}"));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        (cols[1], cols[3], cols[4]),
        ("gpu1", "r1", "row-remap-failure"),
        "{line}"
    );
    assert!(stdout.starts_with("breaker: closed\nNODE"), "{stdout}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "release",
            "--node",
            "n1",
            "--by",
            "alice",
            "--reason",
            "card reseated",
            "--wait",
            "20s",
            "--kube-server",
            kube,
            "--kube-token-file",
            admin_token_file().to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("released: n1"), "{stdout}");
    let n = server.get("nodes", "", "n1").unwrap();
    assert_eq!(taint_keys(server, "n1"), vec!["other.example/maintenance"]);
    assert!(n["metadata"]["labels"]
        .get("faultline.io/unhealthy-devices")
        .is_none());
    assert_eq!(n["metadata"]["labels"]["team"], "a");
    assert!(record(server, "n1").is_none());
    assert!(n["metadata"]["annotations"]
        .get("faultline.io/release")
        .is_none());
    let h = history(server, "n1");
    assert_eq!(h.len(), 1);
    assert_eq!(h[0]["released"]["actor"], "user:alice");
    assert_eq!(h[0]["released"]["reason"], "card reseated");
    assert_eq!(h[0]["released"]["manual"], true);
    let cond = n["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "AcceleratorHealthy")
        .cloned()
        .unwrap();
    assert_eq!(cond["status"], "True");
    assert_eq!(events_on(server, "n1", "FaultlineReleased"), 1);
    // The agent still says failed; reconcile passes run every 500 ms: no re-quarantine.
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 0, "a person's release holds");
    // `faultline status` lists nothing now: the breaker line and the header only.
    let stdout = faultline_status(kube).await;
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(stdout.starts_with("breaker: closed\nNODE"), "{stdout}");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_release_waits_for_health_cooldown_and_the_canary() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .component("canary")
        .agents()
        .start()
        .await;
    let server = &w.server;
    let dir = tempfile::tempdir().unwrap();
    let canary = dir.path().join("canary.yaml");
    std::fs::write(
        &canary,
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: ignored\nspec:\n  template:\n    spec:\n      containers:\n      - name: probe\n        image: nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04\n        command: [nvidia-smi]\n        resources:\n          limits:\n            nvidia.com/gpu: \"8\"\n",
    )
    .unwrap();
    let a1 = w.agent("n1");
    // The default cool-down (10 min), judged on a clock the test moves.
    let clock = faultline_common::time::Clock::default();
    let agg = w
        .healing("r1")
        .args(&[
            "--release",
            "auto",
            "--release-healthy-samples",
            "5",
            "--canary-job",
            canary.to_str().unwrap(),
        ])
        .start_on(&clock)
        .await;
    fail(a1, "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    // Still failed: nothing moves.
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 1);
    assert!(server.list("jobs", NS).is_empty(), "no canary while failed");
    // Healthy again: after the clean samples and the cool-down, a canary Job.
    let (code, _) = call(
        "DELETE",
        &format!("http://{}/v1/sim/faults", a1.addr),
        None,
        String::new(),
    )
    .await;
    assert!(code < 300);
    until(Duration::from_secs(10), "gpu1 published healthy", || {
        let cm = server.get("configmaps", NS, "faultline-shard-0")?;
        let entry: Value = serde_json::from_str(cm["data"]["n1.json"].as_str()?).ok()?;
        (entry["summary"]["failed"] == 0).then_some(())
    })
    .await;
    // Healthy, the clean samples counted, but within the cool-down: no canary.
    passes(agg.addr).await;
    assert!(
        server.list("jobs", NS).is_empty(),
        "no canary within the cool-down"
    );
    clock.advance(Duration::from_secs(10 * 60));
    let (job, _) = until(Duration::from_secs(20), "canary job", || {
        server.list("jobs", NS).into_iter().next()
    })
    .await;
    // The canary started no sooner than the cool-down after gpu1 turned healthy, both
    // times as the aggregator stamped them (the shard's `since`, the record's canary).
    let entry: Value = serde_json::from_str(
        server.get("configmaps", NS, "faultline-shard-0").unwrap()["data"]["n1.json"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let gpu1 = entry["npus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == "gpu1")
        .unwrap()
        .clone();
    assert_eq!(gpu1["status"], "healthy");
    let ms = |v: &Value| faultline_common::time::parse_rfc3339_ms(v.as_str().unwrap()).unwrap();
    // The Job is created before the record names it: wait for the record.
    let (started, _) = until(
        Duration::from_secs(5),
        "the record names the canary",
        || record(server, "n1").and_then(|r| r["canary"]["started"].as_str().map(String::from)),
    )
    .await;
    let started = ms(&Value::String(started));
    let healthy_for = started.saturating_sub(ms(&gpu1["since"]));
    assert!(
        healthy_for >= 600_000,
        "canary started {healthy_for} ms after gpu1 turned healthy; the cool-down is 10 min"
    );
    assert_eq!(
        our_taints(server, "n1"),
        1,
        "not released before the canary"
    );
    assert_eq!(job["spec"]["template"]["spec"]["nodeName"], "n1");
    assert!(job["spec"]["template"]["spec"]["tolerations"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["key"] == TAINT && t["operator"] == "Exists"));
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 1, "the canary is still running");
    // The first canary fails: announced, the node stays
    // quarantined, and the next canary comes only after another cool-down.
    let first = job["metadata"]["name"].as_str().unwrap().to_string();
    let mut failed_job = server.get("jobs", NS, &first).unwrap();
    failed_job["status"] = json!({"failed": 1});
    server
        .update("jobs", NS, &first, failed_job, Some("status"))
        .unwrap();
    until(
        Duration::from_secs(10),
        "the canary's failure announced",
        || (events_on(server, "n1", "FaultlineCanaryFailed") == 1).then_some(()),
    )
    .await;
    assert_eq!(
        our_taints(server, "n1"),
        1,
        "a failed canary keeps the quarantine"
    );
    let second = || {
        server
            .list("jobs", NS)
            .into_iter()
            .find(|j| j["metadata"]["name"] != first.as_str())
    };
    passes(agg.addr).await;
    assert!(
        second().is_none(),
        "no second canary within the cool-down after the failure"
    );
    clock.advance(Duration::from_secs(10 * 60));
    let (job, _) = until(Duration::from_secs(20), "a second canary", second).await;
    assert_eq!(our_taints(server, "n1"), 1);
    // The Job controller's part: the Job succeeds.
    let name = job["metadata"]["name"].as_str().unwrap().to_string();
    let mut done = server.get("jobs", NS, &name).unwrap();
    done["status"] = json!({"succeeded": 1});
    server
        .update("jobs", NS, &name, done, Some("status"))
        .unwrap();
    until(Duration::from_secs(10), "released", || {
        (our_taints(server, "n1") == 0).then_some(())
    })
    .await;
    assert_eq!(taint_keys(server, "n1"), vec!["other.example/maintenance"]);
    let h = history(server, "n1");
    assert_eq!(h.len(), 1);
    assert_eq!(h[0]["released"]["manual"], false);
    assert!(h[0]["released"]["reason"]
        .as_str()
        .unwrap()
        .contains("canary"));
    assert_eq!(h[0]["canary"]["state"], "succeeded");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// The leader taints, a PodDisruptionBudget holds the eviction back, the leader dies;
/// the next one finishes the eviction without a second taint or announcement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_between_taint_and_evictions_is_finished_by_the_next() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .pod(PodFixture::new("train", "n1").gpu())
        .object(
            "poddisruptionbudgets",
            "default",
            json!({"metadata": {"name": "train"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "train"}}}}),
        )
        .agents()
        .start()
        .await;
    let server = &w.server;
    let r1 = w.healing("r1").start().await;
    holds(server, "r1").await;
    let r2 = w.healing("r2").start().await;
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(10), "tainted, eviction refused", || {
        (our_taints(server, "n1") == 1
            && record(server, "n1").is_some_and(|r| {
                r["eviction_blocked"]
                    .as_object()
                    .is_some_and(|b| !b.is_empty())
            }))
        .then_some(())
    })
    .await;
    assert!(server.get("pods", "default", "train").is_some());
    r1.abort();
    // The budget now allows it; r2 takes the Lease when r1's runs out.
    server
        .delete("poddisruptionbudgets", "default", "train")
        .unwrap();
    until(
        Duration::from_secs(15),
        "evicted by the next leader",
        || {
            server
                .get("pods", "default", "train")
                .is_none()
                .then_some(())
        },
    )
    .await;
    passes(r2.addr).await;
    assert_eq!(our_taints(server, "n1"), 1);
    assert_eq!(events_on(server, "n1", "FaultlineQuarantined"), 1);
    assert_eq!(evictions(server, "train"), 1);
    assert!(evicted_once(server, "train"));
    let r = record(server, "n1").unwrap();
    let actions: Vec<(String, String)> = r["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["action"].as_str().unwrap().to_string(),
                a["actor"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        actions.iter().filter(|(a, _)| a == "taint").count(),
        1,
        "{actions:?}"
    );
    assert!(
        actions.contains(&("taint".into(), "r1".into())),
        "{actions:?}"
    );
    assert!(
        actions.contains(&("evict default/train".into(), "r2".into())),
        "{actions:?}"
    );
    r2.cancel_token().cancel();
    r2.wait().await.expect("a clean stop");
}

/// 15% 500s, 15% 409s on writes and 10% of writes done but answered too late for the
/// client: three nodes still end with one taint each, each GPU pod evicted exactly
/// once, the CPU pods untouched, one announcement per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remediation_converges_through_injected_faults_with_nothing_done_twice() {
    let nodes = ["n1", "n2", "n3"];
    let w = Scenario::new()
        .nodes(nodes.map(|n| NodeFixture::shared(n).ready(true)))
        .pods(nodes.iter().flat_map(|n| {
            [
                PodFixture::new(&format!("gpu-{n}"), n).gpu(),
                PodFixture::new(&format!("cpu-{n}"), n),
            ]
        }))
        .agents()
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&["--kube-timeout", "1s"])
        .start()
        .await;
    until(Duration::from_secs(10), "r1 holds the shard", || {
        server.get("leases", NS, "faultline-shard-0")
    })
    .await;
    server.set_faults(Faults {
        error_rate: 0.15,
        conflict_rate: 0.15,
        write_error_rate: 0.1,
        late_answer_rate: 0.10,
        late_answer_ms: 1500,
        seed: 7,
        ..Default::default()
    });
    for a in &w.agents {
        fail(a, "gpu2").await;
    }
    let healed = |n: &str| {
        our_taints(server, n) >= 1
            && server.get("pods", "default", &format!("gpu-{n}")).is_none()
            && events_on(server, n, "FaultlineQuarantined") >= 1
    };
    let start = std::time::Instant::now();
    while !nodes.iter().all(|n| healed(n)) {
        if start.elapsed() > Duration::from_secs(60) {
            for n in nodes {
                eprintln!(
                    "{n}: taints {} pod {} events {} record {:?}",
                    our_taints(server, n),
                    server.get("pods", "default", &format!("gpu-{n}")).is_some(),
                    events_on(server, n, "FaultlineQuarantined"),
                    record(server, n)
                );
            }
            eprintln!("lease {:?}", server.get("leases", NS, "faultline-shard-0"));
            panic!("not healed within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.set_faults(Faults::default());
    passes(agg.addr).await;
    for n in nodes {
        assert_eq!(our_taints(server, n), 1, "{n}: one taint");
        assert_eq!(
            events_on(server, n, "FaultlineQuarantined"),
            1,
            "{n}: one announcement"
        );
        assert!(
            evictions(server, &format!("gpu-{n}")) <= 1
                && eviction_calls(server, &format!("gpu-{n}"), 404) == 0,
            "{n}: evicted at most once"
        );
        assert!(server.get("pods", "default", &format!("cpu-{n}")).is_some());
        let cond = server.get("nodes", "", n).unwrap()["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "AcceleratorHealthy" && c["status"] == "False");
        assert!(cond, "{n}: condition set");
    }
    let injected = server
        .calls()
        .iter()
        .filter(|c| c.status == 500 || c.status == 409)
        .count();
    assert!(injected > 0, "faults were injected");
    eprintln!("converged through {injected} injected 500/409 answers");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// Alerts sent to a replica that does not hold the node's shard are handed to the
/// holder (named by the shard's Lease), which counts and acts: one place per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_reaching_another_replica_are_handed_to_the_holder() {
    // The replicas' Pods: the intake forwards only to a holder whose Pod has the IP
    // its Lease advertises.
    let replica_pod = |r: &str| {
        json!({"metadata": {"name": r}, "spec": {"containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    };
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .pod(
            PodFixture::new("train", "n1")
                .gpu()
                .holds("GPU-abc", "Healthy"),
        )
        .object("pods", NS, replica_pod("r1"))
        .object("pods", NS, replica_pod("r2"))
        .unlisted()
        .start()
        .await;
    let server = &w.server;
    let (_dir, token_file) = token_file();
    let args = ["--intake-token-file", token_file.to_str().unwrap()];
    let r1 = w.healing("r1").args(&args).start().await;
    let lease = holds(server, "r1").await;
    assert_eq!(
        lease["metadata"]["annotations"]["faultline.io/url"],
        format!("http://{}", r1.addr)
    );
    let r2 = w.healing("r2").args(&args).start().await;
    let alert = r#"{"node_name":"n1","gpu_uuid":"GPU-abc","metric":"xid_error","value":"79"}"#;
    let url = format!("http://{}/v1/alerts", r2.addr);
    let mut acted = 0;
    for _ in 0..3 {
        let (code, body) = call("POST", &url, Some("s3cret"), alert.into()).await;
        assert_eq!(code, 202, "{body}");
        assert_eq!(body["forwarded"], 1, "{body}");
        acted += body["acted"].as_array().unwrap().len();
    }
    assert_eq!(acted, 1, "the third alert, counted at the holder");
    until(Duration::from_secs(10), "quarantined by r1", || {
        (our_taints(server, "n1") == 1 && server.get("pods", "default", "train").is_none())
            .then_some(())
    })
    .await;
    assert_eq!(record(server, "n1").unwrap()["actor"], "r1");
    // A Lease edited to advertise an address that is not the holder's Pod gets
    // nothing, not even the token: the sender is told to retry.
    let mut pod = server.get("pods", NS, "r1").unwrap();
    pod["status"]["podIP"] = json!("10.9.9.9");
    pod["status"]["podIPs"] = json!([{"ip": "10.9.9.9"}]);
    server
        .update("pods", NS, "r1", pod, Some("status"))
        .unwrap();
    let (code, body) = call(
        "POST",
        &url,
        Some("s3cret"),
        alert.replace("GPU-abc", "GPU-xyz"),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("not its running Pod's IP"),
        "{body}"
    );
    // The holder gone (no Lease renewal, no answer): the sender is told to retry.
    r1.abort();
    let (code, body) = call(
        "POST",
        &url,
        Some("s3cret"),
        alert.replace("GPU-abc", "GPU-def"),
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("retry"), "{body}");
    r2.cancel_token().cancel();
    r2.wait().await.expect("a clean stop");
}

/// A stop in the middle of a pass: the intake stops answering, the pass finishes (the
/// pod is evicted), then the Lease is released for the next replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_finishes_the_pass_in_flight_then_releases_the_lease() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .pod(PodFixture::new("train", "n1").gpu())
        .agents()
        .start()
        .await;
    let server = &w.server;
    let (_dir, token_file) = token_file();
    let agg = w
        .healing("r1")
        .args(&["--intake-token-file", token_file.to_str().unwrap()])
        .start()
        .await;
    holds(server, "r1").await;
    // Every API call now takes 150 ms: a pass takes seconds (and the 3 s Lease is
    // still renewed in time).
    server.set_faults(Faults {
        latency_ms: 150,
        ..Default::default()
    });
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(15), "tainted", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    assert!(
        server.get("pods", "default", "train").is_some(),
        "stop before the eviction"
    );
    let addr = agg.addr;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    // The intake stops first: its port refuses within moments (polled, not slept on).
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let asked = std::time::Instant::now();
    let refused = loop {
        let r = client
            .request(
                hyper::Request::post(format!("http://{addr}/v1/alerts"))
                    .body(Full::new(Bytes::from("{}")))
                    .unwrap(),
            )
            .await;
        if r.is_err() || asked.elapsed() > Duration::from_secs(5) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(refused.is_err(), "the intake stopped first");
    tokio::time::timeout(Duration::from_secs(30), agg.wait())
        .await
        .expect("stopped within the shutdown timeout")
        .expect("a clean stop");
    assert!(
        server.get("pods", "default", "train").is_none(),
        "the pass in flight finished"
    );
    let lease = server.get("leases", NS, "faultline-shard-0").unwrap();
    assert!(released_as_client_go_does(&lease), "released: {lease}");
    assert_eq!(evictions(server, "train"), 1);
    assert!(evicted_once(server, "train"));
}

/// What an SRE runs first: `kubectl describe node` shows faultline's Events, which it
/// finds by kind, name, namespace and uid (the Node's uid, or its name as the kubelet
/// uses it: staging/src/k8s.io/kubectl/pkg/describe/describe.go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_describe_node_shows_faultlines_events() {
    if !faultline_common::testing::have_tool(
        "kubectl_describe_node_shows_faultlines_events",
        "kubectl",
        &["version", "--client"],
        "kubernetes-client",
    ) {
        return;
    }
    // kubectl sends no token over plain HTTP: let its anonymous requests read, as a
    // person's view role would.
    let w = Scenario::ready_nodes(&["n1"])
        .object(
            "clusterroles",
            "",
            json!({"metadata": {"name": "viewer"}, "rules": [{"apiGroups": ["", "coordination.k8s.io"], "resources": ["*"], "verbs": ["get", "list", "watch"]}]}),
        )
        .object(
            "clusterrolebindings",
            "",
            json!({"metadata": {"name": "viewer"}, "subjects": [{"kind": "User", "name": "system:anonymous"}], "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "viewer"}}),
        )
        .start()
        .await;
    let (server, kube) = (&w.server, &w.kube);
    let agg = w.healing("r1").start().await;
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (events_on(server, "n1", "FaultlineQuarantined") == 1).then_some(())
    })
    .await;
    let out = tokio::process::Command::new("kubectl")
        .args(["--server", kube, "describe", "node", "n1"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let denied = refused(server);
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{denied:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events_section = stdout
        .split("Events:")
        .nth(1)
        .unwrap_or_else(|| panic!("no Events section: {stdout}"));
    assert!(events_section.contains("FaultlineQuarantined"), "{stdout}");
    assert!(events_section.contains("gpu1"), "{stdout}");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// The circuit breaker wired from real failures. Two nodes
/// failing within --breaker-window open it (a third that failed after the window of
/// the first does not count it), nothing more is quarantined while it is open, and
/// `faultline breaker close` lets remediation go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_on_real_failures_and_a_person_closes_it() {
    let w = Scenario::ready_nodes(&["n1", "n2", "n3"]).start().await;
    let (server, kube, agents) = (&w.server, &w.kube, &w.agents);
    // The default window (5 min), judged on a clock the test moves.
    let clock = faultline_common::time::Clock::default();
    let agg = w
        .healing("r1")
        .args(&["--breaker-nodes", "2"])
        .start_on(&clock)
        .await;
    let quarantined = |n: &str| our_taints(server, n) == 1;
    fail(&agents[0], "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        quarantined("n1").then_some(())
    })
    .await;
    // Past the window: n1 no longer counts, n2 alone does not open the breaker.
    clock.advance(Duration::from_secs(5 * 60 + 1));
    fail(&agents[1], "gpu1").await;
    until(Duration::from_secs(10), "n2 quarantined", || {
        quarantined("n2").then_some(())
    })
    .await;
    // n3 within the window of n2: two nodes, the breaker opens, n3 is not touched.
    fail(&agents[2], "gpu1").await;
    until(Duration::from_secs(10), "the breaker opens", || {
        server
            .get("configmaps", NS, "faultline-breaker")
            .filter(|cm| cm["data"]["state"] == "open")
    })
    .await;
    passes(agg.addr).await;
    assert!(
        !quarantined("n3"),
        "nothing is quarantined while the breaker is open"
    );
    let status = faultline_status(kube).await;
    assert!(
        status.starts_with("breaker: open (2 nodes failed within 300s)"),
        "{status}"
    );
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_faultline"))
        .args([
            "breaker",
            "close",
            "--kube-server",
            kube,
            "--kube-token-file",
            admin_token_file().to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    until(
        Duration::from_secs(10),
        "n3 quarantined once the breaker is closed",
        || quarantined("n3").then_some(()),
    )
    .await;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// A per-domain budget holds a failed node back (announced once,
/// however many passes run) and the node is quarantined once room frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_back_node_is_quarantined_once_room_frees() {
    let w = Scenario::new()
        .nodes(["n1", "n2"].map(|n| NodeFixture::new(n).label("rack", "r1").ready(true)))
        .agents()
        .named()
        .start()
        .await;
    let (server, kube, agents) = (&w.server, &w.kube, &w.agents);
    let agg = w
        .healing("r1")
        .args(&[
            "--failure-domain-label",
            "rack",
            "--max-quarantined-per-domain",
            "1",
        ])
        .start()
        .await;
    fail(&agents[0], "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    fail(&agents[1], "gpu1").await;
    until(Duration::from_secs(10), "n2 held back", || {
        (events_on(server, "n2", "FaultlineHeldBack") == 1).then_some(())
    })
    .await;
    // Reconcile passes every 500 ms: still held back, announced once.
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n2"), 0, "one per rack");
    assert_eq!(events_on(server, "n2", "FaultlineHeldBack"), 1);
    // A person releases n1 (its GPU replaced): room frees, n2 is quarantined.
    faultline_release(kube, "n1").await;
    until(
        Duration::from_secs(10),
        "n2 quarantined once room frees",
        || (our_taints(server, "n2") == 1).then_some(()),
    )
    .await;
    // The event is recorded after the taint (isolate, then announce): wait for it.
    until(Duration::from_secs(10), "n2's quarantine announced", || {
        (events_on(server, "n2", "FaultlineQuarantined") >= 1).then_some(())
    })
    .await;
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 0, "the person's release holds");
    assert_eq!(events_on(server, "n2", "FaultlineHeldBack"), 1);
    assert_eq!(events_on(server, "n2", "FaultlineQuarantined"), 1);
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// A person's release holds against a still-failed reading for
/// --dedup-window, and only that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persons_release_holds_for_the_dedup_window_only() {
    let w = Scenario::ready_nodes(&["n1"]).start().await;
    let server = &w.server;
    // The default window (15 min), judged on a clock the test moves.
    let clock = faultline_common::time::Clock::default();
    let agg = w.healing("r1").start_on(&clock).await;
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    faultline_release(&w.kube, "n1").await;
    // The agent still says failed; passes every 500 ms do not undo the release...
    passes(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 0, "within the dedup window");
    clock.advance(Duration::from_secs(14 * 60));
    passes(agg.addr).await;
    assert_eq!(
        our_taints(server, "n1"),
        0,
        "14 of the window's 15 minutes later"
    );
    // ...until the window ends.
    clock.advance(Duration::from_secs(61));
    until(Duration::from_secs(10), "n1 quarantined again", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// On the real binary: every announcement reaches each
/// configured receiver in its own format, each action writes its audit line, and
/// SIGTERM stops the process cleanly with the shard Lease released for the next holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_notifies_audits_and_stops_on_sigterm() {
    use std::sync::{Arc, Mutex};
    let w = Scenario::ready_nodes(&["n1"]).start().await;
    let server = &w.server;
    // One receiver for every format, recording (path, body).
    let got: Arc<Mutex<Vec<(String, Value)>>> = Default::default();
    let app = {
        let got = got.clone();
        axum::Router::new().route(
            "/{fmt}",
            axum::routing::post(
                move |axum::extract::Path(fmt): axum::extract::Path<String>,
                      body: axum::body::Bytes| {
                    let got = got.clone();
                    async move {
                        got.lock()
                            .unwrap()
                            .push((fmt, serde_json::from_slice(&body).unwrap()));
                        axum::http::StatusCode::OK
                    }
                },
            ),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hooks = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let notify = ["generic", "slack", "wecom", "dingtalk", "feishu"]
        .map(|f| format!("{f}=http://{hooks}/{f}"))
        .join(",");
    let args = w
        .healing("r1")
        .args(&["--notify", &notify, "--log-format", "json"])
        .into_args();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_faultline-aggregator"))
        .args(&args)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    holds(server, "r1").await;
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(10), "n1 quarantined", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
    let (bodies, _) = until(Duration::from_secs(10), "every receiver told", || {
        let g = got.lock().unwrap();
        let quarantined: Vec<(String, Value)> = g
            .iter()
            .filter(|(_, b)| b.to_string().contains("FaultlineQuarantined"))
            .cloned()
            .collect();
        (quarantined.len() == 5).then_some(quarantined)
    })
    .await;
    for (fmt, body) in &bodies {
        let text = match fmt.as_str() {
            "generic" => {
                assert_eq!(body["kind"], "FaultlineQuarantined");
                assert_eq!(body["node"], "n1");
                assert_eq!(body["devices"][0]["id"], "gpu1");
                continue;
            }
            "slack" => body["text"].as_str(),
            "wecom" | "dingtalk" => body["text"]["content"].as_str(),
            "feishu" => body["content"]["text"].as_str(),
            other => panic!("{other}"),
        };
        let text = text.unwrap_or_else(|| panic!("{fmt}: {body}"));
        assert!(text.contains("FaultlineQuarantined on n1"), "{fmt}: {text}");
    }
    // SIGTERM: a clean exit, the Lease handed back.
    let pid = child.id().unwrap() as i32;
    assert_eq!(unsafe_free_kill(pid), 0);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("stopped within 30 s of SIGTERM")
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let lease = server.get("leases", NS, "faultline-shard-0").unwrap();
    assert!(
        released_as_client_go_does(&lease),
        "the Lease is released: {lease}"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    let audit: Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| l["target"] == "faultline::audit" && l["fields"]["action"] == "quarantine")
        .unwrap_or_else(|| panic!("no audit line for the quarantine:\n{log}"));
    assert_eq!(audit["fields"]["node"], "n1", "{audit}");
    assert_eq!(audit["fields"]["actor"], "r1", "{audit}");
    assert!(
        audit["fields"]["devices"]
            .as_str()
            .unwrap()
            .contains("gpu1"),
        "{audit}"
    );
    assert_no_forbidden(server);
}

/// SIGTERM to `pid` through the `kill` command (no unsafe code in the tests; procps,
/// which `.ci/run` installs).
fn unsafe_free_kill(pid: i32) -> i32 {
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .map(|s| s.code().unwrap_or(1))
        .unwrap_or(1)
}

/// An alert that reaches its threshold for a device neither the
/// node's agent nor the kubelet reports (for a pod of the node) is announced and not
/// acted on: no taint, nothing evicted on a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alert_for_a_device_nobody_reports_is_only_announced() {
    let w = Scenario::new()
        .node(NodeFixture::new("n1").ready(true))
        // A GPU pod the kubelet says nothing about (no allocatedResourcesStatus).
        .pod(PodFixture::new("train", "n1").gpu())
        .agents_flag(&format!("n1={NO_AGENT}"))
        .start()
        .await;
    let server = &w.server;
    let (_dir, token_file) = token_file();
    let agg = w
        .healing("r1")
        .args(&[
            "--intake-token-file",
            token_file.to_str().unwrap(),
            "--intake-threshold",
            "1",
        ])
        .start()
        .await;
    lease_held(agg.addr).await;
    let url = format!("http://{}/v1/alerts", agg.addr);
    let alert = r#"{"node_name":"n1","gpu_uuid":"GPU-nobody-has","metric":"xid_error","value":"Xid 79","time":1}"#;
    let (code, body) = call("POST", &url, Some("s3cret"), alert.into()).await;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["acted"].as_array().unwrap().len(), 1, "{body}");
    until(Duration::from_secs(10), "announced as unattributed", || {
        (events_on(server, "n1", "FaultlineAlertUnattributed") == 1).then_some(())
    })
    .await;
    reconciles(agg.addr).await;
    assert_eq!(our_taints(server, "n1"), 0, "no taint on a guess");
    assert!(
        server.get("pods", "default", "train").is_some(),
        "nothing evicted"
    );
    assert_eq!(events_on(server, "n1", "FaultlineAlertUnattributed"), 1);
    // A hundred more, each naming another device nobody reports (before, each made an
    // Event of its own): the one Event counts them.
    let flood: Vec<String> = (0..100)
        .map(|i| format!(r#"{{"node_name":"n1","gpu_uuid":"GPU-nobody-{i}","metric":"xid_error","value":"Xid 79","time":1}}"#))
        .collect();
    let (code, body) = call(
        "POST",
        &url,
        Some("s3cret"),
        format!("[{}]", flood.join(",")),
    )
    .await;
    assert_eq!(code, 202, "{body}");
    let counted = |server: &faultline_test_apiserver::ApiServer| {
        server
            .list("events", "default")
            .iter()
            .filter(|e| e["reason"] == "FaultlineAlertUnattributed")
            .map(|e| e["count"].as_i64().unwrap_or(0))
            .max()
    };
    until(
        Duration::from_secs(10),
        "the repeats counted on the Event",
        || counted(server).filter(|c| *c >= 2).map(|_| ()),
    )
    .await;
    assert_eq!(
        events_on(server, "n1", "FaultlineAlertUnattributed"),
        1,
        "one Event"
    );
    assert_eq!(our_taints(server, "n1"), 0, "no taint on a guess");
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// A quarantined node's passes read it from the one watch of the quarantined Nodes:
/// once it is quarantined, reconciles every 500 ms read neither the Node nor the list
/// of quarantined Nodes from the API (the cluster benchmark measured 10.5 full-Node
/// GETs a second with 108 nodes failed, issue 51), and a change someone else makes
/// (the taint removed by hand) is still seen, and undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_nodes_passes_read_it_from_the_watch() {
    let (w, r1) = n1_quarantined().await;
    let server = &w.server;
    // The watch has shown the quarantine's last write (its reads after a write of its
    // own go to the API until then).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    passes(r1.addr).await;
    let reads = || {
        let calls = server.calls();
        calls
            .iter()
            .filter(|c| c.method == "GET")
            .filter(|c| {
                c.uri.starts_with("/api/v1/nodes/n1")
                    || (c.uri.contains("unhealthy-devices") && !c.uri.contains("watch=true"))
            })
            .count()
    };
    let before = reads();
    // At least 6 reconciles, and 4 passes of the node.
    passes(r1.addr).await;
    passes(r1.addr).await;
    assert_eq!(reads() - before, 0, "reads of the quarantined Node");

    let mut node = server.get("nodes", "", "n1").unwrap();
    let taints = node["spec"]["taints"].as_array().unwrap().clone();
    node["spec"]["taints"] =
        Value::Array(taints.into_iter().filter(|t| t["key"] != TAINT).collect());
    server.update("nodes", "", "n1", node, None).unwrap();
    assert_eq!(our_taints(server, "n1"), 0);
    until(Duration::from_secs(10), "the taint put back", || {
        (our_taints(server, "n1") == 1).then_some(())
    })
    .await;
}
