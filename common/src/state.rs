//! The per-device state machine of the aggregator, as a pure function with the clock
//! passed in:
//!
//! ```text
//! unknown  --clean sample-->                    healthy
//! healthy  --a rule held for `degraded_after`--> degraded
//! degraded --degraded for `failed_after`-->      failed
//! any      --hard fault-->                       failed
//! degraded --`degraded_recover_samples` clean--> healthy
//! failed   --`failed_recover_samples` clean-->   healthy
//! healthy/degraded --no fresh data past `unknown_after`--> unknown
//! ```
//!
//! A failed device stays failed while we cannot see it: only clean samples release it.
//! Missing data never makes a device failed.

use serde::{Deserialize, Serialize};

use crate::reading::DeviceStatus;

/// Timers and counts of the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateMachineConfig {
    /// A soft rule must hold this long (ms) before healthy turns degraded (seed: 60 s).
    pub degraded_after_ms: u64,
    /// Degraded this long (ms) turns failed (seed: 180 s).
    pub failed_after_ms: u64,
    /// Consecutive clean samples that release a failed device (seed: 5).
    pub failed_recover_samples: u32,
    /// Consecutive clean samples that release a degraded device.
    pub degraded_recover_samples: u32,
    /// Without a fresh sample this long (ms), healthy and degraded turn unknown.
    pub unknown_after_ms: u64,
}

impl Default for StateMachineConfig {
    fn default() -> Self {
        StateMachineConfig {
            degraded_after_ms: 60_000,
            failed_after_ms: 180_000,
            failed_recover_samples: 5,
            degraded_recover_samples: 3,
            unknown_after_ms: 30_000,
        }
    }
}

/// What one look at a device found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Observation {
    /// No fresh data: the agent is unreachable or its reading is stale/unknown.
    #[default]
    Missing,
    /// A fresh sample with no rule firing.
    Clean,
    /// A fresh sample on which soft rules fire (their reasons, most important first).
    Soft(Vec<String>),
    /// A fresh sample with a hard fault (its reason).
    Hard(String),
}

/// The state of one device between samples.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceState {
    /// Current status.
    pub status: DeviceStatus,
    /// Since when (ms since the epoch).
    pub since_ms: u64,
    /// Why (none when healthy).
    pub reason: Option<String>,
    /// Since when the current soft signal holds without a break.
    pub soft_since_ms: Option<u64>,
    /// Consecutive clean samples.
    pub clean_streak: u32,
    /// When the last fresh sample arrived.
    pub last_fresh_ms: Option<u64>,
}

impl DeviceState {
    /// A device never seen: unknown since `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        DeviceState {
            status: DeviceStatus::Unknown,
            since_ms: now_ms,
            reason: Some("no-data".into()),
            soft_since_ms: None,
            clean_streak: 0,
            last_fresh_ms: None,
        }
    }

    fn to(&self, status: DeviceStatus, reason: Option<String>, now_ms: u64) -> Self {
        let since_ms = if status == self.status {
            self.since_ms
        } else {
            now_ms
        };
        DeviceState {
            status,
            since_ms,
            reason,
            ..self.clone()
        }
    }
}

/// One step: the state after `obs` at `now_ms`.
pub fn step(
    prev: &DeviceState,
    obs: &Observation,
    now_ms: u64,
    cfg: &StateMachineConfig,
) -> DeviceState {
    use DeviceStatus::*;
    let mut s = prev.clone();
    match obs {
        Observation::Missing => {
            s.clean_streak = 0;
            s.soft_since_ms = None;
            let last = prev.last_fresh_ms.unwrap_or(prev.since_ms);
            let silent = now_ms.saturating_sub(last) >= cfg.unknown_after_ms;
            match prev.status {
                Failed | Unknown => s,
                Healthy | Degraded if silent => s.to(Unknown, Some("no-fresh-data".into()), now_ms),
                Healthy | Degraded => s,
            }
        }
        Observation::Hard(reason) => {
            s.last_fresh_ms = Some(now_ms);
            s.clean_streak = 0;
            s.soft_since_ms = None;
            // Keep the first hard reason while failed: it is what happened.
            if prev.status == Failed {
                return s;
            }
            s.to(Failed, Some(reason.clone()), now_ms)
        }
        Observation::Soft(reasons) => {
            s.last_fresh_ms = Some(now_ms);
            s.clean_streak = 0;
            let soft_since = prev.soft_since_ms.unwrap_or(now_ms);
            s.soft_since_ms = Some(soft_since);
            let reason = reasons.first().cloned();
            match prev.status {
                Failed => s,
                Degraded => {
                    // A reason a source may only degrade never turns failed by time.
                    let may_fail = !reasons.iter().all(|r| crate::xid::degrade_only(r));
                    if may_fail && now_ms.saturating_sub(prev.since_ms) >= cfg.failed_after_ms {
                        let r = prev.reason.clone().or(reason);
                        s.to(
                            Failed,
                            r.map(|r| {
                                format!("{r} (degraded for {}s)", cfg.failed_after_ms / 1000)
                            }),
                            now_ms,
                        )
                    } else {
                        s
                    }
                }
                Healthy | Unknown => {
                    if now_ms.saturating_sub(soft_since) >= cfg.degraded_after_ms {
                        s.to(Degraded, reason, now_ms)
                    } else if prev.status == Unknown {
                        // Fresh data, but a rule is pending: we can see the device now.
                        s.to(Healthy, None, now_ms)
                    } else {
                        s
                    }
                }
            }
        }
        Observation::Clean => {
            s.last_fresh_ms = Some(now_ms);
            s.soft_since_ms = None;
            s.clean_streak = prev.clean_streak.saturating_add(1);
            match prev.status {
                Healthy => s,
                Unknown => s.to(Healthy, None, now_ms),
                Degraded if s.clean_streak >= cfg.degraded_recover_samples => {
                    s.to(Healthy, None, now_ms)
                }
                Failed if s.clean_streak >= cfg.failed_recover_samples => {
                    s.to(Healthy, None, now_ms)
                }
                Degraded | Failed => s,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeviceStatus::*;

    const C: StateMachineConfig = StateMachineConfig {
        degraded_after_ms: 60_000,
        failed_after_ms: 180_000,
        failed_recover_samples: 5,
        degraded_recover_samples: 3,
        unknown_after_ms: 30_000,
    };

    fn soft() -> Observation {
        Observation::Soft(vec!["high-temp".into()])
    }
    fn hard() -> Observation {
        Observation::Hard("gpu-lost".into())
    }

    /// Run observations one per second from t=0 and return the final state.
    fn run(obs: &[Observation]) -> DeviceState {
        let mut s = DeviceState::new(0);
        for (i, o) in obs.iter().enumerate() {
            s = step(&s, o, i as u64 * 1000, &C);
        }
        s
    }

    fn n(o: Observation, k: usize) -> Vec<Observation> {
        vec![o; k]
    }

    /// A reason a source may only degrade (an Xid of an untrusted text log) holds the
    /// device degraded for as long as it lasts, never failed by time alone; with
    /// another soft reason beside it, time escalates as before. Three `logger -t kernel`
    /// lines failed a GPU, tainted its node and evicted its pod 245 s later.
    #[test]
    fn a_reason_that_may_only_degrade_never_fails_by_time() {
        let text = Observation::Soft(vec!["xid-79-text-log".into()]);
        let s = run(&n(text.clone(), 1_000));
        assert_eq!(
            (s.status, s.reason.as_deref()),
            (Degraded, Some("xid-79-text-log"))
        );
        let both = Observation::Soft(vec!["xid-79-text-log".into(), "high-temp".into()]);
        assert_eq!(run(&n(both, 1_000)).status, Failed);
        assert!(crate::xid::degrade_only("xid-13-text-log"));
        assert!(!crate::xid::degrade_only("xid-79") && !crate::xid::degrade_only("text-log"));
    }

    #[test]
    fn transition_table() {
        struct Case {
            name: &'static str,
            obs: Vec<Observation>,
            want: DeviceStatus,
            reason: Option<&'static str>,
        }
        let cat = |parts: Vec<Vec<Observation>>| parts.concat();
        let cases = vec![
            Case {
                name: "starts unknown",
                obs: vec![Observation::Missing],
                want: Unknown,
                reason: Some("no-data"),
            },
            Case {
                name: "unknown -> healthy on a clean sample",
                obs: vec![Observation::Clean],
                want: Healthy,
                reason: None,
            },
            Case {
                name: "unknown -> healthy on fresh data with a pending rule",
                obs: vec![soft()],
                want: Healthy,
                reason: None,
            },
            Case {
                name: "unknown -> failed on a hard fault",
                obs: vec![hard()],
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "a rule held 59 s is not enough",
                obs: cat(vec![vec![Observation::Clean], n(soft(), 60)]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "healthy -> degraded after the rule held 60 s",
                obs: cat(vec![vec![Observation::Clean], n(soft(), 61)]),
                want: Degraded,
                reason: Some("high-temp"),
            },
            Case {
                name: "a clean sample resets the 60 s timer",
                obs: cat(vec![n(soft(), 40), vec![Observation::Clean], n(soft(), 40)]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "missing data also breaks the soft timer",
                obs: cat(vec![
                    n(soft(), 40),
                    vec![Observation::Missing],
                    n(soft(), 40),
                ]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "degraded -> failed after 180 s degraded",
                obs: cat(vec![vec![Observation::Clean], n(soft(), 61 + 180)]),
                want: Failed,
                reason: Some("high-temp (degraded for 180s)"),
            },
            Case {
                name: "degraded 179 s stays degraded",
                obs: cat(vec![vec![Observation::Clean], n(soft(), 61 + 178)]),
                want: Degraded,
                reason: Some("high-temp"),
            },
            Case {
                name: "healthy -> failed on a hard fault",
                obs: vec![Observation::Clean, hard()],
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "degraded -> failed on a hard fault",
                obs: cat(vec![vec![Observation::Clean], n(soft(), 61), vec![hard()]]),
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "degraded -> healthy after 3 clean",
                obs: cat(vec![
                    vec![Observation::Clean],
                    n(soft(), 61),
                    n(Observation::Clean, 3),
                ]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "degraded stays with 2 clean",
                obs: cat(vec![
                    vec![Observation::Clean],
                    n(soft(), 61),
                    n(Observation::Clean, 2),
                ]),
                want: Degraded,
                reason: Some("high-temp"),
            },
            Case {
                name: "failed stays failed with 4 clean",
                obs: cat(vec![vec![hard()], n(Observation::Clean, 4)]),
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "failed -> healthy after 5 clean",
                obs: cat(vec![vec![hard()], n(Observation::Clean, 5)]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "a soft sample restarts the clean count of a failed device",
                obs: cat(vec![
                    vec![hard()],
                    n(Observation::Clean, 4),
                    vec![soft()],
                    n(Observation::Clean, 4),
                ]),
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "missing data restarts the clean count too",
                obs: cat(vec![
                    vec![hard()],
                    n(Observation::Clean, 4),
                    vec![Observation::Missing],
                    n(Observation::Clean, 4),
                ]),
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "failed stays failed while unseen",
                obs: cat(vec![vec![hard()], n(Observation::Missing, 100)]),
                want: Failed,
                reason: Some("gpu-lost"),
            },
            Case {
                name: "healthy survives a short gap",
                obs: cat(vec![vec![Observation::Clean], n(Observation::Missing, 29)]),
                want: Healthy,
                reason: None,
            },
            Case {
                name: "healthy -> unknown after 30 s without data",
                obs: cat(vec![vec![Observation::Clean], n(Observation::Missing, 30)]),
                want: Unknown,
                reason: Some("no-fresh-data"),
            },
            Case {
                name: "degraded -> unknown after 30 s without data, never failed",
                obs: cat(vec![
                    vec![Observation::Clean],
                    n(soft(), 61),
                    n(Observation::Missing, 200),
                ]),
                want: Unknown,
                reason: Some("no-fresh-data"),
            },
            Case {
                name: "unknown stays unknown without data",
                obs: n(Observation::Missing, 500),
                want: Unknown,
                reason: Some("no-data"),
            },
        ];
        for c in cases {
            let s = run(&c.obs);
            assert_eq!(
                (s.status, s.reason.as_deref()),
                (c.want, c.reason),
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn since_marks_the_transition_not_the_last_sample() {
        let mut s = DeviceState::new(0);
        s = step(&s, &Observation::Clean, 1_000, &C);
        assert_eq!((s.status, s.since_ms), (Healthy, 1_000));
        s = step(&s, &Observation::Clean, 2_000, &C);
        assert_eq!(s.since_ms, 1_000);
        s = step(&s, &hard(), 3_000, &C);
        s = step(&s, &Observation::Hard("xid-79".into()), 4_000, &C);
        assert_eq!(
            (s.status, s.since_ms, s.reason.as_deref()),
            (Failed, 3_000, Some("gpu-lost"))
        );
    }

    #[test]
    fn config_reads_partial_documents_with_defaults() {
        let c: StateMachineConfig =
            serde_json::from_str(r#"{"failed_recover_samples": 7}"#).unwrap();
        assert_eq!(c.failed_recover_samples, 7);
        assert_eq!(c.degraded_after_ms, 60_000);
        assert!(serde_json::from_str::<StateMachineConfig>(r#"{"bogus": 1}"#).is_err());
    }
}
