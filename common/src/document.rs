//! The node health document served by the agent at `GET /v1/health`.
//!
//! It keeps seed 003's field names (`node`, `npus[]` with `id`, `status`,
//! `temperature_c`, `power_w`, `ecc_errors`, `pcie_link_status`, `reason`; `summary` with
//! `total`, `healthy`, `degraded`, `failed`) so the seed's consumer works on it unchanged,
//! and adds what the seed lacks: identity (UUID, bus id), detail readings, the findings
//! behind a verdict, sample age, recent Xids, per-source status and a generation number.

use serde::{Deserialize, Serialize};

use crate::classify::Finding;
use crate::reading::{DeviceReading, DeviceStatus};
use crate::xid::XidEvent;

use crate::doc_view::devices;
pub use crate::doc_view::{
    limits, AckView, DeviceView, DocError, DocView, FindingView, SourceView,
};

/// Version of this document's shape. Bumped on any incompatible change.
pub const SCHEMA_VERSION: &str = "faultline.node-health/v1";

/// The whole node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeHealth {
    /// [`SCHEMA_VERSION`].
    pub schema_version: String,
    /// Increases by one whenever anything in the document other than ages and the
    /// timestamp changes. Clients long-poll on it.
    pub generation: u64,
    /// When the document was rendered (RFC 3339, UTC).
    pub timestamp: String,
    /// The Kubernetes node name.
    pub node: String,
    /// The agent's version.
    pub agent_version: String,
    /// Every device, sorted by id.
    #[serde(deserialize_with = "devices")]
    pub npus: Vec<DeviceHealth>,
    /// Counts by status.
    pub summary: Summary,
    /// Each configured source and how it is doing.
    pub sources: Vec<SourceStatus>,
    /// Recent Xid events whose PCI bus id matched no known device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unattributed_xids: Vec<XidEvent>,
    /// Drain intents the node's pods acknowledged through this agent, while
    /// the aggregator's entry still lists them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drain_acks: Vec<DrainAck>,
}

/// A pod's word that it has checkpointed: evict it now (`POST /v1/drain/ack` on the
/// agent, from the pod's own address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainAck {
    /// The pod's UID, as the drain intent names it.
    pub uid: String,
    /// The intent's `requested`: an acknowledgement answers that one intent, never a
    /// later one for the same pod.
    pub requested: String,
    /// When the agent took it (RFC 3339).
    pub at: String,
}

/// One device in the document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "DeviceHealthWire")]
pub struct DeviceHealth {
    /// The last reading (identity and metrics).
    #[serde(flatten)]
    pub reading: DeviceReading,
    /// Instantaneous status of the last reading, or `unknown` once it is stale.
    pub status: DeviceStatus,
    /// Code of the worst finding; `null` when healthy.
    pub reason: Option<String>,
    /// Every finding behind the status, worst first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<Finding>,
    /// ECC errors since driver load (corrected + uncorrected), the seed's single number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_errors: Option<u64>,
    /// `up` or `down`, the seed's link field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_link_status: Option<String>,
    /// When the reading was taken (RFC 3339), if ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampled_at: Option<String>,
    /// Age of the reading in milliseconds when the document was rendered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_age_ms: Option<u64>,
    /// Xid events for this device within the retention window, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_xids: Vec<XidEvent>,
}

/// How a [`DeviceHealth`] is read: the reading's fields beside the health's, as
/// `flatten` writes them. serde's `flatten` on the read side collects every field into
/// an intermediate map before reading the inner struct from it; that cost most of the
/// aggregator's time per agent document (measured). Each field here is the
/// one of the same name in [`DeviceReading`] or [`DeviceHealth`] (a test reads every
/// field back).
#[derive(Deserialize)]
struct DeviceHealthWire {
    id: String,
    vendor: crate::reading::Vendor,
    source: String,
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    pci_bus_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    temperature_c: Option<f64>,
    #[serde(default)]
    power_w: Option<f64>,
    #[serde(default)]
    ecc: Option<crate::reading::EccCounts>,
    #[serde(default)]
    retired_pages: Option<crate::reading::RetiredPages>,
    #[serde(default)]
    remapped_rows: Option<crate::reading::RemappedRows>,
    #[serde(default)]
    throttle: Option<crate::reading::Throttle>,
    #[serde(default)]
    pcie: Option<crate::reading::PcieLink>,
    #[serde(default)]
    nvlink: Option<crate::reading::NvLinkState>,
    #[serde(default)]
    lost: bool,
    #[serde(default)]
    vendor_health: Option<crate::reading::VendorHealth>,
    #[serde(default)]
    recovery_action: Option<crate::reading::RecoveryAction>,
    #[serde(default)]
    reported_status: Option<DeviceStatus>,
    #[serde(default)]
    reported_reason: Option<String>,
    #[serde(default)]
    probe_errors: Vec<String>,
    #[serde(default)]
    booting: bool,
    #[serde(default)]
    roce: Option<crate::reading::RoceLink>,
    #[serde(default)]
    ascend: Option<crate::reading::AscendIds>,
    status: DeviceStatus,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    findings: Vec<Finding>,
    #[serde(default)]
    ecc_errors: Option<u64>,
    #[serde(default)]
    pcie_link_status: Option<String>,
    #[serde(default)]
    sampled_at: Option<String>,
    #[serde(default)]
    sample_age_ms: Option<u64>,
    #[serde(default)]
    recent_xids: Vec<XidEvent>,
}

impl From<DeviceHealthWire> for DeviceHealth {
    fn from(w: DeviceHealthWire) -> Self {
        DeviceHealth {
            reading: DeviceReading {
                id: w.id,
                vendor: w.vendor,
                source: w.source,
                index: w.index,
                uuid: w.uuid,
                pci_bus_id: w.pci_bus_id,
                name: w.name,
                temperature_c: w.temperature_c,
                power_w: w.power_w,
                ecc: w.ecc,
                retired_pages: w.retired_pages,
                remapped_rows: w.remapped_rows,
                throttle: w.throttle,
                pcie: w.pcie,
                nvlink: w.nvlink,
                lost: w.lost,
                vendor_health: w.vendor_health,
                recovery_action: w.recovery_action,
                reported_status: w.reported_status,
                reported_reason: w.reported_reason,
                probe_errors: w.probe_errors,
                booting: w.booting,
                roce: w.roce,
                ascend: w.ascend,
            },
            status: w.status,
            reason: w.reason,
            findings: w.findings,
            ecc_errors: w.ecc_errors,
            pcie_link_status: w.pcie_link_status,
            sampled_at: w.sampled_at,
            sample_age_ms: w.sample_age_ms,
            recent_xids: w.recent_xids,
        }
    }
}

/// Counts by status. `total` = the sum of the other four.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// All devices.
    pub total: u32,
    /// Healthy devices.
    pub healthy: u32,
    /// Degraded devices.
    pub degraded: u32,
    /// Failed devices.
    pub failed: u32,
    /// Devices we could not judge.
    pub unknown: u32,
}

impl Summary {
    /// Count the statuses of `devices`.
    pub fn of<'a>(devices: impl IntoIterator<Item = &'a DeviceHealth>) -> Self {
        let mut s = Summary::default();
        for d in devices {
            s.total += 1;
            match d.status {
                DeviceStatus::Healthy => s.healthy += 1,
                DeviceStatus::Degraded => s.degraded += 1,
                DeviceStatus::Failed => s.failed += 1,
                DeviceStatus::Unknown => s.unknown += 1,
            }
        }
        s
    }
}

/// One source as the document reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStatus {
    /// `nvml`, `dcmi`, `npu-smi`, `exec`, `kmsg`, `sim`.
    pub name: String,
    /// The last attempt succeeded.
    pub up: bool,
    /// When the last good sample finished (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_success: Option<String>,
    /// The last error, if the last attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Failed attempts in a row.
    pub consecutive_failures: u32,
    /// Calls that timed out and still have not returned (hung FFI or child).
    pub abandoned_calls: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reading::Vendor;
    use crate::testing::{device, node};
    use std::borrow::Cow;

    fn node_doc(devices: usize) -> NodeHealth {
        node("n1").devices(devices).build()
    }

    /// The aggregator's borrowed view reads the same values as the whole
    /// document, escaped texts included (those are the ones not borrowed), judges the
    /// same by the rules, keeps the same bounds, and refuses what the document refuses
    /// for a missing field.
    #[test]
    fn the_view_reads_what_the_document_reads() {
        use crate::rules::{Entry, Metric, Rules};
        let mut doc = node_doc(3);
        doc.node = "node-\"q\"".into();
        doc.sources = vec![SourceStatus {
            name: "nvml".into(),
            up: true,
            last_success: None,
            last_error: Some("none \\ here".into()),
            consecutive_failures: 0,
            abandoned_calls: 0,
        }];
        let d = &mut doc.npus[1];
        d.reading.uuid = Some("GPU-\u{e9}\\1".into());
        d.reading.pci_bus_id = Some("0000:18:00.0".into());
        d.reading.temperature_c = Some(91.5);
        d.reading.power_w = Some(2.0);
        d.reading.ecc = Some(crate::reading::EccCounts {
            volatile_uncorrected: 4,
            ..Default::default()
        });
        d.ecc_errors = Some(7);
        d.pcie_link_status = Some("down".into());
        d.status = DeviceStatus::Failed;
        d.findings = vec![crate::classify::Finding {
            code: "pcie-link-down".into(),
            status: DeviceStatus::Failed,
            detail: "line \"1\"\n".into(),
        }];
        let bytes = serde_json::to_vec(&doc).unwrap();
        let v = DocView::parse(&bytes).unwrap();
        assert_eq!((v.generation, &*v.node), (1, "node-\"q\""));
        assert_eq!(v.npus.len(), 3);
        assert_eq!((&*v.sources[0].name, v.sources[0].up), ("nvml", true));
        let rules = Rules::default();
        for (view, full) in v.npus.iter().zip(&doc.npus) {
            assert_eq!(*view.id, full.reading.id);
            assert_eq!(view.uuid.as_deref(), full.reading.uuid.as_deref());
            assert_eq!(
                view.pci_bus_id.as_deref(),
                full.reading.pci_bus_id.as_deref()
            );
            assert_eq!(
                view.pcie_link_status.as_deref(),
                full.pcie_link_status.as_deref()
            );
            for m in [
                Metric::TemperatureC,
                Metric::PowerW,
                Metric::EccErrors,
                Metric::EccUncorrected,
                Metric::PcieLinkUp,
            ] {
                assert_eq!(view.metric(m), full.metric(m), "{m:?}");
            }
            assert_eq!(rules.measure(Some(view)), rules.measure(Some(full)));
        }
        // Optional texts are borrowed unless escaped (serde's `borrow` alone copies
        // them inside an `Option`); absent or null is none.
        let d1 = &v.npus[1];
        assert!(matches!(d1.pci_bus_id, Some(Cow::Borrowed(_))));
        assert!(matches!(d1.pcie_link_status, Some(Cow::Borrowed(_))));
        assert!(
            matches!(d1.uuid, Some(Cow::Owned(_))),
            "escaped: unescaped into a copy"
        );
        assert!(v.npus[0].uuid.is_none() && v.npus[0].pcie_link_status.is_none());
        let mut j = serde_json::to_value(&doc).unwrap();
        j["npus"][0]["pcie_link_status"] = serde_json::Value::Null;
        j["npus"][0]["uuid"] = serde_json::json!(7);
        let bytes = serde_json::to_vec(&j).unwrap();
        assert!(DocView::parse(&bytes).is_err(), "a number is no text");
        j["npus"][0]["uuid"] = serde_json::Value::Null;
        let bytes = serde_json::to_vec(&j).unwrap();
        let nulls = DocView::parse(&bytes).unwrap();
        assert!(nulls.npus[0].uuid.is_none() && nulls.npus[0].pcie_link_status.is_none());
        // An Ascend chip's physical id, where the agent learned it; anything else none.
        assert!(v.npus.iter().all(|d| d.ascend_phy_id.is_none()));
        j["npus"][0]["ascend"] = serde_json::json!({"phy_id": 5, "card": 1, "chip": 0});
        j["npus"][1]["ascend"] = serde_json::json!({"card": 3, "chip": 0});
        j["npus"][2]["ascend"] = serde_json::json!({"phy_id": -1});
        let bytes = serde_json::to_vec(&j).unwrap();
        let ids: Vec<Option<u32>> = DocView::parse(&bytes)
            .unwrap()
            .npus
            .iter()
            .map(|d| d.ascend_phy_id)
            .collect();
        assert_eq!(ids, [Some(5), None, None]);
        assert_eq!(
            rules.measure(Some(&v.npus[1])).hard.as_deref(),
            Some("npu-offline")
        );
        assert_eq!(v.check_bounds(), Ok(()));
        let mut long = doc.clone();
        long.npus[0].reading.id = "x".repeat(limits::ID + 1);
        let bytes = serde_json::to_vec(&long).unwrap();
        assert!(DocView::parse(&bytes)
            .unwrap()
            .check_bounds()
            .unwrap_err()
            .to_string()
            .contains("device id"));
        // A required field missing: refused by both.
        for field in ["schema_version", "summary", "sources", "node"] {
            let mut j = serde_json::to_value(&doc).unwrap();
            j.as_object_mut().unwrap().remove(field);
            let bytes = serde_json::to_vec(&j).unwrap();
            assert!(
                serde_json::from_slice::<NodeHealth>(&bytes).is_err(),
                "{field}"
            );
            assert!(DocView::parse(&bytes).is_err(), "{field}");
        }
        assert!(DocView::parse(b"not json").is_err());
        assert!(DocView::parse(b"{\"node\": \"\xff\"}").is_err());
    }

    /// An agent's document is bounded in devices and strings.
    #[test]
    fn documents_outside_the_limits_are_refused() {
        // What the aggregator's gate does with the bytes an agent sends.
        let gate = |d: &NodeHealth| {
            let bytes = serde_json::to_vec(d).unwrap();
            DocView::parse(&bytes).and_then(|v| v.check_bounds())
        };
        assert_eq!(gate(&node_doc(8)), Ok(()));
        let many = gate(&node_doc(limits::DEVICES + 1)).unwrap_err();
        assert!(many.to_string().contains("devices"));
        assert_eq!(many.metric_label(), "too-many");
        let mut d = node_doc(1);
        d.npus[0].reading.id = "x".repeat(limits::ID + 1);
        let long = gate(&d).unwrap_err();
        assert!(long.to_string().contains("device id"));
        assert_eq!(long.metric_label(), "too-long");
        let mut d = node_doc(1);
        d.npus[0].findings = vec![crate::classify::Finding {
            code: "c".into(),
            status: DeviceStatus::Degraded,
            detail: "d".repeat(limits::TEXT + 1),
        }];
        assert!(gate(&d).unwrap_err().to_string().contains("finding detail"));
        let mut d = node_doc(1);
        d.node = String::new();
        assert!(gate(&d).is_err());
        let mut d = node_doc(1);
        d.node = "n".repeat(254);
        assert!(gate(&d).is_err());
        // Readings no sensor reads are refused, not published.
        for (temp, power, ok) in [
            (Some(1e300), None, false),
            (Some(-273.0), None, false),
            (None, Some(-5.0), false),
            (None, Some(1e9), false),
            (Some(95.0), Some(700.0), true),
        ] {
            let mut d = node_doc(1);
            d.npus[0].reading.temperature_c = temp;
            d.npus[0].reading.power_w = power;
            assert_eq!(gate(&d).is_ok(), ok, "{temp:?} C, {power:?} W");
        }
    }

    #[test]
    fn device_entry_keeps_the_seed_field_names() {
        let d = device("npu1")
            .vendor(Vendor::Ascend)
            .source("npu-smi")
            .temperature(89.2)
            .power(312.5)
            .status(DeviceStatus::Degraded)
            .reason(Some("high-temp".into()))
            .ecc_errors(3)
            .pcie("up")
            .sample_age_ms(10)
            .build();
        let v = serde_json::to_value(&d).unwrap();
        for (k, want) in [
            ("id", serde_json::json!("npu1")),
            ("status", serde_json::json!("degraded")),
            ("temperature_c", serde_json::json!(89.2)),
            ("power_w", serde_json::json!(312.5)),
            ("ecc_errors", serde_json::json!(3)),
            ("pcie_link_status", serde_json::json!("up")),
            ("reason", serde_json::json!("high-temp")),
        ] {
            assert_eq!(v[k], want, "{k}");
        }
        let back: DeviceHealth = serde_json::from_value(v).unwrap();
        assert_eq!(back, d);
    }

    /// Every field written is read back: the wire struct names each field of the
    /// reading and of the health (a field missing there would be dropped silently).
    #[test]
    fn every_field_of_a_device_is_read_back() {
        use crate::reading::*;
        let mut r = DeviceReading::new("npu3", Vendor::Ascend, "dcmi");
        r.index = Some(3);
        r.uuid = Some("u".into());
        r.pci_bus_id = Some("0000:01:00.0".into());
        r.name = Some("Ascend910".into());
        r.temperature_c = Some(51.5);
        r.power_w = Some(310.0);
        r.ecc = Some(EccCounts::default());
        r.retired_pages = Some(RetiredPages::default());
        r.remapped_rows = Some(RemappedRows::default());
        r.throttle = Some(Throttle::default());
        r.pcie = Some(PcieLink::default());
        r.nvlink = Some(NvLinkState::default());
        r.lost = true;
        r.vendor_health = Some(VendorHealth {
            level: VendorHealthLevel::Warning,
            raw: "1".into(),
            error_codes: vec!["0x80E01801".into()],
            graded: vec![],
        });
        r.reported_status = Some(DeviceStatus::Degraded);
        r.reported_reason = Some("tool".into());
        r.probe_errors = vec!["power: timeout".into()];
        r.booting = true;
        r.roce = Some(RoceLink {
            result: 6,
            up: true,
        });
        r.ascend = Some(AscendIds {
            phy_id: Some(3),
            logic_id: Some(2),
            card: Some(1),
            chip: Some(0),
        });
        let d = DeviceHealth {
            reading: r,
            status: DeviceStatus::Failed,
            reason: Some("xid-79".into()),
            findings: vec![Finding {
                code: "xid-79".into(),
                status: DeviceStatus::Failed,
                detail: "fell off the bus".into(),
            }],
            ecc_errors: Some(4),
            pcie_link_status: Some("down".into()),
            sampled_at: Some("2026-12-01T00:00:00.000Z".into()),
            sample_age_ms: Some(12),
            recent_xids: vec![serde_json::from_value(serde_json::json!({
                "xid": 79, "class": "fatal", "at_ms": 1, "source": "kmsg", "message": "Xid 79"
            }))
            .unwrap()],
        };
        let json = serde_json::to_value(&d).unwrap();
        // Every field of the reading is written (none was left at its default).
        let written = json.as_object().unwrap().len();
        let back: DeviceHealth = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, d);
        assert_eq!(serde_json::to_value(&back).unwrap(), json);
        assert_eq!(
            written, 31,
            "a field was added: add it to DeviceHealthWire too"
        );
    }

    #[test]
    fn summary_counts_every_status() {
        let mk = |s| device("x").vendor(Vendor::Other).status(s).build();
        let ds = [
            mk(DeviceStatus::Healthy),
            mk(DeviceStatus::Healthy),
            mk(DeviceStatus::Failed),
            mk(DeviceStatus::Unknown),
        ];
        assert_eq!(
            Summary::of(&ds),
            Summary {
                total: 4,
                healthy: 2,
                degraded: 0,
                failed: 1,
                unknown: 1
            }
        );
    }
}
