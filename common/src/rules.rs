//! Denoising rules of the aggregator: per-device, per-metric sliding windows, correlation
//! rules across metrics, and which agent findings are hard faults. They turn one agent
//! reading into an [`Observation`] for the state machine.
//!
//! The rules come from a file (YAML or TOML) that the aggregator reloads on change; every
//! field has a default, so an empty file means the seed's rules:
//! `high-temp` when at least 3 of the last 5 samples exceed 85 C; `ecc-thermal` when ECC
//! errors come with a temperature above 75 C; `npu-offline` when the PCIe link is down
//! and power is under 5 W.

use serde::{Deserialize, Serialize};

use crate::document::{DeviceHealth, DeviceView};
use crate::reading::DeviceStatus;
use crate::state::{Observation, StateMachineConfig};

/// A metric a rule can look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// `temperature_c`.
    TemperatureC,
    /// `power_w`.
    PowerW,
    /// `ecc_errors` (corrected + uncorrected since driver load).
    EccErrors,
    /// Uncorrected ECC errors since driver load.
    EccUncorrected,
    /// `pcie_link_status`: 1 when up, 0 when down.
    PcieLinkUp,
}

/// What the rules read of an agent's device entry: the agent's [`DeviceHealth`], or
/// the aggregator's borrowed view of it ([`crate::document::DeviceView`]).
pub trait Entry {
    /// The agent's instantaneous status.
    fn status(&self) -> DeviceStatus;
    /// The value of a metric, if the entry reports it.
    fn metric(&self, m: Metric) -> Option<f64>;
    /// Each finding's code and status, in order.
    fn findings(&self, each: &mut dyn FnMut(&str, DeviceStatus));
}

/// `pcie_link_status` as a metric: 1 when up, 0 when down.
pub(crate) fn link_up(status: Option<&str>) -> Option<f64> {
    status.map(|s| if s == "up" { 1.0 } else { 0.0 })
}

/// The aggregator's borrowed view of a device entry reads the same as the agent's.
impl Entry for DeviceView<'_> {
    fn status(&self) -> DeviceStatus {
        self.status
    }
    fn metric(&self, m: Metric) -> Option<f64> {
        match m {
            Metric::TemperatureC => self.temperature_c,
            Metric::PowerW => self.power_w,
            Metric::EccErrors => self.ecc_errors.map(|e| e as f64),
            Metric::EccUncorrected => self.ecc.map(|e| e.volatile_uncorrected as f64),
            Metric::PcieLinkUp => link_up(self.pcie_link_status.as_deref()),
        }
    }
    fn findings(&self, each: &mut dyn FnMut(&str, DeviceStatus)) {
        for f in &self.findings {
            each(&f.code, f.status);
        }
    }
}

impl Entry for DeviceHealth {
    fn status(&self) -> DeviceStatus {
        self.status
    }
    fn metric(&self, m: Metric) -> Option<f64> {
        let r = &self.reading;
        match m {
            Metric::TemperatureC => r.temperature_c,
            Metric::PowerW => r.power_w,
            Metric::EccErrors => self.ecc_errors.map(|e| e as f64),
            Metric::EccUncorrected => r.ecc.map(|e| e.volatile_uncorrected as f64),
            Metric::PcieLinkUp => link_up(self.pcie_link_status.as_deref()),
        }
    }
    fn findings(&self, each: &mut dyn FnMut(&str, DeviceStatus)) {
        for f in &self.findings {
            each(&f.code, f.status);
        }
    }
}

/// A test on one metric: `above` and `below` are strict bounds; both may be given.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// The metric.
    pub metric: Metric,
    /// True when the value is greater than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub above: Option<f64>,
    /// True when the value is less than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below: Option<f64>,
}

impl Condition {
    /// Whether `d` meets the condition. A metric the device does not report never does.
    pub fn holds<E: Entry + ?Sized>(&self, d: &E) -> bool {
        match d.metric(self.metric) {
            Some(v) => self.above.is_none_or(|a| v > a) && self.below.is_none_or(|b| v < b),
            None => false,
        }
    }
}

/// "At least `count` of the last `of` samples meet the condition."
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowRule {
    /// The reason it reports (`high-temp`).
    pub reason: String,
    /// The test on each sample.
    #[serde(flatten)]
    pub condition: Condition,
    /// Samples that must meet it.
    pub count: usize,
    /// Window length in samples.
    pub of: usize,
}

/// How bad a rule's finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Must hold for `degraded_after` before the device is degraded.
    #[default]
    Soft,
    /// Fails the device at once.
    Hard,
}

/// Every condition on the same sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CorrelationRule {
    /// The reason it reports (`ecc-thermal`).
    pub reason: String,
    /// All must hold.
    pub all: Vec<Condition>,
    /// Soft (default) or hard.
    #[serde(default)]
    pub severity: Severity,
}

/// The default `node_faults`: what takes a whole node out, whichever device reports it.
pub const DEFAULT_NODE_FAULTS: [&str; 16] = [
    "gpu-lost",
    "pcie-link-down",
    "xid-79",
    "xid-74",
    "xid-144",
    "xid-145",
    "xid-146",
    "xid-147",
    "xid-148",
    "xid-149",
    "xid-150",
    "recovery-node-reboot",
    "recovery-system-reboot",
    "recovery-recover-imex-domain",
    "recovery-drain-p2p",
    "recovery-drain-and-reset",
];

/// The whole rules file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rules {
    /// Sliding-window rules.
    pub windows: Vec<WindowRule>,
    /// Correlation rules.
    pub correlations: Vec<CorrelationRule>,
    /// Agent findings with status failed whose codes fail a device at once; a trailing
    /// `*` matches a prefix (`xid-*`). Default `*`: every finding the agent calls failed
    /// (the severity travels with the finding; a hand-kept list missed every
    /// Ascend reason, so a separated chip waited out the soft windows). A failed finding
    /// that matches no pattern counts as soft; degraded findings always do.
    pub hard_faults: Vec<String>,
    /// Exceptions to `hard_faults` (same patterns): failed findings that count as soft
    /// here, e.g. a site tool's verdict the site does not trust alone.
    pub soft_faults: Vec<String>,
    /// Agent finding codes ignored here because a window rule covers them (the agent's
    /// instantaneous `high-temp` is replaced by the 3-of-5 window).
    pub ignore_findings: Vec<String>,
    /// Findings that are the node's, not one device's (same patterns as
    /// `hard_faults`): a device failed for one of these takes the node path (the node
    /// tainted) even where the device alone could be quarantined. Default: the GPU gone
    /// from the bus (`gpu-lost`, `xid-79`), the PCIe link (`pcie-link-down`), NVLink and
    /// its fabric (`xid-74`, NVLink5's `xid-144` to `xid-150`), and NVML's recovery
    /// actions that reboot the node, recover the multi-node NVLink domain or drain the
    /// node's peer-to-peer traffic.
    pub node_faults: Vec<String>,
    /// From how many failed devices on one node the node is quarantined instead of each
    /// device (at least 1; 1 is the node path for every fault).
    pub node_after_devices: u32,
    /// From how many pods the kubelet refused on one node within the last hour for
    /// lack of devices (`UnexpectedAdmissionError`) the node is quarantined instead of
    /// a device: a node that keeps refusing allocations fails its pods whatever a
    /// device's taint says (0: never).
    pub node_after_rejections: u32,
    /// The state machine's timers.
    pub state_machine: StateMachineConfig,
}

impl Default for Rules {
    fn default() -> Self {
        let c = |metric, above, below| Condition {
            metric,
            above,
            below,
        };
        Rules {
            windows: vec![WindowRule {
                reason: "high-temp".into(),
                condition: c(Metric::TemperatureC, Some(85.0), None),
                count: 3,
                of: 5,
            }],
            correlations: vec![
                CorrelationRule {
                    reason: "ecc-thermal".into(),
                    all: vec![
                        c(Metric::EccErrors, Some(0.0), None),
                        c(Metric::TemperatureC, Some(75.0), None),
                    ],
                    severity: Severity::Soft,
                },
                CorrelationRule {
                    reason: "npu-offline".into(),
                    all: vec![
                        c(Metric::PcieLinkUp, None, Some(0.5)),
                        c(Metric::PowerW, None, Some(5.0)),
                    ],
                    severity: Severity::Hard,
                },
            ],
            hard_faults: vec!["*".into()],
            soft_faults: vec![],
            ignore_findings: vec!["high-temp".into()],
            node_faults: DEFAULT_NODE_FAULTS.iter().map(|s| s.to_string()).collect(),
            node_after_devices: 2,
            node_after_rejections: 3,
            state_machine: StateMachineConfig::default(),
        }
    }
}

/// Errors of a rules file.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The text does not parse.
    #[error("rules file does not parse: {0}")]
    Parse(String),
    /// It parses but makes no sense.
    #[error("invalid rules: {0}")]
    Invalid(String),
}

impl Rules {
    /// Check what serde cannot.
    pub fn validate(&self) -> Result<(), RulesError> {
        if self.windows.len() > MAX_WINDOWS {
            return Err(RulesError::Invalid(format!(
                "{} window rules: at most {MAX_WINDOWS}",
                self.windows.len()
            )));
        }
        for w in &self.windows {
            if w.of == 0 || w.count == 0 || w.count > w.of || w.of > 1000 {
                return Err(RulesError::Invalid(format!(
                    "window {:?}: need 1 <= count <= of <= 1000, got {} of {}",
                    w.reason, w.count, w.of
                )));
            }
            if w.condition.above.is_none() && w.condition.below.is_none() {
                return Err(RulesError::Invalid(format!(
                    "window {:?}: needs above or below",
                    w.reason
                )));
            }
        }
        for c in &self.correlations {
            if c.all.is_empty() {
                return Err(RulesError::Invalid(format!(
                    "correlation {:?}: no conditions",
                    c.reason
                )));
            }
        }
        if self.node_after_devices == 0 {
            return Err(RulesError::Invalid(
                "node_after_devices must be at least 1".into(),
            ));
        }
        let sm = &self.state_machine;
        if sm.failed_recover_samples == 0 || sm.degraded_recover_samples == 0 {
            return Err(RulesError::Invalid(
                "recover samples must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// Whether a failed finding `code` fails the device at once.
    fn is_hard(&self, code: &str) -> bool {
        self.hard_faults.iter().any(|p| pattern_matches(p, code))
            && !self.soft_faults.iter().any(|p| pattern_matches(p, code))
    }

    /// Whether a device failed for `code` takes its whole node out (`node_faults`).
    pub fn is_node_fault(&self, code: &str) -> bool {
        self.node_faults.iter().any(|p| pattern_matches(p, code))
    }
}

/// A pattern of `hard_faults`, `soft_faults` or `node_faults`: a code, or a prefix
/// ending in `*`.
fn pattern_matches(pattern: &str, code: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => code.starts_with(prefix),
        None => pattern == code,
    }
}

/// Sliding windows of one device, one per window rule (by position; a slot whose rule
/// changed on a reload starts empty).
#[derive(Debug, Default, Clone)]
pub struct DeviceWindows {
    windows: Vec<Window>,
}

/// One window: its rule's reason (as a fingerprint), the samples as a ring of bits
/// (`of` long) and how many met the condition (kept, so that asking whether a device is
/// quiet costs nothing per sample: the aggregator asks for every device every second).
/// A reason string and a deque of booleans per window were a fifth of a
/// node's memory, and comparing the cold string for every sample a cache miss each.
#[derive(Debug, Clone)]
struct Window {
    rule: u64,
    /// Sample `k` (0: the oldest) is bit `(head + k) % of`.
    bits: Box<[u64]>,
    of: u16,
    head: u16,
    len: u16,
    hits: u16,
}

/// A window rule's reason as a window remembers it.
fn fingerprint(reason: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x5f3759df).hash_one(reason)
}

impl Window {
    fn new(rule: u64, of: usize) -> Self {
        Window {
            rule,
            bits: vec![0; of.div_ceil(64)].into_boxed_slice(),
            of: of as u16,
            head: 0,
            len: 0,
            hits: 0,
        }
    }

    fn bit(&self, i: usize) -> bool {
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    fn set_bit(&mut self, i: usize, v: bool) {
        if v {
            self.bits[i / 64] |= 1 << (i % 64);
        } else {
            self.bits[i / 64] &= !(1 << (i % 64));
        }
    }

    /// The samples, oldest first.
    fn samples(&self) -> impl Iterator<Item = bool> + '_ {
        let of = usize::from(self.of);
        (0..usize::from(self.len)).map(move |k| self.bit((usize::from(self.head) + k) % of))
    }

    /// Add a sample to a window `of` long (its rule may have changed length on a
    /// reload: the newest samples are kept).
    fn push(&mut self, met: bool, of: usize) {
        if of != usize::from(self.of) {
            let keep: Vec<bool> = self.samples().collect();
            let mut w = Window::new(self.rule, of);
            for v in &keep[keep.len().saturating_sub(of)..] {
                w.push(*v, of);
            }
            *self = w;
        }
        let of = usize::from(self.of);
        let (head, len) = (usize::from(self.head), usize::from(self.len));
        if len == of {
            if self.bit(head) {
                self.hits -= 1;
            }
            self.set_bit(head, met);
            self.head = ((head + 1) % of) as u16;
        } else {
            self.set_bit((head + len) % of, met);
            self.len += 1;
        }
        self.hits += u16::from(met);
    }
}

impl DeviceWindows {
    /// No window holds a sample that met its condition: another sample that does not
    /// meet it changes no verdict (what lets the aggregator skip quiet devices).
    pub fn quiet(&self) -> bool {
        self.windows.iter().all(|w| w.hits == 0)
    }

    /// Judge one agent entry (`None`: no entry this round) and return the observation.
    pub fn observe(&mut self, d: Option<&DeviceHealth>, rules: &Rules) -> Observation {
        self.apply(&rules.measure(d), rules)
    }

    /// Add one measured entry to the windows and return the observation.
    pub fn apply(&mut self, m: &Measure, rules: &Rules) -> Observation {
        if m.missing {
            // Nothing fresh: the windows keep their samples (a gap is not a clean sample).
            return Observation::Missing;
        }
        let mut soft = m.soft.clone();
        self.windows.truncate(rules.windows.len());
        for (i, w) in rules.windows.iter().enumerate() {
            let rule = fingerprint(&w.reason);
            if self.windows.get(i).is_none_or(|s| s.rule != rule) {
                let slot = Window::new(rule, w.of);
                match self.windows.get_mut(i) {
                    Some(s) => *s = slot,
                    None => self.windows.push(slot),
                }
            }
            let slot = &mut self.windows[i];
            let met = m.mets & (1u64 << i) != 0;
            slot.push(met, w.of);
            debug_assert_eq!(
                usize::from(slot.hits),
                slot.samples().filter(|b| *b).count()
            );
            if usize::from(slot.hits) >= w.count {
                soft.insert(0, w.reason.clone());
            }
        }
        match (&m.hard, soft.is_empty()) {
            (Some(h), _) => Observation::Hard(h.clone()),
            (None, false) => Observation::Soft(soft),
            (None, true) => Observation::Clean,
        }
    }
}

/// What one agent entry says by the rules, before the windows: whether it is fresh,
/// the hard and soft reasons of the correlations and findings, and which window rules'
/// conditions it meets. It is measured when the document arrives, while its memory is
/// hot, and applied to the windows when the device is evaluated (judging a
/// document kept from its arrival to the next tick cost a cache miss per field; the
/// measure is all the tick needs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measure {
    /// No fresh reading: no entry, or an unknown one.
    pub missing: bool,
    /// The first hard reason.
    pub hard: Option<String>,
    /// The soft reasons, in rule order.
    pub soft: Vec<String>,
    /// Bit `i`: window rule `i`'s condition holds (at most [`MAX_WINDOWS`]).
    pub mets: u64,
}

/// Window rules at most (a measure keeps one bit each).
pub const MAX_WINDOWS: usize = 64;

impl Rules {
    /// Measure one agent entry (`None`: no entry this round).
    pub fn measure<E: Entry + ?Sized>(&self, d: Option<&E>) -> Measure {
        let Some(d) = d.filter(|d| d.status() != DeviceStatus::Unknown) else {
            return Measure {
                missing: true,
                ..Measure::default()
            };
        };
        let mut m = Measure::default();
        for c in &self.correlations {
            if c.all.iter().all(|cond| cond.holds(d)) {
                match c.severity {
                    Severity::Hard => {
                        m.hard.get_or_insert_with(|| c.reason.clone());
                    }
                    Severity::Soft => m.soft.push(c.reason.clone()),
                }
            }
        }
        d.findings(&mut |code, status| {
            if self.ignore_findings.iter().any(|i| i == code) {
                return;
            }
            match status {
                DeviceStatus::Failed if self.is_hard(code) => {
                    m.hard.get_or_insert_with(|| code.to_string());
                }
                DeviceStatus::Failed | DeviceStatus::Degraded => m.soft.push(code.to_string()),
                DeviceStatus::Healthy | DeviceStatus::Unknown => {}
            }
        });
        for (i, w) in self.windows.iter().take(MAX_WINDOWS).enumerate() {
            if w.condition.holds(d) {
                m.mets |= 1u64 << i;
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Finding;
    use crate::reading::Vendor;

    /// The ring of bits keeps what a list of the last `of` samples keeps,
    /// across its wrap and across a reload that shortens or lengthens the window (the
    /// newest samples kept), for windows shorter and longer than a word.
    #[test]
    fn a_window_keeps_the_last_of_samples() {
        let mut x: u64 = 0x9e3779b97f4a7c15;
        for lens in [[5, 3, 7], [70, 130, 64], [1, 1000, 2]] {
            let mut w = Window::new(fingerprint("r"), lens[0]);
            let mut model: std::collections::VecDeque<bool> = Default::default();
            for (phase, of) in lens.iter().enumerate() {
                for _ in 0..(3 * of + phase) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let met = x.is_multiple_of(3);
                    w.push(met, *of);
                    model.push_back(met);
                    while model.len() > *of {
                        model.pop_front();
                    }
                    assert_eq!(w.samples().collect::<Vec<_>>(), Vec::from(model.clone()));
                    assert_eq!(usize::from(w.hits), model.iter().filter(|b| **b).count());
                }
            }
        }
    }

    fn dev(temp: f64) -> DeviceHealth {
        crate::testing::device("npu0")
            .vendor(Vendor::Ascend)
            .temperature(temp)
            .power(300.0)
            .ecc_errors(0)
            .pcie("up")
            .sample_age_ms(10)
            .build()
    }

    fn finding(code: &str, status: DeviceStatus) -> Finding {
        Finding {
            code: code.into(),
            status,
            detail: String::new(),
        }
    }

    #[test]
    fn high_temp_needs_three_of_the_last_five() {
        let rules = Rules::default();
        let mut w = DeviceWindows::default();
        let temps = [90.0, 60.0, 90.0, 60.0, 60.0, 90.0, 90.0];
        let got: Vec<bool> = temps
            .iter()
            .map(|t| matches!(w.observe(Some(&dev(*t)), &rules), Observation::Soft(r) if r[0] == "high-temp"))
            .collect();
        // 90,60,90 -> 2 hits; ...,60,60 -> 2; then 90 -> window [90,60,60,90]+... : the
        // last five are 60,90,60,60,90 -> 2, then 90,60,60,90,90 -> 3.
        assert_eq!(got, vec![false, false, false, false, false, false, true]);
        // A single spike is noise.
        let mut w = DeviceWindows::default();
        for t in [60.0, 60.0, 99.0, 60.0, 60.0] {
            assert_eq!(w.observe(Some(&dev(t)), &rules), Observation::Clean);
        }
    }

    #[test]
    fn seed_correlation_rules() {
        let rules = Rules::default();
        let mut d = dev(80.0);
        d.ecc_errors = Some(2);
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Soft(vec!["ecc-thermal".into()])
        );
        d.reading.temperature_c = Some(70.0);
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Clean
        );

        let mut off = dev(40.0);
        off.pcie_link_status = Some("down".into());
        off.reading.power_w = Some(2.0);
        off.findings
            .push(finding("pcie-link-down", DeviceStatus::Failed));
        // The more specific correlation names the hard fault.
        assert_eq!(
            DeviceWindows::default().observe(Some(&off), &rules),
            Observation::Hard("npu-offline".into())
        );
    }

    #[test]
    fn agent_findings_are_hard_or_soft_by_the_list() {
        let rules = Rules::default();
        let mut d = dev(40.0);
        d.findings = vec![finding("xid-79", DeviceStatus::Failed)];
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Hard("xid-79".into())
        );
        d.findings = vec![finding("nvlink-down", DeviceStatus::Degraded)];
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Soft(vec!["nvlink-down".into()])
        );
        // The agent's instantaneous high-temp is left to the window rule.
        d.findings = vec![finding("high-temp", DeviceStatus::Degraded)];
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Clean
        );
        // Whatever the agent calls failed is hard by default...
        d.findings = vec![finding("ascend-separate-npu", DeviceStatus::Failed)];
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &rules),
            Observation::Hard("ascend-separate-npu".into())
        );
        // ...unless the rules file says otherwise: an exception, or a list without it.
        let soft = Rules {
            soft_faults: vec!["ascend-*".into()],
            ..Rules::default()
        };
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &soft),
            Observation::Soft(vec!["ascend-separate-npu".into()])
        );
        let listed = Rules {
            hard_faults: vec!["xid-*".into()],
            ..Rules::default()
        };
        assert_eq!(
            DeviceWindows::default().observe(Some(&d), &listed),
            Observation::Soft(vec!["ascend-separate-npu".into()])
        );
    }

    /// Which faults are the node's, by the default list and by a site's own.
    #[test]
    fn node_faults_are_named_by_pattern() {
        let rules = Rules::default();
        for code in [
            "gpu-lost",
            "xid-79",
            "xid-74",
            "xid-147",
            "pcie-link-down",
            "recovery-node-reboot",
        ] {
            assert!(rules.is_node_fault(code), "{code}");
        }
        for code in [
            "xid-48",
            "xid-94",
            "row-remap-failure",
            "recovery-gpu-reset",
            "xid-7",
            "xid-790",
        ] {
            assert!(!rules.is_node_fault(code), "{code}");
        }
        let site = Rules {
            node_faults: vec!["ascend-*".into(), "xid-48".into()],
            ..Rules::default()
        };
        assert!(site.is_node_fault("ascend-separate-npu"));
        assert!(site.is_node_fault("xid-48"));
        assert!(
            !site.is_node_fault("xid-79"),
            "a site's list replaces the default"
        );
        assert!(!Rules {
            node_faults: vec![],
            ..Rules::default()
        }
        .is_node_fault("gpu-lost"));
        // The threshold: at least one device.
        assert_eq!(rules.node_after_devices, 2);
        assert!(Rules {
            node_after_devices: 0,
            ..Rules::default()
        }
        .validate()
        .is_err());
        assert!(Rules {
            node_after_devices: 1,
            ..Rules::default()
        }
        .validate()
        .is_ok());
    }

    /// Every reason the agent can fail a device with, NVIDIA and Ascend alike,
    /// fails it at the aggregator on the first sample under the default rules.
    #[test]
    fn every_reason_the_agent_fails_a_device_with_is_hard_by_default() {
        let reasons = crate::classify::failed_reasons(
            &crate::xid::XidPolicy::default(),
            crate::ascend::Catalog::builtin(),
            crate::ascend_escalation::Escalation::builtin(),
        );
        for must in [
            "gpu-lost",
            "xid-79",
            "ascend-separate-npu",
            "ascend-restart-npu",
            "card-drop",
        ] {
            assert!(reasons.contains(must), "{must} in {reasons:?}");
        }
        let rules = Rules::default();
        for r in &reasons {
            let mut d = dev(40.0);
            d.findings = vec![finding(r, DeviceStatus::Failed)];
            assert_eq!(
                DeviceWindows::default().observe(Some(&d), &rules),
                Observation::Hard(r.clone()),
                "{r}"
            );
        }
    }

    #[test]
    fn unknown_or_absent_is_missing_never_a_fault() {
        let rules = Rules::default();
        let mut d = dev(99.0);
        d.status = DeviceStatus::Unknown;
        d.findings = vec![finding("probe-error", DeviceStatus::Unknown)];
        let mut w = DeviceWindows::default();
        for _ in 0..10 {
            assert_eq!(w.observe(Some(&d), &rules), Observation::Missing);
        }
        assert_eq!(w.observe(None, &rules), Observation::Missing);
    }

    #[test]
    fn validation_catches_nonsense() {
        let mut r = Rules::default();
        r.windows[0].count = 6;
        assert!(r.validate().is_err());
        let mut r = Rules::default();
        r.correlations[0].all.clear();
        assert!(r.validate().is_err());
        assert!(Rules::default().validate().is_ok());
    }

    /// Found by cargo-mutants: the edges of validation, the exact window
    /// bounds, a rule's identity across reloads, and window rules past the first.
    #[test]
    fn edges_cargo_mutants_found_untested() {
        assert_eq!(link_up(Some("up")), Some(1.0));
        assert_eq!(link_up(Some("down")), Some(0.0));
        assert_eq!(link_up(None), None);

        // The aggregator's borrowed view reads findings as the agent's entry does.
        let json = r#"{"id":"gpu0","vendor":"nvidia","source":"nvml","status":"degraded",
            "findings":[{"code":"nvlink-down","status":"degraded","detail":""}]}"#;
        let view: crate::document::DeviceView = serde_json::from_str(json).unwrap();
        assert_eq!(
            Rules::default().measure(Some(&view)).soft,
            vec!["nvlink-down".to_string()]
        );
        // And its metrics, each from its own field.
        let json = r#"{"id":"gpu0","vendor":"nvidia","source":"nvml","status":"healthy",
            "temperature_c":71.5,"power_w":300.0,"ecc_errors":7,"pcie_link_status":"down",
            "ecc":{"volatile_corrected":5,"volatile_uncorrected":2,"aggregate_corrected":9,
            "aggregate_uncorrected":3}}"#;
        let view: crate::document::DeviceView = serde_json::from_str(json).unwrap();
        let read: Vec<Option<f64>> = [
            Metric::TemperatureC,
            Metric::PowerW,
            Metric::EccErrors,
            Metric::EccUncorrected,
            Metric::PcieLinkUp,
        ]
        .into_iter()
        .map(|m| view.metric(m))
        .collect();
        assert_eq!(
            read,
            [Some(71.5), Some(300.0), Some(7.0), Some(2.0), Some(0.0)]
        );

        // `below` is strict, as `above` is.
        let below = Condition {
            metric: Metric::TemperatureC,
            above: None,
            below: Some(50.0),
        };
        assert!(below.holds(&dev(49.9)));
        assert!(!below.holds(&dev(50.0)));

        let window = |count, of| WindowRule {
            reason: "w".into(),
            condition: below,
            count,
            of,
        };
        let with = |windows: Vec<WindowRule>| Rules {
            windows,
            ..Rules::default()
        };
        assert!(with(vec![window(3, 3)]).validate().is_ok());
        assert!(with(vec![window(4, 3)]).validate().is_err(), "count > of");
        assert!(with(vec![window(0, 3)]).validate().is_err(), "count 0");
        assert!(with(vec![window(1, 1000)]).validate().is_ok());
        assert!(with(vec![window(1, 1001)]).validate().is_err(), "of > 1000");
        assert!(with(vec![window(1, 1); MAX_WINDOWS]).validate().is_ok());
        assert!(with(vec![window(1, 1); MAX_WINDOWS + 1])
            .validate()
            .is_err());
        let mut sm = Rules::default();
        sm.state_machine.failed_recover_samples = 0;
        assert!(sm.validate().is_err(), "failed_recover_samples 0");

        // An exact pattern matches only its code.
        let exact = Rules {
            hard_faults: vec!["xid-79".into()],
            ..Rules::default()
        };
        assert!(exact.is_hard("xid-79"));
        assert!(!exact.is_hard("xid-48"));

        // Two window rules, only the second met: its bit, its reason.
        let two = with(vec![
            WindowRule {
                reason: "never".into(),
                condition: Condition {
                    metric: Metric::TemperatureC,
                    above: Some(1000.0),
                    below: None,
                },
                count: 1,
                of: 1,
            },
            WindowRule {
                reason: "cool".into(),
                ..window(1, 2)
            },
        ]);
        let mut w = DeviceWindows::default();
        assert!(w.quiet(), "no window yet");
        assert_eq!(two.measure(Some(&dev(40.0))).mets, 0b10);
        assert_eq!(
            w.observe(Some(&dev(40.0)), &two),
            Observation::Soft(vec!["cool".into()])
        );
        assert!(!w.quiet(), "a sample met a condition");
        // A reload that renames the rule starts its window afresh.
        let renamed = with(vec![two.windows[0].clone(), window(1, 2)]);
        assert_eq!(w.observe(Some(&dev(60.0)), &renamed), Observation::Clean);
        assert!(w.quiet());
    }
}
