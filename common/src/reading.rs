//! One device as a source saw it at one instant.

use serde::{Deserialize, Serialize};

pub use crate::status::DeviceStatus;

/// Who made the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// NVIDIA GPUs (NVML, kernel Xid lines).
    Nvidia,
    /// Huawei Ascend NPUs (DCMI, npu-smi).
    Ascend,
    /// Anything a site-specific exec tool reports.
    Other,
}

/// ECC error counters. "Volatile" counts since the last driver load; "aggregate" over the
/// device's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EccCounts {
    /// Corrected (single-bit) errors since driver load.
    pub volatile_corrected: u64,
    /// Uncorrected (double-bit) errors since driver load.
    pub volatile_uncorrected: u64,
    /// Corrected errors over the device's lifetime.
    pub aggregate_corrected: u64,
    /// Uncorrected errors over the device's lifetime.
    pub aggregate_uncorrected: u64,
}

impl EccCounts {
    /// The seed's single `ecc_errors` number: errors since the driver loaded.
    pub fn volatile_total(&self) -> u64 {
        self.volatile_corrected
            .saturating_add(self.volatile_uncorrected)
    }
}

/// Pages the driver retired (pre-Ampere page retirement).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPages {
    /// Retired because of repeated single-bit errors.
    pub single_bit: u64,
    /// Retired because of a double-bit error.
    pub double_bit: u64,
    /// A retirement waits for the next driver reload or GPU reset.
    pub pending: bool,
}

/// Row remapping (Ampere and later).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    /// Rows remapped after correctable errors.
    pub correctable: u32,
    /// Rows remapped after uncorrectable errors.
    pub uncorrectable: u32,
    /// A remap waits for a GPU reset.
    pub pending: bool,
    /// A remap failed: the device has run out of spare rows.
    pub failure: bool,
}

/// Why the clocks are held down, decoded from NVML's clock event reasons.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Throttle {
    /// The raw bitmask as NVML reported it.
    pub raw: u64,
    /// Hardware slowdown (thermal or power brake asserted by the board).
    pub hw_slowdown: bool,
    /// Hardware thermal slowdown.
    pub hw_thermal: bool,
    /// External power brake asserted.
    pub hw_power_brake: bool,
    /// Software thermal slowdown.
    pub sw_thermal: bool,
}

/// PCIe link state. A lower current generation is normal at idle (power saving); a
/// narrower width than the maximum is not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PcieLink {
    /// Whether the link is up at all.
    pub up: bool,
    /// Current link generation.
    pub gen: Option<u32>,
    /// Maximum link generation of the device and slot.
    pub max_gen: Option<u32>,
    /// Current lane count.
    pub width: Option<u32>,
    /// Maximum lane count.
    pub max_width: Option<u32>,
}

impl PcieLink {
    /// True when the link runs on fewer lanes than it can.
    pub fn width_degraded(&self) -> bool {
        matches!((self.width, self.max_width), (Some(w), Some(m)) if w < m)
    }
}

/// NVLink links by state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvLinkState {
    /// Links the device reports.
    pub total: u32,
    /// Links that are active.
    pub active: u32,
    /// Indices of links that are not active.
    pub down: Vec<u32>,
}

/// The vendor tool's own verdict, e.g. Ascend's `Health: OK/Warning/Alarm/Critical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VendorHealthLevel {
    /// Nothing reported.
    Ok,
    /// A minor alarm (Ascend "Warning").
    Warning,
    /// A major alarm (Ascend "Alarm").
    Alarm,
    /// A critical alarm (Ascend "Critical").
    Critical,
}

/// The vendor's own health verdict and error codes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VendorHealth {
    /// The level after mapping.
    pub level: VendorHealthLevel,
    /// The vendor's own word or number for it ("OK", "Alarm", "2").
    pub raw: String,
    /// Error codes the device reported (hex as the vendor prints them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub error_codes: Vec<String>,
    /// Those codes graded by the fault-code table (Ascend: MindCluster's levels), worst
    /// first. When there are any, they decide the chip's status, not the level above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub graded: Vec<crate::ascend::GradedCode>,
}

/// An Ascend chip's ids: the physical id names it (`npu<phy_id>`, as npu-exporter keys
/// chips); the others are kept for people and for DCMI calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AscendIds {
    /// Physical id (`dcmi_get_device_phyid_from_logicid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phy_id: Option<u32>,
    /// Logic id (what DCMI v2 calls `dev_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logic_id: Option<u32>,
    /// Card (NPU id) and chip on it, where the API has them (DCMI v1, npu-smi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub card: Option<i32>,
    /// Chip on the card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chip: Option<i32>,
}

/// What NVIDIA's driver says a GPU needs before it can be used again: NVML field 230,
/// `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION` (`nvmlDeviceGpuRecoveryAction_t`; values as
/// NVIDIA's "Error Recovery and Response Flags" and the NVML headers give them). It
/// replaces the deprecated reset-status fields; Xid 154 announces a change of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryAction {
    /// 0: nothing to do; a new process may use the GPU.
    None,
    /// 1: terminate the GPU's processes and reset it (`nvidia-smi -r`).
    GpuReset,
    /// 2: the fault may have left the OS inconsistent: reboot the node.
    NodeReboot,
    /// 3: quiesce all peer-to-peer traffic (terminate the processes using it), then
    /// ask again: the driver answers with another action.
    DrainP2p,
    /// 4: drain peer-to-peer traffic, then reset the GPU.
    DrainAndReset,
    /// 5: recover the GPU's IMEX domain (multi-node NVLink).
    RecoverImexDomain,
    /// 6: reset the GPU's PCIe bus.
    BusReset,
    /// 7: reboot the system.
    SystemReboot,
}

impl RecoveryAction {
    /// Every action, at the index of its NVML value.
    pub const ALL: [RecoveryAction; 8] = {
        use RecoveryAction::*;
        [
            None,
            GpuReset,
            NodeReboot,
            DrainP2p,
            DrainAndReset,
            RecoverImexDomain,
            BusReset,
            SystemReboot,
        ]
    };

    /// The action NVML's value `v` names; `None` for a value this build does not know
    /// (a newer driver's: reported as a probe error, never guessed).
    pub fn from_nvml(v: u64) -> Option<RecoveryAction> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i))
            .copied()
    }

    /// The action named `name` on the wire, if this build knows it.
    pub fn named(name: &str) -> Option<RecoveryAction> {
        Self::ALL.iter().copied().find(|a| a.as_str() == name)
    }

    /// The name on the wire and in findings (`gpu-reset`, `node-reboot`, ...).
    pub fn as_str(self) -> &'static str {
        use RecoveryAction::*;
        match self {
            None => "none",
            GpuReset => "gpu-reset",
            NodeReboot => "node-reboot",
            DrainP2p => "drain-p2p",
            DrainAndReset => "drain-and-reset",
            RecoverImexDomain => "recover-imex-domain",
            BusReset => "bus-reset",
            SystemReboot => "system-reboot",
        }
    }
}

/// RoCE network health of an Ascend chip (`dcmi_get_device_network_health`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoceLink {
    /// The raw `dcmi_rdfx_detect_result` (0 OK, 2 receive timeout, 3 unreachable, 6
    /// starting, ...).
    pub result: u32,
    /// 0 or 6.
    pub up: bool,
}

/// One device as one source saw it. Every metric is optional: a source fills what it
/// can read, and a metric it failed to read is listed in `probe_errors`, not guessed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceReading {
    /// Stable id on this node: `gpu0`, `npu3`, `npu3-1` (card 3, chip 1).
    pub id: String,
    /// The vendor.
    pub vendor: Vendor,
    /// The source that produced this reading (`nvml`, `dcmi`, `npu-smi`, `exec`, `sim`).
    pub source: String,
    /// Vendor index (NVML index, NPU id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// Device UUID where the vendor has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// PCI bus id, normalised by [`normalize_bus_id`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Product name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Core temperature in degrees Celsius.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Power draw in watts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// ECC counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc: Option<EccCounts>,
    /// Retired pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_pages: Option<RetiredPages>,
    /// Remapped rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows: Option<RemappedRows>,
    /// Clock event (throttle) reasons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<Throttle>,
    /// PCIe link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie: Option<PcieLink>,
    /// NVLink links.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink: Option<NvLinkState>,
    /// The device is gone: NVML says the GPU is lost, or the kernel says it fell off the
    /// bus. A hard fault, not a probe error.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lost: bool,
    /// The vendor's own verdict.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor_health: Option<VendorHealth>,
    /// The repair the driver says the device needs (NVML field 230), where it offers
    /// one: not supported is no reading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_action: Option<RecoveryAction>,
    /// A status an exec tool reported itself; taken into account, never trusted alone
    /// to make a device healthier than its readings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_status: Option<DeviceStatus>,
    /// The reason an exec tool reported with its status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_reason: Option<String>,
    /// Metrics this sample failed to read, as `metric: error`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probe_errors: Vec<String>,
    /// Still booting (Ascend boot status below 16): nothing it says means anything yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub booting: bool,
    /// RoCE link health (Ascend training chips).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roce: Option<RoceLink>,
    /// Ascend ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ascend: Option<AscendIds>,
}

impl DeviceReading {
    /// An empty reading of `id` from `source`: every metric unknown.
    pub fn new(id: impl Into<String>, vendor: Vendor, source: impl Into<String>) -> Self {
        DeviceReading {
            id: id.into(),
            vendor,
            source: source.into(),
            index: None,
            uuid: None,
            pci_bus_id: None,
            name: None,
            temperature_c: None,
            power_w: None,
            ecc: None,
            retired_pages: None,
            remapped_rows: None,
            throttle: None,
            pcie: None,
            nvlink: None,
            lost: false,
            vendor_health: None,
            recovery_action: None,
            reported_status: None,
            reported_reason: None,
            probe_errors: Vec::new(),
            booting: false,
            roce: None,
            ascend: None,
        }
    }
}

/// Normalise a PCI bus id to `dddd:bb:dd.f`, lowercase, so the kernel's
/// `PCI:0000:3b:00`, NVML's `00000000:3B:00.0` and npu-smi's `0000:C1:00.0` compare
/// equal. Returns `None` for text that is not a bus id.
pub fn normalize_bus_id(raw: &str) -> Option<String> {
    let s = raw.trim();
    let s = s.strip_prefix("PCI:").unwrap_or(s);
    let (addr, func) = match s.rsplit_once('.') {
        Some((a, f)) => (a, f),
        None => (s, "0"),
    };
    let parts: Vec<&str> = addr.split(':').collect();
    let (domain, bus, dev) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0", *b, *v),
        _ => return None,
    };
    let hex = |t: &str| u32::from_str_radix(t, 16).ok();
    let (domain, bus, dev, func) = (hex(domain)?, hex(bus)?, hex(dev)?, hex(func)?);
    if bus > 0xff || dev > 0x1f || func > 7 || domain > 0xffff {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_from_every_tool_compare_equal() {
        for raw in [
            "PCI:0000:3b:00",
            "00000000:3B:00.0",
            "0000:3b:00.0",
            "3b:00.0",
            " 0000:3B:00.0 ",
        ] {
            assert_eq!(
                normalize_bus_id(raw).as_deref(),
                Some("0000:3b:00.0"),
                "{raw}"
            );
        }
        assert_eq!(
            normalize_bus_id("0000:C1:00.0").as_deref(),
            Some("0000:c1:00.0")
        );
    }

    #[test]
    fn garbage_is_not_a_bus_id() {
        for raw in [
            "",
            "gpu0",
            "0000:zz:00.0",
            "1:2:3:4",
            "0000:3b:40.0",
            "0000:3b:00.9",
        ] {
            assert_eq!(normalize_bus_id(raw), None, "{raw}");
        }
    }

    #[test]
    fn empty_optional_fields_stay_out_of_json() {
        let r = DeviceReading::new("gpu0", Vendor::Nvidia, "nvml");
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id": "gpu0", "vendor": "nvidia", "source": "nvml"})
        );
    }
}
