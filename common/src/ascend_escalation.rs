//! MindCluster's escalation rules for Ascend fault codes (`faultCustomization.json`):
//! a code that comes back too often, or stays too long, is graded above its
//! `faultCode.json` level.
//!
//! As the device plugin applies them (mind-cluster@22bb3d98,
//! `component/ascend-device-plugin/pkg/common/fault_code.go`):
//! - **FaultFrequency** (`handleFrequencyFault`): each occurrence of a listed code on a
//!   chip is counted; occurrences older than `TimeWindow` seconds drop out; with
//!   `Times` or more in the window the chip is at `FaultHandling`
//!   (ManuallySeparateNPU by default). Below that again, an escalated chip stays
//!   escalated until the code has recovered and `ReleaseTimeWindow` seconds have passed
//!   since (no release window: never, a person clears it).
//! - **FaultDuration** (`GetFaultTypeFromFaultDuration`): a code asserted for more than
//!   `FaultTimeout` seconds without a break puts the chip at `FaultHandling`
//!   (PreSeparateNPU for a link down held 20 s); once it has recovered for more than
//!   `RecoverTimeout` seconds the level falls back. For a code with a duration rule,
//!   each such trip is one occurrence for its frequency rule (`handleFaultQueue`): five
//!   link downs held past 20 s within a day, not five blips.
//!
//! The built-in rules are the plugin's file (`ascend_fault_customization.json`); a site
//! replaces them with its own file in the same format. An occurrence here is a code
//! that appears in a chip's codes after a sample without it (the plugin counts fault
//! events; the agent sees those codes in its next sample too). The counts live in the
//! agent's memory: a restarted agent starts them again (the plugin keeps a manual
//! separation in a ConfigMap; here the node's quarantine record keeps the node out
//! until a person releases it).

use std::collections::{BTreeMap, VecDeque};

use serde::Deserialize;

use crate::ascend::{parse_code, GradedCode, Level};

const BUILTIN_JSON: &str = include_str!("ascend_fault_customization.json");

/// One frequency rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrequencyRule {
    /// The codes it counts (each on its own).
    pub codes: Vec<u32>,
    /// The window, seconds.
    pub window_s: u64,
    /// Occurrences within the window that escalate.
    pub times: u32,
    /// The level they escalate to.
    pub level: Level,
    /// Seconds after the code recovered before the level falls back; `None`: never.
    pub release_s: Option<u64>,
}

/// One duration rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationRule {
    /// The codes it times (each on its own).
    pub codes: Vec<u32>,
    /// Seconds asserted without a break that escalate.
    pub fault_timeout_s: u64,
    /// Seconds recovered before the level falls back.
    pub recover_timeout_s: u64,
    /// The level.
    pub level: Level,
}

/// The rules.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Escalation {
    /// Frequency rules.
    pub frequency: Vec<FrequencyRule>,
    /// Duration rules.
    pub duration: Vec<DurationRule>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct File {
    #[serde(default)]
    fault_frequency: Vec<FrequencyJson>,
    #[serde(default)]
    fault_duration: Vec<DurationJson>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct FrequencyJson {
    event_id: Vec<String>,
    time_window: u64,
    times: u32,
    fault_handling: String,
    #[serde(default)]
    release_time_window: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DurationJson {
    event_id: Vec<String>,
    fault_timeout: u64,
    recover_timeout: u64,
    fault_handling: String,
}

/// Why a `faultCustomization.json` was refused.
#[derive(Debug, thiserror::Error)]
pub enum EscalationError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("a rule without EventId")]
    NoEventId,
    #[error("EventId {0:?}: not a 32-bit hex code")]
    BadCode(String),
    #[error("FaultHandling {0:?}: not a level")]
    BadLevel(String),
    #[error("FaultFrequency {0:?}: TimeWindow 60-864000 s and Times 1-100")]
    Frequency(Vec<String>),
    #[error("ReleaseTimeWindow {0}: at least 60 s")]
    Release(u64),
    #[error("FaultFrequency {codes:?}: {level} without ReleaseTimeWindow")]
    NoRelease { codes: Vec<String>, level: String },
    #[error("FaultTimeout {0}: at most 600 s")]
    Timeout(u64),
}

fn codes(ids: &[String]) -> Result<Vec<u32>, EscalationError> {
    if ids.is_empty() {
        return Err(EscalationError::NoEventId);
    }
    ids.iter()
        .map(|c| parse_code(c).ok_or_else(|| EscalationError::BadCode(c.clone())))
        .collect()
}

fn level(s: &str) -> Result<Level, EscalationError> {
    Level::parse(s).ok_or_else(|| EscalationError::BadLevel(s.to_string()))
}

impl Escalation {
    /// The device plugin's rules (its `faultCustomization.json`).
    pub fn builtin() -> &'static Escalation {
        static E: std::sync::OnceLock<Escalation> = std::sync::OnceLock::new();
        E.get_or_init(|| Escalation::parse(BUILTIN_JSON).expect("the built-in rules parse"))
    }

    /// A `faultCustomization.json`, checked within the plugin's limits
    /// (`validateFaultFrequencyCustomization`: a window of 60 s to 10 days, 1 to 100
    /// times, a release window of at least 60 s, and a level other than
    /// ManuallySeparateNPU only with a release window; a duration of at most 600 s).
    /// `GraceTolerance` is the plugin's own and ignored.
    pub fn parse(text: &str) -> Result<Escalation, EscalationError> {
        let f: File = serde_json::from_str(text)?;
        let mut out = Escalation::default();
        for r in f.fault_frequency {
            let level = level(&r.fault_handling)?;
            if !(60..=864_000).contains(&r.time_window) || !(1..=100).contains(&r.times) {
                return Err(EscalationError::Frequency(r.event_id));
            }
            let release_s = match r.release_time_window {
                0 => None,
                s if s < 60 => return Err(EscalationError::Release(s)),
                s => Some(s),
            };
            if release_s.is_none() && level != Level::ManuallySeparateNPU {
                return Err(EscalationError::NoRelease {
                    codes: r.event_id,
                    level: r.fault_handling,
                });
            }
            out.frequency.push(FrequencyRule {
                codes: codes(&r.event_id)?,
                window_s: r.time_window,
                times: r.times,
                level,
                release_s,
            });
        }
        for r in f.fault_duration {
            if r.fault_timeout > 600 {
                return Err(EscalationError::Timeout(r.fault_timeout));
            }
            out.duration.push(DurationRule {
                codes: codes(&r.event_id)?,
                fault_timeout_s: r.fault_timeout,
                recover_timeout_s: r.recover_timeout,
                level: level(&r.fault_handling)?,
            });
        }
        Ok(out)
    }
}

/// One code's history on one chip.
#[derive(Debug, Default, Clone)]
struct CodeState {
    present: bool,
    /// Occurrences (ms), oldest first, at most the rule's `times` kept.
    occurrences: VecDeque<u64>,
    last_fault_ms: u64,
    last_recover_ms: Option<u64>,
    by_frequency: bool,
    present_since_ms: Option<u64>,
    recovered_since_ms: Option<u64>,
    by_duration: bool,
}

/// The escalation state of the chips of a node, by chip id and code.
#[derive(Debug, Default)]
pub struct Escalator {
    chips: BTreeMap<String, BTreeMap<u32, CodeState>>,
}

/// Chips followed at most (a node has at most 32).
const MAX_CHIPS: usize = 256;

impl Escalator {
    /// The (chip, code) histories kept now.
    pub fn histories(&self) -> usize {
        self.chips.values().map(BTreeMap::len).sum()
    }

    /// Look at chip `chip`'s codes of this sample (`graded`, as graded by the table) at
    /// `now_ms`, and raise the level of the codes the rules escalate. A code a rule
    /// escalates keeps its reason's level-named form (`ascend-manually-separate-npu`).
    pub fn apply(
        &mut self,
        rules: &Escalation,
        chip: &str,
        graded: &mut Vec<GradedCode>,
        now_ms: u64,
    ) {
        if !self.chips.contains_key(chip) && self.chips.len() >= MAX_CHIPS {
            return;
        }
        let state = self.chips.entry(chip.to_string()).or_default();
        let now: Vec<u32> = graded.iter().filter_map(|g| parse_code(&g.code)).collect();
        let watched = rules
            .frequency
            .iter()
            .flat_map(|r| r.codes.iter())
            .chain(rules.duration.iter().flat_map(|r| r.codes.iter()));
        let timed = |code: u32| rules.duration.iter().any(|r| r.codes.contains(&code));
        for code in watched {
            let present = now.contains(code);
            // State only for codes seen: a site file watching thousands of codes kept
            // a state for each on every chip from the first sample on (a 0.96 MB file
            // took an 8-chip agent to 128 MB, against its 64 Mi limit).
            let s = match state.get_mut(code) {
                Some(s) => s,
                None if present => state.entry(*code).or_default(),
                None => continue,
            };
            // A code a duration rule times counts once each time that rule trips
            // (`handleFaultQueue`), not on every appearance.
            if present && !s.present && !timed(*code) {
                s.occurrences.push_back(now_ms);
                s.last_fault_ms = now_ms;
            } else if !present && s.present && !timed(*code) {
                s.last_recover_ms = Some(now_ms);
            }
            s.present = present;
        }
        let mut raise: BTreeMap<u32, Level> = BTreeMap::new();
        // Duration first: a trip is an occurrence for the frequency rules.
        for r in &rules.duration {
            for &code in &r.codes {
                let Some(s) = state.get_mut(&code) else {
                    continue;
                };
                if s.present {
                    s.recovered_since_ms = None;
                    let since = *s.present_since_ms.get_or_insert(now_ms);
                    if !s.by_duration && now_ms.saturating_sub(since) > r.fault_timeout_s * 1000 {
                        s.by_duration = true;
                        s.occurrences.push_back(since);
                        s.last_fault_ms = since;
                    }
                } else {
                    s.present_since_ms = None;
                    let since = *s.recovered_since_ms.get_or_insert(now_ms);
                    if s.by_duration && now_ms.saturating_sub(since) > r.recover_timeout_s * 1000 {
                        s.by_duration = false;
                        s.last_recover_ms = Some(now_ms);
                    }
                }
                if s.by_duration {
                    let l = raise.entry(code).or_insert(r.level);
                    *l = (*l).max(r.level);
                }
            }
        }
        for r in &rules.frequency {
            for &code in &r.codes {
                let Some(s) = state.get_mut(&code) else {
                    continue;
                };
                let start = now_ms.saturating_sub(r.window_s * 1000);
                while s.occurrences.front().is_some_and(|&t| t < start) {
                    s.occurrences.pop_front();
                }
                while s.occurrences.len() > r.times as usize {
                    s.occurrences.pop_front();
                }
                if s.occurrences.len() >= r.times as usize {
                    // Detected: the count starts again and the level holds until the
                    // release (the plugin's upgrade cache).
                    s.by_frequency = true;
                    s.occurrences.clear();
                } else if s.by_frequency {
                    let released = r.release_s.is_some_and(|rel| {
                        s.last_recover_ms.is_some_and(|rec| {
                            rec >= s.last_fault_ms && now_ms.saturating_sub(rec) > rel * 1000
                        })
                    });
                    if released {
                        s.by_frequency = false;
                    }
                }
                if s.by_frequency {
                    let l = raise.entry(code).or_insert(r.level);
                    *l = (*l).max(r.level);
                }
            }
        }
        // A code gone, counted nowhere and raising nothing has no history left to keep.
        state.retain(|_, s| {
            s.present || s.by_frequency || s.by_duration || !s.occurrences.is_empty()
        });
        for g in graded.iter_mut() {
            let Some(level) = parse_code(&g.code).and_then(|c| raise.get(&c)) else {
                continue;
            };
            if g.level.is_none_or(|l| l < *level) {
                g.level = Some(*level);
                g.status = level.default_status();
                g.reason = level.default_reason().to_string();
            }
        }
        // A code that escalated and is gone keeps the chip escalated, as the plugin's
        // upgrade cache does, until the release.
        for (code, level) in &raise {
            if !now.contains(code) {
                graded.push(GradedCode {
                    code: format!("{code:08X}"),
                    level: Some(*level),
                    status: level.default_status(),
                    reason: level.default_reason().to_string(),
                });
            }
        }
        if !raise.is_empty() {
            crate::ascend::worst_first(graded);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ascend::Catalog;
    use crate::reading::DeviceStatus;

    const S: u64 = 1000;
    const H: u64 = 3600 * S;

    /// One sample of chip `npu0` with `codes` at `at`: its worst code's level, status
    /// and reason.
    fn sample(e: &mut Escalator, codes: &[&str], at: u64) -> (Option<Level>, DeviceStatus, String) {
        let mut g = Catalog::builtin().grade_all(codes.iter().copied());
        e.apply(Escalation::builtin(), "npu0", &mut g, at);
        g.first()
            .map(|g| (g.level, g.status, g.reason.clone()))
            .unwrap_or((None, DeviceStatus::Healthy, String::new()))
    }

    /// The code comes and goes `n` times, an hour apart, from `start`.
    fn flaps(
        e: &mut Escalator,
        code: &str,
        n: u64,
        start: u64,
    ) -> (Option<Level>, DeviceStatus, String) {
        let mut last = sample(e, &[], start);
        for i in 0..n {
            last = sample(e, &[code], start + i * H);
            sample(e, &[], start + i * H + 10 * S);
        }
        last
    }

    #[test]
    fn the_plugins_rules_are_built_in() {
        let e = Escalation::builtin();
        assert_eq!(e.frequency.len(), 3);
        assert_eq!(e.frequency[0].codes.len(), 41);
        assert_eq!(
            (
                e.frequency[0].times,
                e.frequency[0].window_s,
                e.frequency[0].level
            ),
            (2, 86_400, Level::ManuallySeparateNPU)
        );
        assert_eq!(
            (e.frequency[1].codes[0], e.frequency[1].times),
            (0x80E1_8005, 3)
        );
        assert_eq!(
            (
                e.frequency[2].codes[0],
                e.frequency[2].times,
                e.frequency[2].release_s
            ),
            (0x8107_8603, 5, Some(172_800))
        );
        assert_eq!(
            e.duration,
            [DurationRule {
                codes: vec![0x8107_8603],
                fault_timeout_s: 20,
                recover_timeout_s: 60,
                level: Level::PreSeparateNPU
            }]
        );
    }

    #[test]
    fn a_code_repeated_within_its_window_separates_the_chip_for_good() {
        // 80E01801 (HBM double bit, RestartBusiness) twice within 24 h.
        let mut e = Escalator::default();
        let (l, s, _) = flaps(&mut e, "80E01801", 1, 0);
        assert_eq!(
            (l, s),
            (Some(Level::RestartBusiness), DeviceStatus::Degraded)
        );
        let (l, s, r) = flaps(&mut e, "80E01801", 1, 2 * H);
        assert_eq!(
            (l, s),
            (Some(Level::ManuallySeparateNPU), DeviceStatus::Failed)
        );
        assert_eq!(r, "ascend-manually-separate-npu");
        // Gone, and a week later: no release window, still separated.
        assert_eq!(
            sample(&mut e, &[], 200 * H).0,
            Some(Level::ManuallySeparateNPU)
        );
        // 80E18005 needs three; two 25 h apart never meet in one window.
        let mut e = Escalator::default();
        assert_ne!(
            flaps(&mut e, "80E18005", 2, 0).0,
            Some(Level::ManuallySeparateNPU)
        );
        let mut e = Escalator::default();
        flaps(&mut e, "80E18005", 1, 0);
        assert_ne!(
            flaps(&mut e, "80E18005", 1, 25 * H).0,
            Some(Level::ManuallySeparateNPU)
        );
        assert_eq!(
            flaps(&mut e, "80E18005", 2, 26 * H).0,
            Some(Level::ManuallySeparateNPU)
        );
    }

    #[test]
    fn a_link_down_held_20_s_is_pre_separated_and_recovers_after_60_s() {
        let mut e = Escalator::default();
        let link = "81078603";
        assert_eq!(sample(&mut e, &[link], 0).1, DeviceStatus::Healthy);
        assert_eq!(sample(&mut e, &[link], 20 * S).1, DeviceStatus::Healthy);
        let (l, s, r) = sample(&mut e, &[link], 21 * S);
        assert_eq!(
            (l, s),
            (Some(Level::PreSeparateNPU), DeviceStatus::Degraded)
        );
        assert_eq!(r, "ascend-pre-separate-npu");
        // Recovered: still pre-separated for 60 s, then back.
        assert_eq!(sample(&mut e, &[], 22 * S).0, Some(Level::PreSeparateNPU));
        assert_eq!(sample(&mut e, &[], 82 * S).0, Some(Level::PreSeparateNPU));
        assert_eq!(sample(&mut e, &[], 83 * S).1, DeviceStatus::Healthy);
    }

    #[test]
    fn five_link_downs_held_past_20_s_in_a_day_separate_until_48_h_after_recovery() {
        let link = "81078603";
        // Blips shorter than the duration rule's 20 s do not count.
        let mut e = Escalator::default();
        assert_eq!(flaps(&mut e, link, 6, 0).1, DeviceStatus::Healthy);
        // Five held 30 s each, an hour apart: each one a trip of the duration rule.
        let mut e = Escalator::default();
        let mut last = sample(&mut e, &[], 0);
        for i in 0..5 {
            sample(&mut e, &[link], i * H);
            last = sample(&mut e, &[link], i * H + 30 * S);
            sample(&mut e, &[], i * H + 40 * S);
            if i < 4 {
                // Recovered for more than 60 s: the duration rule stands down.
                sample(&mut e, &[], i * H + 101 * S);
            }
        }
        assert_eq!(last.0, Some(Level::ManuallySeparateNPU));
        assert_eq!(last.1, DeviceStatus::Failed);
        // The duration rule recovers 60 s after the last link down cleared (4 h 40 s);
        // the level holds until 48 h after that, out of the 24 h window or not.
        let recovered = 4 * H + 40 * S + 61 * S;
        assert_eq!(
            sample(&mut e, &[], recovered).0,
            Some(Level::ManuallySeparateNPU)
        );
        assert_eq!(
            sample(&mut e, &[], 30 * H).0,
            Some(Level::ManuallySeparateNPU)
        );
        assert_eq!(
            sample(&mut e, &[], recovered + 48 * H).0,
            Some(Level::ManuallySeparateNPU)
        );
        assert_eq!(
            sample(&mut e, &[], recovered + 48 * H + S).1,
            DeviceStatus::Healthy
        );
    }

    /// A site file that watches 20,000 codes: the escalator keeps a history only for
    /// the codes its chips show, and drops it once nothing is left to count. It kept
    /// one for every watched code on every chip from the first sample on.
    #[test]
    fn histories_are_kept_only_for_codes_seen() {
        let ids: Vec<String> = (0..20_000u32)
            .map(|i| format!("\"{:08X}\"", 0x8000_0000 + i))
            .collect();
        let file = format!(
            r#"{{"FaultFrequency": [{{"EventId": [{}], "TimeWindow": 3600, "Times": 2,
                "FaultHandling": "SeparateNPU", "ReleaseTimeWindow": 600}}]}}"#,
            ids.join(",")
        );
        let rules = Escalation::parse(&file).unwrap();
        let mut e = Escalator::default();
        for chip in 0..8 {
            let mut g = Catalog::builtin().grade_all(["80000001"]);
            e.apply(&rules, &format!("npu{chip}"), &mut g, 0);
        }
        assert_eq!(e.histories(), 8, "one code seen on each of 8 chips");
        // Counted once, it is kept for its window; past it, with the code gone, dropped.
        for chip in 0..8 {
            let mut g = Catalog::builtin().grade_all(std::iter::empty::<&str>());
            e.apply(&rules, &format!("npu{chip}"), &mut g, 2 * H);
        }
        assert_eq!(e.histories(), 0);
    }

    #[test]
    fn a_site_file_replaces_the_rules_and_nonsense_is_refused() {
        let e = Escalation::parse(
            r#"{"FaultFrequency": [{"EventId": ["8C084E00"], "TimeWindow": 3600, "Times": 2,
                "FaultHandling": "SeparateNPU", "ReleaseTimeWindow": 600}]}"#,
        )
        .unwrap();
        assert_eq!((e.frequency.len(), e.duration.len()), (1, 0));
        for bad in [
            "{",
            r#"{"FaultFrequency": [{"EventId": [], "TimeWindow": 3600, "Times": 2, "FaultHandling": "SeparateNPU", "ReleaseTimeWindow": 600}]}"#,
            r#"{"FaultFrequency": [{"EventId": ["XYZ"], "TimeWindow": 3600, "Times": 2, "FaultHandling": "SeparateNPU", "ReleaseTimeWindow": 600}]}"#,
            r#"{"FaultFrequency": [{"EventId": ["8C084E00"], "TimeWindow": 10, "Times": 2, "FaultHandling": "SeparateNPU", "ReleaseTimeWindow": 600}]}"#,
            r#"{"FaultFrequency": [{"EventId": ["8C084E00"], "TimeWindow": 3600, "Times": 2, "FaultHandling": "SeparateNPU"}]}"#,
            r#"{"FaultFrequency": [{"EventId": ["8C084E00"], "TimeWindow": 3600, "Times": 2, "FaultHandling": "Broken", "ReleaseTimeWindow": 600}]}"#,
            r#"{"FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 601, "RecoverTimeout": 60, "FaultHandling": "PreSeparateNPU"}]}"#,
        ] {
            assert!(Escalation::parse(bad).is_err(), "{bad}");
        }
    }
}
