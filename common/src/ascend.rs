//! Ascend fault codes graded as MindCluster's device plugin grades them.
//!
//! A chip reports fault codes (DCMI `dcmi_get_device_errorcode_v2`, npu-smi `-t health`)
//! whatever its health level says; the plugin decides what to do from the codes, each
//! listed at a level in `faultCode.json` (NotHandleFault ... SeparateNPU). The table is
//! `ascend_fault_codes.tsv`, one row per code with its level, our status, the reason and
//! the source; a site overrides rows with a file of the same columns.
//!
//! One difference, on purpose: the plugin separates a chip on a code it has never seen
//! (unless the fault event said the severity was minor); we call it degraded, reason
//! `ascend-unknown-fault-code`, since we never fail a device on a guess.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::status::DeviceStatus;

const CATALOG_TSV: &str = include_str!("ascend_fault_codes.tsv");

/// The reason of a code in no row.
pub const UNKNOWN_CODE_REASON: &str = "ascend-unknown-fault-code";

/// MindCluster's fault levels, least severe first (`getMostSeriousFaultType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Level {
    /// Nothing to do.
    NotHandleFault,
    /// Sub-health: keep watching.
    SubHealthFault,
    /// The job should be restarted.
    RestartRequest,
    /// The business (job) must be restarted.
    RestartBusiness,
    /// Reset the NPU once it is free.
    FreeRestartNPU,
    /// Reset the NPU now.
    RestartNPU,
    /// Isolate the NPU once its job ends.
    PreSeparateNPU,
    /// Isolate the NPU.
    SeparateNPU,
    /// Isolated until a person says otherwise (the plugin's frequency rules).
    ManuallySeparateNPU,
}

impl Level {
    /// The plugin's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::NotHandleFault => "NotHandleFault",
            Level::SubHealthFault => "SubHealthFault",
            Level::RestartRequest => "RestartRequest",
            Level::RestartBusiness => "RestartBusiness",
            Level::FreeRestartNPU => "FreeRestartNPU",
            Level::RestartNPU => "RestartNPU",
            Level::PreSeparateNPU => "PreSeparateNPU",
            Level::SeparateNPU => "SeparateNPU",
            Level::ManuallySeparateNPU => "ManuallySeparateNPU",
        }
    }

    /// Parse the plugin's name.
    pub fn parse(s: &str) -> Option<Level> {
        [
            Level::NotHandleFault,
            Level::SubHealthFault,
            Level::RestartRequest,
            Level::RestartBusiness,
            Level::FreeRestartNPU,
            Level::RestartNPU,
            Level::PreSeparateNPU,
            Level::SeparateNPU,
            Level::ManuallySeparateNPU,
        ]
        .into_iter()
        .find(|l| l.as_str() == s)
    }

    /// Our status for a level, where a row does not say: the chip must not take work
    /// (failed) for RestartNPU and the separations; PreSeparateNPU and FreeRestartNPU
    /// (which the plugin keeps in service only while a job uses the chip), the restarts
    /// and sub-health are degraded; NotHandleFault is a finding on a healthy chip.
    /// docs/ascend.md (Grading) says per level what follows and why.
    pub fn default_status(self) -> DeviceStatus {
        match self {
            Level::NotHandleFault => DeviceStatus::Healthy,
            Level::SubHealthFault
            | Level::RestartRequest
            | Level::RestartBusiness
            | Level::FreeRestartNPU
            | Level::PreSeparateNPU => DeviceStatus::Degraded,
            Level::RestartNPU | Level::SeparateNPU | Level::ManuallySeparateNPU => {
                DeviceStatus::Failed
            }
        }
    }

    /// Our reason for a level, where a row does not say.
    pub fn default_reason(self) -> &'static str {
        match self {
            Level::NotHandleFault => "ascend-not-handle",
            Level::SubHealthFault => "ascend-subhealth",
            Level::RestartRequest => "ascend-restart-request",
            Level::RestartBusiness => "ascend-restart-business",
            Level::FreeRestartNPU => "ascend-free-restart-npu",
            Level::RestartNPU => "ascend-restart-npu",
            Level::PreSeparateNPU => "ascend-pre-separate-npu",
            Level::SeparateNPU => "ascend-separate-npu",
            Level::ManuallySeparateNPU => "ascend-manually-separate-npu",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// MindCluster's level.
    pub level: Level,
    /// Our status.
    pub status: DeviceStatus,
    /// Our reason.
    pub reason: String,
}

/// One code of a chip, graded: what the agent serves next to the code.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GradedCode {
    /// The code, upper-case hex (`8C03A000`).
    pub code: String,
    /// MindCluster's level; `null` for a code in no row.
    pub level: Option<Level>,
    /// What it makes of the chip.
    pub status: DeviceStatus,
    /// Why.
    pub reason: String,
}

/// The table: the built-in rows, with a site's overrides on top.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    rows: BTreeMap<u32, Row>,
}

fn parse_status(s: &str) -> Option<DeviceStatus> {
    match s {
        "failed" => Some(DeviceStatus::Failed),
        "degraded" => Some(DeviceStatus::Degraded),
        "healthy" => Some(DeviceStatus::Healthy),
        _ => None,
    }
}

/// A line of a fault-code table that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {what}: {text:?}")]
pub struct BadLine {
    /// 1-based.
    pub line: usize,
    pub what: &'static str,
    pub text: String,
}

fn check_reason(reason: &str) -> Result<(), &'static str> {
    if reason.len() > 64
        || !reason
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err("reason: at most 64 of [a-zA-Z0-9-]");
    }
    Ok(())
}

/// A code as the vendor prints it (`8C03A000`, `0x8c03a000`), as a number.
pub fn parse_code(s: &str) -> Option<u32> {
    let s = s.trim();
    let s = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    // Hex digits only: `from_str_radix` alone would take a sign ("+1").
    if s.is_empty() || s.len() > 8 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl Catalog {
    /// The built-in table (`ascend_fault_codes.tsv`).
    pub fn builtin() -> &'static Catalog {
        static C: std::sync::OnceLock<Catalog> = std::sync::OnceLock::new();
        C.get_or_init(|| {
            let mut c = Catalog {
                rows: BTreeMap::new(),
            };
            c.apply(CATALOG_TSV)
                .expect("the built-in Ascend fault-code table parses");
            c
        })
    }

    /// The built-in table with `overrides` (the same columns: `code level [status
    /// [reason]]`, tab or space separated, `#` comments) applied on top.
    pub fn with_overrides(overrides: &str) -> Result<Catalog, BadLine> {
        let mut c = Catalog::builtin().clone();
        c.apply(overrides)?;
        Ok(c)
    }

    fn apply(&mut self, text: &str) -> Result<(), BadLine> {
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let f: Vec<&str> = if line.contains('\t') {
                line.split('\t').map(str::trim).collect()
            } else {
                line.split_whitespace().collect()
            };
            let bad = |what: &'static str| BadLine {
                line: n + 1,
                what,
                text: line.to_string(),
            };
            // `LEVEL STATUS [REASON]`: every code at that level so far (e.g.
            // `RestartBusiness failed`, to follow the plugin, which takes such a chip
            // out of service, rather than our default).
            if let Some(level) = f.first().and_then(|l| Level::parse(l)) {
                let status = f.get(1).and_then(|s| parse_status(s)).ok_or_else(|| {
                    bad("a level line needs a status: failed, degraded or healthy")
                })?;
                let reason = f.get(2).filter(|s| !s.is_empty()).map(|s| s.to_string());
                if let Some(r) = &reason {
                    check_reason(r).map_err(bad)?;
                }
                for row in self.rows.values_mut().filter(|r| r.level == level) {
                    row.status = status;
                    if let Some(r) = &reason {
                        row.reason = r.clone();
                    }
                }
                continue;
            }
            let code = f
                .first()
                .and_then(|c| parse_code(c))
                .ok_or_else(|| bad("not a 32-bit hex code"))?;
            let level = f
                .get(1)
                .and_then(|l| Level::parse(l))
                .ok_or_else(|| bad("unknown level (NotHandleFault ... ManuallySeparateNPU)"))?;
            let status = match f.get(2).filter(|s| !s.is_empty()) {
                Some(s) => {
                    parse_status(s).ok_or_else(|| bad("status: failed, degraded or healthy"))?
                }
                None => level.default_status(),
            };
            let reason = f
                .get(3)
                .filter(|s| !s.is_empty())
                .map(|s| s.to_string())
                .unwrap_or_else(|| level.default_reason().to_string());
            check_reason(&reason).map_err(bad)?;
            self.rows.insert(
                code,
                Row {
                    level,
                    status,
                    reason,
                },
            );
        }
        Ok(())
    }

    /// The row of `code`, if there is one.
    pub fn row(&self, code: u32) -> Option<&Row> {
        self.rows.get(&code)
    }

    /// Rows in the table.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Every row, by code.
    pub fn rows(&self) -> impl Iterator<Item = (u32, &Row)> {
        self.rows.iter().map(|(c, r)| (*c, r))
    }

    /// The reasons of the rows that fail a chip, each once.
    pub fn failed_reasons(&self) -> std::collections::BTreeSet<&str> {
        self.rows
            .values()
            .filter(|r| r.status == DeviceStatus::Failed)
            .map(|r| r.reason.as_str())
            .collect()
    }

    /// Grade one code.
    pub fn grade(&self, code: u32) -> GradedCode {
        match self.row(code) {
            Some(r) => GradedCode {
                code: format!("{code:08X}"),
                level: Some(r.level),
                status: r.status,
                reason: r.reason.clone(),
            },
            None => GradedCode {
                code: format!("{code:08X}"),
                level: None,
                status: DeviceStatus::Degraded,
                reason: UNKNOWN_CODE_REASON.to_string(),
            },
        }
    }

    /// Grade the codes a chip reported (as printed), skipping what is not a code;
    /// the worst first.
    pub fn grade_all<'a>(&self, codes: impl IntoIterator<Item = &'a str>) -> Vec<GradedCode> {
        let mut out: Vec<GradedCode> = codes
            .into_iter()
            .filter_map(parse_code)
            .filter(|c| *c != 0)
            .map(|c| self.grade(c))
            .collect();
        out.sort_by(|a, b| a.code.cmp(&b.code));
        out.dedup_by(|a, b| a.code == b.code);
        worst_first(&mut out);
        out
    }
}

pub(crate) fn worst_first(g: &mut [GradedCode]) {
    g.sort_by_key(|g| {
        (
            std::cmp::Reverse(g.status.severity()),
            std::cmp::Reverse(g.level),
        )
    });
}

/// An Ascend 950 UB (Unified Bus) port down, as DCMI and npu-smi print it.
pub const UB_PORT_DOWN: &str = "81B18603";
/// The reason of a chip separated for its UB port ([`grade_ub_port_down`]).
pub const UB_PORT_DOWN_REASON: &str = "ub-port-down";

/// What the device plugin makes of a UB port down on a 950 (mind-cluster@22bb3d98
/// `component/ascend-device-plugin/pkg/common/fault_code.go`): the code itself is
/// NotHandleFault, but `a950HyperPlaneFaultOccur` adds its synthetic
/// `UBSeparateFaultCode` (0x020001002, listed under SeparateNPU) to the chip, and
/// `a950HyperPlaneNewOverallFaultModify` swaps it for `UBSubHealFaultCode`
/// (0x020000002, SubHealthFault) on every chip when every chip of the node has the
/// port down (the plane, a switch, is at fault, not the chips). The synthetic codes are
/// not in our table (DCMI never reports them): the port-down row of each chip is
/// graded here instead, across the node's chips (`chips`: the graded codes of the
/// `node_chips` chips read; a chip whose health could not be read has none).
pub fn grade_ub_port_down(chips: &mut [&mut Vec<GradedCode>], node_chips: usize) {
    let down = |g: &Vec<GradedCode>| g.iter().any(|c| c.code == UB_PORT_DOWN);
    let n = chips.iter().filter(|g| down(g)).count();
    if n == 0 {
        return;
    }
    let every = n == node_chips;
    for g in chips.iter_mut().filter(|g| down(g)) {
        for c in g.iter_mut().filter(|c| c.code == UB_PORT_DOWN) {
            (c.level, c.status, c.reason) = if every {
                (
                    Some(Level::SubHealthFault),
                    DeviceStatus::Degraded,
                    "ub-port-down-every-chip".into(),
                )
            } else {
                (
                    Some(Level::SeparateNPU),
                    DeviceStatus::Failed,
                    UB_PORT_DOWN_REASON.into(),
                )
            };
        }
        worst_first(g);
    }
}

/// The physical id of the chip behind a device name of Huawei's device plugin, the
/// `resourceID` the kubelet reports for a pod's NPU (KEP-4680): `Ascend910-3` (chip 3;
/// `assemblePhyDevices`: `"%s-%d", devType, PhyID`) or a virtual NPU `Ascend910-2c-100-3`
/// (`"%s-%d-%d", vDeviType, VDevID, phyID`: the last number is the chip). `None` for
/// anything else. On a 950 (`huawei.com/npu`) the name is `npu-3`.
pub fn chip_of_device_name(name: &str) -> Option<u32> {
    // Ascend 950 ("A5"): `huawei.com/npu`, devices `npu-<phyID>` (ascend910.go).
    let phy = match name.strip_prefix("npu-") {
        Some(phy) => phy,
        None => {
            let (model, phy) = name.strip_prefix("Ascend")?.rsplit_once('-')?;
            if !model.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                return None;
            }
            phy
        }
    };
    if phy.is_empty() || phy.len() > 5 || !phy.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    phy.parse().ok()
}

/// The pod annotation where Huawei's device plugin names the chips a pod really holds
/// (`Ascend910-0,Ascend910-1`, physical ids; `ascendcommon.go`). With Volcano
/// (`-volcanoType=true`) the device ids the kubelet allocated, and reports in
/// `allocatedResourcesStatus`, are aliases the plugin maps to other chips.
pub const REAL_CHIPS_ANNOTATION: &str = "huawei.com/AscendReal";

/// Whether the agent's chip id (`npu3`: the chip's physical id, as DCMI and npu-smi
/// name it) and a device plugin's device name (`Ascend910-3`) are the same chip.
pub fn same_chip(chip_id: &str, device_name: &str) -> bool {
    let Some(phy) = chip_id.strip_prefix("npu") else {
        return false;
    };
    !phy.is_empty()
        && phy.bytes().all(|b| b.is_ascii_digit())
        && chip_of_device_name(device_name).is_some_and(|n| phy.parse() == Ok(n))
}

/// RoCE network health as `dcmi_get_device_network_health` reports it
/// (`enum dcmi_rdfx_detect_result`): 0 (OK) and 6 (the detection task is starting)
/// count as healthy, as in npu-exporter's `getNetworkHealthy`.
pub fn roce_healthy(result: u32) -> bool {
    matches!(result, 0 | 6)
}

/// `dcmi_get_device_boot_status`: only 16 (`DCMI_SYSTEM_START_FINISH`) is started; 0-3
/// are still booting (Huawei's plugin waits for 16 after a reset).
pub const BOOT_FINISHED: u32 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_every_level_and_the_plugins_precedence() {
        let c = Catalog::builtin();
        // npu-smi's example (MINDCLUSTER.md 10.1): A4025021 NotHandle, 8C03A000
        // RestartNPU, 8C084E00 FreeRestartNPU: the chip is failed for RestartNPU.
        let g = c.grade_all(["A4025021", "8C03A000", "8C084E00"]);
        assert_eq!(g[0].code, "8C03A000");
        assert_eq!(g[0].level, Some(Level::RestartNPU));
        assert_eq!(g[0].status, DeviceStatus::Failed);
        assert_eq!(g[1].level, Some(Level::FreeRestartNPU));
        assert_eq!(g[1].status, DeviceStatus::Degraded);
        assert_eq!(g[2].status, DeviceStatus::Healthy);
        // A2301001 is in RestartBusiness and SeparateNPU: the most severe wins.
        assert_eq!(c.grade(0xA230_1001).level, Some(Level::SeparateNPU));
        assert_eq!(c.grade(0x40F8_4E00).reason, "card-drop");
        // A code reported twice counts once.
        assert_eq!(c.grade_all(["8C03A000", "A4025021", "8C03A000"]).len(), 2);
    }

    /// The table is faultCode.json at mind-cluster@22bb3d98, code for code:
    /// 797 codes, each at the most severe level that names it.
    #[test]
    fn the_table_is_the_plugins_faultcode_json_code_for_code() {
        let c = Catalog::builtin();
        assert_eq!(c.len(), 797);
        let mut by_level: BTreeMap<Level, usize> = BTreeMap::new();
        for (_, r) in c.rows() {
            *by_level.entry(r.level).or_default() += 1;
        }
        assert_eq!(
            by_level.into_iter().collect::<Vec<_>>(),
            [
                (Level::NotHandleFault, 131),
                (Level::SubHealthFault, 11),
                (Level::RestartRequest, 33),
                (Level::RestartBusiness, 24),
                (Level::FreeRestartNPU, 23),
                (Level::RestartNPU, 162),
                (Level::PreSeparateNPU, 199),
                (Level::SeparateNPU, 214),
            ]
        );
        // Each level's default status, except where a row says otherwise: RestartNPU's
        // card drop keeps its own reason, and no row changes a status.
        for (code, r) in c.rows() {
            assert_eq!(r.status, r.level.default_status(), "{code:08X}");
        }
    }

    /// A 950's UB port down separates the chip unless every chip of
    /// the node has it (then sub-health, the plane's fault), as the plugin does.
    #[test]
    fn a_ub_port_down_separates_the_chip_unless_every_chip_has_it() {
        let c = Catalog::builtin();
        assert_eq!(c.grade(0x81B1_8603).level, Some(Level::NotHandleFault));
        let mut a = c.grade_all([UB_PORT_DOWN, "80A18006"]);
        let mut b = c.grade_all(["80A18006"]);
        grade_ub_port_down(&mut [&mut a, &mut b], 2);
        assert_eq!(
            (
                a[0].code.as_str(),
                a[0].level,
                a[0].status,
                a[0].reason.as_str()
            ),
            (
                UB_PORT_DOWN,
                Some(Level::SeparateNPU),
                DeviceStatus::Failed,
                "ub-port-down"
            )
        );
        assert_eq!(b[0].status, DeviceStatus::Healthy);
        let mut a = c.grade_all([UB_PORT_DOWN]);
        let mut b = c.grade_all([UB_PORT_DOWN]);
        // Two of three chips (the third unread): the chips', not the plane's.
        let (mut a3, mut b3) = (a.clone(), b.clone());
        grade_ub_port_down(&mut [&mut a3, &mut b3], 3);
        assert_eq!(a3[0].status, DeviceStatus::Failed);
        grade_ub_port_down(&mut [&mut a, &mut b], 2);
        for g in [&a, &b] {
            assert_eq!(
                (g[0].level, g[0].status),
                (Some(Level::SubHealthFault), DeviceStatus::Degraded)
            );
        }
    }

    #[test]
    fn an_unknown_code_is_degraded_never_failed() {
        let g = Catalog::builtin().grade(0x1234_5678);
        assert_eq!((g.level, g.status), (None, DeviceStatus::Degraded));
        assert_eq!(g.reason, UNKNOWN_CODE_REASON);
    }

    #[test]
    fn a_site_overrides_levels_and_bad_lines_are_refused() {
        let c = Catalog::with_overrides(
            "# ours\n8C084E00 SeparateNPU\n0x12345678\tRestartNPU\tdegraded\tsite-thing\n",
        )
        .unwrap();
        assert_eq!(c.grade(0x8C08_4E00).status, DeviceStatus::Failed);
        let g = c.grade(0x1234_5678);
        assert_eq!(
            (g.status, g.reason.as_str()),
            (DeviceStatus::Degraded, "site-thing")
        );
        // A level line moves every code of that level.
        let c = Catalog::with_overrides("RestartBusiness failed\n").unwrap();
        assert_eq!(c.grade(0x80E0_1801).status, DeviceStatus::Failed);
        assert_eq!(c.grade(0x80E0_1801).reason, "hbm-double-bit");
        assert_eq!(
            c.grade(0x80C9_8009).status,
            DeviceStatus::Degraded,
            "RestartRequest"
        );
        assert!(Catalog::with_overrides("RestartBusiness").is_err());
        assert!(Catalog::with_overrides("RestartBusiness failed bad/reason").is_err());
        assert!(Catalog::with_overrides("XYZ SeparateNPU").is_err());
        assert!(Catalog::with_overrides("8C084E00 Broken").is_err());
        assert!(Catalog::with_overrides("8C084E00 SeparateNPU sick").is_err());
        assert!(Catalog::with_overrides("8C084E00 SeparateNPU failed bad/reason").is_err());
    }

    #[test]
    fn a_device_plugin_name_names_its_chip_by_physical_id() {
        assert_eq!(chip_of_device_name("Ascend910-3"), Some(3));
        assert_eq!(chip_of_device_name("Ascend310P-12"), Some(12));
        assert_eq!(chip_of_device_name("Ascend910-2c-100-3"), Some(3));
        for bad in [
            "Ascend910",
            "Ascend910-",
            "ascend910-3",
            "GPU-3",
            "Ascend910-x",
            "Ascend 910-3",
        ] {
            assert_eq!(chip_of_device_name(bad), None, "{bad}");
        }
        assert_eq!(chip_of_device_name("npu-3"), Some(3));
        assert_eq!(chip_of_device_name("npu-core-3"), None);
        assert!(same_chip("npu3", "Ascend910-3"));
        assert!(same_chip("npu3", "Ascend910-4c-101-3"));
        assert!(!same_chip("npu3", "Ascend910-13"));
        assert!(!same_chip("npu3-1", "Ascend910-3"));
        assert!(!same_chip("gpu3", "Ascend910-3"));
    }

    #[test]
    fn codes_parse_as_printed() {
        assert_eq!(parse_code("8C03A000"), Some(0x8C03_A000));
        assert_eq!(parse_code("0x8c03a000"), Some(0x8C03_A000));
        assert_eq!(
            parse_code("200001002"),
            None,
            "the plugin's synthetic codes"
        );
        assert_eq!(parse_code("NA"), None);
        assert!(roce_healthy(0) && roce_healthy(6) && !roce_healthy(3));
    }
}
