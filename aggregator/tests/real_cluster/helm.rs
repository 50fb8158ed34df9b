//! The Helm chart (deploy/helm/faultline) installed, upgraded and removed with the
//! pinned helm on a real control plane that limits the system priority classes as GKE
//! does, the aggregator running under the chart's own RBAC.

use std::time::{Duration, Instant};

use faultline_controlplane::{Delays, Options, Release};

use crate::support;
use crate::support::real::{text, Install, RealCluster, NS};
use crate::{until, HEALING};

/// The agents' pods now, by name.
fn agent_pods(c: &RealCluster) -> Vec<String> {
    c.items(&[
        "-n",
        NS,
        "pods",
        "-l",
        "app.kubernetes.io/name=faultline-agent",
    ])
    .iter()
    .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
    .map(|p| p["metadata"]["name"].as_str().unwrap_or("").to_string())
    .collect()
}

/// `helm` as the admin; fails with its output unless it succeeds.
fn helm(c: &RealCluster, args: &[&str]) -> String {
    let out = c.helm(args);
    assert!(
        out.status.success(),
        "helm {}: {}",
        args.join(" "),
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The chart's whole life on a cluster that admits a `system-node-critical` pod outside
/// kube-system only with a ResourceQuota matching the class (GKE's rule):
///
/// 1. `helm install` of the previous chart version (tests/helm/previous/, with
///    ci/nvidia-enforce-values.yaml): the real DaemonSet controller makes the agents'
///    pods, admitted by the chart's quota;
/// 2. `helm upgrade --reuse-values --set agent.priorityQuota=false` to today's chart
///    (today's deploy/ shipped no quota): a deleted agent pod is not made again, and
///    the DaemonSet controller reports the admission's refusal; `--set
///    agent.priorityQuota=true` brings it back, every other value kept, and the
///    release is today's chart version;
/// 3. the aggregator, run with the chart's Deployment's arguments under a token of the
///    chart's ServiceAccount, heals a failed GPU (n1 tainted once, its pod evicted) with
///    no request refused by the chart's RBAC;
/// 4. `helm uninstall` removes every object the chart made, cluster-wide ones included.
async fn the_chart_installs_upgrades_heals_and_uninstalls(release: Release) {
    let test = format!("the_chart_installs_upgrades_heals_and_uninstalls ({release:?})");
    let values = support::repo_root().join("deploy/helm/faultline/ci/nvidia-enforce-values.yaml");
    let values = values.to_str().unwrap();
    let install = Install::Helm {
        chart: &previous_chart(),
        args: &["-f", values],
    };
    let opts = Options::new(release).like_gke();
    let Some(c) = RealCluster::installed(&test, opts, 2, Delays::default(), install).await else {
        return;
    };
    let status = helm(&c, &["status", "faultline", "-n", NS]);
    assert!(status.contains("STATUS: deployed"), "{status}");
    assert_eq!(
        agent_pods(&c).len(),
        2,
        "an agent per node, admitted by the chart's quota"
    );

    // 2. Without the quota (today's deploy/ shipped none): refused as on GKE.
    quota(&c, false);
    let gone = agent_pods(&c).remove(0);
    c.cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "pod",
        &gone,
        "--grace-period=0",
        "--force",
    ]);
    let refusal = until(
        Duration::from_secs(60),
        "the DaemonSet's refused pod",
        || {
            let failed = c.items(&[
                "-n",
                NS,
                "events",
                "--field-selector",
                "reason=FailedCreate",
            ]);
            failed
                .iter()
                .find_map(|e| {
                    let m = e["message"].as_str().unwrap_or("");
                    m.contains("insufficient quota to match these scopes")
                        .then(|| m.to_string())
                })
                .ok_or_else(|| format!("no FailedCreate event yet; agents {:?}", agent_pods(&c)))
        },
    )
    .await;
    assert_eq!(
        agent_pods(&c).len(),
        1,
        "the deleted agent was made again: {refusal}"
    );
    quota(&c, true);
    c.until_agents_ready(2, Duration::from_secs(120)).await;
    let got = helm(&c, &["get", "values", "faultline", "-n", NS, "-o", "json"]);
    let got: serde_json::Value = serde_json::from_str(&got).unwrap();
    assert_eq!(
        got["dryRun"], false,
        "--reuse-values kept the install's values: {got}"
    );
    assert_eq!(got["aggregator"]["replicas"], 0, "{got}");
    let history = helm(&c, &["history", "faultline", "-n", NS, "-o", "json"]);
    let history: Vec<serde_json::Value> = serde_json::from_str(&history).unwrap();
    let charts: Vec<&str> = history
        .iter()
        .map(|r| r["chart"].as_str().unwrap_or(""))
        .collect();
    let today = format!("faultline-{}", chart_version());
    assert_eq!(charts.len(), 3, "{history:?}");
    assert_ne!(
        charts[0], today,
        "installed the previous version: {charts:?}"
    );
    assert!(
        charts[1..].iter().all(|c| *c == today),
        "upgraded to {today}: {charts:?}"
    );

    // 3. Healing under the chart's RBAC.
    // A pod holding a GPU of n1 (the device plugin's: the node path).
    c.apply(&serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "n1"},
            "containers": [{"name": "train", "image": "train:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
    }));
    let web = "web";
    until(Duration::from_secs(60), "web running on n1", || {
        let pods = c.items(&["-n", "default", "pods"]);
        pods.iter()
            .any(|p| p["metadata"]["name"] == web && p["status"]["phase"] == "Running")
            .then_some(())
            .ok_or_else(|| format!("{} pods, web not running", pods.len()))
    })
    .await;
    let (_agg, _url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let fault = r#"{"device":"gpu1","fault":"row-remap-failure"}"#;
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", fault).await,
        201
    );
    let start = Instant::now();
    loop {
        let taints = c.taints("n1");
        let ours = RealCluster::ours(&taints);
        let evicted =
            c.cp.audit()
                .iter()
                .filter(|e| {
                    e.verb == "create"
                        && e.uri.contains(&format!("/pods/{web}/eviction"))
                        && e.code == 201
                })
                .count();
        if ours == 1 && evicted == 1 {
            break;
        }
        assert!(ours <= 1, "n1 tainted {ours} times: {taints:?}");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not healed within 60 s: taints {taints:?}, evictions {evicted}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.assert_no_forbidden();
    eprintln!("{test}: installed, refused without the quota ({refusal}), upgraded, n1 healed");

    // 4. Everything the chart made goes with it.
    let made = helm(&c, &["get", "manifest", "faultline", "-n", NS]);
    let objects: Vec<(String, String, String)> =
        made.split("\n---").filter_map(object_of).collect();
    assert!(
        objects.iter().any(|(k, _, _)| k == "ClusterRole"),
        "{objects:?}"
    );
    helm(&c, &["uninstall", "faultline", "-n", NS]);
    until(
        Duration::from_secs(60),
        "every object of the chart gone",
        || {
            let left: Vec<String> = objects
                .iter()
                .filter(|(kind, ns, name)| {
                    let mut args = vec!["get", kind.as_str(), name.as_str()];
                    args.extend(["--ignore-not-found", "-o", "name"]);
                    if !ns.is_empty() {
                        args.extend(["-n", ns.as_str()]);
                    }
                    !c.cp.kubectl(&args).trim().is_empty()
                })
                .map(|(kind, ns, name)| format!("{kind} {ns}/{name}"))
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("left after helm uninstall: {left:?}"))
            }
        },
    )
    .await;
}

/// `helm upgrade --reuse-values` with the agents' priority quota on or off.
fn quota(c: &RealCluster, on: bool) {
    let set = format!("agent.priorityQuota={on}");
    let args = [
        "upgrade",
        "faultline",
        chart(),
        "-n",
        NS,
        "--reuse-values",
        "--set",
        &set,
    ];
    helm(c, &args);
}

/// The chart's path.
fn chart() -> &'static str {
    static CHART: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CHART.get_or_init(|| {
        support::repo_root()
            .join("deploy/helm/faultline")
            .display()
            .to_string()
    })
}

/// The previous chart version, packaged (tests/helm/previous/faultline-*.tgz), from
/// the repository root.
fn previous_chart() -> String {
    let dir = support::repo_root().join("tests/helm/previous");
    let mut tgz: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("faultline-") && n.ends_with(".tgz"))
        .collect();
    assert_eq!(
        tgz.len(),
        1,
        "one previous chart in {}: {tgz:?}",
        dir.display()
    );
    format!("tests/helm/previous/{}", tgz.remove(0))
}

/// Today's chart version (deploy/helm/faultline/Chart.yaml).
fn chart_version() -> String {
    let chart = std::fs::read_to_string(format!("{}/Chart.yaml", chart())).unwrap();
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version: "))
        .expect("Chart.yaml has a version")
        .trim()
        .to_string()
}

/// (kind, namespace, name) of one rendered manifest, read from its `kind:` and
/// `metadata:` lines (helm's own rendering: two-space indents, one object a document).
fn object_of(doc: &str) -> Option<(String, String, String)> {
    let mut kind = None;
    let (mut name, mut ns, mut in_meta) = (None, String::new(), false);
    for line in doc.lines() {
        if let Some(k) = line.strip_prefix("kind: ") {
            kind = Some(k.trim().to_string());
        }
        if line.starts_with("metadata:") {
            in_meta = true;
            continue;
        }
        if in_meta {
            if !line.starts_with("  ") {
                in_meta = false;
            } else if let Some(n) = line.strip_prefix("  name: ") {
                name = Some(n.trim().to_string());
            } else if let Some(n) = line.strip_prefix("  namespace: ") {
                ns = n.trim().to_string();
            }
        }
    }
    Some((kind?, ns, name?))
}

on_releases!(the_chart_installs_upgrades_heals_and_uninstalls:
    the_chart_installs_upgrades_heals_and_uninstalls_on_1_37 = V1_37,
);
