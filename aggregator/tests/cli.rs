//! The CLI as SREs run it: `kubectl faultline` (the `kubectl-faultline` binary found by
//! kubectl on $PATH, as `pkg/cmd/plugin` finds plugins) against the test API server,
//! with a kubeconfig whose current context is wrong: `--context` and `-n` are honoured,
//! `describe` shows a quarantined node's devices and record, `agents` its agents and
//! sources, and `-o json|yaml|wide` print what kubectl users expect.

mod support;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use support::*;

fn have_kubectl(test: &str) -> bool {
    faultline_common::testing::have_tool(
        test,
        "kubectl",
        &["version", "--client"],
        "kubernetes-client",
    )
}

/// A kubeconfig with two contexts: `broken` (current; nothing listens there) and
/// `test` (the API server at `kube`, with the administrator's token file).
fn kubeconfig(dir: &Path, kube: &str) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1
kind: Config
current-context: broken
clusters:
- name: broken
  cluster: {{server: 'http://127.0.0.1:9'}}
- name: test
  cluster: {{server: '{kube}'}}
users:
- name: admin
  user: {{tokenFile: '{}'}}
contexts:
- name: broken
  context: {{cluster: broken, user: admin}}
- name: test
  context: {{cluster: test, user: admin}}
",
        admin_token_file().display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A directory holding the `faultline` binary under the plugin's name, as an install
/// puts it (`cp faultline kubectl-faultline`).
fn plugin_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            env!("CARGO_BIN_EXE_faultline"),
            dir.path().join("kubectl-faultline"),
        )
        .unwrap();
        dir
    })
    .path()
}

/// `kubectl faultline ARGS` with the plugin's directory first on $PATH.
async fn kubectl_faultline(kubeconfig: &Path, args: &[&str]) -> Output {
    let path = format!(
        "{}:{}",
        plugin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = tokio::process::Command::new("kubectl")
        .arg("faultline")
        .args(args)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("FAULTLINE_KUBE_SERVER")
        .env_remove("FAULTLINE_NAMESPACE")
        .output();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("kubectl faultline within 60 s")
        .unwrap()
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "kubectl faultline failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_faultline_describes_nodes_and_agents_in_the_chosen_context() {
    if !have_kubectl("kubectl_faultline_describes_nodes_and_agents_in_the_chosen_context") {
        return;
    }
    let w = Scenario::new()
        .nodes(["n1", "n2"].map(|n| NodeFixture::new(n).ready(true)))
        .agents()
        .start()
        .await;
    let (server, kube) = (&w.server, &w.kube);
    let _agg = w.healing("r1").start().await;
    fail(w.agent("n1"), "gpu1").await;
    // The driver asks for a GPU reset of gpu2 (NVML's recovery action 1).
    inject(
        w.agent("n1"),
        r#"{"device":"gpu2","fault":"recovery","value":1}"#,
    )
    .await;
    until(
        Duration::from_secs(15),
        "n1 quarantined and published, n2 published",
        || {
            let node = server.get("nodes", "", "n1")?;
            let cm = server.get("configmaps", NS, "faultline-shard-0")?;
            // n2's first reading may land a pass after n1's quarantine (CI, a busy
            // machine): `agents` below lists both.
            cm["data"]["n2.json"].as_str()?;
            let entry: Value = serde_json::from_str(cm["data"]["n1.json"].as_str()?).ok()?;
            let failed = entry["npus"][1]["status"] == "failed"
                && entry["npus"][2]["recovery_action"] == "gpu-reset";
            let sources = entry["agent"]["sources"][0]["name"] == "sim";
            let record = node["metadata"]["annotations"]["faultline.io/quarantine"].as_str()?;
            (record.contains("\"recovery_action\":\"gpu-reset\"") && failed && sources)
                .then_some(())
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let kc = kubeconfig(dir.path(), kube);

    // The current context points nowhere: without --context the plugin fails, naming
    // the connection; with it, it reads the test server.
    let wrong = kubectl_faultline(&kc, &["agents"]).await;
    assert!(
        !wrong.status.success(),
        "the current context is unreachable"
    );

    let text = stdout(&kubectl_faultline(&kc, &["--context", "test", "describe", "n1"]).await);
    assert!(text.starts_with("Node:        n1\n"), "{text}");
    assert!(
        text.contains("faultline/faultline-shard-0 (shard 0 of 1"),
        "{text}"
    );
    let gpu1 = text
        .lines()
        .find(|l| l.trim_start().starts_with("gpu1 "))
        .unwrap_or_else(|| panic!("no gpu1 row: {text}"));
    let cols: Vec<&str> = gpu1.split_whitespace().collect();
    assert_eq!(
        (cols[1], cols[3]),
        ("failed", "row-remap-failure"),
        "{gpu1}"
    );
    assert!(text.contains("Sources:     sim (up)"), "{text}");
    assert!(text.contains("Quarantine:\n  Since:"), "{text}");
    assert!(
        text.contains("  Device:    gpu1 row-remap-failure"),
        "{text}"
    );
    // The repair the driver asks for: in the devices' table and the record.
    let gpu2 = text
        .lines()
        .find(|l| l.trim_start().starts_with("gpu2 "))
        .unwrap_or_else(|| panic!("no gpu2 row: {text}"));
    let cols: Vec<&str> = gpu2.split_whitespace().collect();
    assert_eq!(
        (cols[3], cols[8]),
        ("recovery-gpu-reset", "gpu-reset"),
        "{gpu2}"
    );
    assert!(
        text.contains("  Device:    gpu2 recovery-gpu-reset (said by agent), repair: gpu-reset"),
        "{text}"
    );
    assert!(text.contains(":NoSchedule (faultline)"), "{text}");

    // -o json: the same view, whole.
    let json: Value = serde_json::from_str(&stdout(
        &kubectl_faultline(&kc, &["--context", "test", "describe", "n1", "-o", "json"]).await,
    ))
    .unwrap();
    assert_eq!(json["published"]["npus"][1]["status"], "failed");
    assert_eq!(json["quarantine"]["devices"][0]["id"], "gpu1");
    assert_eq!(json["shard"]["writer"], "r1");

    // agents -o yaml: both agents, reachable, with their sources.
    let yaml: Value = serde_yaml_ng::from_str(&stdout(
        &kubectl_faultline(&kc, &["--context", "test", "-o", "yaml", "agents"]).await,
    ))
    .unwrap();
    let nodes: Vec<&str> = yaml
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["node"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["n1", "n2"]);
    assert_eq!(yaml[0]["agent"]["reachable"], true);
    assert_eq!(yaml[0]["agent"]["sources"][0]["name"], "sim");
    assert_eq!(yaml[0]["summary"]["failed"], 2, "gpu1 and gpu2");

    // agents -o wide: kubectl's columns, the wide ones added.
    let wide =
        stdout(&kubectl_faultline(&kc, &["--context", "test", "agents", "-o", "wide"]).await);
    let header: Vec<&str> = wide.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NODE",
            "REACHABLE",
            "DEVICES",
            "FAILED",
            "SOURCES",
            "SHARD",
            "LAST-SEEN",
            "ERROR"
        ]
    );
    let n1: Vec<&str> = wide.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&n1[..6], ["n1", "true", "4", "2", "sim", "0"], "{wide}");

    // status -o json: the record and the breaker.
    let json: Value = serde_json::from_str(&stdout(
        &kubectl_faultline(&kc, &["--context", "test", "status", "-o", "json"]).await,
    ))
    .unwrap();
    assert_eq!(json["breaker"]["state"], "closed");
    assert_eq!(json["quarantined"][0]["node"], "n1");

    // -n: another namespace publishes nothing.
    let other =
        stdout(&kubectl_faultline(&kc, &["--context", "test", "-n", "elsewhere", "agents"]).await);
    assert_eq!(
        other.trim(),
        "no agents published in elsewhere (is the aggregator running with --sink configmap?)"
    );

    // --kubeconfig overrides $KUBECONFIG; a missing node is an error that says so.
    let missing = kubectl_faultline(
        Path::new("/nonexistent"),
        &[
            "--kubeconfig",
            kc.to_str().unwrap(),
            "--context",
            "test",
            "describe",
            "n9",
        ],
    )
    .await;
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("node \"n9\" not found"), "{err}");
}
