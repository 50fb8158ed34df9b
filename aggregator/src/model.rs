//! The aggregator's shared vocabulary: a device as a quarantine record names it, a
//! device as the pipeline sees it, and a verdict from outside the pipeline. Every other
//! module may use these; this module uses nothing of the crate.

use faultline_common::reading::normalize_bus_id;
use faultline_common::DeviceStatus;
use serde::{Deserialize, Serialize};

/// What said a device failed: the wire form (`agent`, `alert`, `kubelet`) is what
/// quarantine records on Nodes carry, so a record written by a newer version with a kind
/// this one does not know reads as [`Provenance::Other`] instead of failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provenance {
    /// The aggregator's own verdict from the agent's readings.
    Agent,
    /// The alert intake.
    Alert,
    /// A pod's `allocatedResourcesStatus` (KEP-4680).
    Kubelet,
    /// A kind this version does not know.
    #[serde(other)]
    Other,
}

impl Provenance {
    /// The wire form.
    pub fn as_str(self) -> &'static str {
        match self {
            Provenance::Agent => "agent",
            Provenance::Alert => "alert",
            Provenance::Kubelet => "kubelet",
            Provenance::Other => "other",
        }
    }
}

impl std::fmt::Display for Provenance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One failed (or unknown) device, as a quarantine record, an announcement or a
/// notification names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordDevice {
    /// Device id on the node.
    pub id: String,
    /// UUID, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// PCI bus id, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Why it failed.
    pub reason: String,
    /// What said so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Provenance>,
    /// The metric and its value behind the verdict, where there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    /// The metric's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The repair the driver asked for when it was recorded (NVML's recovery action:
    /// a GPU reset, a reboot, ...), where the agent reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_action: Option<faultline_common::RecoveryAction>,
    /// An Ascend chip's physical id, where its agent learned it (Huawei's device plugin
    /// names chips by it: `ManuallySeparateNPU` is matched on it alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phy_id: Option<u32>,
    /// The DRA device that published its UUID when the node path recorded it
    /// (`<driver>/<pool>/<device>`): its holders are found by it once the driver no
    /// longer publishes the device (NVIDIA's republishes only healthy ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<String>,
}

impl RecordDevice {
    /// A device judged by the aggregator's own pipeline.
    pub fn new(id: impl Into<String>, reason: impl Into<String>) -> Self {
        RecordDevice {
            id: id.into(),
            uuid: None,
            pci_bus_id: None,
            recovery_action: None,
            phy_id: None,
            dra: None,
            reason: reason.into(),
            source: None,
            metric: None,
            value: None,
        }
    }

    /// Whether `key` (an id, a UUID, a bus id, or the Ascend device plugin's name of
    /// the chip, `Ascend910-3` for `npu3`) names this device.
    pub fn is(&self, key: &str) -> bool {
        self.id == key
            || self.uuid.as_deref() == Some(key)
            || faultline_common::ascend::same_chip(&self.id, key)
            || self
                .pci_bus_id
                .as_deref()
                .and_then(normalize_bus_id)
                .is_some_and(|b| normalize_bus_id(key).as_deref() == Some(b.as_str()))
    }

    /// Whether `other` is the same device: by any of `other`'s keys this device knows.
    pub fn same_device(&self, other: &RecordDevice) -> bool {
        self.is(&other.id) || other.uuid.as_deref().is_some_and(|u| self.is(u))
    }
}

/// A node's device as the pipeline sees it, for release decisions.
#[derive(Debug, Clone)]
pub struct DeviceView {
    /// Its identities (id, UUID, bus id).
    pub device: RecordDevice,
    /// Smoothed state.
    pub status: DeviceStatus,
    /// Clean samples in a row.
    pub clean_streak: u32,
    /// Since when it has had this state (ms since the epoch).
    pub since_ms: u64,
}

/// A device judged failed outside the pipeline (the alert intake, the kubelet), for the
/// core loop to hand to remediation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The node.
    pub node: String,
    /// The device (`id` is the UUID or bus id the alert named; the core loop maps it to
    /// the agent's id where the node reports the device).
    pub device: RecordDevice,
}

/// A shard this replica just took, with what its last holder published: the core loop
/// seeds each node's devices from it before anything of the shard is written
/// (a takeover changes no published status).
#[derive(Debug, Clone)]
pub struct Takeover {
    /// The shard.
    pub shard: u32,
    /// Each node's entry of the shard's last document (none for a shard never written).
    /// (Its sequence needs no hand-over: the ConfigMap sink continues it on its first
    /// write.)
    pub nodes: Vec<faultline_common::fault::NodeFaults>,
}

/// A shard this replica hands back: write it once more, then answer.
#[derive(Debug)]
pub struct FinalWrite {
    /// The shard.
    pub shard: u32,
    /// Answered once the write is done (or dropped if it cannot be).
    pub done: tokio::sync::oneshot::Sender<()>,
}

/// What the Lease loop tells the core loop, in the order it happened: one stream, so
/// a shard's seed is in before the shard counts as held, and a final write before the
/// hand-back.
#[derive(Debug)]
pub enum ShardEvent {
    /// A shard was taken: seed it (sent before it counts as held).
    Taken(Takeover),
    /// The shards granted changed (a grant or a release; not a hold running out on
    /// this replica's clock, which the core loop's tick sees).
    Held,
    /// Write a shard once more before it is handed back.
    FinalWrite(FinalWrite),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_named_by_id_uuid_or_any_spelling_of_its_bus_id() {
        let d = RecordDevice {
            uuid: Some("GPU-1".into()),
            pci_bus_id: Some("00000000:3B:00.0".into()),
            ..RecordDevice::new("gpu3", "xid-79")
        };
        assert!(d.is("gpu3") && d.is("GPU-1") && d.is("0000:3b:00.0"));
        assert!(!d.is("gpu4") && !d.is("GPU-2"));
        let by_uuid = RecordDevice {
            uuid: Some("GPU-1".into()),
            ..RecordDevice::new("other-name", "alert:x")
        };
        assert!(d.same_device(&by_uuid));
        assert!(!d.same_device(&RecordDevice::new("gpu5", "x")));
    }
}
