//! End to end on Ascend: a node whose pods hold NPUs (`huawei.com/Ascend910`,
//! the kubelet naming each by the device plugin's name, `Ascend910-<physical id>`), its
//! agent reading the chips through the C double of libdcmi or the fake `npu-smi`, and
//! the aggregator on default rules with the ConfigMap sink and remediation enforced,
//! against the Kubernetes API test server. A SeparateNPU chip is tainted and only the
//! pods holding it are evicted; a RestartNPU chip is failed and handled alike (what
//! docs/ascend.md says); a hung DCMI call or npu-smi is Unknown and evicts nothing.

mod support;

use std::path::Path;
use std::time::Duration;

use faultline_common::DeviceStatus;
use support::*;

/// Chips on the node, one pod holding each.
const CHIPS: usize = 4;

/// A SeparateNPU code (faultCode.json) and a RestartNPU one.
const SEPARATE: &str = "80818C00";
const RESTART: &str = "80A18008";

/// A running pod on `asc` asking for one `huawei.com/Ascend910`, the kubelet saying it
/// holds `Ascend910-<chip>`.
fn npu_pod(chip: usize) -> serde_json::Value {
    const NPU: &str = "huawei.com/Ascend910";
    PodFixture::new(&format!("asc-{chip}"), "asc")
        .asks(NPU)
        .holds_of(NPU, &format!("Ascend910-{chip}"), "Healthy")
        .build()
}

/// The cluster: node `asc` with a pod on each chip and one without an NPU; the
/// aggregator following `agent` with `extra` flags. Returns once every chip is
/// published healthy.
async fn cluster(
    agent: &faultline_agent::Agent,
    extra: &[&str],
) -> (World, faultline_aggregator::Aggregator) {
    cluster_of(agent, extra, NodeFixture::shared("asc"), None).await
}

/// [`cluster`] with this node, and where `component` names one, that component's RBAC
/// (`deploy/components/<c>`).
async fn cluster_of(
    agent: &faultline_agent::Agent,
    extra: &[&str],
    node: NodeFixture,
    component: Option<&'static str>,
) -> (World, faultline_aggregator::Aggregator) {
    let mut scenario = Scenario::new()
        .node(node.ready(true))
        .pod(PodFixture::new("cpu-only", "asc"))
        .unlisted();
    if let Some(c) = component {
        scenario = scenario.component(c);
    }
    let w = scenario.start().await;
    for chip in 0..CHIPS {
        w.server.create("pods", "default", npu_pod(chip)).unwrap();
    }
    let flag = format!("asc=http://{}", agent.addr);
    let mut args = vec!["--agents", flag.as_str()];
    args.extend_from_slice(extra);
    let agg = w.healing("r1").args(&args).start().await;
    until(
        Duration::from_secs(15),
        "every chip published healthy",
        || {
            node_entry(&w.server, 1, "asc")
                .is_some_and(|e| e.npus.len() == CHIPS && e.summary.healthy as usize == CHIPS)
                .then_some(())
        },
    )
    .await;
    (w, agg)
}

/// The published status and reason of chip `npu<chip>`.
fn published(w: &World, chip: usize) -> Option<(DeviceStatus, Option<String>)> {
    let id = format!("npu{chip}");
    node_entry(&w.server, 1, "asc")?
        .npus
        .into_iter()
        .find(|d| d.id == id)
        .map(|d| (d.status, d.reason))
}

/// The pods the quarantine record says were evicted, as `namespace/name` (the record
/// keys each by its UID too).
fn evicted(w: &World) -> Vec<String> {
    record(&w.server, "asc")
        .and_then(|r| serde_json::from_value::<Vec<String>>(r["evicted"].clone()).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|k| k.splitn(3, '/').take(2).collect::<Vec<_>>().join("/"))
        .collect()
}

/// A SeparateNPU code on chip 1 taints the node and evicts the pod holding it, and
/// only that pod; then a RestartNPU code on chip 2 fails that chip too and evicts its
/// pod (docs/ascend.md: RestartNPU fails the chip), nothing else.
async fn separate_then_restart(w: &World, set_code: impl Fn(usize, &str)) {
    let mut evicted_so_far: Vec<String> = Vec::new();
    for (chip, code, reason) in [
        (1, SEPARATE, "ascend-separate-npu"),
        (2, RESTART, "ascend-restart-npu"),
    ] {
        set_code(chip, code);
        // Published (the page write may land a little after the eviction) and acted on.
        let failed = Some((DeviceStatus::Failed, Some(reason.to_string())));
        let pod = format!("asc-{chip}");
        evicted_so_far.push(format!("default/{pod}"));
        until(
            Duration::from_secs(10),
            &format!("npu{chip} published failed, {pod} evicted"),
            || {
                (published(w, chip) == failed && evicted(w).contains(&format!("default/{pod}")))
                    .then_some(())
            },
        )
        .await;
        assert_eq!(our_taints(&w.server, "asc"), 1, "one taint for every chip");
        assert_eq!(evicted(w), evicted_so_far);
        for p in &evicted_so_far {
            let name = p.trim_start_matches("default/");
            assert!(evicted_once(&w.server, name), "{name}");
        }
        for other in ["asc-0", "asc-2", "asc-3", "cpu-only"] {
            if !evicted_so_far.iter().any(|p| p.ends_with(other)) {
                assert_eq!(evictions(&w.server, other), 0, "{other}");
            }
        }
    }
    let rec = record(&w.server, "asc").unwrap();
    let ids: Vec<&str> = rec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    assert_eq!(ids, ["npu1", "npu2"], "{rec}");
    assert_no_forbidden(&w.server);
}

async fn dcmi_agent(lib: &Path) -> faultline_agent::Agent {
    let flags = [
        "--source",
        "dcmi",
        "--dcmi-lib",
        lib.to_str().unwrap(),
        "--interval",
        "100ms",
        "--timeout",
        "1s",
        "--cache-ttl",
        "2s",
    ];
    agent_from("asc", &flags).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dcmi_a_separated_chip_is_tainted_and_only_its_pods_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let (lib, state) = fake_dcmi_in(dir.path());
    let base = format!("card_count={CHIPS}\n");
    std::fs::write(&state, &base).unwrap();
    let agent = dcmi_agent(&lib).await;
    let (w, _agg) = cluster(&agent, &[]).await;
    let codes = std::sync::Mutex::new(base);
    separate_then_restart(&w, |chip, code| {
        let mut s = codes.lock().unwrap();
        s.push_str(&format!("card.{chip}.chip.0.errorcodes={code}\n"));
        std::fs::write(&state, s.as_str()).unwrap();
    })
    .await;
}

/// Huawei's device plugin's ConfigMap for node `asc` as the plugin writes it
/// (component/ascend-device-plugin/pkg/kubeclient/client_server.go
/// `WriteDeviceInfoDataIntoCM`, the default card type): its device list, the chips it
/// separated for good (`separated`), the upgrade reasons and the sunset notice, labelled
/// for its consumers.
fn device_info(separated: &str) -> serde_json::Value {
    let info = serde_json::json!({
        "DeviceInfo": {
            "DeviceList": {
                "huawei.com/Ascend910": "Ascend910-0,Ascend910-2,Ascend910-3",
                "huawei.com/Ascend910-Unhealthy": separated,
                "huawei.com/Ascend910-NetworkUnhealthy": "",
                "huawei.com/Ascend910-Fault": "[]"
            },
            "UpdateTime": 1_764_900_000
        },
        "SuperPodID": -1,
        "ServerIndex": -1,
        "CheckCode": "6b2a2bd1c5a0d1e1e0b5f6a3c4d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4"
    });
    serde_json::json!({
        "metadata": {
            "name": "mindx-dl-deviceinfo-asc",
            "namespace": "kube-system",
            "labels": {"mx-consumer-cim": "true"}
        },
        "data": {
            "DeviceInfoCfg": info.to_string(),
            "ManuallySeparateNPU": separated,
            "UpgradeFaultReason": "{}",
            "Description": "The field[xxx.com/xxx] is sunset."
        }
    })
}

/// A node of CHIPS `huawei.com/Ascend910` chips, all in allocatable (only the plugin's
/// list can tell a chip is out), its agent reading the C double of libdcmi, the
/// aggregator with `--ascend-device-info=true` (and the component's RBAC where
/// `component`), the plugin's ConfigMap listing `separated`; then chip 1 gets a
/// SeparateNPU code. The directory holding the double must outlive the test.
async fn chip_1_fails_with_the_plugins_list(
    dir: &Path,
    separated: &str,
    component: Option<&'static str>,
) -> (
    World,
    faultline_aggregator::Aggregator,
    faultline_agent::Agent,
) {
    let (lib, state) = fake_dcmi_in(dir);
    let base = format!("card_count={CHIPS}\n");
    std::fs::write(&state, &base).unwrap();
    let agent = dcmi_agent(&lib).await;
    let node =
        NodeFixture::shared("asc").devices("huawei.com/Ascend910", CHIPS as u32, CHIPS as u32);
    let (w, agg) = cluster_of(&agent, &["--ascend-device-info=true"], node, component).await;
    w.server
        .create("configmaps", "kube-system", device_info(separated))
        .unwrap();
    std::fs::write(
        &state,
        format!("{base}card.1.chip.0.errorcodes={SEPARATE}\n"),
    )
    .unwrap();
    (w, agg, agent)
}

/// On a node whose chips are Huawei's device plugin's
/// (`huawei.com/Ascend910`, 4 in capacity and all still in allocatable, so only the
/// plugin's list tells), a chip the plugin lists in `ManuallySeparateNPU` is its
/// isolation: no taint, the record says so, only the chip's pod is evicted, and
/// `fault.json` marks the chip. The aggregator runs under the deploy RBAC plus
/// deploy/components/ascend-device-plugin (get on ConfigMaps in kube-system), enforced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chip_the_plugin_separated_by_hand_gets_no_second_isolation() {
    let dir = tempfile::tempdir().unwrap();
    let (w, agg, _agent) =
        chip_1_fails_with_the_plugins_list(dir.path(), "Ascend910-1", Some("ascend-device-plugin"))
            .await;
    let rec = until(
        Duration::from_secs(10),
        "npu1 recorded as the plugin's isolation, asc-1 evicted",
        || {
            record(&w.server, "asc").filter(|r| {
                r["isolation"]["by"] == "manually-separate-npu"
                    && evicted(&w).contains(&"default/asc-1".to_string())
            })
        },
    )
    .await
    .0;
    assert_eq!(
        rec["isolation"]["resource"], "huawei.com/Ascend910",
        "{rec}"
    );
    assert_eq!(our_taints(&w.server, "asc"), 0, "no taint of faultline's");
    assert_eq!(evicted(&w), ["default/asc-1"]);
    assert!(evicted_once(&w.server, "asc-1"));
    for other in ["asc-0", "asc-2", "asc-3", "cpu-only"] {
        assert_eq!(evictions(&w.server, other), 0, "{other}");
    }
    let labels = &w.server.get("nodes", "", "asc").unwrap()["metadata"]["labels"];
    assert_eq!(
        labels["faultline.io/quarantine-scope"], "device",
        "{labels}"
    );
    let (entry, _) = until(Duration::from_secs(20), "npu1 marked in fault.json", || {
        node_entry(&w.server, 1, "asc").filter(|e| e.npus.iter().any(|d| d.quarantine.is_some()))
    })
    .await;
    let marked: Vec<(&str, &str, Option<&str>)> = entry
        .npus
        .iter()
        .filter_map(|d| {
            let m = d.quarantine.as_ref()?;
            Some((d.id.as_str(), m.by.as_str(), m.detail.as_deref()))
        })
        .collect();
    assert_eq!(
        marked,
        [(
            "npu1",
            "manually-separate-npu",
            Some("huawei.com/Ascend910")
        )]
    );
    metric_until(
        agg.addr,
        "faultline_aggregator_devices_isolated{node=\"asc\",driver=\"huawei.com/Ascend910\",by=\"manually-separate-npu\"} 1",
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(events(&w.server, "FaultlineDeviceQuarantined"), 1);
    assert_no_forbidden(&w.server);
    // The plugin's ConfigMap cannot be read for a while (API Priority and Fairness
    // answers 429): passes go on counting the failed reads, and the record stays the
    // plugin's isolation, untainted, with no second action.
    w.server.set_faults(faultline_test_apiserver::Faults {
        throttle_rate: 1.0,
        throttle_match: "mindx-dl-deviceinfo".into(),
        ..Default::default()
    });
    let text = metric_until(
        agg.addr,
        "faultline_aggregator_remediation_errors_total{kind=\"ascend\"} 2",
        Duration::from_secs(30),
    )
    .await;
    assert!(text.contains("by=\"manually-separate-npu\"} 1"), "{text}");
    let kept = record(&w.server, "asc").unwrap();
    assert_eq!(kept["isolation"], rec["isolation"], "{kept}");
    assert_eq!(our_taints(&w.server, "asc"), 0);
    assert_eq!(events(&w.server, "FaultlineDeviceQuarantined"), 1);
}

/// The plugin's list names another chip (`Ascend910-3`) and the allocatable is whole:
/// nothing keeps npu1 from new pods but faultline, so the node is tainted as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chip_the_plugin_did_not_separate_takes_the_node_path() {
    let dir = tempfile::tempdir().unwrap();
    let (w, _agg, _agent) =
        chip_1_fails_with_the_plugins_list(dir.path(), "Ascend910-3", Some("ascend-device-plugin"))
            .await;
    until(
        Duration::from_secs(10),
        "asc tainted, asc-1 evicted",
        || (our_taints(&w.server, "asc") == 1 && evicted(&w) == ["default/asc-1"]).then_some(()),
    )
    .await;
    let rec = record(&w.server, "asc").unwrap();
    assert!(rec["isolation"].is_null(), "{rec}");
    assert_no_forbidden(&w.server);
}

/// The flag without its component's RBAC: the read of the plugin's ConfigMap is refused
/// (403), logged and counted, and the chip takes the node path as if no list were there:
/// a refused read never leaves a failed chip without isolation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_read_of_the_plugins_list_takes_the_node_path() {
    let dir = tempfile::tempdir().unwrap();
    let (w, agg, _agent) =
        chip_1_fails_with_the_plugins_list(dir.path(), "Ascend910-1", None).await;
    until(
        Duration::from_secs(10),
        "asc tainted, asc-1 evicted",
        || (our_taints(&w.server, "asc") == 1 && evicted(&w) == ["default/asc-1"]).then_some(()),
    )
    .await;
    metric_until(
        agg.addr,
        "faultline_aggregator_remediation_errors_total{kind=\"ascend\"}",
        Duration::from_secs(5),
    )
    .await;
    let rec = record(&w.server, "asc").unwrap();
    assert!(rec["isolation"].is_null(), "{rec}");
}

/// The fake npu-smi in `t` serving the first CHIPS rows of a real 910B table
/// (davinci0..3, each NPU its chip 0), and an agent reading it.
async fn npu_smi_agent(t: &Path) -> faultline_agent::Agent {
    let rows = 6 + 3 * CHIPS;
    let table: String =
        std::fs::read_to_string(repo_root().join("tests/data/npu-smi/info_910b_8.txt"))
            .unwrap()
            .lines()
            .take(rows)
            .map(|l| format!("{l}\n"))
            .collect();
    std::fs::write(t.join("info.txt"), table).unwrap();
    let dev = t.join("dev");
    std::fs::create_dir(&dev).unwrap();
    for chip in 0..CHIPS {
        std::fs::write(dev.join(format!("davinci{chip}")), "").unwrap();
    }
    std::fs::write(dev.join("davinci_manager"), "").unwrap();
    // The agent runs npu-smi as a child; the fake reads its directory from the
    // environment, which this process shares with other tests: a wrapper sets it.
    let smi = t.join("npu-smi");
    std::fs::write(
        &smi,
        format!(
            "#!/bin/sh\nFAKE_TOOL_DIR='{}' exec '{}' \"$@\"\n",
            t.display(),
            repo_root().join("tests/fixtures/bin/npu-smi").display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    agent_from(
        "asc",
        &[
            "--source",
            "npu-smi",
            "--npu-smi",
            smi.to_str().unwrap(),
            "--davinci-dir",
            dev.to_str().unwrap(),
            "--interval",
            "100ms",
            "--timeout",
            "3s",
            "--cache-ttl",
            "5s",
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn npu_smi_a_separated_chip_is_tainted_and_only_its_pods_evicted() {
    let tools = tempfile::tempdir().unwrap();
    let t = tools.path();
    let agent = npu_smi_agent(t).await;
    let (w, _agg) = cluster(&agent, &[]).await;
    // npu-smi asks `-t health` for the codes of the chips its table shows not OK (a
    // process per chip): the fault shows in both, as on a real host.
    let table = std::sync::Mutex::new(std::fs::read_to_string(t.join("info.txt")).unwrap());
    separate_then_restart(&w, |chip, code| {
        let mut tab = table.lock().unwrap();
        *tab = tab
            .lines()
            .map(|l| {
                if l.starts_with(&format!("| {chip}     910B3")) {
                    format!("{}\n", l.replacen("| OK            |", "| Critical      |", 1))
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        std::fs::write(t.join("info.txt"), tab.as_str()).unwrap();
        let health = format!(
            "\tHealth Status                  : Critical\n\tError Code                     : {code}\n\tError Information              : NA\n"
        );
        std::fs::write(t.join(format!("health_{chip}_0.txt")), health).unwrap();
    })
    .await;
}

/// Every call of the agent's source hangs (`hang` makes it so): the chips turn unknown,
/// the unknown guard gives the node its NoSchedule taint valued `unknown` after
/// `--unknown-tolerance`, and no pod is evicted (the guard acting first makes "nothing
/// evicted" an outcome that was given its chance, not a wait that proves nothing).
async fn hung_is_unknown_and_evicts_nothing(agent: &faultline_agent::Agent, hang: impl FnOnce()) {
    // A device without fresh data turns unknown after 2 s here (30 s by default), and
    // the unknown guard acts 1 s later (5 min by default).
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, "state_machine: {unknown_after_ms: 2000}\n").unwrap();
    let (w, _agg) = cluster(
        agent,
        &[
            "--unknown-tolerance",
            "1s",
            "--rules",
            rules.to_str().unwrap(),
        ],
    )
    .await;
    hang();
    until(Duration::from_secs(20), "the unknown guard's taint", || {
        taints(&w.server, "asc")
            .iter()
            .any(|t| t["value"] == "unknown")
            .then_some(())
    })
    .await;
    for chip in 0..CHIPS {
        assert_eq!(
            published(&w, chip).map(|p| p.0),
            Some(DeviceStatus::Unknown),
            "npu{chip}"
        );
    }
    assert!(
        !taints(&w.server, "asc")
            .iter()
            .any(|t| t["value"] == "true"),
        "no failed taint"
    );
    assert!(evicted(&w).is_empty());
    for chip in 0..CHIPS {
        assert_eq!(evictions(&w.server, &format!("asc-{chip}")), 0);
    }
    assert_eq!(eviction_calls(&w.server, "asc-0", 201), 0);
    assert_no_forbidden(&w.server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_dcmi_call_is_unknown_and_evicts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (lib, state) = fake_dcmi_in(dir.path());
    std::fs::write(&state, format!("card_count={CHIPS}\n")).unwrap();
    let agent = dcmi_agent(&lib).await;
    hung_is_unknown_and_evicts_nothing(&agent, || {
        std::fs::write(&state, format!("card_count={CHIPS}\nhang_ms=30000\n")).unwrap()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_npu_smi_is_unknown_and_evicts_nothing() {
    let tools = tempfile::tempdir().unwrap();
    let t = tools.path();
    let agent = npu_smi_agent(t).await;
    hung_is_unknown_and_evicts_nothing(&agent, || {
        std::fs::write(t.join("mode"), "hang\n").unwrap()
    })
    .await;
}
