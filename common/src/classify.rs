//! The instantaneous verdict on one reading. The agent serves it as is; the aggregator
//! smooths it with windows and a state machine before anyone acts.

use serde::{Deserialize, Serialize};

use std::collections::BTreeSet;

use crate::reading::{DeviceReading, DeviceStatus, RecoveryAction, VendorHealthLevel};
use crate::xid::{XidPolicy, XidVerdict};

/// A device that no longer answers on the bus.
pub const GPU_LOST: &str = "gpu-lost";
/// A PCIe link down, or up with no lanes trained.
pub const PCIE_LINK_DOWN: &str = "pcie-link-down";
/// Row remapping failed: no spare rows left.
pub const ROW_REMAP_FAILURE: &str = "row-remap-failure";
/// The vendor's health level says critical and no graded code says more.
pub const VENDOR_HEALTH_CRITICAL: &str = "vendor-health-critical";
/// A RoCE link down (failed only where the agent's policy says so).
pub const ROCE_LINK_DOWN: &str = "roce-link-down";
/// The prefix of a recovery action's reason: `recovery-gpu-reset`, `recovery-node-reboot`.
pub const RECOVERY_PREFIX: &str = "recovery-";

/// What a recovery action the driver reports makes of the device, and why; `None`
/// for no action. Every repair that ends or resets the GPU's work fails it (the
/// driver says its processes must go); recovering the IMEX domain degrades it (the
/// repair is the domain's, not this GPU's: no eviction on that alone).
pub fn recovery_verdict(a: RecoveryAction) -> Option<(String, DeviceStatus, String)> {
    use RecoveryAction as A;
    let (status, what) = match a {
        A::None => return None,
        A::GpuReset => (
            DeviceStatus::Failed,
            "terminate its processes and reset the GPU",
        ),
        A::NodeReboot => (
            DeviceStatus::Failed,
            "reboot the node (the OS may be inconsistent)",
        ),
        A::DrainP2p => (
            DeviceStatus::Failed,
            "terminate the processes using peer-to-peer traffic, then ask again",
        ),
        A::DrainAndReset => (
            DeviceStatus::Failed,
            "drain peer-to-peer traffic, then reset the GPU",
        ),
        A::RecoverImexDomain => (DeviceStatus::Degraded, "recover the GPU's IMEX domain"),
        A::BusReset => (DeviceStatus::Failed, "reset the GPU's PCIe bus"),
        A::SystemReboot => (DeviceStatus::Failed, "reboot the system"),
    };
    Some((
        format!("{RECOVERY_PREFIX}{}", a.as_str()),
        status,
        format!("the driver's recovery action is {}: {what}", a.as_str()),
    ))
}

/// Every recovery action that fails a device, as its reason.
pub fn recovery_failed_reasons() -> impl Iterator<Item = String> {
    RecoveryAction::ALL
        .into_iter()
        .filter_map(recovery_verdict)
        .filter(|(_, s, _)| *s == DeviceStatus::Failed)
        .map(|(code, _, _)| code)
}

/// The classifier's own reasons that fail a device; the others come from the Xid
/// policy, the Ascend table and what a source reports ([`failed_reasons`]).
pub const FAILED_CODES: [&str; 5] = [
    GPU_LOST,
    PCIE_LINK_DOWN,
    ROW_REMAP_FAILURE,
    VENDOR_HEALTH_CRITICAL,
    ROCE_LINK_DOWN,
];

/// Every reason the classifier can fail a device with, given the agent's Xid policy,
/// Ascend table and escalation rules (the aggregator's tests walk this list,
/// so a reason added to the catalogs is tested without anyone listing it). Left out:
/// what a site tool reports (`--source exec`), whose reasons are the tool's own.
pub fn failed_reasons(
    xid: &XidPolicy,
    ascend: &crate::ascend::Catalog,
    esc: &crate::ascend_escalation::Escalation,
) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = FAILED_CODES.iter().map(|c| c.to_string()).collect();
    out.extend(recovery_failed_reasons());
    out.extend(
        crate::xid::catalog()
            .iter()
            .filter(|e| !xid.ignores(e.xid))
            .filter(|e| {
                xid.threshold_for(e.xid, e.class)
                    .is_some_and(|(_, s)| s == DeviceStatus::Failed)
            })
            .map(|e| format!("xid-{}", e.xid)),
    );
    out.extend(ascend.failed_reasons().into_iter().map(String::from));
    out.insert(crate::ascend::UB_PORT_DOWN_REASON.to_string());
    // The escalation rules' levels (ManuallySeparateNPU).
    out.extend(
        esc.frequency
            .iter()
            .map(|r| r.level)
            .chain(esc.duration.iter().map(|r| r.level))
            .filter(|l| l.default_status() == DeviceStatus::Failed)
            .map(|l| l.default_reason().to_string()),
    );
    out
}

/// Limits for the instantaneous verdict.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// At or above this core temperature a device is degraded (seed 003: 85 C).
    pub temp_degraded_c: f64,
    /// A RoCE link that is down fails the chip (default: degrades it).
    #[serde(default)]
    pub roce_down_failed: bool,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            temp_degraded_c: 85.0,
            roce_down_failed: false,
        }
    }
}

/// One finding about a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// Machine-readable code, e.g. `gpu-lost`, `high-temp`, `xid-79`.
    pub code: String,
    /// What this finding alone makes of the device.
    pub status: DeviceStatus,
    /// Human detail.
    pub detail: String,
}

/// The verdict: the worst status, its reason, and every finding behind it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Classification {
    /// The worst status over all findings (healthy when there are none).
    pub status: DeviceStatus,
    /// The code of the worst finding.
    pub reason: Option<String>,
    /// All findings, worst first.
    pub findings: Vec<Finding>,
}

impl Classification {
    /// A device we could not look at.
    pub fn unknown(code: &str, detail: impl Into<String>) -> Self {
        Classification {
            status: DeviceStatus::Unknown,
            reason: Some(code.to_string()),
            findings: vec![Finding {
                code: code.to_string(),
                status: DeviceStatus::Unknown,
                detail: detail.into(),
            }],
        }
    }
}

/// Classify one fresh reading, with the device's Xid verdict if it has one.
///
/// Staleness is not judged here: the caller turns a reading past its TTL into
/// [`Classification::unknown`] before calling this.
pub fn classify(r: &DeviceReading, xid: Option<&XidVerdict>, t: &Thresholds) -> Classification {
    let mut f: Vec<Finding> = Vec::new();
    let mut add = |code: &str, status: DeviceStatus, detail: String| {
        f.push(Finding {
            code: code.to_string(),
            status,
            detail,
        })
    };
    use DeviceStatus::*;

    // A chip still booting after a reset: not failed, not healthy, just not yet.
    if r.booting && !r.lost {
        return Classification::unknown(
            "booting",
            "the chip is still booting (boot status below 16)",
        );
    }
    if r.lost {
        add(
            GPU_LOST,
            Failed,
            "device lost: it no longer answers on the bus".into(),
        );
    }
    if let Some(p) = &r.pcie {
        if !p.up {
            add(PCIE_LINK_DOWN, Failed, "PCIe link is down".into());
        } else if p.width == Some(0) {
            // A link with no lanes trained carries nothing: it is down, whatever the
            // "up" flag says (NVML reports the current width as 0 then).
            add(
                PCIE_LINK_DOWN,
                Failed,
                format!(
                    "PCIe link has no lanes (x0 of x{})",
                    p.max_width.unwrap_or(0)
                ),
            );
        } else if p.width_degraded() {
            add(
                "pcie-width-degraded",
                Degraded,
                format!(
                    "PCIe link runs x{} of x{}",
                    p.width.unwrap_or(0),
                    p.max_width.unwrap_or(0)
                ),
            );
        }
    }
    if let Some(rr) = &r.remapped_rows {
        if rr.failure {
            add(
                ROW_REMAP_FAILURE,
                Failed,
                "row remapping failed: no spare rows left".into(),
            );
        } else if rr.pending {
            add(
                "row-remap-pending",
                Degraded,
                "row remap pending: GPU reset required".into(),
            );
        }
    }
    if let Some(rp) = &r.retired_pages {
        if rp.pending {
            add(
                "page-retirement-pending",
                Degraded,
                "page retirement pending: driver reload or reset required".into(),
            );
        }
    }
    if let Some(e) = &r.ecc {
        if e.volatile_uncorrected > 0 {
            add(
                "ecc-uncorrectable",
                Degraded,
                format!(
                    "{} uncorrectable ECC error(s) since driver load",
                    e.volatile_uncorrected
                ),
            );
        }
    }
    if let Some(vh) = &r.vendor_health {
        for x in vendor_findings(vh) {
            add(&x.code, x.status, x.detail);
        }
    }
    if let Some((code, status, detail)) = r.recovery_action.and_then(recovery_verdict) {
        add(&code, status, detail);
    }
    if let Some(temp) = r.temperature_c {
        if temp >= t.temp_degraded_c {
            add(
                "high-temp",
                Degraded,
                format!(
                    "temperature {temp:.1} C at or above {:.1} C",
                    t.temp_degraded_c
                ),
            );
        }
    }
    if let Some(th) = &r.throttle {
        if th.hw_power_brake {
            add(
                "power-brake",
                Degraded,
                "external power brake asserted".into(),
            );
        }
        if th.hw_thermal || th.sw_thermal {
            add(
                "thermal-slowdown",
                Degraded,
                "clocks held down for temperature".into(),
            );
        } else if th.hw_slowdown {
            add("hw-slowdown", Degraded, "hardware slowdown asserted".into());
        }
    }
    if let Some(link) = r.roce.filter(|l| !l.up) {
        add(
            ROCE_LINK_DOWN,
            if t.roce_down_failed { Failed } else { Degraded },
            format!("RoCE network health {} (0 or 6 is up)", link.result),
        );
    }
    if let Some(nv) = &r.nvlink {
        if !nv.down.is_empty() {
            add(
                "nvlink-down",
                Degraded,
                format!(
                    "{} of {} NVLink links inactive: {:?}",
                    nv.down.len(),
                    nv.total,
                    nv.down
                ),
            );
        }
    }
    if let Some(v) = xid {
        add(&v.reason, v.status, v.detail.clone());
    }
    if let Some(s) = r.reported_status {
        if s != Healthy {
            let code = r
                .reported_reason
                .clone()
                .unwrap_or_else(|| format!("reported-{}", s.as_str()));
            add(&code, s, format!("the source reported {}", s.as_str()));
        }
    }
    let read_nothing = r.temperature_c.is_none()
        && r.power_w.is_none()
        && r.ecc.is_none()
        && r.pcie.is_none()
        && r.vendor_health.is_none()
        && r.recovery_action.is_none()
        && r.reported_status.is_none();
    if read_nothing && !r.lost {
        let detail = if r.probe_errors.is_empty() {
            "the source returned no metric for this device".to_string()
        } else {
            r.probe_errors.join("; ")
        };
        add("no-metrics", Unknown, detail);
    }

    f.sort_by_key(|x| std::cmp::Reverse(x.status.severity()));
    let status = f.first().map(|x| x.status).unwrap_or(Healthy);
    Classification {
        status,
        // A healthy device has findings at most (a NotHandleFault code), no reason.
        reason: f
            .first()
            .filter(|x| x.status != Healthy)
            .map(|x| x.code.clone()),
        findings: f,
    }
}

/// The vendor's verdict: graded codes decide (MindCluster grades by code, not by the
/// health level); the level then says at most degraded.
fn vendor_findings(vh: &crate::reading::VendorHealth) -> Vec<Finding> {
    use DeviceStatus::*;
    let mut f = Vec::new();
    let mut add = |code: &str, status: DeviceStatus, detail: String| {
        f.push(Finding {
            code: code.to_string(),
            status,
            detail,
        })
    };
    let codes = if vh.error_codes.is_empty() {
        String::new()
    } else {
        format!(", error codes {}", vh.error_codes.join(","))
    };
    // Graded codes decide (MindCluster grades by code, not by the health level);
    // the level then says at most degraded.
    let graded = !vh.graded.is_empty();
    for (reason, status, list) in group_graded(&vh.graded) {
        add(
            &reason,
            status,
            format!("fault code {list} (vendor health {})", vh.raw),
        );
    }
    match vh.level {
        VendorHealthLevel::Critical => add(
            VENDOR_HEALTH_CRITICAL,
            if graded { Degraded } else { Failed },
            format!("vendor health {}{codes}", vh.raw),
        ),
        VendorHealthLevel::Alarm => add(
            "vendor-health-alarm",
            Degraded,
            format!("vendor health {}{codes}", vh.raw),
        ),
        VendorHealthLevel::Warning => add(
            "vendor-health-warning",
            Degraded,
            format!("vendor health {}{codes}", vh.raw),
        ),
        VendorHealthLevel::Ok => {}
    }
    f
}

/// Graded codes as one finding per reason (a chip may report 128 codes; a document
/// holds at most 64 findings): reason, status, the codes with their levels.
fn group_graded(g: &[crate::ascend::GradedCode]) -> Vec<(String, DeviceStatus, String)> {
    let mut out: Vec<(String, DeviceStatus, String)> = Vec::new();
    for c in g {
        let item = match c.level {
            Some(l) => format!("{} ({})", c.code, l.as_str()),
            None => format!("{} (in no table)", c.code),
        };
        match out
            .iter_mut()
            .find(|(r, s, _)| *r == c.reason && *s == c.status)
        {
            Some((_, _, list)) => {
                list.push_str(", ");
                list.push_str(&item);
            }
            None => out.push((c.reason.clone(), c.status, item)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reading::*;

    /// Every reason this file's classifier fails a device with is in `FAILED_CODES`,
    /// the list `failed_reasons` (and the aggregator's table test) starts from: read
    /// from the code, so a new failed finding left off the list fails here. A finding
    /// whose status is a variable comes from one of the other catalogs, which
    /// `failed_reasons` walks; a new one of those is named here too, to be reviewed.
    #[test]
    fn every_reason_the_classifier_fails_with_is_listed() {
        let src = include_str!("classify.rs");
        let code = &src[..src.find("#[cfg(test)]").expect("the tests")];
        let list = code
            .split_once("pub const FAILED_CODES")
            .and_then(|(_, rest)| rest.split_once("= ["))
            .and_then(|(_, rest)| rest.split_once("];"))
            .map(|(items, _)| items)
            .expect("the FAILED_CODES array");
        let listed: BTreeSet<&str> = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let mut failing = BTreeSet::new();
        let mut variable = BTreeSet::new();
        for call in code.split("add(").skip(1) {
            let args: Vec<&str> = call.splitn(3, ',').map(str::trim).collect();
            let [what, status, _] = args[..] else {
                continue;
            };
            if status.contains("Failed") {
                failing.insert(what);
            } else if !["Degraded", "Unknown", "Healthy"].contains(&status) {
                variable.insert(what);
            }
        }
        let unlisted: Vec<&&str> = failing.difference(&listed).collect();
        assert!(
            unlisted.is_empty(),
            "failed findings missing from FAILED_CODES: {unlisted:?}"
        );
        assert_eq!(listed.len(), FAILED_CODES.len());
        assert_eq!(
            variable,
            BTreeSet::from(["&code", "&reason", "&v.reason", "&x.code"]),
            "findings of a variable status: each from a catalog failed_reasons walks"
        );
    }

    fn healthy() -> DeviceReading {
        let mut r = DeviceReading::new("gpu0", Vendor::Nvidia, "nvml");
        r.temperature_c = Some(45.0);
        r.power_w = Some(120.0);
        r.ecc = Some(EccCounts::default());
        r.pcie = Some(PcieLink {
            up: true,
            gen: Some(3),
            max_gen: Some(5),
            width: Some(16),
            max_width: Some(16),
        });
        r
    }

    fn verdict(r: &DeviceReading) -> (DeviceStatus, Option<String>) {
        let c = classify(r, None, &Thresholds::default());
        (c.status, c.reason)
    }

    #[test]
    fn a_clean_reading_is_healthy_even_at_a_lower_idle_pcie_gen() {
        assert_eq!(verdict(&healthy()), (DeviceStatus::Healthy, None));
    }

    #[test]
    fn each_recovery_action_maps_to_its_status_and_reason() {
        use RecoveryAction as A;
        let want = [
            (0, None),
            (1, Some(("recovery-gpu-reset", DeviceStatus::Failed))),
            (2, Some(("recovery-node-reboot", DeviceStatus::Failed))),
            (3, Some(("recovery-drain-p2p", DeviceStatus::Failed))),
            (4, Some(("recovery-drain-and-reset", DeviceStatus::Failed))),
            (
                5,
                Some(("recovery-recover-imex-domain", DeviceStatus::Degraded)),
            ),
            (6, Some(("recovery-bus-reset", DeviceStatus::Failed))),
            (7, Some(("recovery-system-reboot", DeviceStatus::Failed))),
        ];
        for (v, expect) in want {
            let mut r = healthy();
            r.recovery_action = A::from_nvml(v);
            let got = verdict(&r);
            match expect {
                None => assert_eq!(got, (DeviceStatus::Healthy, None), "value {v}"),
                Some((code, status)) => {
                    assert_eq!(got, (status, Some(code.to_string())), "value {v}")
                }
            }
        }
        assert_eq!(A::from_nvml(8), None, "a value this build does not know");
        // Only a reading of the action is still a reading (not "no metrics").
        let mut only = DeviceReading::new("gpu0", Vendor::Nvidia, "nvml");
        only.recovery_action = Some(A::None);
        assert_eq!(verdict(&only), (DeviceStatus::Healthy, None));
        only.recovery_action = Some(A::GpuReset);
        assert_eq!(
            verdict(&only),
            (DeviceStatus::Failed, Some("recovery-gpu-reset".into()))
        );
        let failed: BTreeSet<String> = recovery_failed_reasons().collect();
        assert_eq!(failed.len(), 6, "{failed:?}");
        assert!(!failed.contains("recovery-recover-imex-domain"));
    }

    #[test]
    fn each_signal_maps_to_its_status_and_reason() {
        type Case = (&'static str, fn(&mut DeviceReading), DeviceStatus);
        let cases: &[Case] = &[
            ("gpu-lost", |r| r.lost = true, DeviceStatus::Failed),
            (
                "pcie-link-down",
                |r| r.pcie.as_mut().unwrap().up = false,
                DeviceStatus::Failed,
            ),
            (
                "pcie-width-degraded",
                |r| r.pcie.as_mut().unwrap().width = Some(8),
                DeviceStatus::Degraded,
            ),
            // X0 is not a narrow link, it is no link.
            (
                "pcie-link-down",
                |r| r.pcie.as_mut().unwrap().width = Some(0),
                DeviceStatus::Failed,
            ),
            (
                "high-temp",
                |r| r.temperature_c = Some(85.0),
                DeviceStatus::Degraded,
            ),
            (
                "ecc-uncorrectable",
                |r| r.ecc.as_mut().unwrap().volatile_uncorrected = 1,
                DeviceStatus::Degraded,
            ),
            (
                "row-remap-failure",
                |r| {
                    r.remapped_rows = Some(RemappedRows {
                        failure: true,
                        ..Default::default()
                    })
                },
                DeviceStatus::Failed,
            ),
            (
                "row-remap-pending",
                |r| {
                    r.remapped_rows = Some(RemappedRows {
                        pending: true,
                        ..Default::default()
                    })
                },
                DeviceStatus::Degraded,
            ),
            (
                "page-retirement-pending",
                |r| {
                    r.retired_pages = Some(RetiredPages {
                        pending: true,
                        ..Default::default()
                    })
                },
                DeviceStatus::Degraded,
            ),
            (
                "power-brake",
                |r| {
                    r.throttle = Some(Throttle {
                        hw_power_brake: true,
                        ..Default::default()
                    })
                },
                DeviceStatus::Degraded,
            ),
            (
                "nvlink-down",
                |r| {
                    r.nvlink = Some(NvLinkState {
                        total: 18,
                        active: 17,
                        down: vec![3],
                    })
                },
                DeviceStatus::Degraded,
            ),
            (
                "vendor-health-critical",
                |r| {
                    r.vendor_health = Some(VendorHealth {
                        level: VendorHealthLevel::Critical,
                        raw: "Critical".into(),
                        error_codes: vec!["0x80E01801".into()],
                        graded: vec![],
                    })
                },
                DeviceStatus::Failed,
            ),
        ];
        for (code, mutate, status) in cases {
            let mut r = healthy();
            mutate(&mut r);
            assert_eq!(verdict(&r), (*status, Some(code.to_string())), "{code}");
        }
    }

    #[test]
    fn the_worst_finding_names_the_reason() {
        let mut r = healthy();
        r.temperature_c = Some(95.0);
        r.lost = true;
        let c = classify(&r, None, &Thresholds::default());
        assert_eq!(c.status, DeviceStatus::Failed);
        assert_eq!(c.reason.as_deref(), Some("gpu-lost"));
        assert_eq!(c.findings.len(), 2);
    }

    #[test]
    fn a_reading_with_no_metric_is_unknown_not_healthy() {
        let mut r = DeviceReading::new("npu0", Vendor::Ascend, "npu-smi");
        r.probe_errors.push("health: timed out".into());
        assert_eq!(
            verdict(&r),
            (DeviceStatus::Unknown, Some("no-metrics".into()))
        );
    }

    #[test]
    fn an_xid_verdict_is_a_finding() {
        let v = XidVerdict {
            status: DeviceStatus::Failed,
            reason: "xid-79".into(),
            detail: "fell off the bus".into(),
        };
        let c = classify(&healthy(), Some(&v), &Thresholds::default());
        assert_eq!(
            (c.status, c.reason.as_deref()),
            (DeviceStatus::Failed, Some("xid-79"))
        );
    }

    #[test]
    fn graded_codes_decide_and_many_codes_stay_within_the_findings_bound() {
        let cat = crate::ascend::Catalog::builtin();
        let mut r = healthy();
        // 128 codes (the library's most): NotHandle ones and one SeparateNPU.
        let mut codes: Vec<String> = (0..127)
            .map(|i| format!("{:08X}", 0x9000_0000u32 + i))
            .collect();
        codes.push("80E18402".into());
        r.vendor_health = Some(VendorHealth {
            level: VendorHealthLevel::Critical,
            raw: "Critical".into(),
            graded: cat.grade_all(codes.iter().map(String::as_str)),
            error_codes: codes,
        });
        let c = classify(&r, None, &Thresholds::default());
        assert_eq!(c.status, DeviceStatus::Failed);
        assert_eq!(c.reason.as_deref(), Some("ascend-separate-npu"));
        assert!(c.findings.len() <= 4, "{:?}", c.findings);
        // With graded codes the level says at most degraded.
        let crit = c
            .findings
            .iter()
            .find(|f| f.code == "vendor-health-critical")
            .unwrap();
        assert_eq!(crit.status, DeviceStatus::Degraded);
    }
}
