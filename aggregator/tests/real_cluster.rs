//! faultline on a real Kubernetes control plane (issue 46): kube-apiserver, etcd,
//! kube-controller-manager and kube-scheduler built from their Go modules
//! (`tests/controlplane`), deploy/ applied as a user applies it, the aggregator under its
//! ServiceAccount's token with exactly deploy/'s RBAC. Each scenario runs on every
//! pinned release (1.37 and 1.36), each in a process and network namespace of its own
//! (`faultline_controlplane::network_namespace`: the pods' addresses are local there,
//! nothing outside is reachable), one after the other: a control plane takes ~0.5 GiB
//! and most of the 2 cores while it starts.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use faultline_controlplane::{Delays, Release};
use support::real::RealCluster;

/// The Deployment's `--shards`.
const SHARDS: u32 = 4;

/// Whether to run test `test` here: in the network namespace of its own that its
/// process runs in (`true`), or not at all, having run it in a child process there or
/// skipped it (`false`). One at a time: each starts a control plane of its own.
fn isolated(test: &str) -> bool {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    faultline_controlplane::network_namespace(test)
}

/// Run a test's body on a runtime of its own.
fn run(body: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body);
}

/// What the published entries showed during a rollout, per node.
#[derive(Default, Debug)]
struct Seen {
    absent: usize,
    unreachable: usize,
    polls: usize,
}

/// An agent DaemonSet rollout (`kubectl rollout restart`): each agent pod is deleted
/// (its endpoint turns not ready, then goes), and a new one takes a few seconds to
/// start. Every node stays in the published shard throughout, its agent unreachable
/// while it is away (the node unknown, never absent), and is followed again at its new
/// pod's address. Before the fix, a node whose endpoint was not ready or gone was
/// forgotten: absent from its shard until the new agent was ready.
async fn an_agent_rollout_keeps_every_node_published(release: Release) {
    let test = format!("an_agent_rollout_keeps_every_node_published ({release:?})");
    // 3 s to stop and 3 s to start: the agent is away ~6 s per node.
    let delays = Delays {
        start: 3_000,
        stop: 3_000,
    };
    let Some(c) = RealCluster::start(&test, release, 2, delays).await else {
        return;
    };
    eprintln!(
        "{test}: control plane up in {:.1} s; {}",
        c.cp.started_in.as_secs_f64(),
        c.memory()
    );
    let (_agg, _url) = c.aggregator("faultline-aggregator-0", &[]).await;
    let nodes = ["n1", "n2"];
    let start = Instant::now();
    loop {
        let mut reachable = 0;
        for n in nodes {
            if c.node_entry(SHARDS, n)
                .await
                .is_some_and(|e| e.agent.reachable)
            {
                reachable += 1;
            }
        }
        if reachable == nodes.len() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "both nodes not published reachable within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before: BTreeSet<String> = c.agent_pods().await.into_iter().map(|p| p.1).collect();
    c.cp.kubectl(&[
        "-n",
        "faultline",
        "rollout",
        "restart",
        "daemonset/faultline-agent",
    ]);
    let mut seen: Vec<Seen> = nodes.iter().map(|_| Seen::default()).collect();
    let start = Instant::now();
    loop {
        for (i, n) in nodes.iter().enumerate() {
            seen[i].polls += 1;
            match c.node_entry(SHARDS, n).await {
                None => seen[i].absent += 1,
                Some(e) if !e.agent.reachable => seen[i].unreachable += 1,
                Some(_) => {}
            }
        }
        let pods = c.agent_pods().await;
        let replaced = pods.len() == nodes.len()
            && pods.iter().all(|p| !before.contains(&p.1) && !p.3)
            && c.ready_agent_endpoints().await.len() == nodes.len();
        let mut reachable = 0;
        for n in nodes {
            if c.node_entry(SHARDS, n)
                .await
                .is_some_and(|e| e.agent.reachable)
            {
                reachable += 1;
            }
        }
        if replaced && reachable == nodes.len() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the rollout did not end with both nodes reachable within 120 s: {seen:?}, pods {pods:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "{test}: rollout done in {:.1} s: {seen:?}",
        start.elapsed().as_secs_f64()
    );
    for (n, s) in nodes.iter().zip(&seen) {
        assert_eq!(
            s.absent, 0,
            "{n} was absent from its shard in {} of {} polls during the rollout (unreachable in {})",
            s.absent, s.polls, s.unreachable
        );
        assert!(s.unreachable > 0, "{n} was never seen unreachable: {s:?}");
    }
    c.assert_no_forbidden();
}

#[test]
fn an_agent_rollout_keeps_every_node_published_1_37() {
    if isolated("an_agent_rollout_keeps_every_node_published_1_37") {
        run(an_agent_rollout_keeps_every_node_published(Release::V1_37));
    }
}

#[test]
fn an_agent_rollout_keeps_every_node_published_1_36() {
    if isolated("an_agent_rollout_keeps_every_node_published_1_36") {
        run(an_agent_rollout_keeps_every_node_published(Release::V1_36));
    }
}

/// The rule faultline made for `device` of n1's pool, if any.
fn rule_for(c: &RealCluster, device: &str) -> Option<serde_json::Value> {
    c.rules()
        .into_iter()
        .find(|r| r["spec"]["deviceSelector"]["device"] == device)
}

/// Wait (60 s at most) until `device`'s rule has `effect`; the rule.
async fn until_effect(c: &RealCluster, device: &str, effect: &str) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let rule = rule_for(c, device);
        if let Some(r) = rule
            .as_ref()
            .filter(|r| r["spec"]["taint"]["effect"] == effect)
        {
            return r.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{device}'s DeviceTaintRule not at {effect} within 60 s: {rule:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The aggregator's extra flags in the DRA tests: a reconcile every 500 ms, no node
/// share budget (one node).
const HEALING: [&str; 2] = [
    "--reconcile-interval=500ms",
    "--max-quarantined-percent=100",
];

/// Break 1 of issue 46, a holder that tolerates the taint: its claim tolerates
/// faultline's taint with `NoExecute` for ever, so the real device-taint eviction
/// controller leaves it out of its prediction ("0 pods would be evicted"). Before the
/// fix faultline counted it in, the two never agreed, and the failed GPU stayed
/// allocatable at effect None for ever. Now faultline counts as the controller does:
/// the rule goes to NoSchedule and the tolerating pod is left running.
async fn a_tolerating_holder_does_not_keep_a_failed_gpu_in_service(release: Release) {
    let test = format!("a_tolerating_holder_does_not_keep_a_failed_gpu_in_service ({release:?})");
    let Some(c) = RealCluster::start_with(
        &test,
        release,
        1,
        Delays::default(),
        "deploy/overlays/nvidia-enforce",
    )
    .await
    else {
        return;
    };
    let gpus = c.publish_gpus("n1").await;
    let tolerates = serde_json::json!([
        {"key": "faultline.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}
    ]);
    let device = c.gpu_pod("tolerant", "n1", tolerates).await;
    let other = c.gpu_pod("plain", "n1", serde_json::json!([])).await;
    assert_ne!(device, other);
    let id = &gpus.iter().find(|(d, _)| *d == device).unwrap().1;
    let (_agg, url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let agent = c.agent_addr("n1");
    let fault = format!(r#"{{"device":"{id}","fault":"row-remap-failure"}}"#);
    assert_eq!(support::post(agent, "/v1/sim/faults", &fault).await, 201);
    let rule = until_effect(&c, &device, "NoSchedule").await;
    eprintln!(
        "{test}: {device} ({id}) at NoSchedule; the controller said: {}",
        rule["status"]["conditions"][0]["message"]
    );
    // Two more remediation passes: the eviction pass has run and left both pods.
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    support::grows(
        addr,
        &[("faultline_aggregator_remediation_passes_total", 2)],
    )
    .await;
    let pods = c.items(&["-n", "default", "pods"]);
    for name in ["tolerant", "plain"] {
        let p = pods.iter().find(|p| p["metadata"]["name"] == name);
        assert!(
            p.is_some_and(|p| p["metadata"]["deletionTimestamp"].is_null()),
            "{name} was evicted: {p:?}"
        );
    }
    c.assert_no_forbidden();
}

/// Break 1 of issue 46, pod churn: a rule of faultline's left at `None` by an earlier
/// replica, whose prediction (written once, when the rule was made) counts a pod that
/// has since gone. Before the fix the stale "1 pod would be evicted" never agreed with
/// faultline's count of 0, and the failed GPU stayed allocatable for ever. Now a
/// disagreement asks the controller again (a spec change, `timeAdded`), and the fresh
/// prediction agrees.
async fn a_stale_prediction_is_asked_again(release: Release) {
    let test = format!("a_stale_prediction_is_asked_again ({release:?})");
    let Some(c) = RealCluster::start_with(
        &test,
        release,
        1,
        Delays::default(),
        "deploy/overlays/nvidia-enforce",
    )
    .await
    else {
        return;
    };
    let gpus = c.publish_gpus("n1").await;
    let device = c.gpu_pod("gone", "n1", serde_json::json!([])).await;
    let id = &gpus.iter().find(|(d, _)| *d == device).unwrap().1;
    // The rule an earlier replica made, as faultline names and labels it.
    let dev = faultline_aggregator::quarantine::DeviceRef {
        driver: "gpu.nvidia.com".into(),
        pool: "n1".into(),
        device: device.clone(),
    };
    let version = match release {
        Release::V1_37 => "v1",
        Release::V1_36 => "v1beta2",
    };
    c.apply(&serde_json::json!({
        "apiVersion": format!("resource.k8s.io/{version}"), "kind": "DeviceTaintRule",
        "metadata": {"name": faultline_aggregator::quarantine::rule_name(&dev),
                     "labels": {"app.kubernetes.io/managed-by": "faultline"}},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": device},
                 "taint": {"key": "faultline.io/unhealthy", "value": "row-remap-failure", "effect": "None"}},
    }));
    let start = Instant::now();
    loop {
        let msg = rule_for(&c, &device).and_then(|r| {
            r["status"]["conditions"][0]["message"]
                .as_str()
                .map(String::from)
        });
        if msg
            .as_deref()
            .is_some_and(|m| m.contains("1 pod would be evicted"))
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no prediction: {msg:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.cp.kubectl(&["-n", "default", "delete", "pod", "gone", "--wait=true"]);
    let (_agg, _url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let fault = format!(r#"{{"device":"{id}","fault":"row-remap-failure"}}"#);
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", &fault).await,
        201
    );
    let rule = until_effect(&c, &device, "NoSchedule").await;
    eprintln!(
        "{test}: {device} at NoSchedule, generation {}; the controller said: {}",
        rule["metadata"]["generation"], rule["status"]["conditions"][0]["message"]
    );
    c.assert_no_forbidden();
}

#[test]
fn a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_37() {
    if isolated("a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_37") {
        run(a_tolerating_holder_does_not_keep_a_failed_gpu_in_service(
            Release::V1_37,
        ));
    }
}

#[test]
fn a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_36() {
    if isolated("a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_36") {
        run(a_tolerating_holder_does_not_keep_a_failed_gpu_in_service(
            Release::V1_36,
        ));
    }
}

#[test]
fn a_stale_prediction_is_asked_again_1_37() {
    if isolated("a_stale_prediction_is_asked_again_1_37") {
        run(a_stale_prediction_is_asked_again(Release::V1_37));
    }
}

#[test]
fn a_stale_prediction_is_asked_again_1_36() {
    if isolated("a_stale_prediction_is_asked_again_1_36") {
        run(a_stale_prediction_is_asked_again(Release::V1_36));
    }
}

/// Healing on a real cluster, the node path (GPUs of the device plugin, which took none
/// out of allocatable): a GPU of n1 fails. faultline taints n1 once; evicts through the
/// Eviction API the Deployment's pod there, whose replacement the real scheduler then
/// keeps off n1 (Pending: the taint works); never forces the pod whose real
/// PodDisruptionBudget allows no disruption (the real answer, 429, every time); and
/// `kubectl describe node n1` shows why.
async fn healing_respects_a_real_budget(release: Release) {
    let test = format!("healing_respects_a_real_budget ({release:?})");
    let Some(c) = RealCluster::start_with(
        &test,
        release,
        2,
        Delays::default(),
        "deploy/overlays/nvidia-enforce",
    )
    .await
    else {
        return;
    };
    let gpu_pod = |labels: serde_json::Value| {
        serde_json::json!({
            "metadata": {"labels": labels},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": "n1"},
                "containers": [{"name": "train", "image": "train:1",
                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            },
        })
    };
    let mut solo = gpu_pod(serde_json::json!({"app": "solo"}));
    solo["apiVersion"] = "v1".into();
    solo["kind"] = "Pod".into();
    solo["metadata"]["name"] = "solo".into();
    solo["metadata"]["namespace"] = "default".into();
    c.apply(&solo);
    c.apply(&serde_json::json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "solo", "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "solo"}}},
    }));
    c.apply(&serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                 "template": gpu_pod(serde_json::json!({"app": "web"}))},
    }));
    let running = |c: &RealCluster| -> Vec<(String, String, bool)> {
        c.items(&["-n", "default", "pods"])
            .iter()
            .map(|p| {
                (
                    p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    p["status"]["phase"].as_str().unwrap_or("").to_string(),
                    !p["metadata"]["deletionTimestamp"].is_null(),
                )
            })
            .collect()
    };
    let start = Instant::now();
    let web = loop {
        let pods = running(&c);
        let web = pods
            .iter()
            .find(|p| p.0.starts_with("web-") && p.1 == "Running")
            .map(|p| p.0.clone());
        let budget_ready = c
            .items(&["-n", "default", "poddisruptionbudgets"])
            .first()
            .is_some_and(|b| b["status"]["observedGeneration"] == b["metadata"]["generation"]);
        if let (Some(w), true, true) = (
            web,
            pods.iter().any(|p| p.0 == "solo" && p.1 == "Running"),
            budget_ready,
        ) {
            break w;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "workloads not running: {pods:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (_agg, url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let fault = r#"{"device":"gpu1","fault":"row-remap-failure"}"#;
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", fault).await,
        201
    );

    // The taint, once; the Deployment's pod evicted and its replacement kept off n1.
    let start = Instant::now();
    loop {
        let taints: Vec<serde_json::Value> = c
            .items(&["nodes", "--field-selector", "metadata.name=n1"])
            .first()
            .and_then(|n| n["spec"]["taints"].as_array().cloned())
            .unwrap_or_default();
        let ours = taints.iter().filter(|t| t["key"] == support::TAINT).count();
        let pods = running(&c);
        let web_gone = !pods.iter().any(|p| p.0 == web);
        let replacement_pending = pods
            .iter()
            .any(|p| p.0.starts_with("web-") && p.0 != web && p.1 == "Pending");
        if ours == 1 && web_gone && replacement_pending {
            break;
        }
        assert!(ours <= 1, "n1 tainted {ours} times: {taints:?}");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not healed within 60 s: taints {taints:?}, pods {pods:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two more passes: solo is still asked, and still refused.
    support::grows(
        addr,
        &[("faultline_aggregator_remediation_passes_total", 2)],
    )
    .await;
    assert!(
        running(&c)
            .iter()
            .any(|p| p.0 == "solo" && p.1 == "Running" && !p.2),
        "solo was forced out despite its budget"
    );
    let evictions: Vec<(String, u16)> =
        c.cp.audit()
            .into_iter()
            .filter(|e| e.verb == "create" && e.uri.contains("/eviction"))
            .map(|e| (e.uri, e.code))
            .collect();
    let solo_answers: Vec<u16> = evictions
        .iter()
        .filter(|(u, _)| u.contains("/pods/solo/"))
        .map(|(_, code)| *code)
        .collect();
    assert!(
        !solo_answers.is_empty() && solo_answers.iter().all(|c| *c == 429),
        "solo's evictions: {evictions:?}"
    );
    assert_eq!(
        evictions
            .iter()
            .filter(|(u, code)| u.contains(&format!("/pods/{web}/")) && *code == 201)
            .count(),
        1,
        "{evictions:?}"
    );
    let describe = c.cp.kubectl(&["describe", "node", "n1"]);
    assert!(
        describe.contains("FaultlineQuarantined"),
        "kubectl describe node n1 shows no FaultlineQuarantined Event:\n{describe}"
    );
    eprintln!(
        "{test}: n1 tainted once, {web} evicted once, solo refused {} times (429)",
        solo_answers.len()
    );
    c.assert_no_forbidden();
}

#[test]
fn healing_respects_a_real_budget_1_37() {
    if isolated("healing_respects_a_real_budget_1_37") {
        run(healing_respects_a_real_budget(Release::V1_37));
    }
}

#[test]
fn healing_respects_a_real_budget_1_36() {
    if isolated("healing_respects_a_real_budget_1_36") {
        run(healing_respects_a_real_budget(Release::V1_36));
    }
}

/// 1.36 as it comes: DeviceTaintRules off (the `DRADeviceTaintRules` gate and the
/// `v1beta2` API), DRA on. faultline finds no DeviceTaintRule API and takes the node
/// path: n1 tainted once, the holder of the failed GPU (by its claim) evicted, the
/// other GPU's pod left.
#[test]
fn without_device_taint_rules_1_36_takes_the_node_path() {
    let test = "without_device_taint_rules_1_36_takes_the_node_path";
    if !isolated(test) {
        return;
    }
    run(async {
        let opts = faultline_controlplane::Options::defaults(Release::V1_36);
        let Some(c) = RealCluster::start_as(
            test,
            opts,
            1,
            Delays::default(),
            "deploy/overlays/nvidia-enforce",
        )
        .await
        else {
            return;
        };
        let gpus = c.publish_gpus("n1").await;
        let failed = c.gpu_pod("holder", "n1", serde_json::json!([])).await;
        let other = c.gpu_pod("bystander", "n1", serde_json::json!([])).await;
        assert_ne!(failed, other);
        let id = &gpus.iter().find(|(d, _)| *d == failed).unwrap().1;
        let (_agg, _url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
        let fault = format!(r#"{{"device":"{id}","fault":"row-remap-failure"}}"#);
        assert_eq!(
            support::post(c.agent_addr("n1"), "/v1/sim/faults", &fault).await,
            201
        );
        let start = Instant::now();
        loop {
            let taints: Vec<serde_json::Value> = c
                .items(&["nodes", "--field-selector", "metadata.name=n1"])
                .first()
                .and_then(|n| n["spec"]["taints"].as_array().cloned())
                .unwrap_or_default();
            let ours = taints.iter().filter(|t| t["key"] == support::TAINT).count();
            let pods = c.items(&["-n", "default", "pods"]);
            let holder_gone = !pods.iter().any(|p| p["metadata"]["name"] == "holder");
            if ours == 1 && holder_gone {
                break;
            }
            assert!(ours <= 1, "n1 tainted {ours} times");
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "node path not taken within 60 s: taints {taints:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pods = c.items(&["-n", "default", "pods"]);
        assert!(
            pods.iter().any(|p| p["metadata"]["name"] == "bystander"
                && p["metadata"]["deletionTimestamp"].is_null()),
            "the other GPU's pod was evicted too"
        );
        c.assert_no_forbidden();
    });
}
