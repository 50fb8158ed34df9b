//! Warn before evicting. A pod on a failed device that asks for time to
//! checkpoint (`faultline.io/checkpoint-grace`) gets a drain intent first: in its node's
//! `fault.json` (the ConfigMap entry and the node's own, served by its agent), on the
//! Node's record and as an Event on the pod. It is evicted at once when it acknowledges
//! through its node's agent, from its own address, and at its deadline otherwise,
//! never before; a pod that asks for nothing is evicted at once, as before.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faultline_common::time::{now_ms, parse_rfc3339_ms};
use serde_json::{json, Value};
use support::*;

const TOKEN: &str = "delivery-token-0123456789";

/// A GPU pod on `n1` with `grace` (if any) and its address `ip`.
fn pod(name: &str, grace: Option<&str>, ip: &str) -> Value {
    let mut p = PodFixture::new(name, "n1").gpu().build();
    if let Some(g) = grace {
        p["metadata"]["annotations"] = json!({"faultline.io/checkpoint-grace": g});
    }
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{"ip": ip}]);
    p
}

/// When the first eviction of `pod` was answered 201 (ms), if it was.
fn evicted_at(server: &faultline_test_apiserver::ApiServer, pod: &str) -> Option<u64> {
    server
        .calls()
        .iter()
        .find(|c| {
            c.method == "POST"
                && c.uri.contains(&format!("/pods/{pod}/eviction"))
                && c.status == 201
        })
        .map(|c| c.at_ms)
}

fn uid(server: &faultline_test_apiserver::ApiServer, pod: &str) -> String {
    server.get("pods", "default", pod).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string()
}

/// An agent for `n1` that takes the aggregator's deliveries (its token file, written in
/// `tmp`), keeps the node's own fault.json in `tmp/node` and serves its pods on a port of
/// their own: the agent, the token file and that directory.
async fn delivering_agent(tmp: &Path) -> (faultline_agent::Agent, PathBuf, PathBuf) {
    let token = tmp.join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let dir = tmp.join("node");
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
        ],
    )
    .await;
    (agent, token, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warned_pod_is_evicted_at_its_acknowledgement_or_its_deadline_never_before() {
    let tmp = tempfile::tempdir().unwrap();
    let (agent, token, _) = delivering_agent(tmp.path()).await;
    let pod_port = agent.fault_addr.expect("--fault-listen bound");
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        // Checkpoints when warned, and says so from its own address (this test's).
        .object("pods", "default", pod("ckpt", Some("300s"), "127.0.0.1"))
        // Never acknowledges: evicted at its deadline.
        .object("pods", "default", pod("slow", Some("4s"), "10.1.2.3"))
        // Asks for nothing: evicted at once, as before.
        .object("pods", "default", pod("plain", None, "10.1.2.4"))
        // A second publish namespace, as deploy/'s RBAC grants one (default's copied).
        .object("namespaces", "", json!({"metadata": {"name": "team-b"}}))
        .object("roles", "team-b", publisher_role("Role"))
        .object("rolebindings", "team-b", publisher_role("RoleBinding"))
        .agents_flag(&format!("n1=http://{}", agent.addr))
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&["--delivery-token-file", token.to_str().unwrap()])
        .args(&["--publish-namespaces", "default,team-b"])
        .start()
        .await;
    holds(server, "r1").await;
    let (ckpt, slow) = (uid(server, "ckpt"), uid(server, "slow"));

    fail(&agent, "gpu1").await;
    let failed_at = now_ms();
    until(Duration::from_secs(15), "the plain pod evicted", || {
        evicted_at(server, "plain")
    })
    .await;

    // Both warned pods have an intent: on the record, in the ConfigMap entry, in the
    // node's own fault.json, and as an Event on each pod.
    let (entry, _) = until(Duration::from_secs(10), "both intents published", || {
        node_entry(server, 1, "n1").filter(|e| e.drain.len() == 2)
    })
    .await;
    let intent = |uid: &str| entry.drain.iter().find(|d| d.uid == uid).unwrap().clone();
    let (i_ckpt, i_slow) = (intent(&ckpt), intent(&slow));
    assert_eq!(
        (i_ckpt.pod.as_str(), i_ckpt.namespace.as_str()),
        ("ckpt", "default")
    );
    assert_eq!(i_ckpt.devices, ["gpu1"]);
    assert_eq!(
        i_ckpt.reasons,
        ["row-remap-failure"],
        "as npus[].reason says it"
    );
    assert_eq!(i_ckpt.pod_ips, ["127.0.0.1"]);
    assert!(i_ckpt.acknowledged.is_none());
    let deadline = |i: &faultline_common::fault::DrainNotice| {
        parse_rfc3339_ms(&i.evict_after).unwrap() - parse_rfc3339_ms(&i.requested).unwrap()
    };
    assert_eq!(deadline(&i_ckpt), 300_000);
    assert_eq!(deadline(&i_slow), 4_000);
    // The copies in the publish namespaces name only their own namespace's pods.
    let copy = |ns: &str| -> Option<faultline_common::fault::NodeFaults> {
        let name = faultline_common::fault::page_name("faultline", 0, 0);
        let cm = server.get("configmaps", ns, &name)?;
        serde_json::from_str(cm["data"]["n1.json"].as_str()?).ok()
    };
    let (default_copy, _) = until(Duration::from_secs(10), "the copies written", || {
        copy("default").filter(|e| e.drain.len() == 2)
    })
    .await;
    assert!(default_copy.drain.iter().all(|d| d.namespace == "default"));
    // The same verdict in team-b's, written after default's.
    let (team_b, _) = until(Duration::from_secs(10), "team-b's copy", || {
        copy("team-b").filter(|e| {
            e.npus
                .iter()
                .any(|d| d.id == "gpu1" && d.status == faultline_common::DeviceStatus::Failed)
        })
    })
    .await;
    assert!(
        team_b.drain.is_empty(),
        "default's pods in team-b: {:?}",
        team_b.drain
    );
    let on_node = record(server, "n1").unwrap();
    assert_eq!(on_node["drains"].as_object().unwrap().len(), 2, "{on_node}");
    assert_eq!(events_on(server, "ckpt", "FaultlineDrainRequested"), 1);
    assert_eq!(events_on(server, "slow", "FaultlineDrainRequested"), 1);
    let node_fault = format!("http://{}/v1/fault", agent.addr);
    until(
        Duration::from_secs(10),
        "the node's own fault.json lists them",
        || {
            let (s, body) = futures_block(call("GET", &node_fault, None, String::new()));
            (s == 200 && body["drain"].as_array().is_some_and(|d| d.len() == 2)).then_some(())
        },
    )
    .await;
    // The pod port shows a pod its own intent only: ckpt's, asked from its address
    // (this test's), not slow's name, UID and address.
    let (s, body) = call(
        "GET",
        &format!("http://{pod_port}/v1/fault"),
        None,
        String::new(),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(drain_uids(&body), [ckpt.as_str()], "{body}");
    assert_eq!(evicted_at(server, "ckpt"), None, "warned, not evicted");

    // Acknowledgements are checked: the pod's own address, a listed intent, a body.
    let ack = format!("http://{pod_port}/v1/drain/ack");
    // (The Rust kit's acknowledge, as a pod would call it.)
    let kit = |uid: String| {
        let agent = format!("http://{pod_port}");
        tokio::task::spawn_blocking(move || {
            faultline_consumer::acknowledge(&agent, &uid, Duration::from_secs(5))
        })
    };
    let refused = kit(slow.clone()).await.unwrap().unwrap_err().to_string();
    assert!(
        refused.contains("HTTP 403") && refused.contains("10.1.2.3"),
        "not slow's address: {refused}"
    );
    let (s, _) = call("POST", &ack, None, json!({"uid": "no-such"}).to_string()).await;
    assert_eq!(s, 404);
    let (s, _) = call("POST", &ack, None, "garbage".into()).await;
    assert_eq!(s, 400);
    assert_eq!(evicted_at(server, "slow"), None);

    // ckpt checkpointed and says so: evicted now, not in 300 s.
    let acked = Instant::now();
    kit(ckpt.clone()).await.unwrap().unwrap();
    let (s, _) = call("POST", &ack, None, json!({"uid": ckpt}).to_string()).await;
    assert_eq!(s, 200, "once");
    until(Duration::from_secs(10), "ckpt evicted on its word", || {
        evicted_at(server, "ckpt")
    })
    .await;
    let took = acked.elapsed();
    eprintln!("acknowledgement -> eviction: {took:?}");

    // slow never acknowledged: evicted at its deadline, not before.
    let (at, _) = until(
        Duration::from_secs(15),
        "slow evicted at its deadline",
        || evicted_at(server, "slow"),
    )
    .await;
    let due = parse_rfc3339_ms(&i_slow.evict_after).unwrap();
    assert!(at >= due, "evicted {} ms before its deadline", due - at);
    eprintln!(
        "slow: evicted {} ms after its deadline ({} ms after the fault)",
        at - due,
        at - failed_at
    );
    for p in ["ckpt", "slow", "plain"] {
        assert!(evicted_once(server, p), "{p}");
    }
    let m = metric_until(
        agg.addr,
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"timed-out\"} 1",
        Duration::from_secs(5),
    )
    .await;
    for line in [
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"ok\"} 2",
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"acknowledged\"} 1",
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
    // The intents are gone with their pods, from the record and from fault.json.
    until(Duration::from_secs(10), "no intent left", || {
        node_entry(server, 1, "n1").filter(|e| e.drain.is_empty())
    })
    .await;
    let actions = record(server, "n1").unwrap()["actions"].to_string();
    assert!(
        actions.contains("evict default/ckpt (drain intent acknowledged)")
            && actions.contains("evict default/slow (drain intent timed-out)"),
        "{actions}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// `call` from a synchronous closure (`until` polls a closure).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// The kit's example trainer (`consumers/job/train.py`) as a pod (`FAULTLINE_ON=drain`,
/// so only its own drain intent stops it), its output collected as it comes.
struct Trainer {
    child: ChildGuard,
    out: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Trainer {
    fn start(uid: &str, node_file: &Path, ckpt: &Path, agent: &str) -> Self {
        let mut child = ChildGuard(
            Command::new("python3")
                .arg(repo_root().join("consumers/job/train.py"))
                .env("NODE_NAME", "n1")
                .env("POD_UID", uid)
                .env("FAULTLINE_FILE", node_file)
                .env("FAULTLINE_AGENT", agent)
                .env("FAULTLINE_ON", "drain")
                .env("CHECKPOINT_DIR", ckpt)
                .env("STEP_SECONDS", "0.005")
                .env("CHECKPOINT_EVERY", "100000")
                // The next pod (resumed from the warned one's checkpoint) ends soon.
                .env("STEPS", "400")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
        let (out, stdout) = (Arc::new(Mutex::new(String::new())), child.0.stdout.take());
        let sink = out.clone();
        let reader = std::thread::spawn(move || {
            let lines = std::io::BufRead::lines(std::io::BufReader::new(stdout.unwrap()));
            for l in lines.map_while(Result::ok) {
                let mut o = sink.lock().unwrap();
                o.push_str(&l);
                o.push('\n');
            }
        });
        Trainer {
            child,
            out,
            reader: Some(reader),
        }
    }

    /// What it printed so far.
    fn said(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Its exit code and whole output, once it exited (at most `within`).
    async fn output(&mut self, within: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(s) = self.child.0.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "the trainer did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if let Some(r) = self.reader.take() {
            r.join().unwrap();
        }
        (status.code(), self.said())
    }
}

/// The step the trainer checkpointed at when warned.
fn lost_at(out: &str) -> u64 {
    out.lines()
        .find_map(|l| l.split("checkpointed at step ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint line: {out}"))
}

/// Steps lost, from the trainer's last line.
fn lost(out: &str) -> u64 {
    let last = out.lines().last().unwrap_or_default();
    let n = last
        .strip_suffix(" steps lost")
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("no steps-lost line: {out}"));
    n.parse().unwrap()
}

/// Two trainers on one node whose GPU fails, side by side. The one
/// that asked for a grace is warned, checkpoints, acknowledges through its node's agent
/// and is evicted at once, losing nothing; the one that did not is evicted at once and
/// loses every step since its last periodic checkpoint. The test plays the kubelet: a
/// pod the API server no longer has gets SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_by_side_the_warned_trainer_loses_nothing_the_unwarned_one_its_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let (agent, token, dir) = delivering_agent(tmp.path()).await;
    let pod_agent = format!("http://{}", agent.fault_addr.unwrap());
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .object("pods", "default", pod("warned", Some("60s"), "127.0.0.1"))
        .object("pods", "default", pod("unwarned", None, "10.1.2.5"))
        .agents_flag(&format!("n1=http://{}", agent.addr))
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&["--delivery-token-file", token.to_str().unwrap()])
        .start()
        .await;
    holds(server, "r1").await;
    let node_file = dir.join("fault.json");
    until(Duration::from_secs(20), "the node's verdict", || {
        let t: Value = serde_json::from_slice(&std::fs::read(&node_file).ok()?).ok()?;
        (t["verdict"]["writer"] == "r1").then_some(())
    })
    .await;
    let ckpts = [tmp.path().join("warned"), tmp.path().join("unwarned")];
    let mut pods = Vec::new();
    for (name, ckpt) in ["warned", "unwarned"].iter().zip(&ckpts) {
        std::fs::create_dir(ckpt).unwrap();
        pods.push((
            *name,
            Trainer::start(&uid(server, name), &node_file, ckpt, &pod_agent),
        ));
    }
    // Both train (and neither checkpoints: every 100,000 steps) before the GPU fails.
    until(Duration::from_secs(20), "both trainers started", || {
        pods.iter()
            .all(|(_, t)| t.said().contains("training from step 0"))
            .then_some(())
    })
    .await;
    fail(&agent, "gpu1").await;
    // The kubelet: SIGTERM to a pod's process once the pod is gone (evicted).
    let mut killed = [None, None];
    let deadline = Instant::now() + Duration::from_secs(30);
    while killed.iter().any(Option::is_none) {
        assert!(Instant::now() < deadline, "not both evicted: {killed:?}");
        for (i, (name, trainer)) in pods.iter().enumerate() {
            if killed[i].is_none() && server.get("pods", "default", name).is_none() {
                let pid = trainer.child.0.id().to_string();
                Command::new("kill").args(["-TERM", &pid]).status().unwrap();
                killed[i] = Some(now_ms());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut outs = Vec::new();
    for (name, trainer) in &mut pods {
        let (code, out) = trainer.output(Duration::from_secs(10)).await;
        eprintln!("--- {name} (exit {code:?}):\n{out}");
        outs.push((code, out));
    }
    let (warned, unwarned) = (&outs[0], &outs[1]);
    assert!(
        warned.1.contains("drain requested on n1") && warned.1.contains("acknowledged at "),
        "{}",
        warned.1
    );
    assert!(
        lost(&warned.1) <= 1,
        "the warned trainer lost at most one step"
    );
    assert_eq!(warned.0, Some(143), "never 0: the Job would complete");
    let acked_ms: f64 = warned
        .1
        .lines()
        .find_map(|l| l.strip_prefix("acknowledged at "))
        .and_then(|l| l.split(';').next())
        .unwrap()
        .parse()
        .unwrap();
    let evicted = evicted_at(server, "warned").unwrap();
    let after_ack = evicted as f64 - acked_ms * 1000.0;
    eprintln!("warned: evicted {after_ack:.0} ms after its acknowledgement (grace 60 s)");
    assert!(
        after_ack < 30_000.0,
        "evicted on its word, not at its deadline: {after_ack} ms"
    );
    let steps = lost(&unwarned.1);
    eprintln!("unwarned: evicted at once, {steps} steps lost");
    assert!(
        steps > 1,
        "the unwarned trainer loses its steps: {}",
        unwarned.1
    );
    assert!(
        unwarned.1.contains("last checkpoint at step 0"),
        "{}",
        unwarned.1
    );
    assert!(evicted_once(server, "warned") && evicted_once(server, "unwarned"));
    // The Job's next pod, elsewhere, resumes from the checkpoint.
    let saved = lost_at(&warned.1);
    let mut next = Trainer::start(
        "next-pod",
        &tmp.path().join("elsewhere.json"),
        &ckpts[0],
        &pod_agent,
    );
    let (code, out) = next.output(Duration::from_secs(20)).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.starts_with(&format!("resumed from step {saved}\n")),
        "{out}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await.expect("a clean stop");
}

/// Dry run: the announcement says the pod would be warned first, and nothing is
/// published, recorded or evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_announces_the_warning_and_publishes_no_intent() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .object("pods", "default", pod("ckpt", Some("300s"), "10.1.2.6"))
        .object("pods", "default", pod("plain", None, "10.1.2.7"))
        .agents()
        .start()
        .await;
    let server = &w.server;
    let _agg = w
        .healing("r1")
        .set("--remediation", "dry-run")
        .start()
        .await;
    holds(server, "r1").await;
    fail(w.agent("n1"), "gpu1").await;
    let messages = |reason: &str| -> Vec<String> {
        server
            .list("events", "default")
            .iter()
            .filter(|e| e["reason"] == reason)
            .filter_map(|e| e["message"].as_str().map(String::from))
            .collect()
    };
    let (would, _) = until(Duration::from_secs(15), "both announced", || {
        let m = messages("FaultlineWouldEvict");
        (m.len() == 2).then_some(m)
    })
    .await;
    assert!(
        would.iter().any(|m| m
            == "dry-run: would evict default/ckpt after warning it to checkpoint (grace 300s, or its acknowledgement)"),
        "{would:?}"
    );
    assert!(
        would
            .iter()
            .any(|m| m == "dry-run: would evict default/plain"),
        "{would:?}"
    );
    assert!(record(server, "n1").is_none());
    let (entry, _) = until(Duration::from_secs(10), "gpu1 published failed", || {
        node_entry(server, 1, "n1").filter(|e| e.summary.failed == 1)
    })
    .await;
    assert!(entry.drain.is_empty(), "{entry:?}");
    assert_eq!(events(server, "FaultlineDrainRequested"), 0);
    assert_eq!(evictions(server, "ckpt") + evictions(server, "plain"), 0);
    assert_no_forbidden(server);
}

/// A warned pod whose disruption budget refuses its eviction past `--eviction-deadline`
/// is left (as before): its intent ends with it, so it is not told to drain forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_left_to_its_budget_is_no_longer_told_to_drain() {
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        .object("pods", "default", pod("stuck", Some("1s"), "10.1.2.8"))
        .object(
            "poddisruptionbudgets",
            "default",
            json!({"metadata": {"name": "stuck"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "stuck"}}}}),
        )
        .agents()
        .start()
        .await;
    let server = &w.server;
    let _agg = w
        .healing("r1")
        .args(&["--eviction-deadline", "2s"])
        .start()
        .await;
    holds(server, "r1").await;
    fail(w.agent("n1"), "gpu1").await;
    until(Duration::from_secs(10), "the intent published", || {
        node_entry(server, 1, "n1").filter(|e| e.drain.len() == 1)
    })
    .await;
    until(
        Duration::from_secs(20),
        "given up on, its intent gone",
        || {
            let gone = node_entry(server, 1, "n1")?.drain.is_empty();
            (gone && events_on(server, "n1", "FaultlineEvictionBlocked") == 1).then_some(())
        },
    )
    .await;
    let r = record(server, "n1").unwrap();
    assert!(r.get("drains").is_none(), "{r}");
    assert!(
        server.get("pods", "default", "stuck").is_some(),
        "left, as before"
    );
    assert_eq!(eviction_calls(server, "stuck", 201), 0);
    assert!(eviction_calls(server, "stuck", 429) >= 1);
    assert_no_forbidden(server);
}

/// deploy/'s Role or RoleBinding `faultline-publisher` of namespace default, as the one
/// of namespace team-b (a second publish namespace).
fn publisher_role(kind: &str) -> Value {
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/base/aggregator.yaml"
    ))
    .unwrap();
    let doc = yaml
        .split("\n---\n")
        .find(|d| {
            d.contains(&format!("kind: {kind}\n"))
                && d.contains("faultline-publisher, namespace: default")
        })
        .unwrap_or_else(|| panic!("deploy/'s {kind} faultline-publisher"));
    let mut v: Value = serde_yaml_ng::from_str(doc).unwrap();
    v["metadata"]["namespace"] = json!("team-b");
    v
}
