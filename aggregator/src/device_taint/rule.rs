//! One DeviceTaintRule per quarantined device, pure: its
//! deterministic name, the object faultline writes, whether a rule is faultline's, and
//! what the device-taint eviction controller says a `None` rule would evict.

use serde_json::{json, Value};

use super::api::TaintApi;
use super::index::DeviceRef;

/// The label every rule faultline writes carries; a rule without it is never touched.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "faultline");
/// The taint's key.
pub const TAINT_KEY: &str = "faultline.io/unhealthy";
/// The `fault.json` sequence the decision was published under.
pub const SEQUENCE_ANNOTATION: &str = "faultline.io/sequence";
/// The shard the decision was made under.
pub const SHARD_ANNOTATION: &str = "faultline.io/shard";
/// The device's UUID, as the agent reported it.
pub const UUID_ANNOTATION: &str = "faultline.io/uuid";

/// Longest object name (a DNS-1123 subdomain).
const NAME_MAX: usize = 253;

/// A taint's effect (`None` from 1.35: the controller only reports what it would do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    None,
    NoSchedule,
    NoExecute,
}

impl Effect {
    pub fn as_str(self) -> &'static str {
        match self {
            Effect::None => "None",
            Effect::NoSchedule => "NoSchedule",
            Effect::NoExecute => "NoExecute",
        }
    }
}

/// FNV-1a, 64 bits: a stable hash (std's is seeded per process).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Lowercase alphanumerics and `-` of `s`, others as `-`, no `-` at either end.
fn label_part(s: &str) -> String {
    let t: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    t.trim_matches('-').to_string()
}

/// The rule's name: `faultline-<device>-<pool>-<hash>`, the same for the same device
/// on every replica and every restart, distinct for distinct (driver, pool, device)
/// (the hash is of all three), a DNS-1123 subdomain of at most 253 characters.
pub fn rule_name(d: &DeviceRef) -> String {
    let hash = fnv1a(&format!("{}/{}/{}", d.driver, d.pool, d.device));
    let head = format!(
        "faultline-{}-{}",
        label_part(&d.device),
        label_part(&d.pool)
    );
    let room = NAME_MAX - 17; // "-" and 16 hex digits
    let head: String = head.chars().take(room).collect();
    format!("{}-{hash:016x}", head.trim_end_matches('-'))
}

/// The taint's value for a fault `reason`: the reason cut to a label value.
pub fn taint_value(reason: &str) -> String {
    let value: String = label_part(reason).chars().take(63).collect();
    value.trim_end_matches('-').to_string()
}

/// The rule for `d`: selector on driver, pool and device; the taint
/// `faultline.io/unhealthy=<reason>` with `effect`; faultline's label; the sequence,
/// shard and UUID it was decided under. `reason` is cut to a label value.
pub fn rule_object(
    api: &TaintApi,
    d: &DeviceRef,
    uuid: &str,
    effect: Effect,
    reason: &str,
    sequence: u64,
    shard: u32,
) -> Value {
    let value = taint_value(reason);
    json!({
        "apiVersion": api.api_version(),
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(d),
            "labels": {MANAGED_BY.0: MANAGED_BY.1},
            "annotations": {
                SEQUENCE_ANNOTATION: sequence.to_string(),
                SHARD_ANNOTATION: shard.to_string(),
                UUID_ANNOTATION: uuid,
            },
        },
        "spec": {
            "deviceSelector": {"driver": d.driver, "pool": d.pool, "device": d.device},
            "taint": {"key": TAINT_KEY, "value": value, "effect": effect.as_str()},
        },
    })
}

/// Whether `rule` is faultline's to change or delete: its label, nothing else.
pub fn is_ours(rule: &Value) -> bool {
    rule.pointer("/metadata/labels")
        .and_then(|l| l.get(MANAGED_BY.0))
        .and_then(Value::as_str)
        == Some(MANAGED_BY.1)
}

/// What the device-taint eviction controller reported on a rule at effect `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reported {
    /// Nothing for the rule's current generation yet: the controller has not simulated
    /// it (or does not run), or the rule is not at `None`.
    NotYet,
    /// The pods it would evict if the effect were `NoExecute`.
    Pods(u64),
    /// A report for this generation in words faultline cannot read (`message`, and the
    /// reason it came with): upstream says the message "may change". Never guessed at.
    Unreadable(String),
}

/// What the device-taint eviction controller reported for a `None` rule at its current
/// generation: the `EvictionInProgress` condition with that `observedGeneration`, its
/// reason `NoEffect` and its message "… N pods would be evicted in …" ("1 pod would be
/// evicted in …"), as pkg/controller/devicetainteviction/device_taint_eviction.go
/// writes them in 1.35, 1.36 and 1.37 alike. A report for this generation in other
/// words is [`Reported::Unreadable`].
pub fn would_evict(rule: &Value) -> Reported {
    let generation = rule.pointer("/metadata/generation").and_then(Value::as_i64);
    let at_none = rule.pointer("/spec/taint/effect").and_then(Value::as_str) == Some("None");
    let c = rule
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|c| c.get("type").and_then(Value::as_str) == Some("EvictionInProgress"));
    let Some(c) = c.filter(|c| {
        at_none
            && generation.is_some()
            && c.get("observedGeneration").and_then(Value::as_i64) == generation
    }) else {
        return Reported::NotYet;
    };
    let reason = c.get("reason").and_then(Value::as_str).unwrap_or("");
    let msg = c.get("message").and_then(Value::as_str).unwrap_or("");
    let count = msg
        .find(" pods would be evicted in ")
        .or_else(|| msg.find(" pod would be evicted in "))
        .and_then(|at| {
            let start = msg[..at]
                .rfind(|c: char| !c.is_ascii_digit())
                .map_or(0, |i| i + 1);
            msg[start..at].parse().ok()
        });
    match count {
        Some(n) if reason == "NoEffect" => Reported::Pods(n),
        _ => Reported::Unreadable(format!("{reason}: {msg}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(pool: &str, device: &str) -> DeviceRef {
        DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: pool.into(),
            device: device.into(),
        }
    }

    #[test]
    fn a_rule_name_is_stable_distinct_and_valid() {
        let a = rule_name(&dev("node-7", "gpu-3"));
        assert_eq!(a, rule_name(&dev("node-7", "gpu-3")));
        assert!(a.starts_with("faultline-gpu-3-node-7-"), "{a}");
        assert_ne!(a, rule_name(&dev("node-7", "gpu-4")));
        assert_ne!(a, rule_name(&dev("node-73", "gpu-3")));
        // Pools may be paths; the longest still makes a valid name.
        let long = rule_name(&dev(&format!("{}/b", "a".repeat(251)), "gpu-0"));
        assert!(long.len() <= 253, "{}", long.len());
        for n in [&a, &long] {
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{n}"
            );
            assert!(!n.starts_with('-') && !n.ends_with('-'));
        }
    }

    #[test]
    fn the_hash_is_fnv1a_and_tells_drivers_apart() {
        // FNV-1a 64's published test vectors.
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
        // Same device and pool under two drivers: only the hash differs, and it does.
        let mut other = dev("n1", "gpu-0");
        other.driver = "npu.huawei.com".into();
        assert_ne!(rule_name(&dev("n1", "gpu-0")), rule_name(&other));
    }

    #[test]
    fn the_rule_selects_one_device_and_is_marked_ours() {
        let api = TaintApi {
            version: "v1beta2".into(),
        };
        let r = rule_object(
            &api,
            &dev("n1", "gpu-3"),
            "GPU-abc",
            Effect::None,
            "Xid 79: fallen off the bus",
            42,
            3,
        );
        assert_eq!(r["apiVersion"], "resource.k8s.io/v1beta2");
        assert_eq!(
            r["spec"]["deviceSelector"],
            json!({"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-3"})
        );
        assert_eq!(r["spec"]["taint"]["effect"], "None");
        assert_eq!(r["spec"]["taint"]["value"], "xid-79--fallen-off-the-bus");
        assert_eq!(r["metadata"]["annotations"][SEQUENCE_ANNOTATION], "42");
        assert_eq!(r["metadata"]["annotations"][SHARD_ANNOTATION], "3");
        assert!(is_ours(&r));
        let mut theirs = r.clone();
        theirs["metadata"]["labels"] = json!({"app.kubernetes.io/managed-by": "nvsentinel"});
        assert!(!is_ours(&theirs));
        theirs["metadata"].as_object_mut().unwrap().remove("labels");
        assert!(!is_ours(&theirs));
        let long = rule_object(
            &api,
            &dev("n1", "gpu-3"),
            "u",
            Effect::NoSchedule,
            &"x".repeat(200),
            1,
            0,
        );
        assert_eq!(long["spec"]["taint"]["value"].as_str().unwrap().len(), 63);
    }

    fn simulated(generation: i64, observed: i64, reason: &str, message: &str) -> Value {
        json!({"metadata": {"generation": generation}, "spec": {"taint": {"effect": "None"}},
            "status": {"conditions": [{"type": "EvictionInProgress", "status": "False", "reason": reason,
                "message": message, "observedGeneration": observed}]}})
    }

    #[test]
    fn the_controllers_prediction_is_read_from_its_own_words() {
        // The messages as device_taint_eviction.go writes them (and its tests expect).
        let m = "0 published devices selected. 3 allocated devices selected. 2 pods would be evicted in 2 different namespaces if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update.";
        assert_eq!(
            would_evict(&simulated(1, 1, "NoEffect", m)),
            Reported::Pods(2)
        );
        let one = "1 published device selected. 1 allocated device selected. 1 pod would be evicted in 1 namespace if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update.";
        assert_eq!(
            would_evict(&simulated(1, 1, "NoEffect", one)),
            Reported::Pods(1)
        );
        let none = "1 published device selected. 0 allocated devices selected. 0 pods would be evicted in 0 different namespaces if the effect was NoExecute. This information will not be updated again. Recreate the DeviceTaintRule to trigger an update.";
        assert_eq!(
            would_evict(&simulated(1, 1, "NoEffect", none)),
            Reported::Pods(0)
        );
        // After a NoExecute period the controller adds what it evicted.
        let after = format!("{m} 3 pods evicted since starting the controller.");
        assert_eq!(
            would_evict(&simulated(1, 1, "NoEffect", &after)),
            Reported::Pods(2)
        );
        // Not for this generation, or nothing there: not yet.
        assert_eq!(
            would_evict(&simulated(2, 1, "NoEffect", m)),
            Reported::NotYet
        );
        assert_eq!(
            would_evict(
                &json!({"metadata": {"generation": 1}, "spec": {"taint": {"effect": "None"}}})
            ),
            Reported::NotYet
        );
        // A rule no longer at None: its condition is no prediction.
        let mut enforced = simulated(
            1,
            1,
            "OtherEffect",
            "Eviction only happens for the NoExecute effect.",
        );
        enforced["spec"]["taint"]["effect"] = json!("NoSchedule");
        assert_eq!(would_evict(&enforced), Reported::NotYet);
        // This generation's report in other words: unreadable, never a count guessed
        // (before, it read as "not yet", and the rule waited).
        for (reason, msg) in [
            ("NoEffect", "garbled"),
            ("NoEffect", "2 Pods würden entfernt"),
            ("Simulated", m),
        ] {
            assert_eq!(
                would_evict(&simulated(1, 1, reason, msg)),
                Reported::Unreadable(format!("{reason}: {msg}"))
            );
        }
    }
}
