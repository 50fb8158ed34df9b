//! NVIDIA Xid errors: the catalog (which are fatal, which mean "restart the
//! application", which are informational) and the per-Xid "N in window W" policy.
//!
//! Classes follow NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) and its
//! resolution buckets: RESET_GPU / RESTART_BM / CONTACT_SUPPORT are `Fatal`,
//! RESTART_APP is `RestartApp`, IGNORE and recording events are `Informational`.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::reading::DeviceStatus;
use crate::time::parse_duration;

/// What an Xid means for the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum XidClass {
    /// The device needs a reset, a reboot or a replacement before it takes work again.
    Fatal,
    /// The application hit an error (often its own); the device stays usable.
    RestartApp,
    /// Recorded for the record; no action.
    Informational,
    /// Not in our catalog. Treated like `RestartApp`: counted, degraded past a threshold.
    Unknown,
}

/// NVIDIA's Xid catalog as a table: `xid, name, NVIDIA resolution bucket, our class,
/// justification`, tab separated. Built from docs.nvidia.com/deploy/xid-errors (via the
/// catalog spreadsheet as gpud generates it); each row says why it got its class.
const CATALOG_TSV: &str = include_str!("xid_catalog.tsv");

/// One catalog row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogEntry {
    /// The Xid.
    pub xid: u32,
    /// Short name.
    pub name: &'static str,
    /// NVIDIA's resolution bucket (RESET_GPU, RESTART_APP, IGNORE, ...), `-` if none.
    pub resolution: &'static str,
    /// Our class.
    pub class: XidClass,
}

fn parse_class(s: &str) -> Option<XidClass> {
    match s {
        "fatal" => Some(XidClass::Fatal),
        "restart-app" => Some(XidClass::RestartApp),
        "informational" => Some(XidClass::Informational),
        _ => None,
    }
}

/// The whole catalog, sorted by Xid.
pub fn catalog() -> &'static [CatalogEntry] {
    static CATALOG: std::sync::OnceLock<Vec<CatalogEntry>> = std::sync::OnceLock::new();
    CATALOG.get_or_init(|| {
        let mut rows: Vec<CatalogEntry> = CATALOG_TSV
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .filter_map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                Some(CatalogEntry {
                    xid: f.first()?.trim().parse().ok()?,
                    name: f.get(1)?.trim(),
                    resolution: f.get(2)?.trim(),
                    class: parse_class(f.get(3)?.trim())?,
                })
            })
            .collect();
        rows.sort_by_key(|r| r.xid);
        rows.dedup_by_key(|r| r.xid);
        rows
    })
}

fn entry(xid: u32) -> Option<&'static CatalogEntry> {
    let c = catalog();
    c.binary_search_by_key(&xid, |r| r.xid).ok().map(|i| &c[i])
}

/// The class of an Xid after NVIDIA's catalog.
pub fn class_of(xid: u32) -> XidClass {
    entry(xid).map(|e| e.class).unwrap_or(XidClass::Unknown)
}

/// The class of one Xid message. Xid 154 ("GPU recovery action changed") is fatal only
/// when the new action is not `None`.
pub fn class_of_message(xid: u32, message: &str) -> XidClass {
    if xid == 154 && message.contains("to 0x0 (None)") {
        return XidClass::Informational;
    }
    class_of(xid)
}

/// A short human name for an Xid, when the catalog has one.
pub fn name_of(xid: u32) -> Option<&'static str> {
    entry(xid).map(|e| e.name)
}

/// One Xid (or Xid-less "fallen off the bus") event seen for a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidEvent {
    /// The Xid number; 79 for the Xid-less "has fallen off the bus" message.
    pub xid: u32,
    /// Catalog class at the time it was seen.
    pub class: XidClass,
    /// Normalised PCI bus id the event names, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// Milliseconds since the Unix epoch when the agent saw it.
    pub at_ms: u64,
    /// Where it came from: `nvml-event` or `kmsg`.
    pub source: String,
    /// The message text, trimmed (kernel line or NVML event description).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// "N events within window W" before an Xid changes the device's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidThreshold {
    /// Events needed.
    pub count: u32,
    /// Within this window.
    #[serde(with = "duration_secs")]
    pub window: Duration,
}

mod duration_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_secs())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_secs(u64::deserialize(d)?))
    }
}

impl std::str::FromStr for XidThreshold {
    type Err = String;
    /// `N/W`, e.g. `3/10m`, `1/1h`, `2/30s`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (n, w) = s
            .split_once('/')
            .ok_or_else(|| format!("threshold {s:?}: expected N/WINDOW, e.g. 3/10m"))?;
        let count: u32 = n
            .trim()
            .parse()
            .map_err(|_| format!("threshold {s:?}: {n:?} is not a count"))?;
        if count == 0 {
            return Err(format!("threshold {s:?}: count must be at least 1"));
        }
        let window = parse_duration(w.trim())
            .ok_or_else(|| format!("threshold {s:?}: {w:?} is not a duration (30s, 10m, 1h)"))?;
        Ok(XidThreshold { count, window })
    }
}

/// How Xid events turn into a device status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidPolicy {
    /// Xids dropped entirely (still counted in metrics).
    pub ignore: BTreeSet<u32>,
    /// Per-Xid thresholds that override the class defaults.
    pub thresholds: BTreeMap<u32, XidThreshold>,
    /// Fatal Xids: this many within the window fail the device.
    pub fatal: XidThreshold,
    /// Restart-app and unknown Xids: this many within the window degrade the device.
    pub restart_app: XidThreshold,
    /// How long the agent keeps events for display and evaluation.
    #[serde(with = "duration_secs")]
    pub retention: Duration,
}

impl Default for XidPolicy {
    fn default() -> Self {
        XidPolicy {
            ignore: BTreeSet::new(),
            thresholds: BTreeMap::new(),
            // A fatal Xid means reset or reboot: it holds the device failed for an hour
            // unless the operator narrows the window. The aggregator's release needs
            // clean samples on top of that.
            fatal: XidThreshold {
                count: 1,
                window: Duration::from_secs(3600),
            },
            restart_app: XidThreshold {
                count: 3,
                window: Duration::from_secs(600),
            },
            retention: Duration::from_secs(3600),
        }
    }
}

/// The `source` of an Xid read from a text log the agent does not trust (a line
/// without the kernel's facility: `logger -t kernel` writes those); its reason carries
/// the same suffix (`xid-79-text-log`).
pub const TEXT_LOG: &str = "text-log";

/// Whether `reason` may only degrade a device: a finding of an untrusted text log
/// (`xid-79-text-log`). Time alone never turns it failed (the aggregator's state
/// machine turned three `logger` lines, degraded for 180 s, into a failed GPU, a taint
/// and an eviction).
pub fn degrade_only(reason: &str) -> bool {
    reason
        .strip_suffix(TEXT_LOG)
        .is_some_and(|r| r.ends_with('-'))
}

/// What an Xid history means right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidVerdict {
    /// Failed or Degraded.
    pub status: DeviceStatus,
    /// `xid-79` and so on.
    pub reason: String,
    /// Human detail.
    pub detail: String,
}

impl XidPolicy {
    /// Whether the policy drops this Xid.
    pub fn ignores(&self, xid: u32) -> bool {
        self.ignore.contains(&xid)
    }

    /// The threshold for `xid`, or `None` when it never changes the status
    /// (informational Xids without an explicit threshold).
    pub fn threshold_for(&self, xid: u32, class: XidClass) -> Option<(XidThreshold, DeviceStatus)> {
        let status = if class == XidClass::Fatal {
            DeviceStatus::Failed
        } else {
            DeviceStatus::Degraded
        };
        if let Some(t) = self.thresholds.get(&xid) {
            return Some((*t, status));
        }
        match class {
            XidClass::Fatal => Some((self.fatal, status)),
            XidClass::RestartApp | XidClass::Unknown => Some((self.restart_app, status)),
            XidClass::Informational => None,
        }
    }

    /// The worst verdict the events of one device give at `now_ms`.
    pub fn evaluate(&self, events: &[XidEvent], now_ms: u64) -> Option<XidVerdict> {
        let mut counts: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
        let mut best: Option<XidVerdict> = None;
        for e in events.iter().filter(|e| !self.ignores(e.xid)) {
            let Some((t, status)) = self.threshold_for(e.xid, e.class) else {
                continue;
            };
            let window_ms = t.window.as_millis() as u64;
            if now_ms.saturating_sub(e.at_ms) > window_ms {
                continue;
            }
            let c = counts.entry(e.xid).or_insert((0, e.at_ms));
            c.0 += 1;
            c.1 = c.1.max(e.at_ms);
            if c.0 >= t.count {
                let worse = best
                    .as_ref()
                    .is_none_or(|b| status.severity() > b.status.severity());
                if worse {
                    best = Some(XidVerdict {
                        status,
                        reason: if e.source.ends_with(TEXT_LOG) {
                            format!("xid-{}-{TEXT_LOG}", e.xid)
                        } else {
                            format!("xid-{}", e.xid)
                        },
                        detail: format!(
                            "Xid {} ({}) seen {} time(s) within {}s",
                            e.xid,
                            name_of(e.xid).unwrap_or("not in catalog"),
                            c.0,
                            t.window.as_secs()
                        ),
                    });
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Xid of an untrusted text log gives a reason that says so, which may only
    /// degrade (the state machine never fails it by time).
    #[test]
    fn a_text_logs_xid_reason_says_so() {
        let mut e = ev(13, 1_000);
        e.source = format!("kmsg-{TEXT_LOG}");
        let p = XidPolicy::default();
        let v = p.evaluate(&[e.clone(), e.clone(), e], 2_000).unwrap();
        assert_eq!(v.reason, "xid-13-text-log");
        assert!(degrade_only(&v.reason));
        let v = p.evaluate(&[ev(13, 1_000), ev(13, 1_000), ev(13, 1_000)], 2_000);
        assert_eq!(v.unwrap().reason, "xid-13");
    }

    fn ev(xid: u32, at_ms: u64) -> XidEvent {
        XidEvent {
            xid,
            class: class_of(xid),
            pci_bus_id: None,
            at_ms,
            source: "kmsg".into(),
            message: String::new(),
        }
    }

    #[test]
    fn the_whole_catalog_parses() {
        let rows = CATALOG_TSV
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        // Every row but the header becomes an entry: none is silently dropped.
        assert_eq!(catalog().len(), rows - 1);
    }

    #[test]
    fn recovery_action_none_is_informational() {
        let to_none = "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)";
        assert_eq!(class_of_message(154, to_none), XidClass::Informational);
        let to_reset = "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)";
        assert_eq!(class_of_message(154, to_reset), XidClass::Fatal);
    }

    #[test]
    fn catalog_classes() {
        assert_eq!(class_of(79), XidClass::Fatal);
        assert_eq!(class_of(48), XidClass::Fatal);
        assert_eq!(class_of(95), XidClass::Fatal);
        assert_eq!(class_of(94), XidClass::RestartApp);
        assert_eq!(class_of(13), XidClass::RestartApp);
        assert_eq!(class_of(63), XidClass::Informational);
        assert_eq!(class_of(9999), XidClass::Unknown);
    }

    #[test]
    fn one_fatal_xid_fails_the_device() {
        let p = XidPolicy::default();
        let v = p.evaluate(&[ev(79, 1_000)], 2_000).unwrap();
        assert_eq!(v.status, DeviceStatus::Failed);
        assert_eq!(v.reason, "xid-79");
    }

    #[test]
    fn restart_app_xids_degrade_only_past_the_threshold() {
        let p = XidPolicy::default();
        let two = [ev(13, 1_000), ev(13, 2_000)];
        assert_eq!(p.evaluate(&two, 3_000), None);
        let three = [ev(13, 1_000), ev(13, 2_000), ev(13, 2_500)];
        assert_eq!(
            p.evaluate(&three, 3_000).unwrap().status,
            DeviceStatus::Degraded
        );
        // Outside the 10 minute window they no longer count.
        assert_eq!(p.evaluate(&three, 1_000 + 601_000), None);
    }

    #[test]
    fn informational_and_ignored_xids_change_nothing() {
        let mut p = XidPolicy::default();
        assert_eq!(p.evaluate(&[ev(63, 0)], 1), None);
        p.ignore.insert(79);
        assert_eq!(p.evaluate(&[ev(79, 0)], 1), None);
    }

    #[test]
    fn per_xid_threshold_overrides_class_default() {
        let mut p = XidPolicy::default();
        p.thresholds.insert(79, "2/1m".parse().unwrap());
        assert_eq!(p.evaluate(&[ev(79, 0)], 1), None);
        let v = p.evaluate(&[ev(79, 0), ev(79, 10)], 20).unwrap();
        assert_eq!(v.status, DeviceStatus::Failed);
        // An informational Xid with an explicit threshold degrades.
        p.thresholds.insert(92, "1/1m".parse().unwrap());
        assert_eq!(
            p.evaluate(&[ev(92, 0)], 1).unwrap().status,
            DeviceStatus::Degraded
        );
    }

    #[test]
    fn fatal_wins_over_degraded() {
        let mut p = XidPolicy::default();
        p.thresholds.insert(13, "1/1m".parse().unwrap());
        let v = p.evaluate(&[ev(13, 0), ev(48, 1)], 2).unwrap();
        assert_eq!(v.reason, "xid-48");
    }

    #[test]
    fn threshold_syntax() {
        let t: XidThreshold = "3/10m".parse().unwrap();
        assert_eq!((t.count, t.window), (3, Duration::from_secs(600)));
        for bad in ["3", "0/1m", "x/1m", "3/10y", "3/"] {
            assert!(bad.parse::<XidThreshold>().is_err(), "{bad}");
        }
    }
}
