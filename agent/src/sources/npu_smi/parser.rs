//! Parsers of `npu-smi` output: the `info` table (single-chip and multi-chip layouts,
//! `-`/`NA` fields) and the `-t health`, `-t common`, `-t ecc` key/value outputs.

use faultline_common::{normalize_bus_id, EccCounts, VendorHealth, VendorHealthLevel};

/// One chip row pair of `npu-smi info`.
#[derive(Debug, Clone, PartialEq)]
pub struct InfoChip {
    /// NPU id (first column of the first row).
    pub npu: u32,
    /// Chip id within the NPU.
    pub chip: u32,
    /// Product name (`910B3`, `Ascend910`, `310P3`).
    pub name: String,
    /// The Health column as printed.
    pub health: String,
    /// Power in W, when printed (`-` and `NA` are absent).
    pub power_w: Option<f64>,
    /// Temperature in C.
    pub temp_c: Option<f64>,
    /// Bus id, normalised.
    pub bus_id: Option<String>,
    /// Physical id, where the table prints one (`Chip  Phy-ID` on Atlas A3,
    /// `npu_info_print.c`).
    pub phy: Option<u32>,
}

/// Map the Health word to a level. `None` for words we do not know.
pub fn health_level(word: &str) -> Option<VendorHealthLevel> {
    match word.trim().to_ascii_lowercase().as_str() {
        "ok" => Some(VendorHealthLevel::Ok),
        "warning" => Some(VendorHealthLevel::Warning),
        "alarm" => Some(VendorHealthLevel::Alarm),
        "critical" => Some(VendorHealthLevel::Critical),
        _ => None,
    }
}

fn number(s: &str) -> Option<f64> {
    s.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Output of `npu-smi` that could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NpuSmiError {
    #[error("line {line}: chip row without a Health column")]
    NoHealthColumn { line: usize },
    #[error("line {line}: {text:?} is not a bus id")]
    BusId { line: usize, text: String },
    #[error("output ends in the middle of a chip")]
    HalfChip,
    #[error("no chip rows in npu-smi info output")]
    NoChips,
    #[error("no physical id, NPU ID and Chip ID in {0:?}")]
    NoIds(String),
    #[error("no known Health Status in output (got {0:?})")]
    NoHealth(String),
    #[error("no ECC counters in output")]
    NoEcc,
}

/// Parse `npu-smi info`. Errors when no chip row is found or a row pair is broken.
pub fn parse_info(text: &str) -> Result<Vec<InfoChip>, NpuSmiError> {
    let mut out = Vec::new();
    // The first row of a chip, waiting for its second row.
    let mut pending: Option<InfoChip> = None;
    // The second header row names the second number of a chip's second row: `Phy-ID`
    // (A3) or `Device` (310P); 910B prints the chip alone.
    let mut phy_column = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if !line.starts_with('|') {
            continue;
        }
        if line.starts_with("| Chip") && line.contains("Bus-Id") {
            phy_column = line.contains("Phy-ID");
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.len() < 3 {
            continue;
        }
        // The process table starts with its own header: nothing after it is a chip.
        if cells[1].starts_with("Process id") {
            break;
        }
        let first: Vec<&str> = cells[0].split_whitespace().collect();
        let Some(lead) = first.first().and_then(|w| w.parse::<u32>().ok()) else {
            continue; // a header row
        };
        match pending.take() {
            None => {
                // First row: NPU, name | health | power temp ...
                let metrics: Vec<&str> = cells[2].split_whitespace().collect();
                if cells[1].is_empty() {
                    return Err(NpuSmiError::NoHealthColumn { line: n + 1 });
                }
                pending = Some(InfoChip {
                    npu: lead,
                    chip: 0,
                    name: first[1..].join(" "),
                    health: cells[1].to_string(),
                    power_w: metrics.first().and_then(|s| number(s)),
                    temp_c: metrics.get(1).and_then(|s| number(s)),
                    bus_id: None,
                    phy: None,
                });
            }
            Some(mut chip) => {
                // Second row: chip [phy-id/device] | bus id | ...
                chip.bus_id = normalize_bus_id(cells[1]);
                if chip.bus_id.is_none() && !matches!(cells[1], "-" | "NA") {
                    return Err(NpuSmiError::BusId {
                        line: n + 1,
                        text: cells[1].to_string(),
                    });
                }
                chip.chip = lead;
                if phy_column {
                    chip.phy = first.get(1).and_then(|w| w.parse().ok());
                }
                out.push(chip);
            }
        }
    }
    if pending.is_some() {
        return Err(NpuSmiError::HalfChip);
    }
    if out.is_empty() {
        return Err(NpuSmiError::NoChips);
    }
    Ok(out)
}

fn fields(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines().filter_map(|l| {
        let (k, v) = l.split_once(':')?;
        Some((k.trim(), v.trim()))
    })
}

/// Parse `npu-smi info -t phyid-remap -p PHY` (`npu_chip_info.c`: `Chip Physical ID`,
/// `Chip Logic ID`, `NPU ID`, `Chip ID`, each `"\t%-30s:%lu"`): (NPU, chip) of the
/// physical id asked.
pub fn parse_phyid_remap(text: &str) -> Result<(u32, u32, u32), NpuSmiError> {
    let (mut phy, mut npu, mut chip) = (None, None, None);
    for (k, v) in fields(text) {
        let v = v.parse::<u32>().ok();
        match k {
            "Chip Physical ID" | "Chip Phy-ID" => phy = v,
            "NPU ID" => npu = v,
            "Chip ID" => chip = v,
            _ => {}
        }
    }
    match (phy, npu, chip) {
        (Some(p), Some(n), Some(c)) => Ok((p, n, c)),
        _ => Err(NpuSmiError::NoIds(text.to_string())),
    }
}

/// Parse `npu-smi info -t health -i N -c C`.
pub fn parse_health(text: &str) -> Result<VendorHealth, NpuSmiError> {
    let mut level = None;
    let mut raw = String::new();
    let mut codes = Vec::new();
    for (k, v) in fields(text) {
        match k {
            "Health Status" => {
                raw = v.to_string();
                level = health_level(v);
            }
            "Error Code" => {
                codes = v
                    .split_whitespace()
                    .filter(|c| *c != "NA" && c.chars().all(|ch| ch.is_ascii_hexdigit()))
                    .map(str::to_ascii_uppercase)
                    .collect()
            }
            _ => {}
        }
    }
    let level = level.ok_or_else(|| NpuSmiError::NoHealth(raw.clone()))?;
    Ok(VendorHealth {
        level,
        raw,
        error_codes: codes,
        graded: vec![],
    })
}

/// `-t common`: temperature and power.
pub fn parse_common(text: &str) -> (Option<f64>, Option<f64>) {
    let (mut t, mut p) = (None, None);
    for (k, v) in fields(text) {
        match k {
            "Temperature(C)" => t = number(v),
            "NPU Real-time Power(W)" | "Real-time Power(W)" => p = number(v),
            _ => {}
        }
    }
    (t, p)
}

/// `-t ecc`: HBM counters where the chip has HBM, else DDR.
pub fn parse_ecc(text: &str) -> Result<EccCounts, NpuSmiError> {
    let mut hbm = [None::<u64>; 4];
    let mut ddr = [None::<u64>; 4];
    for (k, v) in fields(text) {
        let (bank, rest) = match k.split_once(' ') {
            Some(("HBM", r)) => (&mut hbm, r),
            Some(("DDR", r)) => (&mut ddr, r),
            _ => continue,
        };
        let slot = match rest {
            "Single Bit Error Count" => 0,
            "Double Bit Error Count" => 1,
            "Single Bit Aggregate Total Err Cnt" => 2,
            "Double Bit Aggregate Total Err Cnt" => 3,
            _ => continue,
        };
        bank[slot] = v.parse().ok();
    }
    let pick = if hbm.iter().any(Option::is_some) {
        hbm
    } else {
        ddr
    };
    if pick.iter().all(Option::is_none) {
        return Err(NpuSmiError::NoEcc);
    }
    Ok(EccCounts {
        volatile_corrected: pick[0].unwrap_or(0),
        volatile_uncorrected: pick[1].unwrap_or(0),
        aggregate_corrected: pick[2].unwrap_or(0),
        aggregate_uncorrected: pick[3].unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(name: &str) -> String {
        let p = format!(
            "{}/../tests/data/npu-smi/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
    }

    #[test]
    fn the_a3_table_names_physical_ids_and_phyid_remap_maps_them() {
        let c = parse_info(&data("info_a3_2chip_16.txt")).unwrap();
        let phys: Vec<Option<u32>> = c.iter().map(|c| c.phy).collect();
        assert_eq!(phys[..4], [Some(0), Some(1), Some(2), Some(3)]);
        let b = parse_info(&data("info_910b_8.txt")).unwrap();
        assert!(
            b.iter().all(|c| c.phy.is_none()),
            "910B prints no physical id"
        );
        // `"\t%-30s:%lu\n"` as npu_chip_info.c prints it.
        let text = format!(
            "\t{:<30}:5\n\t{:<30}:1\n\t{:<30}:1\n\t{:<30}:0\n",
            "Chip Physical ID", "Chip Logic ID", "NPU ID", "Chip ID"
        );
        assert_eq!(parse_phyid_remap(&text), Ok((5, 1, 0)));
        assert!(parse_phyid_remap("Error: no such device").is_err());
    }

    #[test]
    fn eight_910b_single_chip() {
        let c = parse_info(&data("info_910b_8.txt")).unwrap();
        assert_eq!(c.len(), 8);
        assert_eq!(c[0].name, "910B3");
        assert_eq!((c[0].npu, c[0].chip), (0, 0));
        assert_eq!(c[0].health, "OK");
        assert_eq!(c[0].power_w, Some(94.7));
        assert_eq!(c[0].temp_c, Some(54.0));
        assert_eq!(c[0].bus_id.as_deref(), Some("0000:c1:00.0"));
        assert_eq!(c[7].npu, 7);
    }

    #[test]
    fn two_chips_per_npu_with_dash_fields() {
        let c = parse_info(&data("info_a3_2chip_16.txt")).unwrap();
        assert_eq!(c.len(), 16);
        assert_eq!((c[1].npu, c[1].chip), (0, 1));
        assert_eq!(c[1].power_w, None, "the second chip prints '-' for power");
        assert_eq!(c[1].temp_c, Some(30.0));
        assert_eq!(c[1].bus_id.as_deref(), Some("0000:9f:00.0"));
    }

    #[test]
    fn duo_card_with_na_power() {
        let c = parse_info(&data("info_310p3_duo_devices_only.txt")).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!((c[1].npu, c[1].chip), (2, 1));
        assert_eq!(c[0].power_w, None);
        assert_eq!(c[0].temp_c, Some(45.0));
    }

    #[test]
    fn an_alarm_in_the_table() {
        let c = parse_info(&data("info_910b_8_npu3_alarm.txt")).unwrap();
        assert_eq!(c[3].health, "Alarm");
        assert_eq!(health_level(&c[3].health), Some(VendorHealthLevel::Alarm));
    }

    #[test]
    fn health_outputs() {
        let ok = parse_health(&data("health_ok.txt")).unwrap();
        assert_eq!((ok.level, ok.error_codes.len()), (VendorHealthLevel::Ok, 0));
        let crit = parse_health(&data("health_critical_two_codes.txt")).unwrap();
        assert_eq!(crit.level, VendorHealthLevel::Critical);
        assert_eq!(crit.error_codes, vec!["80E01801", "80E18402"]);
        let alarm = parse_health(&data("health_alarm_80E01801.txt")).unwrap();
        assert_eq!(alarm.error_codes, vec!["80E01801"]);
        assert!(parse_health("Health Status : Purple").is_err());
    }

    #[test]
    fn common_and_ecc_outputs() {
        assert_eq!(
            parse_common(&data("common_910b.txt")),
            (Some(46.0), Some(69.0))
        );
        let e = parse_ecc(&data("ecc_910b_errors.txt")).unwrap();
        assert_eq!((e.volatile_corrected, e.volatile_uncorrected), (12, 2));
        assert_eq!((e.aggregate_corrected, e.aggregate_uncorrected), (37, 3));
        assert_eq!(
            parse_ecc(&data("ecc_910_ok.txt")).unwrap(),
            EccCounts::default()
        );
    }

    #[test]
    fn garbage_and_partial_output_are_errors() {
        assert!(parse_info("").is_err());
        assert!(parse_info("command not found\n").is_err());
        let full = data("info_910b_8.txt");
        let half: String = full.lines().take(7).collect::<Vec<_>>().join("\n");
        assert!(
            parse_info(&half).is_err(),
            "a table cut after a first row is partial"
        );
        assert!(parse_ecc("garbage").is_err());
    }
}
