//! Simulated devices with realistic noise, and fault injection (by the API or a
//! scenario file). Used by the demo and by tests of everything above the sources.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use faultline_common::sync::Locked;
use faultline_common::time::now_ms;
use faultline_common::xid::class_of;
use faultline_common::{
    DeviceReading, EccCounts, NvLinkState, PcieLink, RecoveryAction, RemappedRows, Throttle,
    Vendor, VendorHealth, VendorHealthLevel, XidEvent,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::{ProbeError, Source, SourceSample};

/// A fault the simulator can show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// Temperature at `value` C (default 92).
    HighTemp,
    /// `value` uncorrectable ECC errors (default 1).
    EccUncorrectable,
    /// `value` corrected ECC errors (default 100).
    EccCorrectable,
    /// The device is lost (fell off the bus).
    Lost,
    /// PCIe link down.
    PcieDown,
    /// PCIe link trained at x`value` (default 8).
    PcieWidth,
    /// NVLink link `value` (default 0) inactive.
    NvlinkDown,
    /// External power brake.
    PowerBrake,
    /// Row remap pending.
    RowRemapPending,
    /// Row remap failure.
    RowRemapFailure,
    /// One Xid event `xid` on the device.
    Xid,
    /// Vendor health Critical (Ascend style).
    VendorCritical,
    /// Every sample of the source hangs (`value` seconds, default 3600).
    Hang,
    /// Every sample of the source fails with an error.
    ProbeError,
    /// The driver's recovery action is NVML's value `value` (default 1, GPU reset).
    Recovery,
}

/// `POST /v1/sim/faults` body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// Device id (`gpu3`) or index (`3`); not needed for `hang` and `probe-error`.
    #[serde(default)]
    pub device: Option<String>,
    /// What to inject.
    pub fault: FaultKind,
    /// Magnitude, where the fault has one.
    #[serde(default)]
    pub value: Option<f64>,
    /// The Xid for `fault: xid`.
    #[serde(default)]
    pub xid: Option<u32>,
    /// Clear the fault by itself after this many seconds.
    #[serde(default)]
    pub duration_s: Option<f64>,
}

/// A fault in force.
#[derive(Debug, Clone, Serialize)]
pub struct ActiveFault {
    /// Which device (`*` for the whole source).
    pub device: String,
    /// The request that made it.
    pub request: FaultRequest,
    #[serde(skip)]
    until: Option<Instant>,
    #[serde(skip)]
    delivered: bool,
}

/// One entry of a scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioStep {
    /// Seconds after start.
    pub at_s: f64,
    /// The fault, as the API takes it.
    #[serde(flatten)]
    pub fault: FaultRequest,
}

/// Why an injection was refused (the API answers 422 with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    #[error("fault {0:?} needs a device")]
    NoDevice(FaultKind),
    #[error("no simulated device {device:?} (have {count} devices: {first}..)")]
    NoSuchDevice {
        device: String,
        count: usize,
        first: String,
    },
    #[error("fault xid needs \"xid\": N")]
    NoXid,
    #[error("value must be a finite number")]
    NotFinite,
    #[error("duration_s must be between 0 and 604800 (a week)")]
    Duration,
    #[error("{MAX_FAULTS} faults in force already; clear some (DELETE /v1/sim/faults)")]
    Full,
}

/// The simulator's shared control: the API injects through it, the source reads it.
pub struct SimControl {
    ids: Vec<String>,
    faults: Mutex<Vec<ActiveFault>>,
}

impl SimControl {
    fn resolve(&self, device: &Option<String>, kind: FaultKind) -> Result<String, InjectError> {
        if matches!(kind, FaultKind::Hang | FaultKind::ProbeError) {
            return Ok("*".into());
        }
        let d = device.as_deref().ok_or(InjectError::NoDevice(kind))?;
        if self.ids.iter().any(|id| id == d) {
            return Ok(d.to_string());
        }
        if let Ok(i) = d.parse::<usize>() {
            if let Some(id) = self.ids.get(i) {
                return Ok(id.clone());
            }
        }
        Err(InjectError::NoSuchDevice {
            device: d.to_string(),
            count: self.ids.len(),
            first: self.ids[0].clone(),
        })
    }

    /// Put a fault in force.
    pub fn inject(&self, req: FaultRequest) -> Result<ActiveFault, InjectError> {
        let device = self.resolve(&req.device, req.fault)?;
        if req.fault == FaultKind::Xid && req.xid.is_none() {
            return Err(InjectError::NoXid);
        }
        if let Some(v) = req.value {
            if !v.is_finite() {
                return Err(InjectError::NotFinite);
            }
        }
        let until = match req.duration_s {
            Some(s) if s.is_finite() && s > 0.0 && s <= 7.0 * 86_400.0 => {
                Some(Instant::now() + Duration::from_secs_f64(s))
            }
            Some(_) => return Err(InjectError::Duration),
            None => None,
        };
        let f = ActiveFault {
            device,
            request: req,
            until,
            delivered: false,
        };
        let mut faults = self.faults.locked();
        // A new fault of the same kind on the same device replaces the old one.
        faults.retain(|o| {
            !(o.device == f.device && o.request.fault == f.request.fault)
                || f.request.fault == FaultKind::Xid
        });
        // Xid events pile up while nothing samples them: bounded.
        if faults.len() >= MAX_FAULTS {
            return Err(InjectError::Full);
        }
        faults.push(f.clone());
        tracing::info!(device = %f.device, fault = ?f.request.fault, "sim: fault injected");
        Ok(f)
    }

    /// Faults in force.
    pub fn faults(&self) -> Vec<ActiveFault> {
        self.faults.locked().clone()
    }

    /// Clear every fault; returns how many there were.
    pub fn clear(&self) -> usize {
        let mut f = self.faults.locked();
        let n = f.len();
        f.clear();
        n
    }
}

struct Noise {
    rng: StdRng,
    temp: Vec<f64>,
    power: Vec<f64>,
}

/// Faults in force at once at most.
pub const MAX_FAULTS: usize = 256;

/// The UUID prefix of a node's simulated GPUs: derived from the node's name and the
/// seed (FNV-1a), so no two nodes share a UUID and a node keeps its own across
/// restarts. Alerts, KEP-4680 matching and dedup across nodes are tested honestly.
pub fn uuid_prefix(node: &str, seed: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(seed.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!(
        "GPU-5157e000-{:04x}-4{:03x}-8{:03x}-{:04x}",
        (h >> 48) & 0xffff,
        (h >> 36) & 0xfff,
        (h >> 24) & 0xfff,
        (h >> 8) & 0xffff
    )
}

/// The simulated source.
pub struct SimSource {
    vendor: Vendor,
    /// `uuid_prefix` of this node; a device's UUID adds its index (8 hex digits).
    uuid_prefix: String,
    control: std::sync::Arc<SimControl>,
    noise: Mutex<Noise>,
    scenario: Mutex<Vec<ScenarioStep>>,
    start: Instant,
}

impl SimSource {
    /// `n` devices of `vendor` on `node`, noise seeded by `seed` (default: the clock),
    /// with an optional scenario. UUIDs follow the node and `seed` (default 0), never
    /// the clock: a node keeps them across restarts.
    pub fn new(
        node: &str,
        n: u32,
        vendor: Vendor,
        seed: Option<u64>,
        scenario: Vec<ScenarioStep>,
    ) -> Self {
        let uuids = uuid_prefix(node, seed.unwrap_or(0));
        let seed = seed.unwrap_or_else(faultline_common::time::now_ms);
        let prefix = if vendor == Vendor::Ascend {
            "npu"
        } else {
            "gpu"
        };
        let ids: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let mut rng = StdRng::seed_from_u64(seed);
        let temp = (0..n).map(|_| rng.random_range(38.0..58.0)).collect();
        let power = (0..n).map(|_| rng.random_range(180.0..420.0)).collect();
        SimSource {
            vendor,
            uuid_prefix: uuids,
            control: std::sync::Arc::new(SimControl {
                ids,
                faults: Mutex::new(Vec::new()),
            }),
            noise: Mutex::new(Noise { rng, temp, power }),
            scenario: Mutex::new(scenario),
            start: Instant::now(),
        }
    }

    /// Read a scenario file.
    pub fn load_scenario(path: &std::path::Path) -> anyhow::Result<Vec<ScenarioStep>> {
        let text = std::fs::read_to_string(path)?;
        let steps: Vec<ScenarioStep> = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("scenario {}: {e}", path.display()))?;
        Ok(steps)
    }

    /// The control handle for the API.
    pub fn control(&self) -> std::sync::Arc<SimControl> {
        self.control.clone()
    }

    fn bus_id(i: usize) -> String {
        format!("{:04x}:{:02x}:00.0", i / 200, 0x18 + i % 200)
    }
}

impl Source for SimSource {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn sample(&self, _timeout: Duration) -> Result<SourceSample, ProbeError> {
        let elapsed = self.start.elapsed().as_secs_f64();
        {
            let mut sc = self.scenario.locked();
            let (due, later): (Vec<_>, Vec<_>) = sc.drain(..).partition(|s| s.at_s <= elapsed);
            *sc = later;
            for step in due {
                if let Err(e) = self.control.inject(step.fault) {
                    tracing::warn!(error = %e, "sim: scenario step rejected");
                }
            }
        }
        let now = Instant::now();
        let faults = {
            let mut f = self.control.faults.locked();
            f.retain(|x| x.until.is_none_or(|u| u > now));
            let snapshot = f.clone();
            for x in f.iter_mut() {
                x.delivered = true;
            }
            // Xid faults are events: delivered once, then gone.
            f.retain(|x| x.request.fault != FaultKind::Xid);
            snapshot
        };
        for f in faults.iter().filter(|f| f.device == "*") {
            match f.request.fault {
                FaultKind::Hang => {
                    let secs = f.request.value.unwrap_or(3600.0).clamp(0.0, 86_400.0);
                    let until = now + Duration::from_secs_f64(secs);
                    // Hang like a stuck driver call, but give up if the fault is cleared.
                    while Instant::now() < until {
                        std::thread::sleep(Duration::from_millis(20));
                        let still = self
                            .control
                            .faults
                            .locked()
                            .iter()
                            .any(|x| x.request.fault == FaultKind::Hang);
                        if !still {
                            break;
                        }
                    }
                }
                FaultKind::ProbeError => {
                    return Err(ProbeError::Call("simulated probe error".into()));
                }
                _ => {}
            }
        }
        let mut noise = self.noise.locked();
        let mut out = SourceSample::default();
        let at_ms = now_ms();
        for (i, id) in self.control.ids.iter().enumerate() {
            let Noise { rng, temp, power } = &mut *noise;
            // A bounded random walk: sensors drift a little every second.
            temp[i] = (temp[i] + rng.random_range(-0.6..0.6)).clamp(35.0, 70.0);
            power[i] = (power[i] + rng.random_range(-8.0..8.0)).clamp(120.0, 650.0);
            let mut r = DeviceReading::new(id.clone(), self.vendor, "sim");
            r.index = Some(i as u32);
            r.pci_bus_id = Some(Self::bus_id(i));
            r.temperature_c = Some((temp[i] * 10.0).round() / 10.0);
            r.power_w = Some((power[i] * 10.0).round() / 10.0);
            r.ecc = Some(EccCounts::default());
            r.pcie = Some(PcieLink {
                up: true,
                gen: Some(5),
                max_gen: Some(5),
                width: Some(16),
                max_width: Some(16),
            });
            match self.vendor {
                Vendor::Ascend => {
                    r.name = Some("Ascend910B3".into());
                    r.vendor_health = Some(VendorHealth {
                        level: VendorHealthLevel::Ok,
                        raw: "OK".into(),
                        error_codes: vec![],
                        graded: vec![],
                    });
                }
                _ => {
                    r.name = Some("NVIDIA H100 80GB HBM3 (simulated)".into());
                    r.uuid = Some(format!("{}{i:08x}", self.uuid_prefix));
                    r.throttle = Some(Throttle::default());
                    r.remapped_rows = Some(RemappedRows::default());
                    r.nvlink = Some(NvLinkState {
                        total: 18,
                        active: 18,
                        down: vec![],
                    });
                }
            }
            for f in faults.iter().filter(|f| &f.device == id) {
                let v = f.request.value;
                match f.request.fault {
                    FaultKind::HighTemp => r.temperature_c = Some(v.unwrap_or(92.0)),
                    FaultKind::EccUncorrectable => {
                        r.ecc
                            .get_or_insert_with(Default::default)
                            .volatile_uncorrected = v.unwrap_or(1.0) as u64
                    }
                    FaultKind::EccCorrectable => {
                        r.ecc
                            .get_or_insert_with(Default::default)
                            .volatile_corrected = v.unwrap_or(100.0) as u64
                    }
                    FaultKind::Lost => {
                        r.lost = true;
                        r.temperature_c = None;
                        r.power_w = None;
                    }
                    FaultKind::PcieDown => {
                        if let Some(p) = r.pcie.as_mut() {
                            p.up = false;
                        }
                        r.power_w = Some(v.unwrap_or(2.0));
                    }
                    FaultKind::PcieWidth => {
                        if let Some(p) = r.pcie.as_mut() {
                            p.width = Some(v.unwrap_or(8.0) as u32);
                        }
                    }
                    FaultKind::NvlinkDown => {
                        let nv = r.nvlink.get_or_insert_with(|| NvLinkState {
                            total: 18,
                            active: 18,
                            down: vec![],
                        });
                        nv.active = nv.active.saturating_sub(1);
                        nv.down.push(v.unwrap_or(0.0) as u32);
                    }
                    FaultKind::PowerBrake => {
                        let t = r.throttle.get_or_insert_with(Default::default);
                        t.hw_power_brake = true;
                        t.hw_slowdown = true;
                    }
                    FaultKind::RowRemapPending => {
                        r.remapped_rows.get_or_insert_with(Default::default).pending = true
                    }
                    FaultKind::RowRemapFailure => {
                        r.remapped_rows.get_or_insert_with(Default::default).failure = true
                    }
                    FaultKind::Recovery => {
                        r.recovery_action = RecoveryAction::from_nvml(v.unwrap_or(1.0) as u64)
                    }
                    FaultKind::VendorCritical => {
                        r.vendor_health = Some(VendorHealth {
                            level: VendorHealthLevel::Critical,
                            raw: "Critical".into(),
                            error_codes: vec!["0x80E01801".into()],
                            graded: vec![],
                        })
                    }
                    FaultKind::Xid => {
                        if !f.delivered {
                            let xid = f.request.xid.unwrap_or(79);
                            out.events.push(XidEvent {
                                xid,
                                class: class_of(xid),
                                pci_bus_id: r.pci_bus_id.clone(),
                                at_ms,
                                source: "sim".into(),
                                message: format!("simulated Xid {xid}"),
                            });
                        }
                    }
                    FaultKind::Hang | FaultKind::ProbeError => {}
                }
            }
            out.devices.push(r);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No two simulated nodes share a GPU UUID; a node keeps its
    /// own across restarts (the UUIDs follow the name and seed, not the clock); and
    /// injected faults are bounded.
    #[test]
    fn uuids_are_unique_per_node_and_faults_bounded() {
        let uuids = |node: &str, seed: Option<u64>| -> Vec<String> {
            SimSource::new(node, 8, Vendor::Nvidia, seed, vec![])
                .sample(Duration::from_secs(1))
                .unwrap()
                .devices
                .into_iter()
                .map(|d| d.uuid.unwrap())
                .collect()
        };
        let a = uuids("gpu-node-1", None);
        let b = uuids("gpu-node-2", None);
        assert!(a.iter().all(|u| !b.contains(u)), "{a:?} {b:?}");
        assert_eq!(a, uuids("gpu-node-1", None), "stable across restarts");
        assert_ne!(a, uuids("gpu-node-1", Some(3)));
        let mut all: Vec<&String> = a.iter().collect();
        all.dedup();
        assert_eq!(all.len(), 8);
        let s = SimSource::new("n1", 1, Vendor::Nvidia, Some(1), vec![]);
        let xid = || FaultRequest {
            xid: Some(79),
            ..req("gpu0", FaultKind::Xid)
        };
        for _ in 0..MAX_FAULTS {
            s.control().inject(xid()).unwrap();
        }
        let full = s.control().inject(xid()).unwrap_err();
        assert_eq!(full, InjectError::Full);
        assert!(full.to_string().contains("faults in force"));
        assert_eq!(s.control().clear(), MAX_FAULTS);
    }

    fn req(device: &str, fault: FaultKind) -> FaultRequest {
        FaultRequest {
            device: Some(device.into()),
            fault,
            value: None,
            xid: None,
            duration_s: None,
        }
    }

    #[test]
    fn noise_stays_plausible_and_faults_show() {
        let s = SimSource::new("n1", 4, Vendor::Nvidia, Some(7), vec![]);
        for _ in 0..50 {
            let out = s.sample(Duration::from_secs(1)).unwrap();
            assert_eq!(out.devices.len(), 4);
            for d in &out.devices {
                let t = d.temperature_c.unwrap();
                assert!((35.0..=70.0).contains(&t), "{t}");
            }
        }
        s.control().inject(req("gpu2", FaultKind::Lost)).unwrap();
        let out = s.sample(Duration::from_secs(1)).unwrap();
        assert!(out.devices[2].lost);
        assert!(!out.devices[1].lost);
    }

    #[test]
    fn an_xid_fault_is_delivered_once() {
        let s = SimSource::new("n1", 2, Vendor::Nvidia, Some(1), vec![]);
        let mut r = req("1", FaultKind::Xid);
        r.xid = Some(48);
        s.control().inject(r).unwrap();
        let first = s.sample(Duration::from_secs(1)).unwrap();
        assert_eq!(first.events.len(), 1);
        assert_eq!(first.events[0].xid, 48);
        assert_eq!(first.events[0].pci_bus_id, first.devices[1].pci_bus_id);
        assert!(s.sample(Duration::from_secs(1)).unwrap().events.is_empty());
    }

    #[test]
    fn bad_injections_are_rejected_with_a_reason() {
        let s = SimSource::new("n1", 2, Vendor::Nvidia, Some(1), vec![]);
        let c = s.control();
        assert!(c
            .inject(req("gpu9", FaultKind::Lost))
            .unwrap_err()
            .to_string()
            .contains("no simulated device"));
        assert!(c
            .inject(req("gpu0", FaultKind::Xid))
            .unwrap_err()
            .to_string()
            .contains("xid"));
        let mut r = req("gpu0", FaultKind::HighTemp);
        r.duration_s = Some(-1.0);
        assert!(c.inject(r).is_err());
    }

    #[test]
    fn scenario_steps_fire_when_due() {
        let steps: Vec<ScenarioStep> = serde_json::from_str(
            r#"[{"at_s": 0, "device": "npu1", "fault": "high-temp", "value": 97}]"#,
        )
        .unwrap();
        let s = SimSource::new("n1", 2, Vendor::Ascend, Some(1), steps);
        let out = s.sample(Duration::from_secs(1)).unwrap();
        assert_eq!(out.devices[1].temperature_c, Some(97.0));
    }
}
