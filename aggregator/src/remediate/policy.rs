//! What remediation may do and when, as pure functions: no API, no clock (the time is
//! passed in), so every decision has a table test here. The passes (`isolate.rs`,
//! `evict.rs`, `release.rs`, `canary.rs`) read the cluster, ask these, then write.

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;

use super::record::{CanaryRun, CanaryState, QuarantineRecord};
use super::view::{JobView, PodView};
use crate::model::{DeviceView, RecordDevice};
use faultline_common::time::age_secs_at;
use faultline_common::DeviceStatus;

/// What remediation may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Nothing.
    Off,
    /// Log and announce what would be done; change nothing.
    DryRun,
    /// Act.
    Enforce,
}

/// How much may be quarantined at once, cluster-wide.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Nodes quarantined at most.
    pub max_nodes: usize,
    /// Share of accelerator nodes quarantined at most, in percent.
    pub max_percent: f64,
    /// Nodes whose label names the failure domain (rack, zone) and how many of one
    /// domain may be quarantined at most.
    pub per_domain: Option<(String, usize)>,
    /// Label selector of the accelerator nodes (the percentage's base).
    pub node_selector: String,
    /// Nodes the unknown guard taints at most (its own budget: a blind spot cannot use
    /// up the room real failures need).
    pub max_unknown: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_nodes: 5,
            max_percent: 10.0,
            per_domain: None,
            node_selector: String::new(),
            max_unknown: 2,
        }
    }
}

impl Budget {
    /// Why quarantining a node of failure domain `domain` would exceed the budget, with
    /// `quarantined` the domains of the nodes quarantined now (each `None` where the node
    /// has no domain label, or no domain budget is set), if it would. `total` (the
    /// accelerator nodes) is asked only when the node count leaves room.
    pub fn refusal(
        &self,
        domain: Option<&str>,
        quarantined: &[Option<String>],
        total: impl FnOnce() -> usize,
    ) -> Option<String> {
        if quarantined.len() >= self.max_nodes {
            return Some(format!(
                "{} nodes quarantined, budget {}",
                quarantined.len(),
                self.max_nodes
            ));
        }
        let total = total().max(1);
        // The share applies from the second node on: one quarantine is always allowed
        // (within max_nodes), or a small cluster could never isolate anything.
        let share = (quarantined.len() + 1) as f64 * 100.0 / total as f64;
        if !quarantined.is_empty() && share > self.max_percent {
            return Some(format!(
                "{} of {total} nodes would be quarantined ({share:.0}%), budget {}%",
                quarantined.len() + 1,
                self.max_percent
            ));
        }
        if let Some((label, max)) = &self.per_domain {
            let domain = domain.unwrap_or_default();
            let same = quarantined
                .iter()
                .filter(|d| d.as_deref() == Some(domain))
                .count();
            if same >= *max {
                return Some(format!(
                    "{same} nodes of {label}={domain} quarantined, budget {max}"
                ));
            }
        }
        None
    }
}

/// A node's place in the budget, taken in the shared ledger (a ConfigMap written by
/// compare-and-swap) before its taint is written: every replica counts it from then on,
/// landed or not, so across replicas the budget holds exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Place {
    /// When it was taken (RFC 3339, the taker's clock).
    pub at: String,
    /// The replica that took it.
    pub by: String,
    /// The node's failure domain, where a domain budget is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

/// How long a place whose node is not quarantined is kept: one taken by a pass whose
/// taint never landed (the hold ended, a 500, a crash). A taint is written within this
/// of its place or not at all (`isolate` checks before its write, and the write is bounded
/// by the hold), so a place is never dropped while its taint may still land.
pub const PLACE_TTL: Duration = Duration::from_secs(300);

/// Take `node`'s place (failure domain `domain`) in `ledger`, within `budget`: the
/// count is every node quarantined now (`quarantined`, read from the Nodes: name →
/// domain) and every other place in the ledger. A place whose node is not quarantined
/// and which is [`PLACE_TTL`] old (`age_secs` of its `at`) is dropped first. On room,
/// `place` is `node`'s from now on (a place taken before is stamped anew) and `None`
/// comes back; else why not, and `ledger` keeps its places (the caller writes nothing).
pub fn take_place(
    budget: &Budget,
    ledger: &mut std::collections::BTreeMap<String, Place>,
    quarantined: &std::collections::BTreeMap<String, Option<String>>,
    (node, domain): (&str, Option<&str>),
    place: Place,
    age_secs: impl Fn(&str) -> Option<f64>,
    total: impl FnOnce() -> usize,
) -> Option<String> {
    let ttl = PLACE_TTL.as_secs_f64();
    ledger.retain(|n, p| {
        n == node || quarantined.contains_key(n) || age_secs(&p.at).is_some_and(|a| a < ttl)
    });
    let others = quarantined
        .iter()
        .filter(|(n, _)| *n != node)
        .map(|(_, d)| d.clone());
    let reserved = ledger
        .iter()
        .filter(|(n, _)| *n != node && !quarantined.contains_key(*n))
        .map(|(_, p)| p.domain.clone());
    let domains: Vec<Option<String>> = others.chain(reserved).collect();
    let why = budget.refusal(domain, &domains, total);
    if why.is_none() {
        ledger.insert(node.to_string(), place);
    }
    why
}

/// When a quarantine ends by itself.
#[derive(Debug, Clone)]
pub struct ReleasePolicy {
    /// `--release auto`: after health, cool-down and (if set) the canary. `manual`
    /// (false): only when a person asks. Unknown-only taints lift by themselves either
    /// way once the devices are seen healthy again: they were a guard, not a verdict.
    pub auto: bool,
    /// Clean samples in a row every device needs.
    pub healthy_samples: u32,
    /// How long every device must have been healthy (and since a failed canary).
    pub cooldown: Duration,
    /// The probe Job (a template) that must succeed on the node first.
    pub canary: Option<CanarySpec>,
    /// How long a person's release holds against the same fault (default 15 min); also
    /// the window of the intake's dedup.
    pub dedup_window: Duration,
    /// A record's expiry: when it is due for review; one that cannot be released then
    /// is extended by as much again and announced.
    pub expiry: Duration,
}

impl Default for ReleasePolicy {
    fn default() -> Self {
        ReleasePolicy {
            auto: false,
            healthy_samples: 30,
            cooldown: Duration::from_secs(600),
            canary: None,
            dedup_window: Duration::from_secs(900),
            expiry: Duration::from_secs(86_400),
        }
    }
}

/// The canary: a Job template, run pinned to the node, tolerating faultline's taint.
#[derive(Debug, Clone)]
pub struct CanarySpec {
    /// The Job as written by the operator (name and nodeName are set by faultline).
    pub template: Job,
    /// Where the Jobs run.
    pub namespace: String,
    /// A canary not done by then has failed.
    pub timeout: Duration,
}

/// Whether a record may be released now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Not yet: why.
    Waiting(String),
    /// Every device proved healthy (the canary, if any, comes next): the reason.
    Ready(String),
}

/// Whether `record` may be released by itself: unknown-only records once every device
/// is healthy with enough clean samples; with `--release auto` also past the cool-down.
/// `views` are the pipeline's devices of the node.
pub fn release_readiness(
    record: &QuarantineRecord,
    views: &[DeviceView],
    policy: &ReleasePolicy,
    now_ms: u64,
) -> Readiness {
    if !record.unknown_only && !policy.auto {
        return Readiness::Waiting("manual release (faultline release)".into());
    }
    for d in &record.devices {
        let Some(v) = views
            .iter()
            .find(|v| d.is(&v.device.id) || d.uuid.as_deref().is_some_and(|u| v.device.is(u)))
        else {
            return Readiness::Waiting(format!("{} not reported by the agent", d.id));
        };
        if v.status != DeviceStatus::Healthy || v.clean_streak < policy.healthy_samples {
            return Readiness::Waiting(format!(
                "{} {} with {} clean samples of {}",
                d.id,
                v.status.as_str(),
                v.clean_streak,
                policy.healthy_samples
            ));
        }
        let healthy_for = Duration::from_millis(now_ms.saturating_sub(v.since_ms));
        if !record.unknown_only && healthy_for < policy.cooldown {
            return Readiness::Waiting(format!(
                "{} healthy for {}s of the {}s cool-down",
                d.id,
                healthy_for.as_secs(),
                policy.cooldown.as_secs()
            ));
        }
    }
    Readiness::Ready(if record.unknown_only {
        "devices seen healthy again".into()
    } else {
        format!(
            "{} clean samples and {}s cool-down",
            policy.healthy_samples,
            policy.cooldown.as_secs()
        )
    })
}

/// How a running canary stands, from its Job (`None`: gone) at `now_ms`.
pub fn canary_verdict(
    run: &CanaryRun,
    job: Option<JobView>,
    timeout: Duration,
    now_ms: u64,
) -> CanaryState {
    if job.is_some_and(|j| j.succeeded) {
        return CanaryState::Succeeded;
    }
    let timed_out = age_secs_at(&run.started, now_ms).unwrap_or(f64::MAX) > timeout.as_secs_f64();
    // Gone (deleted by someone) counts as failed too: start over after the cool-down.
    if job.is_none_or(|j| j.failed) || timed_out {
        CanaryState::Failed
    } else {
        CanaryState::Running
    }
}

/// Why no new canary may start yet: the last one failed within the cool-down.
pub fn canary_retry_wait(
    last: Option<&CanaryRun>,
    cooldown: Duration,
    now_ms: u64,
) -> Option<String> {
    let c = last.filter(|c| c.state == CanaryState::Failed)?;
    let waited = c
        .finished
        .as_deref()
        .and_then(|f| age_secs_at(f, now_ms))
        .unwrap_or(f64::MAX);
    (waited < cooldown.as_secs_f64()).then(|| {
        format!(
            "canary {} failed {}s ago; cool-down {}s",
            c.job,
            waited as u64,
            cooldown.as_secs()
        )
    })
}

/// Whether a record is past its expiry (due for review) at `now_ms`.
pub fn expired(record: &QuarantineRecord, now_ms: u64) -> bool {
    record
        .expiry
        .as_deref()
        .is_some_and(|e| age_secs_at(e, now_ms).is_some_and(|a| a >= 0.0))
}

/// Whether a quarantine is young enough that a missing announcement is made up for
/// (Events expire after an hour by default; an old quarantine was announced long ago).
pub fn young(record: &QuarantineRecord, now_ms: u64, within_secs: f64) -> bool {
    age_secs_at(&record.first_seen, now_ms).is_some_and(|a| a < within_secs)
}

/// The devices of `devices` a person has not released within `window`: those of the
/// last record released by hand (same device and reason), and those released from the
/// current `record` one by one.
pub fn not_suppressed(
    history: &[QuarantineRecord],
    record: Option<&QuarantineRecord>,
    devices: Vec<RecordDevice>,
    window: Duration,
    now_ms: u64,
) -> Vec<RecordDevice> {
    let window = window.as_secs_f64();
    let recent = |at: &str| age_secs_at(at, now_ms).is_some_and(|a| a < window);
    let mut released: Vec<&RecordDevice> = Vec::new();
    if let Some(last) = history.last() {
        if last
            .released
            .as_ref()
            .is_some_and(|r| r.manual && recent(&r.at))
        {
            released.extend(last.devices.iter());
        }
    }
    let partly: Vec<&String> = record
        .map(|r| {
            r.released_devices
                .iter()
                .filter(|(_, at)| recent(at))
                .map(|(id, _)| id)
                .collect()
        })
        .unwrap_or_default();
    devices
        .into_iter()
        .filter(|d| {
            let gone = released.iter().any(|r| {
                r.reason == d.reason && (d.is(&r.id) || r.uuid.as_deref().is_some_and(|u| d.is(u)))
            }) || partly.iter().any(|id| d.is(id));
            if gone {
                tracing::debug!(device = %d.id, "released by a person within the dedup window: not acted on");
            }
            !gone
        })
        .collect()
}

/// A remediation step, as the guards see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Taint, label, condition (a failed node, or the unknown guard).
    Isolate,
    /// Evict the pods on a failed device.
    Evict,
    /// Lift a quarantine (auto or a person's).
    Release,
}

/// Whether an open circuit breaker stops `step`. Isolation and eviction stop: many nodes
/// failing at once is more likely the monitoring than the hardware. A release never
/// does: a breaker must not keep a healthy node out of service (README: "a release is
/// never blocked by an open breaker").
pub fn breaker_stops(step: Step) -> bool {
    !matches!(step, Step::Release)
}

/// What noting a failed node did to the breaker's shared count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Noted {
    /// The breaker is open already: nothing counted.
    Open,
    /// The node was counted within the window already: nothing to write.
    Unchanged,
    /// Counted; below the threshold.
    Counted,
    /// Counted, and the count reached the threshold: the breaker opens.
    Tripped,
}

/// Note `node` failed at `now` (RFC 3339) in the breaker's stored count `failures`
/// (node -> when): pure, so the breaker's compare-and-swap loop and the model checker
/// decide alike. `age_secs` reads a stored time's age; `nodes` within `window_secs`
/// trip it. A closed breaker holding a full count was closed by a person: the count
/// starts afresh, or the next failure would reopen it at once.
pub fn note_failure(
    open: bool,
    failures: &mut std::collections::BTreeMap<String, String>,
    node: &str,
    now: &str,
    age_secs: impl Fn(&str) -> Option<f64>,
    nodes: usize,
    window_secs: f64,
) -> Noted {
    if open {
        return Noted::Open;
    }
    if failures.len() >= nodes {
        failures.clear();
    }
    failures.retain(|_, at| age_secs(at).is_some_and(|a| a <= window_secs));
    if failures.contains_key(node) {
        return Noted::Unchanged;
    }
    failures.insert(node.to_string(), now.to_string());
    if failures.len() >= nodes {
        Noted::Tripped
    } else {
        Noted::Counted
    }
}

/// Whether a quarantine evicts at all: an unknown-only one (the unknown guard's
/// NoSchedule taint) never does. Unknown alone never evicts anything.
pub fn record_evicts(unknown_only: bool) -> bool {
    !unknown_only
}

/// What to do about a pod whose budget refused its eviction for `waited`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// Try again on a later pass.
    Retry,
    /// Past the deadline: announce and leave it.
    GiveUp,
    /// Past the deadline with `--force-delete-after-deadline`: delete it.
    Delete,
}

/// The eviction deadline applied to a refusal that has lasted `waited`.
pub fn blocked(waited: Duration, deadline: Duration, force_delete: bool) -> Blocked {
    match (waited >= deadline, force_delete) {
        (false, _) => Blocked::Retry,
        (true, false) => Blocked::GiveUp,
        (true, true) => Blocked::Delete,
    }
}

/// DaemonSet, mirror, finished and terminating pods, and faultline's own canary: never
/// evicted, whatever they hold.
fn never_evicted(pod: &PodView) -> bool {
    pod.terminating || pod.finished || pod.mirror || pod.daemon || pod.canary
}

/// Whether a pod is evicted for a fault on `failed` devices: running pods that use an
/// accelerator and, where the kubelet says which devices they hold (KEP-4680), hold a
/// failed one. Never DaemonSet, mirror, finished or terminating pods, nor faultline's own
/// canary.
pub fn wants_eviction(pod: &PodView, failed: &[RecordDevice]) -> bool {
    if never_evicted(pod) {
        return false;
    }
    if !pod.accelerator {
        return false;
    }
    // KEP-4680: where the kubelet says which devices the pod holds, evict only the pods
    // that hold a failed one.
    if pod.held.is_empty() {
        return true;
    }
    pod.held.iter().any(|id| failed.iter().any(|d| d.is(id)))
}

/// [`wants_eviction`] with what DRA and a device quarantine add: a pod whose
/// claim holds a failed device (`claim_holds`) is evicted, whatever it asks for; where
/// only devices are quarantined (`device_scoped`), a pod is evicted only when it is
/// known to hold a failed device (its claim, or the kubelet's KEP-4680 status), so the
/// pods of the node's healthy devices stay.
pub fn wants_device_eviction(
    pod: &PodView,
    failed: &[RecordDevice],
    claim_holds: bool,
    device_scoped: bool,
) -> bool {
    if never_evicted(pod) {
        return false;
    }
    if claim_holds {
        return true;
    }
    if device_scoped && pod.held.is_empty() {
        return false;
    }
    wants_eviction(pod, failed)
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
