//! Whatever the agent calls failed is published failed within 5 s under the
//! default rules and acted on, NVIDIA and Ascend alike. The table is every reason the
//! agent's classifier, Xid policy and Ascend table can fail a device with
//! (`classify::failed_reasons`), so a reason added there lands here without anyone
//! listing it; a reason this test cannot produce fails it.
//!
//! The real agents: the simulator for the NVIDIA reasons (its Xids go through the
//! agent's Xid policy), the C double of libdcmi for the Ascend ones (codes graded by the
//! agent's table, the health level, RoCE network health). The aggregator on default
//! rules, remediation enforced, against the Kubernetes API test server.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use faultline_common::ascend::{Catalog, UB_PORT_DOWN, UB_PORT_DOWN_REASON};
use faultline_common::ascend_escalation::Escalation;
use faultline_common::classify::{
    failed_reasons, recovery_verdict, GPU_LOST, PCIE_LINK_DOWN, RECOVERY_PREFIX, ROCE_LINK_DOWN,
    ROW_REMAP_FAILURE, VENDOR_HEALTH_CRITICAL,
};
use faultline_common::{DeviceStatus, NodeHealth, RecoveryAction, XidPolicy};
use support::*;

/// How the test makes a device fail with one reason.
#[derive(Debug)]
enum Cause {
    /// A fault the NVIDIA simulator shows: the body of `POST /v1/sim/faults` without
    /// the device.
    Sim(String),
    /// A DCMI chip's state lines, without the `card.N.chip.0.` prefix.
    Chip(String),
}

fn cause(reason: &str, catalog: &Catalog) -> Cause {
    if reason.starts_with(RECOVERY_PREFIX) {
        // The NVML value is the action's index.
        let v = RecoveryAction::ALL
            .into_iter()
            .position(|a| recovery_verdict(a).is_some_and(|(code, _, _)| code == reason))
            .unwrap_or_else(|| panic!("no NVML value gives {reason}"));
        return Cause::Sim(format!(r#""fault":"recovery","value":{v}"#));
    }
    if let Some(xid) = reason.strip_prefix("xid-") {
        return Cause::Sim(format!(r#""fault":"xid","xid":{xid}"#));
    }
    match reason {
        GPU_LOST => Cause::Sim(r#""fault":"lost""#.into()),
        // Power stays up: with almost none, the npu-offline correlation names the fault.
        PCIE_LINK_DOWN => Cause::Sim(r#""fault":"pcie-down","value":300"#.into()),
        ROW_REMAP_FAILURE => Cause::Sim(r#""fault":"row-remap-failure""#.into()),
        VENDOR_HEALTH_CRITICAL => Cause::Chip("health=3".into()),
        ROCE_LINK_DOWN => Cause::Chip("net_health=3".into()),
        // One chip's of several: the plugin separates it (all of them: sub-health).
        UB_PORT_DOWN_REASON => Cause::Chip(format!("errorcodes={UB_PORT_DOWN}")),
        // A frequency rule met: the agent below counts 80E18405 once for it.
        "ascend-manually-separate-npu" => Cause::Chip("errorcodes=80E18405".into()),
        _ => {
            let code = catalog
                .rows()
                .find(|(_, r)| r.reason == reason && r.status == DeviceStatus::Failed)
                .map(|(c, _)| c)
                .unwrap_or_else(|| {
                    panic!("no way to fail a device with {reason}: teach this test")
                });
            Cause::Chip(format!("errorcodes={code:08X}"))
        }
    }
}

async fn health(agent: &faultline_agent::Agent) -> NodeHealth {
    let (status, body) = call(
        "GET",
        &format!("http://{}/v1/health", agent.addr),
        None,
        String::new(),
    )
    .await;
    assert_eq!(status, 200);
    serde_json::from_value(body).unwrap()
}

/// The device plugin's name of chip `id` (`npu3` -> `Ascend910-3`): what the kubelet
/// reports a pod holds.
fn npu_resource_id(id: &str) -> String {
    format!("Ascend910-{}", id.strip_prefix("npu").unwrap())
}

/// The agent's document once it serves `n` devices, all healthy.
async fn healthy(agent: &faultline_agent::Agent, n: usize) -> NodeHealth {
    let start = Instant::now();
    loop {
        let d = health(agent).await;
        if d.npus.len() == n && d.summary.healthy as usize == n {
            return d;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{d:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pod on `node` asking for one `resource`, the kubelet saying it holds `id`.
fn pod_holding(name: &str, node: &str, resource: &str, id: &str) -> serde_json::Value {
    PodFixture::new(name, node)
        .asks(resource)
        .holds_of(resource, id, "Healthy")
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_reason_the_agent_fails_a_device_with_is_published_at_once_and_acted_on() {
    let catalog = Catalog::builtin();
    let reasons = failed_reasons(&XidPolicy::default(), catalog, Escalation::builtin());
    let (mut sim, mut chips) = (Vec::new(), Vec::new());
    for r in &reasons {
        match cause(r, catalog) {
            Cause::Sim(body) => sim.push((r.clone(), body)),
            Cause::Chip(lines) => chips.push((r.clone(), lines)),
        }
    }
    assert!(sim.len() >= 30 && chips.len() >= 5, "{sim:?} {chips:?}");

    // nv: one simulated GPU per NVIDIA reason and one that stays healthy; asc: one
    // DCMI chip (a card each) per Ascend reason and one that stays healthy.
    let dir = tempfile::tempdir().unwrap();
    let (lib, state) = fake_dcmi_in(dir.path());
    // MindCluster's format, one occurrence enough (the built-in rules count two or more
    // within a day; the agent's tests walk them).
    let escalation = dir.path().join("faultCustomization.json");
    std::fs::write(
        &escalation,
        r#"{"FaultFrequency": [{"EventId": ["80E18405"], "TimeWindow": 86400, "Times": 1, "FaultHandling": "ManuallySeparateNPU"}]}"#,
    )
    .unwrap();
    let cards = chips.len() + 1;
    std::fs::write(&state, format!("card_count={cards}\n")).unwrap();
    let nv_devices = (sim.len() + 1).to_string();
    let nv = agent_from(
        "nv",
        &[
            "--source",
            "sim",
            "--sim-devices",
            &nv_devices,
            "--interval",
            "100ms",
        ],
    )
    .await;
    let asc = agent_from(
        "asc",
        &[
            "--source",
            "dcmi",
            "--dcmi-lib",
            lib.to_str().unwrap(),
            "--roce-link-down",
            "failed",
            "--ascend-fault-customization",
            escalation.to_str().unwrap(),
            "--interval",
            "100ms",
            "--timeout",
            "3s",
        ],
    )
    .await;
    let w = Scenario::new()
        .node(NodeFixture::shared("nv").ready(true))
        .node(NodeFixture::shared("asc").ready(true))
        .unlisted()
        .start()
        .await;
    let server = &w.server;

    // Every device's id (and the UUID a GPU's pod is said to hold), once each agent
    // has read them all healthy.
    let nv_doc = healthy(&nv, sim.len() + 1).await;
    let asc_doc = healthy(&asc, cards).await;
    let gpus: Vec<(String, String)> = nv_doc
        .npus
        .iter()
        .map(|d| (d.reading.id.clone(), d.reading.uuid.clone().unwrap()))
        .collect();
    let npus: Vec<String> = asc_doc.npus.iter().map(|d| d.reading.id.clone()).collect();
    for (i, (_, uuid)) in gpus.iter().enumerate() {
        let pod = pod_holding(&format!("nv-{i}"), "nv", "nvidia.com/gpu", uuid);
        server.create("pods", "default", pod).unwrap();
    }
    for (i, id) in npus.iter().enumerate() {
        let pod = pod_holding(
            &format!("asc-{i}"),
            "asc",
            "huawei.com/Ascend910",
            &npu_resource_id(id),
        );
        server.create("pods", "default", pod).unwrap();
    }

    let flag = format!("nv=http://{},asc=http://{}", nv.addr, asc.addr);
    let agg = w
        .healing("r1")
        .args(&["--agents", &flag, "--max-evictions-per-minute", "0"])
        .start()
        .await;
    until(
        Duration::from_secs(10),
        "both nodes published healthy",
        || {
            let ok = |node: &str, n: usize| {
                node_entry(server, 1, node)
                    .is_some_and(|e| e.npus.len() == n && e.summary.healthy == n as u32)
            };
            (ok("nv", gpus.len()) && ok("asc", npus.len())).then_some(())
        },
    )
    .await;

    // The faults, all at once: each GPU but the last its reason, each chip but the
    // last its own.
    let mut want: BTreeMap<(&str, String), String> = BTreeMap::new();
    for (i, (reason, body)) in sim.iter().enumerate() {
        let id = &gpus[i].0;
        inject(&nv, &format!(r#"{{"device":"{id}",{body}}}"#)).await;
        want.insert(("nv", id.clone()), reason.clone());
    }
    let mut lines = format!("card_count={cards}\n");
    for (i, (reason, line)) in chips.iter().enumerate() {
        lines.push_str(&format!("card.{i}.chip.0.{line}\n"));
        want.insert(("asc", npus[i].clone()), reason.clone());
    }
    std::fs::write(&state, lines).unwrap();

    // Published failed, each with its own reason, within 5 s.
    let (_, took) = until(Duration::from_secs(5), "every fault published", || {
        let published = |node: &str| {
            node_entry(server, 1, node)
                .map(|e| e.npus)
                .unwrap_or_default()
        };
        let (nv_pub, asc_pub) = (published("nv"), published("asc"));
        want.iter()
            .all(|((node, id), reason)| {
                let list = if *node == "nv" { &nv_pub } else { &asc_pub };
                list.iter().any(|d| {
                    &d.id == id
                        && d.status == DeviceStatus::Failed
                        && d.reason.as_deref() == Some(reason.as_str())
                })
            })
            .then_some(())
    })
    .await;
    eprintln!(
        "{} reasons published failed {:?} after the faults",
        want.len(),
        took
    );
    // NVML's recovery action, beside its reason, in the entry.
    let nv_pub = node_entry(server, 1, "nv").unwrap().npus;
    let repairs: Vec<(&String, RecoveryAction)> = want
        .iter()
        .filter_map(|((_, id), reason)| {
            let name = reason.strip_prefix(RECOVERY_PREFIX)?;
            Some((id, RecoveryAction::named(name).unwrap()))
        })
        .collect();
    assert_eq!(repairs.len(), 6, "every failing action: {repairs:?}");
    for (id, action) in &repairs {
        let d = nv_pub.iter().find(|d| &&d.id == id).unwrap();
        assert_eq!(d.recovery_action, Some(*action), "{id}");
    }

    // Acted on: each node quarantined once, its record naming every failed device,
    // every pod holding one evicted once, the pods of the healthy devices kept.
    until(
        Duration::from_secs(20),
        "every pod on a failed device evicted",
        || {
            let evicted_nv = (0..sim.len()).all(|i| evicted_once(server, &format!("nv-{i}")));
            let evicted_asc = (0..chips.len()).all(|i| evicted_once(server, &format!("asc-{i}")));
            (evicted_nv && evicted_asc).then_some(())
        },
    )
    .await;
    for node in ["nv", "asc"] {
        assert_eq!(our_taints(server, node), 1, "{node}");
        let rec = record(server, node).unwrap();
        for ((n, id), reason) in &want {
            if *n == node {
                let listed = rec["devices"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|d| d["id"] == id.as_str() && d["reason"] == reason.as_str());
                assert!(
                    listed.is_some(),
                    "{node}/{id} ({reason}) in the record {rec}"
                );
                // The repair the driver asked for, kept with the device.
                if let Some(name) = reason.strip_prefix(RECOVERY_PREFIX) {
                    assert_eq!(listed.unwrap()["recovery_action"], name, "{rec}");
                }
            }
        }
    }
    assert_eq!(evictions(server, &format!("nv-{}", sim.len())), 0);
    assert_eq!(evictions(server, &format!("asc-{}", chips.len())), 0);
    assert_no_forbidden(server);
    drop(agg);
}
