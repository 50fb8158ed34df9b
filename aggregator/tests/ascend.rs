//! Issue 30, end to end on Ascend: a node whose pods hold NPUs (`huawei.com/Ascend910`,
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
    let w = Scenario::new()
        .node(NodeFixture::shared("asc").ready(true))
        .pod(PodFixture::new("cpu-only", "asc"))
        .unlisted()
        .start()
        .await;
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
