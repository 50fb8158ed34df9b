//! Warn before evicting: a pod on a failed device that asks for time to
//! checkpoint (`faultline.io/checkpoint-grace: 300s` on the pod, or on its namespace;
//! at most `--max-checkpoint-grace`) gets a drain intent first: published in its node's
//! `fault.json` entry (`drain[]`, with `evict_after`), recorded on the Node, and sent as
//! an Event to the pod. It is evicted when it acknowledges (through its node's agent,
//! `POST /v1/drain/ack`), and at `evict_after` in any case, never later: the dispatcher
//! wakes the node's pass at the deadline. A pod that exits has acknowledged by leaving.
//! Without the annotation (grace 0) a pod is evicted at once, as before.
//!
//! The decisions are the pure functions here ([`grace`], [`drain_step`],
//! [`acknowledged`]), each with a table test (and cargo-mutants, scripts/mutants.sh);
//! reading a namespace's annotation is `grace.rs`'s. Budgets, the breaker, PDBs and
//! dry-run apply to the eviction as before.

use std::time::Duration;

use faultline_common::fault::DrainNotice;
use faultline_common::time::{parse_duration, rfc3339_ms};
use k8s_openapi::api::core::v1::Pod;

/// The annotation (on a pod, or on its namespace) asking for time to checkpoint.
pub const GRACE_ANNOTATION: &str = "faultline.io/checkpoint-grace";

/// A checkpoint grace that is not a duration (on the pod, or on its namespace).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{GRACE_ANNOTATION}: {0:?} is not a duration such as 300s or 5m")]
pub struct BadGrace(pub String);

/// How long a pod may checkpoint before its eviction: its own annotation, else its
/// namespace's, at most `max`; none: zero. A value that is not a duration is an error
/// (the pod is then evicted at once, as without one, and the error announced).
pub fn grace(
    pod: Option<&str>,
    namespace: Option<&str>,
    max: Duration,
) -> Result<Duration, BadGrace> {
    let Some(v) = pod.or(namespace) else {
        return Ok(Duration::ZERO);
    };
    match parse_duration(v) {
        Some(d) => Ok(d.min(max)),
        None => Err(BadGrace(v.to_string())),
    }
}

/// Why a pod is evicted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// It asked for no time: as before.
    NoGrace,
    /// It acknowledged its intent.
    Acknowledged,
    /// Its intent's deadline passed.
    TimedOut,
}

impl Drained {
    /// The metric's result.
    pub fn result(self) -> crate::metrics::ActionResult {
        use crate::metrics::ActionResult;
        match self {
            Drained::NoGrace => ActionResult::Ok,
            Drained::Acknowledged => ActionResult::Acknowledged,
            Drained::TimedOut => ActionResult::TimedOut,
        }
    }

    /// The record's wording.
    pub fn as_str(self) -> &'static str {
        match self {
            Drained::NoGrace => "no-grace",
            Drained::Acknowledged => "acknowledged",
            Drained::TimedOut => "timed-out",
        }
    }
}

/// What to do with a pod on a failed device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainStep {
    /// Evict it now.
    Evict(Drained),
    /// Publish its intent: evicted at this time (ms) at the latest.
    Request(u64),
    /// Its intent stands: wait until this time (ms) or its acknowledgement.
    Wait(u64),
}

/// The step for a pod with `grace`, its intent so far (`evict_after`, in ms), whether
/// it acknowledged, at `now_ms`. An intent once published keeps its deadline (a grace
/// changed meanwhile does not move it); an acknowledgement counts only for a published
/// intent.
pub fn drain_step(grace: Duration, intent: Option<u64>, acked: bool, now_ms: u64) -> DrainStep {
    match intent {
        None if grace.is_zero() => DrainStep::Evict(Drained::NoGrace),
        None => DrainStep::Request(now_ms.saturating_add(grace.as_millis() as u64)),
        Some(_) if acked => DrainStep::Evict(Drained::Acknowledged),
        Some(at) if now_ms >= at => DrainStep::Evict(Drained::TimedOut),
        Some(at) => DrainStep::Wait(at),
    }
}

/// Whether `intent` is acknowledged: recorded so, or answered by one of `acks` (pod
/// UID, the intent's `requested`). An acknowledgement of an earlier intent of the same
/// pod answers nothing now.
pub fn acknowledged(intent: &DrainNotice, acks: &[(String, String)]) -> bool {
    intent.acknowledged.is_some()
        || acks
            .iter()
            .any(|(uid, requested)| *uid == intent.uid && *requested == intent.requested)
}

/// A new intent for `pod` (its record key `key`), evicted at `evict_after_ms`, for
/// `reasons` (sorted, each once).
pub fn notice(
    pod: &Pod,
    devices: Vec<String>,
    reasons: Vec<String>,
    now_ms: u64,
    evict_after_ms: u64,
) -> DrainNotice {
    let status = pod.status.as_ref();
    let host_network = pod
        .spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false);
    let pod_ips = if host_network {
        Vec::new()
    } else {
        let mut ips: Vec<String> = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().map(|p| p.ip.clone()).collect())
            .unwrap_or_default();
        if ips.is_empty() {
            ips.extend(status.and_then(|s| s.pod_ip.clone()));
        }
        ips
    };
    DrainNotice {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        pod_ips,
        devices,
        reasons,
        requested: rfc3339_ms(now_ms),
        evict_after: rfc3339_ms(evict_after_ms),
        acknowledged: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_secs(600);

    #[test]
    fn the_pod_s_grace_wins_over_its_namespace_s_and_none_is_zero() {
        let s = Duration::from_secs;
        for (pod, ns, want) in [
            (None, None, Ok(s(0))),
            (Some("300s"), None, Ok(s(300))),
            (None, Some("2m"), Ok(s(120))),
            (Some("30s"), Some("2m"), Ok(s(30))),
            (Some("0"), Some("2m"), Ok(s(0))),
            (Some("2h"), None, Ok(MAX)),
        ] {
            assert_eq!(grace(pod, ns, MAX), want, "pod {pod:?}, namespace {ns:?}");
        }
        let e = grace(Some("five minutes"), Some("2m"), MAX)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("five minutes") && e.contains(GRACE_ANNOTATION),
            "{e}"
        );
        assert_eq!(
            grace(Some("300s"), None, Duration::ZERO),
            Ok(s(0)),
            "max 0: none"
        );
    }

    #[test]
    fn a_pod_is_warned_then_evicted_at_its_acknowledgement_or_deadline() {
        let g = Duration::from_secs(300);
        use DrainStep::*;
        for (grace, intent, acked, now, want) in [
            (Duration::ZERO, None, false, 1_000, Evict(Drained::NoGrace)),
            (Duration::ZERO, None, true, 1_000, Evict(Drained::NoGrace)),
            (g, None, false, 1_000, Request(301_000)),
            (g, None, true, 1_000, Request(301_000)),
            (g, Some(301_000), false, 1_000, Wait(301_000)),
            (g, Some(301_000), false, 300_999, Wait(301_000)),
            (g, Some(301_000), false, 301_000, Evict(Drained::TimedOut)),
            (g, Some(301_000), true, 2_000, Evict(Drained::Acknowledged)),
            // The grace changed after the intent: its deadline stands.
            (Duration::ZERO, Some(301_000), false, 2_000, Wait(301_000)),
            (
                g * 10,
                Some(301_000),
                false,
                301_000,
                Evict(Drained::TimedOut),
            ),
        ] {
            assert_eq!(
                drain_step(grace, intent, acked, now),
                want,
                "grace {grace:?}, intent {intent:?}, acked {acked}, now {now}"
            );
        }
    }

    /// What the metric and the record say of each way a pod leaves.
    #[test]
    fn each_way_out_is_named_and_counted_apart() {
        use crate::metrics::ActionResult;
        for (d, word, result) in [
            (Drained::NoGrace, "no-grace", ActionResult::Ok),
            (
                Drained::Acknowledged,
                "acknowledged",
                ActionResult::Acknowledged,
            ),
            (Drained::TimedOut, "timed-out", ActionResult::TimedOut),
        ] {
            assert_eq!((d.as_str(), d.result()), (word, result), "{d:?}");
        }
    }

    #[test]
    fn an_acknowledgement_answers_its_own_intent_only() {
        let intent = DrainNotice {
            namespace: "ml".into(),
            pod: "p".into(),
            uid: "u-1".into(),
            pod_ips: vec![],
            devices: vec!["gpu0".into()],
            reasons: vec!["xid-79".into()],
            requested: rfc3339_ms(2_000),
            evict_after: rfc3339_ms(302_000),
            acknowledged: None,
        };
        let ack = |uid: &str, at: u64| (uid.to_string(), rfc3339_ms(at));
        assert!(acknowledged(&intent, &[ack("u-1", 2_000)]));
        assert!(!acknowledged(&intent, &[]));
        assert!(
            !acknowledged(&intent, &[ack("u-2", 2_000)]),
            "another pod's"
        );
        assert!(
            !acknowledged(&intent, &[ack("u-1", 1_000)]),
            "an earlier intent's, of the same pod"
        );
        let recorded = DrainNotice {
            acknowledged: Some(rfc3339_ms(3_000)),
            ..intent
        };
        assert!(acknowledged(&recorded, &[]), "recorded: it stands");
    }

    #[test]
    fn an_intent_names_the_pod_s_own_addresses_and_none_on_the_host_network() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train-0", "namespace": "ml", "uid": "u-1"},
            "spec": {"containers": []},
            "status": {"podIP": "10.0.0.7", "podIPs": [{"ip": "10.0.0.7"}, {"ip": "fd00::7"}]},
        }))
        .unwrap();
        let n = notice(&pod, vec!["gpu3".into()], vec!["xid-79".into()], 0, 300_000);
        assert_eq!(n.pod_ips, ["10.0.0.7", "fd00::7"]);
        assert_eq!(
            (n.namespace.as_str(), n.pod.as_str(), n.uid.as_str()),
            ("ml", "train-0", "u-1")
        );
        assert_eq!(n.evict_after, "1970-01-01T00:05:00.000Z");
        let mut host = pod.clone();
        host.spec.as_mut().unwrap().host_network = Some(true);
        assert!(notice(&host, vec![], vec![], 0, 1).pod_ips.is_empty());
        let mut old = pod;
        old.status.as_mut().unwrap().pod_ips = None;
        assert_eq!(notice(&old, vec![], vec![], 0, 1).pod_ips, ["10.0.0.7"]);
    }
}
