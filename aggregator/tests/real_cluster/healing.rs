//! Healing on the node path: a real PodDisruptionBudget, the node path where
//! DeviceTaintRules are off.

use std::time::{Duration, Instant};

use faultline_controlplane::{Delays, Release};

use crate::support::{self, real::RealCluster};
use crate::{isolated, run, HEALING};

/// The pods of `default`: (name, phase, terminating).
fn running(c: &RealCluster) -> Vec<(String, String, bool)> {
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
}

/// Healing on a real cluster, the node path (GPUs of the device plugin, which took none
/// out of allocatable): a GPU of n1 fails. faultline taints n1 once; evicts through the
/// Eviction API the Deployment's pod there, whose replacement the real scheduler then
/// keeps off n1 (Pending: the taint works); never forces the pod whose real
/// PodDisruptionBudget allows no disruption (the real answer, 429, every time); and
/// `kubectl describe node n1` shows why. Then the GPU recovers: after the clean samples
/// and the cool-down faultline starts a canary Job, the real Job controller runs its pod
/// and calls it complete, and only then is n1 released, once, and the Deployment's
/// replacement scheduled back onto it.
async fn healing_respects_a_real_budget_then_a_canary_releases(release: Release) {
    let test = format!("healing_respects_a_real_budget_then_a_canary_releases ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, 2).await else {
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
    let canary = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        canary.path(),
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: probe\nspec:\n  template:\n    \
         spec:\n      containers:\n      - name: probe\n        image: cuda:12\n        \
         command: [nvidia-smi]\n        resources:\n          limits:\n            \
         nvidia.com/gpu: \"1\"\n",
    )
    .unwrap();
    let canary_flag = format!("--canary-job={}", canary.path().display());
    let mut args = HEALING.to_vec();
    args.extend([
        "--release=auto",
        "--release-healthy-samples=3",
        "--release-cooldown=2s",
        &canary_flag,
    ]);
    // The canary's flags come with their permission (deploy/components/canary).
    let canary_rbac = support::repo_root().join("deploy/components/canary/rbac.yaml");
    c.cp.kubectl(&[
        "apply",
        "--server-side",
        "-f",
        canary_rbac.to_str().unwrap(),
    ]);
    let (_agg, url) = c.aggregator("faultline-aggregator-0", &args).await;
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let fault = r#"{"device":"gpu1","fault":"row-remap-failure"}"#;
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", fault).await,
        201
    );

    // The taint, once; the Deployment's pod evicted and its replacement kept off n1.
    let start = Instant::now();
    loop {
        let taints = c.taints("n1");
        let ours = RealCluster::ours(&taints);
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
    assert!(
        c.items(&["-n", support::real::NS, "jobs"]).is_empty(),
        "a canary while gpu1 is failed"
    );

    a_canary_releases_n1(&c, &test).await;
    c.assert_no_forbidden();
}

/// 1.36 as it comes: DeviceTaintRules off (the `DRADeviceTaintRules` gate and the
/// `v1beta2` API), DRA on. faultline finds no DeviceTaintRule API and takes the node
/// path: n1 tainted once, the holder of the failed GPU (by its claim) evicted, the
/// other GPU's pod left.
#[test]
fn without_device_taint_rules_1_36_takes_the_node_path() {
    let test = "healing::without_device_taint_rules_1_36_takes_the_node_path";
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
            let taints = c.taints("n1");
            let ours = RealCluster::ours(&taints);
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

/// gpu1 of n1 recovers: a canary Job, run by the real Job controller, then the release,
/// and the Deployment's replacement back on n1.
async fn a_canary_releases_n1(c: &RealCluster, test: &str) {
    // gpu1 recovers: a canary, run by the real Job controller, then the release.
    let healed = Instant::now();
    let (code, _) = support::call(
        "DELETE",
        &format!("http://{}/v1/sim/faults", c.agent_addr("n1")),
        None,
        String::new(),
    )
    .await;
    assert!(code < 300, "{code}");
    let job = crate::until(Duration::from_secs(60), "a canary Job", || {
        let jobs = c.items(&["-n", support::real::NS, "jobs"]);
        match jobs.as_slice() {
            [] => Err(format!(
                "none; n1 tainted {}",
                RealCluster::ours(&c.taints("n1"))
            )),
            [j] => Ok(j.clone()),
            more => panic!("{} canaries at once", more.len()),
        }
    })
    .await;
    let name = job["metadata"]["name"].as_str().unwrap().to_string();
    let complete = crate::until(Duration::from_secs(60), "n1 released", || {
        let job = c
            .items(&["-n", support::real::NS, "jobs"])
            .into_iter()
            .find(|j| j["metadata"]["name"] == name.as_str())
            .ok_or("the canary Job vanished")?;
        let done = job["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Complete" && c["status"] == "True");
        let tainted = RealCluster::ours(&c.taints("n1"));
        assert!(
            done || tainted == 1,
            "n1 released before its canary completed: {job}"
        );
        (tainted == 0)
            .then_some(job)
            .ok_or(format!("n1 tainted {tainted}"))
    })
    .await;
    // The canary's pod: the Job controller's, pinned to n1, run to success.
    let pods = c.items(&[
        "-n",
        support::real::NS,
        "pods",
        "-l",
        &format!("batch.kubernetes.io/job-name={name}"),
    ]);
    assert_eq!(pods.len(), 1, "{pods:#?}");
    assert_eq!(pods[0]["metadata"]["ownerReferences"][0]["kind"], "Job");
    assert_eq!(pods[0]["spec"]["nodeName"], "n1");
    assert_eq!(pods[0]["status"]["phase"], "Succeeded");
    assert_eq!(complete["status"]["succeeded"], 1);
    // Released: the Deployment's replacement runs on n1 again.
    crate::until(Duration::from_secs(60), "web back on n1", || {
        let pods = running(c);
        pods.iter()
            .any(|p| p.0.starts_with("web-") && p.1 == "Running" && !p.2)
            .then_some(())
            .ok_or(format!("{pods:?}"))
    })
    .await;
    eprintln!(
        "{test}: healthy -> canary {name} complete -> released in {:.1} s",
        healed.elapsed().as_secs_f64()
    );
}

on_releases!(healing_respects_a_real_budget_then_a_canary_releases:
    healing_respects_a_real_budget_then_a_canary_releases_1_37 = V1_37,
    healing_respects_a_real_budget_then_a_canary_releases_1_36 = V1_36,
);
