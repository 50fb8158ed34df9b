//! The `npu-smi` source itself: the calls, their shared deadline, and the chips read
//! from `parser`'s tables.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use faultline_common::sync::Locked;
use faultline_common::{
    DeviceReading, EccCounts, PcieLink, Vendor, VendorHealth, VendorHealthLevel,
};

use super::super::{process, ProbeError, Source, SourceSample};

/// `npu-smi` output that could not be understood, as the probe's error.
fn parse_error(e: super::parser::NpuSmiError) -> ProbeError {
    ProbeError::Parse(e.to_string())
}

/// ECC counters are read every this many samples.
pub const ECC_EVERY: u64 = 10;

/// The npu-smi source.
pub struct NpuSmiSource {
    program: String,
    samples: Mutex<u64>,
    ecc: Mutex<HashMap<String, EccCounts>>,
    multi_chip: std::sync::atomic::AtomicBool,
    fault_codes: std::sync::Arc<faultline_common::ascend::Catalog>,
    across: super::super::AcrossChips,
    /// Where the `davinciN` device nodes are (`/dev`).
    davinci_dir: std::path::PathBuf,
    /// (NPU, chip) -> physical id, once learned.
    phys: Mutex<HashMap<(u32, u32), u32>>,
    /// When the davinci nodes were last asked (at most once a minute).
    phy_scan: Mutex<Option<Instant>>,
}

impl NpuSmiSource {
    /// `program`: path or name on PATH.
    pub fn new(program: String) -> Self {
        NpuSmiSource {
            program,
            samples: Mutex::new(0),
            ecc: Mutex::new(HashMap::new()),
            multi_chip: std::sync::atomic::AtomicBool::new(false),
            fault_codes: std::sync::Arc::new(faultline_common::ascend::Catalog::builtin().clone()),
            across: super::super::AcrossChips::default(),
            davinci_dir: std::path::PathBuf::from("/dev"),
            phys: Mutex::new(HashMap::new()),
            phy_scan: Mutex::new(None),
        }
    }

    /// Where the `davinciN` device nodes are (default `/dev`).
    pub fn with_davinci_dir(mut self, dir: std::path::PathBuf) -> Self {
        self.davinci_dir = dir;
        self
    }

    /// Learn the physical ids of `chips`: the table's, else `phyid-remap` for each
    /// davinci node (once, then at most once a minute while a chip is missing).
    fn learn_phys(&self, chips: &[super::parser::InfoChip], deadline: Instant) -> Option<String> {
        let mut phys = self.phys.locked().clone();
        for c in chips {
            if let Some(p) = c.phy {
                phys.entry((c.npu, c.chip)).or_insert(p);
            }
        }
        let missing = chips.iter().any(|c| !phys.contains_key(&(c.npu, c.chip)));
        let due = {
            let mut last = self.phy_scan.locked();
            let due = missing && last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
            if due {
                *last = Some(Instant::now());
            }
            due
        };
        let mut err = None;
        if due {
            let nodes: Vec<u32> = std::fs::read_dir(&self.davinci_dir)
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .filter_map(|e| {
                            e.file_name()
                                .to_str()?
                                .strip_prefix("davinci")?
                                .parse::<u32>()
                                .ok()
                        })
                        .collect()
                })
                .unwrap_or_default();
            for n in nodes.into_iter().filter(|n| *n < 256) {
                if phys.values().any(|p| *p == n) {
                    continue;
                }
                let p = n.to_string();
                match self
                    .run(&["info", "-t", "phyid-remap", "-p", &p], deadline)
                    .and_then(|t| super::parser::parse_phyid_remap(&t).map_err(parse_error))
                {
                    Ok((phy, npu, chip)) => {
                        phys.entry((npu, chip)).or_insert(phy);
                    }
                    Err(e) => err = Some(format!("physical id of davinci{n}: {e}")),
                }
            }
        }
        *self.phys.locked() = phys;
        err
    }

    /// Grade `-t health` codes with this table (the built-in one by default).
    pub fn with_fault_codes(
        mut self,
        fault_codes: std::sync::Arc<faultline_common::ascend::Catalog>,
    ) -> Self {
        self.fault_codes = fault_codes;
        self
    }

    /// Escalate codes by these rules (MindCluster's by default).
    pub fn with_escalation(
        mut self,
        rules: std::sync::Arc<faultline_common::ascend_escalation::Escalation>,
    ) -> Self {
        self.across = super::super::AcrossChips::new(rules);
        self
    }

    fn run(&self, args: &[&str], deadline: Instant) -> Result<String, ProbeError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ProbeError::Timeout(Duration::ZERO));
        }
        let mut argv = vec![self.program.clone()];
        argv.extend(args.iter().map(|s| s.to_string()));
        process::run(&argv, left)
    }
}

impl Source for NpuSmiSource {
    fn name(&self) -> &'static str {
        "npu-smi"
    }

    fn sample(&self, timeout: Duration) -> Result<SourceSample, ProbeError> {
        let deadline = Instant::now() + timeout;
        let info = self.run(&["info"], deadline)?;
        let chips = super::parser::parse_info(&info).map_err(parse_error)?;
        let n = {
            let mut s = self.samples.locked();
            *s += 1;
            *s
        };
        let read_ecc = n % ECC_EVERY == 1;
        // Once a chip other than 0 was seen, ids stay `npuN-C` even if a chip drops out
        // of the table: ids must not change under the aggregator's feet.
        if chips.iter().any(|c| c.chip > 0) {
            self.multi_chip
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let multi_chip = self.multi_chip.load(std::sync::atomic::Ordering::Relaxed);
        let phy_error = self.learn_phys(&chips, deadline);
        let phys = self.phys.locked().clone();
        let any_phy = chips.iter().any(|c| phys.contains_key(&(c.npu, c.chip)));
        let mut out = SourceSample::default();
        for c in chips {
            let phy = phys.get(&(c.npu, c.chip)).copied();
            // One name per chip, the dcmi source's: its physical id. A chip whose id
            // is not known while others' are gets `npuN-C`, which no physical name
            // can collide with.
            let id = match phy {
                Some(p) => format!("npu{p}"),
                None if multi_chip || any_phy => format!("npu{}-{}", c.npu, c.chip),
                None => format!("npu{}", c.npu),
            };
            let (i, ch) = (c.npu.to_string(), c.chip.to_string());
            let mut r = DeviceReading::new(id.clone(), Vendor::Ascend, "npu-smi");
            r.index = phy.or(Some(c.npu));
            r.ascend = Some(faultline_common::AscendIds {
                phy_id: phy,
                logic_id: None,
                card: i32::try_from(c.npu).ok(),
                chip: i32::try_from(c.chip).ok(),
            });
            if let (None, Some(e)) = (phy, &phy_error) {
                r.probe_errors.push(e.clone());
            }
            r.name = Some(c.name);
            r.pci_bus_id = c.bus_id;
            r.power_w = c.power_w;
            r.temperature_c = c.temp_c;
            // npu-smi lists only chips that answer on the bus.
            r.pcie = Some(PcieLink {
                up: true,
                ..Default::default()
            });
            match super::parser::health_level(&c.health) {
                Some(VendorHealthLevel::Ok) => {
                    r.vendor_health = Some(VendorHealth {
                        level: VendorHealthLevel::Ok,
                        raw: c.health.clone(),
                        error_codes: vec![],
                        graded: vec![],
                    })
                }
                level => {
                    // Ask for the error codes; fall back to the table's word.
                    match self
                        .run(&["info", "-t", "health", "-i", &i, "-c", &ch], deadline)
                        .and_then(|t| super::parser::parse_health(&t).map_err(parse_error))
                    {
                        Ok(mut h) => {
                            // Graded as MindCluster grades them: the codes decide.
                            h.graded = self
                                .fault_codes
                                .grade_all(h.error_codes.iter().map(String::as_str));
                            r.vendor_health = Some(h)
                        }
                        Err(e) => {
                            r.probe_errors.push(format!("health: {e}"));
                            r.vendor_health = level.map(|level| VendorHealth {
                                level,
                                raw: c.health.clone(),
                                error_codes: vec![],
                                graded: vec![],
                            });
                        }
                    }
                }
            }
            if r.temperature_c.is_none() {
                match self.run(&["info", "-t", "common", "-i", &i, "-c", &ch], deadline) {
                    Ok(t) => {
                        let (temp, power) = super::parser::parse_common(&t);
                        r.temperature_c = temp;
                        r.power_w = r.power_w.or(power);
                    }
                    Err(e) => r.probe_errors.push(format!("common: {e}")),
                }
            }
            // The cache lock is never held across a child process (which may hang).
            let cached = self.ecc.locked().get(&id).copied();
            r.ecc = cached;
            if read_ecc || cached.is_none() {
                match self
                    .run(&["info", "-t", "ecc", "-i", &i, "-c", &ch], deadline)
                    .and_then(|t| super::parser::parse_ecc(&t).map_err(parse_error))
                {
                    Ok(e) => {
                        r.ecc = Some(e);
                        self.ecc.locked().insert(id.clone(), e);
                    }
                    Err(e) => r.probe_errors.push(format!("ecc: {e}")),
                }
            }
            // Without a health verdict the chip's numbers do not make it healthy: report
            // nothing, and its last good reading ages into unknown.
            if r.vendor_health.is_none() {
                let mut blank = DeviceReading::new(r.id.clone(), Vendor::Ascend, "npu-smi");
                blank.probe_errors = r.probe_errors;
                blank
                    .probe_errors
                    .push(format!("health: {:?} is not a known health word", c.health));
                out.devices.push(blank);
                continue;
            }
            out.devices.push(r);
        }
        self.across.apply(&mut out.devices);
        Ok(out)
    }

    fn enforces_timeout(&self) -> bool {
        true
    }

    fn needs_warm_up(&self) -> bool {
        true
    }
}
