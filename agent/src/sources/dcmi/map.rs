//! The pure half of the `dcmi` source: what the library answered for one chip
//! ([`RawChip`], gathered by `mod.rs` without judging it) turned into the chip's
//! [`DeviceReading`]. Nothing here calls the library, so every case (a dropped card, a
//! refused call, DCMI v1 against v2) is a table test without it.
//!
//! The gathering side asks [`booting`], [`judged`] and [`ecc_falls_back`] which calls
//! are worth making, so what it asks and what this reads stay one decision.

use std::ffi::{c_int, c_uint};
use std::time::Duration;

use faultline_common::ascend::{roce_healthy, Catalog, BOOT_FINISHED};
use faultline_common::{
    normalize_bus_id, AscendIds, DeviceReading, EccCounts, RoceLink, Vendor, VendorHealth,
    VendorHealthLevel,
};

use super::ffi::{Addr, ChipInfo, EccInfo, PcieInfoAll, MAX_CHIPS, NOT_READY, NOT_SUPPORTED};

/// "Not ready" answers in a row before a chip is reported lost (one may be a blip).
pub(super) const NOT_READY_LOST_AFTER: u32 = 3;

/// Why a DCMI call gave no usable answer (a reading's `probe_errors` says it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum DcmiError {
    /// The library has no such function, or it cannot be resolved.
    #[error("{0}")]
    Missing(String),
    /// The call answered with an error code.
    #[error("{call}: dcmi error {rc}")]
    Code { call: String, rc: c_int },
    /// An id lookup answered an id outside the library's range.
    #[error("{what} id: dcmi error {rc} ({value})")]
    Id {
        what: &'static str,
        rc: c_int,
        value: i64,
    },
    #[error("network health: an earlier call is still blocked")]
    NetBusy,
    #[error("network health: cannot start a thread: {0}")]
    NetThread(String),
    #[error("network health: no answer within {}s", .0.as_secs())]
    NetTimedOut(Duration),
}

#[cfg(test)]
impl From<&str> for DcmiError {
    fn from(s: &str) -> Self {
        DcmiError::Missing(s.to_string())
    }
}

/// One call's answer: the library's return code and the value it wrote, or why the
/// call could not be made (the library has no such function).
pub(super) type Answer<T> = Result<(c_int, T), DcmiError>;

/// What the library answered for one chip in one sample, not yet judged. A field that
/// is `None` was not asked: an earlier answer made it not worth asking.
pub(super) struct RawChip {
    pub(super) addr: Addr,
    /// Logic id, once learned (v2: the `dev_id`).
    pub(super) logic: Option<c_int>,
    /// Physical id, once learned.
    pub(super) phy: Option<u32>,
    /// Why an id lookup failed this time.
    pub(super) id_errors: Vec<String>,
    /// `dcmi_get_device_boot_status`.
    pub(super) boot: Answer<c_uint>,
    /// `dcmi_get_device_health`; not asked while the chip boots.
    pub(super) health: Option<Answer<c_uint>>,
    /// The other calls; made only once the chip gave its own verdict.
    pub(super) details: Option<RawDetails>,
}

/// The calls made of a chip that gave its own verdict.
pub(super) struct RawDetails {
    /// The fault-code list.
    pub(super) codes: Answer<Vec<c_uint>>,
    /// Codes fault events reported for the chip within the last minute.
    pub(super) event_codes: Vec<u32>,
    /// In C.
    pub(super) temperature: Answer<c_int>,
    /// In 0.1 W.
    pub(super) power: Answer<c_int>,
    /// HBM ECC (910-class chips).
    pub(super) ecc_hbm: Answer<EccInfo>,
    /// DDR ECC (310P), asked only when HBM is not supported.
    pub(super) ecc_ddr: Option<Answer<EccInfo>>,
    /// `dcmi_get_device_pcie_info_v2`; v1 only.
    pub(super) pcie: Option<Answer<PcieInfoAll>>,
    /// `dcmi_get_device_chip_info`; v1 only.
    pub(super) chip_info: Option<Answer<ChipInfo>>,
    /// RoCE network health.
    pub(super) net: RawNet,
}

/// What became of a chip's network-health call (it runs on its own thread).
pub(super) enum RawNet {
    /// Not asked: the chip answered "not supported" before.
    NotAsked,
    /// Not started: an earlier call still blocks, or no thread could start.
    NotStarted(DcmiError),
    /// Its answer.
    Answered(Answer<c_uint>),
    /// No answer within this bound.
    TimedOut(Duration),
}

/// A logic-id lookup's answer: the id, or why not (one out of range is an error too).
pub(super) fn logic_id(answer: Answer<c_int>) -> Result<c_int, DcmiError> {
    match answer {
        Ok((0, logic)) if (0..MAX_CHIPS as c_int).contains(&logic) => Ok(logic),
        Ok((rc, logic)) => Err(DcmiError::Id {
            what: "logic",
            rc,
            value: logic.into(),
        }),
        Err(e) => Err(e),
    }
}

/// A physical-id lookup's answer for the chip of logic id `logic`.
pub(super) fn phy_id(answer: Answer<c_uint>, logic: c_int) -> Result<u32, DcmiError> {
    match answer {
        Ok((0, phy)) if (phy as usize) < MAX_CHIPS => Ok(phy),
        Ok((rc, phy)) => Err(DcmiError::Id {
            what: "physical",
            rc,
            value: phy.into(),
        }),
        // A library without the lookup: the logic id is the only stable id there is.
        Err(_) => Ok(logic as u32),
    }
}

/// Whether the chip is still booting after a reset: nothing else it says means
/// anything yet, so nothing else is asked.
pub(super) fn booting(boot: &Answer<c_uint>) -> bool {
    matches!(boot, Ok((0, s)) if *s != BOOT_FINISHED)
}

/// Whether the chip gave its own verdict: without it, its other numbers would not make
/// it healthy, so they are not asked.
pub(super) fn judged(health: &Answer<c_uint>) -> bool {
    matches!(health, Ok((0, h)) if health_level(*h).is_some())
}

/// Whether HBM said "not supported", so DDR is asked (310P has DDR, 910 HBM).
pub(super) fn ecc_falls_back(hbm: &Answer<EccInfo>) -> bool {
    matches!(hbm, Ok((NOT_SUPPORTED, _)))
}

/// The header's health values: 0 OK, 1 minor, 2 major, 3 critical.
fn health_level(h: c_uint) -> Option<(VendorHealthLevel, &'static str)> {
    match h {
        0 => Some((VendorHealthLevel::Ok, "OK")),
        1 => Some((VendorHealthLevel::Warning, "Warning")),
        2 => Some((VendorHealthLevel::Alarm, "Alarm")),
        3 => Some((VendorHealthLevel::Critical, "Critical")),
        _ => None,
    }
}

/// One id per chip: its physical id. Until it is known (the lookup failed every time so
/// far), a provisional id, named as such.
fn chip_id(addr: Addr, phy: Option<u32>) -> String {
    match (phy, addr) {
        (Some(p), _) => format!("npu{p}"),
        (None, Addr::V1 { card, chip }) => format!("npu{card}-{chip}"),
        (None, Addr::V2 { dev }) => format!("npu-dev{dev}"),
    }
}

/// The reading of one chip, and its run of "not ready" answers after this sample
/// (`not_ready`: the run before it).
pub(super) fn reading(raw: RawChip, not_ready: u32, fault_codes: &Catalog) -> (DeviceReading, u32) {
    let a = raw.addr;
    let mut r = DeviceReading::new(chip_id(a, raw.phy), Vendor::Ascend, "dcmi");
    r.index = raw.phy;
    r.probe_errors = raw.id_errors;
    r.ascend = Some(AscendIds {
        phy_id: raw.phy,
        logic_id: raw.logic.map(|l| l as u32),
        card: match a {
            Addr::V1 { card, .. } => Some(card),
            Addr::V2 { .. } => None,
        },
        chip: match a {
            Addr::V1 { chip, .. } => Some(chip),
            Addr::V2 { .. } => None,
        },
    });

    match raw.boot {
        Ok((0, s)) if s != BOOT_FINISHED => {
            r.booting = true;
            return (r, not_ready);
        }
        Ok((0 | NOT_SUPPORTED, _)) | Err(_) => {}
        Ok((rc, _)) => r.probe_errors.push(format!("boot status: dcmi error {rc}")),
    }

    // Health first: a dropped card answers "not ready" and nothing else is worth asking.
    let Some(health) = raw.health else {
        return (r, not_ready);
    };
    match health {
        Ok((0, h)) => match health_level(h) {
            Some((level, word)) => {
                r.vendor_health = Some(VendorHealth {
                    level,
                    raw: word.into(),
                    error_codes: vec![],
                    graded: vec![],
                })
            }
            None => r
                .probe_errors
                .push(format!("health: unexpected value {h:#x}")),
        },
        Ok((NOT_READY, _)) => {
            // How Huawei's plugin spots a card that dropped off; a single answer may be
            // a blip, so it takes a few in a row.
            let run = not_ready + 1;
            if run >= NOT_READY_LOST_AFTER {
                r.lost = true;
            } else {
                r.probe_errors
                    .push(format!("health: not ready ({run} in a row)"));
            }
            return (r, run);
        }
        Ok((e, _)) => r.probe_errors.push(format!("health: dcmi error {e}")),
        Err(e) => r.probe_errors.push(e.to_string()),
    }
    // Without the chip's own verdict its other numbers do not make it healthy: report
    // only the errors, and its last good reading ages into unknown.
    if r.vendor_health.is_none() {
        return (r, not_ready);
    }
    if let Some(d) = raw.details {
        details(&mut r, d, fault_codes);
    }
    (r, 0)
}

/// The calls made of a chip that gave its verdict, into `r` (which has that verdict).
fn details(r: &mut DeviceReading, d: RawDetails, fault_codes: &Catalog) {
    // Fault codes on every sample, whatever the level (MindCluster grades by code),
    // with those fault events reported within the last minute.
    let mut codes: Vec<u32> = match d.codes {
        Ok((0, c)) => c,
        Ok((rc, _)) => {
            r.probe_errors.push(format!("error codes: dcmi error {rc}"));
            Vec::new()
        }
        Err(e) => {
            r.probe_errors.push(e.to_string());
            Vec::new()
        }
    };
    for c in d.event_codes {
        if !codes.contains(&c) {
            codes.push(c);
        }
    }
    if let Some(vh) = r.vendor_health.as_mut() {
        vh.error_codes = codes.iter().map(|c| format!("{c:08X}")).collect();
        vh.graded = fault_codes.grade_all(vh.error_codes.iter().map(String::as_str));
    }

    r.temperature_c = value(r, d.temperature, "dcmi_get_device_temperature")
        .filter(|t| *t > -275)
        .map(f64::from);
    r.power_w = value(r, d.power, "dcmi_get_device_power_info")
        .filter(|p| *p >= 0)
        .map(|p| f64::from(p) / 10.0);
    ecc(r, d.ecc_hbm, d.ecc_ddr);
    if let Some(Ok((0, p))) = d.pcie {
        r.pci_bus_id = normalize_bus_id(&format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            p.domain, p.bdf_busid, p.bdf_deviceid, p.bdf_funcid
        ));
    }
    if let Some(Ok((0, c))) = d.chip_info {
        let name = format!("{}{}", c_text(&c.chip_type), c_text(&c.chip_name));
        if !name.is_empty() {
            r.name = Some(name);
        }
    }
    match roce(d.net) {
        Ok(link) => r.roce = link,
        Err(e) => r.probe_errors.push(e.to_string()),
    }
}

/// A signed value, when the call gave one; "not supported" leaves it out quietly.
fn value(r: &mut DeviceReading, answer: Answer<c_int>, name: &str) -> Option<c_int> {
    match answer {
        Ok((0, v)) => Some(v),
        Ok((NOT_SUPPORTED, _)) => None,
        Ok((e, _)) => {
            r.probe_errors.push(format!("{name}: dcmi error {e}"));
            None
        }
        Err(e) => {
            r.probe_errors.push(e.to_string());
            None
        }
    }
}

/// HBM on 910-class chips (DDR answers -8255 there), DDR on 310P (HBM answers -8255).
/// ECC switched off is no reading; an HBM error other than "not supported" is reported
/// rather than hidden by asking DDR.
fn ecc(r: &mut DeviceReading, hbm: Answer<EccInfo>, ddr: Option<Answer<EccInfo>>) {
    for (answer, name) in [(Some(hbm), "hbm"), (ddr, "ddr")] {
        match answer {
            None | Some(Err(_)) => return,
            Some(Ok((0, e))) => {
                if e.enable_flag != 0 {
                    r.ecc = Some(EccCounts {
                        volatile_corrected: e.single_bit_error_cnt.into(),
                        volatile_uncorrected: e.double_bit_error_cnt.into(),
                        aggregate_corrected: e.total_single_bit_error_cnt.into(),
                        aggregate_uncorrected: e.total_double_bit_error_cnt.into(),
                    });
                }
                return;
            }
            Some(Ok((NOT_SUPPORTED, _))) => continue,
            Some(Ok((rc, _))) => {
                r.probe_errors
                    .push(format!("ecc ({name}): dcmi error {rc}"));
                return;
            }
        }
    }
}

/// A C string of a fixed buffer: up to its first NUL, trimmed.
fn c_text(b: &[u8]) -> String {
    let end = b.iter().position(|x| *x == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim().to_string()
}

/// RoCE network health: 0 and 6 are up; "not supported" (not a training card) and a
/// library without the call are no reading; no answer in time is an error.
fn roce(net: RawNet) -> Result<Option<RoceLink>, DcmiError> {
    match net {
        RawNet::NotAsked => Ok(None),
        RawNet::NotStarted(e) => Err(e),
        RawNet::Answered(Ok((0, v))) => Ok(Some(RoceLink {
            result: v,
            up: roce_healthy(v),
        })),
        RawNet::Answered(Ok((NOT_SUPPORTED, _)) | Err(_)) => Ok(None),
        RawNet::Answered(Ok((rc, _))) => Err(DcmiError::Code {
            call: "network health".into(),
            rc,
        }),
        RawNet::TimedOut(bound) => Err(DcmiError::NetTimedOut(bound)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::ascend::GradedCode;
    use faultline_common::{classify, Classification, DeviceStatus, Thresholds};

    const V1: Addr = Addr::V1 { card: 1, chip: 0 };
    const V2: Addr = Addr::V2 { dev: 3 };
    const REFUSED: c_int = -8005;

    fn ok<T>(v: T) -> Answer<T> {
        Ok((0, v))
    }

    fn rc<T: Default>(code: c_int) -> Answer<T> {
        Ok((code, T::default()))
    }

    fn ecc_info(enable: c_int, single: c_uint, double: c_uint) -> EccInfo {
        EccInfo {
            enable_flag: enable,
            single_bit_error_cnt: single,
            double_bit_error_cnt: double,
            total_single_bit_error_cnt: single * 10,
            total_double_bit_error_cnt: double * 10,
            ..EccInfo::default()
        }
    }

    fn name(kind: &str, model: &str) -> ChipInfo {
        let mut c = ChipInfo::default();
        c.chip_type[..kind.len()].copy_from_slice(kind.as_bytes());
        c.chip_name[..model.len()].copy_from_slice(model.as_bytes());
        c
    }

    /// A 910B chip that answers every call well (v1: bus id and name too).
    fn details(a: Addr) -> RawDetails {
        let v1 = matches!(a, Addr::V1 { .. });
        RawDetails {
            codes: ok(vec![]),
            event_codes: vec![],
            temperature: ok(45),
            power: ok(850),
            ecc_hbm: ok(ecc_info(1, 0, 0)),
            ecc_ddr: None,
            pcie: v1.then(|| {
                ok(PcieInfoAll {
                    bdf_busid: 0xc1,
                    ..PcieInfoAll::default()
                })
            }),
            chip_info: v1.then(|| ok(name("Ascend", "910B3\0junk"))),
            net: RawNet::Answered(ok(0)),
        }
    }

    fn chip(a: Addr) -> RawChip {
        RawChip {
            addr: a,
            logic: Some(match a {
                Addr::V1 { .. } => 2,
                Addr::V2 { dev } => dev,
            }),
            phy: Some(4),
            id_errors: vec![],
            boot: ok(BOOT_FINISHED),
            health: Some(ok(0)),
            details: Some(details(a)),
        }
    }

    fn map(raw: RawChip) -> DeviceReading {
        reading(raw, 0, Catalog::builtin()).0
    }

    fn verdict(r: &DeviceReading) -> Classification {
        classify(r, None, &Thresholds::default())
    }

    #[test]
    fn a_healthy_chip_reads_every_metric_and_clears_its_not_ready_run() {
        let (r, run) = reading(chip(V1), 2, Catalog::builtin());
        assert_eq!(run, 0, "a verdict ends a run of not-ready answers");
        assert_eq!((r.id.as_str(), r.index), ("npu4", Some(4)));
        assert_eq!((r.vendor, r.source.as_str()), (Vendor::Ascend, "dcmi"));
        let vh = r.vendor_health.as_ref().unwrap();
        assert_eq!((vh.level, vh.raw.as_str()), (VendorHealthLevel::Ok, "OK"));
        assert!(vh.error_codes.is_empty() && vh.graded.is_empty());
        assert_eq!((r.temperature_c, r.power_w), (Some(45.0), Some(85.0)));
        assert_eq!(r.ecc, Some(EccCounts::default()));
        assert_eq!(r.pci_bus_id.as_deref(), Some("0000:c1:00.0"));
        assert_eq!(r.name.as_deref(), Some("Ascend910B3"));
        assert_eq!(
            r.roce,
            Some(RoceLink {
                result: 0,
                up: true
            })
        );
        assert!(r.probe_errors.is_empty(), "{:?}", r.probe_errors);
        assert!(!r.booting && !r.lost);
        assert_eq!(verdict(&r).status, DeviceStatus::Healthy);
    }

    #[test]
    fn v1_and_v2_chips_differ_in_ids_and_identity() {
        // (address, physical id) -> id, card, chip, logic id, bus id, name.
        type Want = (&'static str, Option<c_int>, Option<c_int>, u32, bool);
        let cases: [(Addr, Option<u32>, Want); 4] = [
            (V1, Some(4), ("npu4", Some(1), Some(0), 2, true)),
            (V1, None, ("npu1-0", Some(1), Some(0), 2, true)),
            // v2: one dev_id, the logic id; no card, no chip, no v1 identity calls.
            (V2, Some(7), ("npu7", None, None, 3, false)),
            (V2, None, ("npu-dev3", None, None, 3, false)),
        ];
        for (a, phy, (id, card, chip_no, logic, v1)) in cases {
            let mut raw = chip(a);
            raw.phy = phy;
            let r = map(raw);
            let ids = r.ascend.unwrap();
            assert_eq!(r.id, id, "{a:?} {phy:?}");
            assert_eq!(r.index, phy, "{id}");
            assert_eq!(ids.phy_id, phy, "{id}");
            assert_eq!((ids.card, ids.chip), (card, chip_no), "{id}");
            assert_eq!(ids.logic_id, Some(logic), "{id}");
            assert_eq!(r.pci_bus_id.is_some(), v1, "{id}");
            assert_eq!(r.name.is_some(), v1, "{id}");
            assert_eq!(
                r.temperature_c,
                Some(45.0),
                "{id}: v2 reads the same metrics"
            );
        }
        // A name the library left empty is no name.
        let mut raw = chip(V1);
        raw.details.as_mut().unwrap().chip_info = Some(ok(name("  ", "")));
        assert_eq!(map(raw).name, None);
    }

    #[test]
    fn fault_codes_are_graded_whatever_the_health_level() {
        // (health, polled codes, event codes) -> error codes, status, reason.
        let cases = [
            // SeparateNPU under an OK level: the code decides.
            (
                0,
                vec![0x8081_8C00],
                vec![],
                vec!["80818C00"],
                DeviceStatus::Failed,
                Some("ascend-separate-npu"),
            ),
            (
                1,
                vec![0x8081_8C06],
                vec![],
                vec!["80818C06"],
                DeviceStatus::Degraded,
                Some("ascend-subhealth"),
            ),
            // NotHandleFault: a finding only.
            (
                0,
                vec![0x8081_8200],
                vec![],
                vec!["80818200"],
                DeviceStatus::Healthy,
                None,
            ),
            // An event's code counts though the poll missed it, once.
            (
                0,
                vec![0x8081_8C06],
                vec![0x8081_8C06, 0x40F8_4E00],
                vec!["80818C06", "40F84E00"],
                DeviceStatus::Failed,
                Some("card-drop"),
            ),
            // A code in no table: degraded, never failed on a guess.
            (
                0,
                vec![0x1234_5678],
                vec![],
                vec!["12345678"],
                DeviceStatus::Degraded,
                Some(faultline_common::ascend::UNKNOWN_CODE_REASON),
            ),
            // Without codes the level speaks.
            (
                3,
                vec![],
                vec![],
                vec![],
                DeviceStatus::Failed,
                Some("vendor-health-critical"),
            ),
            (
                2,
                vec![],
                vec![],
                vec![],
                DeviceStatus::Degraded,
                Some("vendor-health-alarm"),
            ),
        ];
        for (health, polled, events, codes, status, reason) in cases {
            let mut raw = chip(V1);
            raw.health = Some(ok(health));
            let d = raw.details.as_mut().unwrap();
            d.codes = ok(polled);
            d.event_codes = events;
            let r = map(raw);
            let vh = r.vendor_health.as_ref().unwrap();
            assert_eq!(vh.error_codes, codes, "{health} {codes:?}");
            let graded: Vec<&str> = vh
                .graded
                .iter()
                .map(|g: &GradedCode| g.code.as_str())
                .collect();
            assert_eq!(graded.len(), codes.len(), "{codes:?}: every code graded");
            let v = verdict(&r);
            assert_eq!(v.status, status, "{health} {codes:?}: {v:?}");
            assert_eq!(v.reason.as_deref(), reason, "{health} {codes:?}");
        }
    }

    #[test]
    fn a_health_call_without_a_verdict_is_unknown_never_unhealthy() {
        // The health answer -> its probe error. The run of not-ready answers stays.
        let cases: [(Answer<c_uint>, &str); 3] = [
            (rc(REFUSED), "health: dcmi error -8005"),
            (
                Err("dcmiv2_get_device_health: undefined symbol".into()),
                "dcmiv2_get_device_health: undefined symbol",
            ),
            (ok(7), "health: unexpected value 0x7"),
        ];
        for (health, error) in cases {
            assert!(!judged(&health), "{error}: nothing more is asked");
            let mut raw = chip(V2);
            raw.health = Some(health);
            raw.details = None;
            let (r, run) = reading(raw, 1, Catalog::builtin());
            assert_eq!(r.probe_errors, [error]);
            assert_eq!(run, 1, "{error}");
            assert!(r.vendor_health.is_none() && r.temperature_c.is_none() && !r.lost);
            let v = verdict(&r);
            assert_eq!(v.status, DeviceStatus::Unknown, "{error}: {v:?}");
            assert_eq!(v.reason.as_deref(), Some("no-metrics"));
        }
        for h in 0..=3 {
            assert!(judged(&ok(h)), "{h}");
        }
    }

    #[test]
    fn a_refused_metric_is_left_out_and_named_in_order() {
        let mut raw = chip(V1);
        raw.id_errors = vec!["physical id: dcmi error -8005 (4294967295)".into()];
        raw.boot = rc(REFUSED);
        let d = raw.details.as_mut().unwrap();
        d.codes = rc(REFUSED);
        d.temperature = rc(REFUSED);
        d.power = rc(NOT_SUPPORTED);
        d.net = RawNet::TimedOut(Duration::from_secs(1));
        let r = map(raw);
        assert_eq!(
            r.probe_errors,
            [
                "physical id: dcmi error -8005 (4294967295)",
                "boot status: dcmi error -8005",
                "error codes: dcmi error -8005",
                "dcmi_get_device_temperature: dcmi error -8005",
                "network health: no answer within 1s",
            ],
            "\"not supported\" (power) is no error"
        );
        assert_eq!((r.temperature_c, r.power_w, r.roce), (None, None, None));
        assert_eq!(r.vendor_health.unwrap().level, VendorHealthLevel::Ok);
        // A missing function is named by the lookup's own message.
        let mut raw = chip(V2);
        raw.details.as_mut().unwrap().power = Err("dcmiv2_get_device_power_info: gone".into());
        assert_eq!(
            map(raw).probe_errors,
            ["dcmiv2_get_device_power_info: gone"]
        );
    }

    #[test]
    fn implausible_temperature_and_power_are_left_out() {
        // (temperature C, power 0.1 W) -> readings.
        let cases = [
            ((45, 850), (Some(45.0), Some(85.0))),
            ((-275, -1), (None, None)),
            ((-274, 0), (Some(-274.0), Some(0.0))),
            ((100, 1234), (Some(100.0), Some(123.4))),
        ];
        for ((t, p), want) in cases {
            let mut raw = chip(V1);
            let d = raw.details.as_mut().unwrap();
            d.temperature = ok(t);
            d.power = ok(p);
            let r = map(raw);
            assert_eq!((r.temperature_c, r.power_w), want, "{t} {p}");
            assert!(r.probe_errors.is_empty());
        }
    }

    #[test]
    fn a_card_answering_not_ready_is_lost_on_the_third_in_a_row() {
        // (run before, health) -> run after, lost, probe errors.
        let cases = [
            (
                0,
                rc(NOT_READY),
                1,
                false,
                vec!["health: not ready (1 in a row)"],
            ),
            (
                1,
                rc(NOT_READY),
                2,
                false,
                vec!["health: not ready (2 in a row)"],
            ),
            (2, rc(NOT_READY), 3, true, vec![]),
            (5, rc(NOT_READY), 6, true, vec![]),
            // A refused call neither extends nor ends the run; a verdict ends it.
            (2, rc(REFUSED), 2, false, vec!["health: dcmi error -8005"]),
        ];
        for (before, health, after, lost, errors) in cases {
            let mut raw = chip(V1);
            raw.health = Some(health);
            raw.details = None;
            let (r, run) = reading(raw, before, Catalog::builtin());
            assert_eq!((run, r.lost), (after, lost), "{before}");
            assert_eq!(r.probe_errors, errors, "{before}");
            let want = if lost {
                DeviceStatus::Failed
            } else {
                DeviceStatus::Unknown
            };
            assert_eq!(verdict(&r).status, want, "{before}");
        }
    }

    #[test]
    fn a_booting_chip_is_unknown_until_it_has_started() {
        // Boot status answer -> booting (nothing more asked), probe errors.
        let cases: [(Answer<c_uint>, bool, Vec<&str>); 6] = [
            (ok(0), true, vec![]),
            (ok(3), true, vec![]),
            (ok(BOOT_FINISHED), false, vec![]),
            // Not supported, or no such call: the chip is judged on its other answers.
            (rc(NOT_SUPPORTED), false, vec![]),
            (
                Err("dcmi_get_device_boot_status: gone".into()),
                false,
                vec![],
            ),
            (rc(REFUSED), false, vec!["boot status: dcmi error -8005"]),
        ];
        for (boot, is_booting, errors) in cases {
            assert_eq!(booting(&boot), is_booting, "{errors:?}");
            let mut raw = chip(V1);
            if is_booting {
                raw.health = None;
                raw.details = None;
            }
            raw.boot = boot;
            let (r, run) = reading(raw, 2, Catalog::builtin());
            assert_eq!(r.booting, is_booting);
            assert_eq!(r.probe_errors, errors);
            let v = verdict(&r);
            if is_booting {
                assert_eq!(run, 2, "booting keeps the run");
                assert_eq!(v.reason.as_deref(), Some("booting"));
                assert_eq!(v.status, DeviceStatus::Unknown);
                assert_eq!(r.id, "npu4", "a booting chip keeps its id");
            } else {
                assert_eq!(v.status, DeviceStatus::Healthy, "{errors:?}");
            }
        }
    }

    #[test]
    fn ecc_switched_off_is_no_reading_and_an_hbm_error_is_not_hidden() {
        let counts = |single: u64, double: u64| EccCounts {
            volatile_corrected: single,
            volatile_uncorrected: double,
            aggregate_corrected: single * 10,
            aggregate_uncorrected: double * 10,
        };
        // (HBM, DDR) -> ECC counts, probe errors.
        type Case = (
            Answer<EccInfo>,
            Option<Answer<EccInfo>>,
            Option<EccCounts>,
            Vec<&'static str>,
        );
        let cases: [Case; 7] = [
            (ok(ecc_info(1, 3, 1)), None, Some(counts(3, 1)), vec![]),
            (ok(ecc_info(0, 5, 5)), None, None, vec![]),
            // 310P: HBM not supported, DDR answers.
            (
                rc(NOT_SUPPORTED),
                Some(ok(ecc_info(1, 2, 0))),
                Some(counts(2, 0)),
                vec![],
            ),
            (rc(NOT_SUPPORTED), Some(ok(ecc_info(0, 2, 0))), None, vec![]),
            (rc(NOT_SUPPORTED), Some(rc(NOT_SUPPORTED)), None, vec![]),
            (
                rc(NOT_SUPPORTED),
                Some(rc(REFUSED)),
                None,
                vec!["ecc (ddr): dcmi error -8005"],
            ),
            (rc(REFUSED), None, None, vec!["ecc (hbm): dcmi error -8005"]),
        ];
        for (hbm, ddr, want, errors) in cases {
            assert_eq!(ecc_falls_back(&hbm), ddr.is_some(), "{errors:?}");
            let mut raw = chip(V1);
            let d = raw.details.as_mut().unwrap();
            d.ecc_hbm = hbm;
            d.ecc_ddr = ddr;
            let r = map(raw);
            assert_eq!(r.ecc, want, "{errors:?}");
            assert_eq!(r.probe_errors, errors);
        }
        // A library without the ECC call: no reading, no error, DDR not asked.
        let missing: Answer<EccInfo> = Err("dcmi_get_device_ecc_info: gone".into());
        assert!(!ecc_falls_back(&missing));
        let mut raw = chip(V1);
        raw.details.as_mut().unwrap().ecc_hbm = missing;
        let r = map(raw);
        assert_eq!((r.ecc, r.probe_errors.len()), (None, 0));
        // Uncorrectable errors since driver load degrade the chip.
        let mut raw = chip(V1);
        raw.details.as_mut().unwrap().ecc_hbm = ok(ecc_info(1, 0, 2));
        assert_eq!(verdict(&map(raw)).status, DeviceStatus::Degraded);
    }

    #[test]
    fn roce_link_health_is_up_down_or_unread() {
        let down = |result| Some(RoceLink { result, up: false });
        // The call's fate -> link, probe errors, status (RoCE down degrades by default).
        let cases: [(RawNet, Option<RoceLink>, Vec<&str>, DeviceStatus); 9] = [
            (
                RawNet::Answered(ok(0)),
                Some(RoceLink {
                    result: 0,
                    up: true,
                }),
                vec![],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::Answered(ok(6)),
                Some(RoceLink {
                    result: 6,
                    up: true,
                }),
                vec![],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::Answered(ok(3)),
                down(3),
                vec![],
                DeviceStatus::Degraded,
            ),
            (
                RawNet::Answered(rc(NOT_SUPPORTED)),
                None,
                vec![],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::Answered(Err("gone".into())),
                None,
                vec![],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::Answered(rc(REFUSED)),
                None,
                vec!["network health: dcmi error -8005"],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::TimedOut(Duration::from_secs(1)),
                None,
                vec!["network health: no answer within 1s"],
                DeviceStatus::Healthy,
            ),
            (
                RawNet::NotStarted(DcmiError::NetBusy),
                None,
                vec!["network health: an earlier call is still blocked"],
                DeviceStatus::Healthy,
            ),
            (RawNet::NotAsked, None, vec![], DeviceStatus::Healthy),
        ];
        for (net, link, errors, status) in cases {
            let mut raw = chip(V1);
            raw.details.as_mut().unwrap().net = net;
            let r = map(raw);
            assert_eq!(r.roce, link, "{errors:?}");
            assert_eq!(r.probe_errors, errors);
            assert_eq!(verdict(&r).status, status, "{link:?}");
        }
        // The site may say a link that is down fails the chip.
        let mut raw = chip(V1);
        raw.details.as_mut().unwrap().net = RawNet::Answered(ok(3));
        let strict = Thresholds {
            roce_down_failed: true,
            ..Thresholds::default()
        };
        assert_eq!(
            classify(&map(raw), None, &strict).status,
            DeviceStatus::Failed
        );
    }

    #[test]
    fn ids_are_kept_only_when_in_range() {
        assert_eq!(logic_id(ok(5)), Ok(5));
        fn text<T>(r: Result<T, DcmiError>) -> Result<T, String> {
            r.map_err(|e| e.to_string())
        }
        assert_eq!(
            text(logic_id(ok(300))),
            Err("logic id: dcmi error 0 (300)".into())
        );
        assert_eq!(
            text(logic_id(Ok((REFUSED, -1)))),
            Err("logic id: dcmi error -8005 (-1)".into())
        );
        assert_eq!(logic_id(Err("gone".into())), Err("gone".into()));
        assert_eq!(phy_id(ok(4), 1), Ok(4));
        assert_eq!(
            text(phy_id(ok(256), 1)),
            Err("physical id: dcmi error 0 (256)".into())
        );
        assert_eq!(
            text(phy_id(Ok((REFUSED, u32::MAX)), 1)),
            Err("physical id: dcmi error -8005 (4294967295)".into())
        );
        // No lookup in the library: the logic id is the stable id.
        assert_eq!(phy_id(Err("gone".into()), 7), Ok(7));
    }
}
