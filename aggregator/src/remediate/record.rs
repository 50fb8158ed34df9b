//! The quarantine record: what faultline did to a node and why, kept in the Node's own
//! annotation `faultline.io/quarantine` (JSON). It is readable with `kubectl get node -o
//! yaml`, goes away with the Node, and a new leader reads it back instead of starting
//! over. It lists which taint and label faultline itself added, so a release removes
//! only those. Released records move to `faultline.io/quarantine-history`.
//!
//! Also here: a person's release request (annotations on the Node), the devices label's
//! value and the text that names devices in messages.

pub use super::describe::{describe, label_value, named_or_all};
use std::collections::BTreeMap;

use faultline_common::fault::DrainNotice;
use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use super::error::RemediateError;
use crate::model::RecordDevice;

/// The annotation holding the record.
pub const RECORD_ANNOTATION: &str = "faultline.io/quarantine";
/// The label listing the unhealthy devices (dot separated ids).
pub const DEVICES_LABEL: &str = "faultline.io/unhealthy-devices";
/// On a node whose failed devices are quarantined alone (value `device`): the node is
/// not, and the node budget does not count it.
pub const SCOPE_LABEL: &str = "faultline.io/quarantine-scope";
/// The effect of faultline's taint: new pods stay off the node; the pods running leave
/// one by one through the Eviction API (PodDisruptionBudgets respected), never all at
/// once by `NoExecute`.
pub const TAINT_EFFECT: &str = "NoSchedule";
/// The taint's value on a node quarantined for a failed device.
pub const TAINT_FAILED: &str = "true";
/// The taint's value, and the devices label's, where only the unknown guard acted (a
/// node no agent could read for long: kept free of new work, nothing evicted).
pub const UNKNOWN_MARK: &str = "unknown";
/// The node condition type.
pub const CONDITION: &str = "AcceleratorHealthy";
/// The label of canary pods (never evicted by faultline).
pub const CANARY_LABEL: &str = "faultline.io/canary";
/// Released records, newest last (JSON list, the last [`HISTORY_KEEP`]).
pub const HISTORY_ANNOTATION: &str = "faultline.io/quarantine-history";
/// How many released records a Node keeps.
pub const HISTORY_KEEP: usize = 10;
/// A person asks for a release: `all` (or empty), or device ids/UUIDs, comma separated.
pub const RELEASE_ANNOTATION: &str = "faultline.io/release";
/// Who asks for the release (set by `faultline release`).
pub const RELEASE_BY_ANNOTATION: &str = "faultline.io/release-by";
/// Why (set by `faultline release --reason`).
pub const RELEASE_REASON_ANNOTATION: &str = "faultline.io/release-reason";
/// How long after a quarantine a missing announcement is still made up for.
pub const ANNOUNCE_RETRY_SECS: f64 = 1800.0;
/// Actions a record keeps: the first few and the latest.
pub const ACTIONS_KEEP: (usize, usize) = (8, 56);
/// Bytes of history a Node keeps at most (annotations share 256 KiB per object).
pub const HISTORY_MAX_BYTES: usize = 64 * 1024;

/// How a record ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// When (RFC 3339).
    pub at: String,
    /// Who: a user (`user:NAME`) or a replica (auto release).
    pub actor: String,
    /// Why.
    pub reason: String,
    /// A person asked for it: the same fault is not acted on again within the dedup
    /// window, so the release is not undone by a reading that still says failed.
    pub manual: bool,
}

/// Where a canary Job stands (written as `running`, `succeeded`, `failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CanaryState {
    /// Created, not done.
    Running,
    /// Its Job succeeded: the node may be released.
    Succeeded,
    /// Its Job failed, vanished or ran past the timeout (also any state this version
    /// does not know: a new canary follows after the cool-down).
    #[serde(other)]
    Failed,
}

/// The canary of an auto release: a probe Job pinned to the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryRun {
    /// `namespace/name` of the Job.
    pub job: String,
    /// When it was created.
    pub started: String,
    /// Where it stands.
    pub state: CanaryState,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
}

impl CanaryRun {
    /// The Job's name (without its namespace).
    pub fn job_name(&self) -> &str {
        self.job.rsplit('/').next().unwrap_or_default()
    }
}

/// An action taken, for the record's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// `taint`, `label`, `condition`.
    pub action: String,
    /// When (RFC 3339).
    pub at: String,
    /// Who (the replica).
    pub actor: String,
}

/// The quarantine record of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineRecord {
    /// Node name.
    pub node: String,
    /// The failed devices.
    pub devices: Vec<RecordDevice>,
    /// Where the verdict came from (`faultline-aggregator`).
    pub source: String,
    /// Stable identity of this fault: node and sorted (device, reason) pairs.
    pub fingerprint: String,
    /// First and last time it was seen.
    pub first_seen: String,
    /// Last time it was seen.
    pub last_seen: String,
    /// Who quarantined (a replica, or a user).
    pub actor: String,
    /// When the quarantine ends by itself, if ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry: Option<String>,
    /// The taint faultline added (absent: it was there already, not ours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned_taint: Option<String>,
    /// Whether faultline added the devices label.
    #[serde(default)]
    pub owned_label: bool,
    /// What was done, in order.
    pub actions: Vec<Action>,
    /// Pods evicted for this fault (`namespace/name/uid`): each at most once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evicted: Vec<String>,
    /// Pods whose eviction a PodDisruptionBudget refuses, and since when.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub eviction_blocked: BTreeMap<String, String>,
    /// Pods whose eviction failed otherwise (two budgets, RBAC, a server error), and why:
    /// retried by later passes, never counted toward the eviction deadline.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub eviction_failed: BTreeMap<String, String>,
    /// Tainted only because devices were unknown too long: nothing is evicted for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown_only: bool,
    /// Devices a person released while the rest stay quarantined, and when: not acted
    /// on again within the dedup window.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub released_devices: BTreeMap<String, String>,
    /// The last canary of an auto release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryRun>,
    /// Canaries started for this record (names each Job apart).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub canary_attempts: u32,
    /// Set when the record ends (it then moves to the history annotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<Released>,
    /// Pods warned before their eviction (`namespace/name/uid`), as published in
    /// `fault.json`: each leaves when it is evicted or gone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub drains: BTreeMap<String, DrainNotice>,
    /// How the devices are kept from new work when the node is not tainted:
    /// absent, the node's taint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<DeviceIsolation>,
    /// Why the node was tainted where a device alone could have been quarantined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_why: Option<String>,
}

/// How the failed devices of a record are kept from new work without tainting their
/// node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "by")]
pub enum DeviceIsolation {
    /// One DeviceTaintRule per device (DRA).
    DeviceTaintRule {
        /// The rules, one per device.
        rules: Vec<DeviceRule>,
    },
    /// The device plugin took the devices out of the node's allocatable already: that
    /// stands, nothing is added.
    DevicePlugin {
        /// The extended resource (`nvidia.com/gpu`).
        resource: String,
        /// Devices the plugin took out when the record was made.
        taken_out: u64,
    },
    /// Huawei's device plugin lists the chips in `ManuallySeparateNPU` already (its
    /// ConfigMap `kube-system/mindx-dl-deviceinfo-<node>`): that stands, nothing is added.
    ManuallySeparateNpu {
        /// The extended resource (`huawei.com/Ascend910`).
        resource: String,
    },
}

/// A device's DeviceTaintRule, as a record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRule {
    /// The device's id on the node (`gpu3`).
    pub id: String,
    /// Its UUID.
    pub uuid: String,
    /// The DRA driver, pool and device the rule selects.
    pub driver: String,
    /// The pool (NVIDIA's driver: the node's name).
    pub pool: String,
    /// The device (`gpu-3`).
    pub device: String,
    /// The rule's name.
    pub rule: String,
    /// Its effect when last written (`None` while the controller's prediction is
    /// awaited, then `NoSchedule`, or `NoExecute` where opted in).
    pub effect: String,
    /// The pods the device-taint controller said `NoExecute` would evict (its dry run
    /// at effect `None`), which faultline's own count matched before enforcing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<u64>,
}

impl DeviceRule {
    /// The DRA device it selects.
    pub fn device_ref(&self) -> crate::device_taint::DeviceRef {
        crate::device_taint::DeviceRef {
            driver: self.driver.clone(),
            pool: self.pool.clone(),
            device: self.device.clone(),
        }
    }
}

impl QuarantineRecord {
    /// The DeviceTaintRules of the record (none on the node path).
    pub fn rules(&self) -> &[DeviceRule] {
        match &self.isolation {
            Some(DeviceIsolation::DeviceTaintRule { rules }) => rules,
            _ => &[],
        }
    }

    /// How each device of the record is kept from new work, for `fault.json` (an
    /// unknown-only record marks none: nothing failed).
    pub fn marks(&self) -> Vec<(String, faultline_common::fault::QuarantineMark)> {
        use faultline_common::fault::QuarantineMark;
        if self.unknown_only {
            return Vec::new();
        }
        let mark = |by: &str, rule: Option<String>, detail: Option<String>| QuarantineMark {
            by: by.into(),
            rule,
            detail,
        };
        self.devices
            .iter()
            .filter_map(|d| {
                let m = match &self.isolation {
                    _ if self.owned_taint.is_some() || self.isolation.is_none() => {
                        mark("node-taint", None, self.owned_taint.clone())
                    }
                    Some(DeviceIsolation::DeviceTaintRule { rules }) => {
                        let r = rules.iter().find(|r| r.id == d.id)?;
                        mark(
                            "device-taint-rule",
                            Some(r.rule.clone()),
                            Some(r.effect.clone()),
                        )
                    }
                    Some(DeviceIsolation::DevicePlugin { resource, .. }) => {
                        mark("device-plugin", None, Some(resource.clone()))
                    }
                    Some(DeviceIsolation::ManuallySeparateNpu { resource }) => {
                        mark("manually-separate-npu", None, Some(resource.clone()))
                    }
                    None => return None,
                };
                Some((d.id.clone(), m))
            })
            .collect()
    }

    /// For the metric: (node, driver or resource, how, devices) of a failure record
    /// (`-`: the driver is not known on the node path).
    pub fn isolated_counts(&self) -> Vec<(String, String, String, usize)> {
        let mut out: Vec<(String, String, String, usize)> = Vec::new();
        let rules = self.rules();
        for (id, mark) in self.marks() {
            let driver = match &self.isolation {
                Some(
                    DeviceIsolation::DevicePlugin { resource, .. }
                    | DeviceIsolation::ManuallySeparateNpu { resource },
                ) => resource.clone(),
                _ => rules
                    .iter()
                    .find(|r| r.id == id)
                    .map_or_else(|| "-".to_string(), |r| r.driver.clone()),
            };
            match out.iter_mut().find(|o| o.1 == driver && o.2 == mark.by) {
                Some(o) => o.3 += 1,
                None => out.push((self.node.clone(), driver, mark.by, 1)),
            }
        }
        out
    }

    /// Whether the node itself is kept from new work (its taint), not only devices:
    /// no device isolation, or one escalated to the node since.
    pub fn node_scoped(&self) -> bool {
        self.isolation.is_none() || self.owned_taint.is_some()
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl QuarantineRecord {
    /// A new record of `devices` on `node`, first seen `now`, by `actor`, due for review
    /// at `expiry`: nothing owned or done yet.
    pub fn new(
        node: &str,
        devices: Vec<RecordDevice>,
        now: &str,
        actor: &str,
        expiry: String,
    ) -> Self {
        QuarantineRecord {
            node: node.to_string(),
            fingerprint: fingerprint(node, &devices),
            devices,
            source: "faultline-aggregator".into(),
            first_seen: now.to_string(),
            last_seen: now.to_string(),
            actor: actor.to_string(),
            expiry: Some(expiry),
            owned_taint: None,
            owned_label: false,
            actions: vec![],
            evicted: vec![],
            eviction_blocked: BTreeMap::new(),
            eviction_failed: BTreeMap::new(),
            unknown_only: false,
            released_devices: BTreeMap::new(),
            canary: None,
            canary_attempts: 0,
            released: None,
            drains: BTreeMap::new(),
            isolation: None,
            node_why: None,
        }
    }

    /// Note an action by `actor` at `at`.
    pub fn act(&mut self, action: impl Into<String>, at: &str, actor: &str) {
        self.actions.push(Action {
            action: action.into(),
            at: at.to_string(),
            actor: actor.to_string(),
        });
    }

    /// The record as written to the Node: the first and the latest actions only.
    pub fn to_annotation(&self) -> String {
        let mut record = self.clone();
        let (head, tail) = ACTIONS_KEEP;
        if record.actions.len() > head + tail {
            let cut = record.actions.len() - tail;
            record.actions.drain(head..cut);
        }
        serde_json::to_string(&record).unwrap_or_default()
    }
}

impl QuarantineRecord {
    /// Carry what an eviction pass did to `ours` (read as `before` at the pass's start)
    /// over to `self`, the record as it is now on the Node (another writer, the kubelet
    /// or a person changed the Node in between): evictions and actions added, and the
    /// state of the pods `touched`, the earliest refusal kept.
    pub fn merge_eviction_pass(
        &mut self,
        before: &QuarantineRecord,
        ours: &QuarantineRecord,
        touched: &[String],
    ) {
        for k in &ours.evicted {
            if !before.evicted.contains(k) && !self.evicted.contains(k) {
                self.evicted.push(k.clone());
            }
        }
        self.actions
            .extend(ours.actions.iter().skip(before.actions.len()).cloned());
        for k in touched {
            match ours.eviction_blocked.get(k) {
                Some(since) => {
                    let e = self
                        .eviction_blocked
                        .entry(k.clone())
                        .or_insert_with(|| since.clone());
                    if since < e {
                        *e = since.clone();
                    }
                }
                None => {
                    self.eviction_blocked.remove(k);
                }
            }
            match ours.eviction_failed.get(k) {
                Some(why) => {
                    self.eviction_failed.insert(k.clone(), why.clone());
                }
                None => {
                    self.eviction_failed.remove(k);
                }
            }
            match ours.drains.get(k) {
                Some(n) => {
                    self.drains.insert(k.clone(), n.clone());
                }
                None => {
                    self.drains.remove(k);
                }
            }
        }
    }
}

/// The fingerprint of a set of failed devices on a node.
pub fn fingerprint(node: &str, devices: &[RecordDevice]) -> String {
    let mut parts: Vec<String> = devices
        .iter()
        .map(|d| format!("{}={}", d.id, d.reason))
        .collect();
    parts.sort();
    format!("{node}/{}", parts.join(","))
}

/// The record on a Node, if any.
pub fn record_of(node: &Node) -> Result<Option<QuarantineRecord>, RemediateError> {
    let name = node.metadata.name.clone().unwrap_or_default();
    match node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RECORD_ANNOTATION))
    {
        Some(s) => serde_json::from_str(s)
            .map(Some)
            .map_err(|e| RemediateError::Record(name, e.to_string())),
        None => Ok(None),
    }
}

/// The released records kept on a Node, oldest first.
pub fn history_of(node: &Node) -> Vec<QuarantineRecord> {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(HISTORY_ANNOTATION))
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default()
}

/// The history annotation's text: the last [`HISTORY_KEEP`] records, fewer when they
/// would pass [`HISTORY_MAX_BYTES`] (the newest is always kept).
pub fn history_text(history: &[QuarantineRecord]) -> String {
    let mut skip = history.len().saturating_sub(HISTORY_KEEP);
    let mut text = serde_json::to_string(&history[skip..]).unwrap_or_default();
    while text.len() > HISTORY_MAX_BYTES && skip + 1 < history.len() {
        skip += 1;
        text = serde_json::to_string(&history[skip..]).unwrap_or_default();
    }
    text
}

/// A Node as read at the start of a pass, with its record parsed once.
#[derive(Debug, Clone)]
pub struct LiveNode {
    /// The Node as the API returned it (its resourceVersion guards the pass's writes).
    pub node: Node,
    /// Its name.
    pub name: String,
    /// Its quarantine record, if any.
    pub record: Option<QuarantineRecord>,
}

impl LiveNode {
    /// Parse `node`'s record.
    pub fn of(node: Node) -> Result<Self, RemediateError> {
        let record = record_of(&node)?;
        Ok(LiveNode {
            name: node.metadata.name.clone().unwrap_or_default(),
            node,
            record,
        })
    }

    /// The Node's taints.
    pub fn taints(&self) -> Vec<k8s_openapi::api::core::v1::Taint> {
        self.node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
    }

    /// Whether the Node has label `key`.
    pub fn has_label(&self, key: &str) -> bool {
        self.node
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key(key))
    }
}

/// A release a person asked for.
#[derive(Debug, Clone, Default)]
pub struct ReleaseRequest {
    /// Devices (ids, UUIDs or bus ids) to release; empty: all of them.
    pub devices: Vec<String>,
    /// Who (`user:NAME`).
    pub actor: String,
    /// Why.
    pub reason: String,
}

impl ReleaseRequest {
    /// The request written on a Node (`faultline.io/release` and friends), if any.
    pub fn of(node: &Node) -> Option<Self> {
        let a = node.metadata.annotations.as_ref()?;
        let v = a.get(RELEASE_ANNOTATION)?;
        let devices = v
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty() && *d != "all" && *d != "true")
            .map(String::from)
            .collect();
        let who = a
            .get(RELEASE_BY_ANNOTATION)
            .map(String::as_str)
            .filter(|w| !w.is_empty())
            .unwrap_or("unknown");
        Some(ReleaseRequest {
            devices,
            actor: format!("user:{who}"),
            reason: a
                .get(RELEASE_REASON_ANNOTATION)
                .cloned()
                .unwrap_or_else(|| "released by a person".into()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How each device is kept from new work, as `fault.json` and the
    /// metric show it, and the record's isolation written as text.
    #[test]
    fn marks_say_how_each_device_is_isolated() {
        let mut r = QuarantineRecord::new(
            "n1",
            vec![RecordDevice::new("gpu3", "row-remap-failure")],
            "2026-11-30T00:00:00.000Z",
            "replica-0",
            "2026-12-01T00:00:00.000Z".into(),
        );
        // The node path: the node's taint.
        r.owned_taint = Some("nvidia.com/gpu-fault".into());
        let m = r.marks();
        assert_eq!(
            (m[0].0.as_str(), m[0].1.by.as_str()),
            ("gpu3", "node-taint")
        );
        assert_eq!(m[0].1.detail.as_deref(), Some("nvidia.com/gpu-fault"));
        assert!(r.node_scoped());
        // A device alone: its rule.
        r.owned_taint = None;
        r.isolation = Some(DeviceIsolation::DeviceTaintRule {
            rules: vec![DeviceRule {
                id: "gpu3".into(),
                uuid: "GPU-3".into(),
                driver: "gpu.nvidia.com".into(),
                pool: "n1".into(),
                device: "gpu-3".into(),
                rule: "faultline-gpu-3-n1-abcd".into(),
                effect: "NoSchedule".into(),
                predicted: Some(1),
            }],
        });
        assert!(!r.node_scoped());
        let m = r.marks();
        assert_eq!(m[0].1.by, "device-taint-rule");
        assert_eq!(m[0].1.rule.as_deref(), Some("faultline-gpu-3-n1-abcd"));
        assert_eq!(
            r.isolated_counts(),
            [(
                "n1".into(),
                "gpu.nvidia.com".into(),
                "device-taint-rule".into(),
                1
            )]
        );
        let text = serde_json::to_string(&r).unwrap();
        assert!(
            text.contains(r#""isolation":{"by":"device-taint-rule","rules":[{"id":"gpu3""#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<QuarantineRecord>(&text).unwrap(), r);
        // Escalated to the node: the node's taint again, the rules kept for the release.
        r.owned_taint = Some("nvidia.com/gpu-fault".into());
        assert!(r.node_scoped());
        assert_eq!(r.marks()[0].1.by, "node-taint");
        assert_eq!(r.rules().len(), 1);
        // The device plugin's isolation.
        r.owned_taint = None;
        r.isolation = Some(DeviceIsolation::DevicePlugin {
            resource: "nvidia.com/gpu".into(),
            taken_out: 1,
        });
        assert_eq!(r.marks()[0].1.by, "device-plugin");
        assert_eq!(r.isolated_counts()[0].1, "nvidia.com/gpu");
        // Huawei's device plugin's ManuallySeparateNPU: marked with its resource.
        r.isolation = Some(DeviceIsolation::ManuallySeparateNpu {
            resource: "huawei.com/Ascend910".into(),
        });
        let m = &r.marks()[0].1;
        assert_eq!(
            (m.by.as_str(), m.detail.as_deref()),
            ("manually-separate-npu", Some("huawei.com/Ascend910"))
        );
        assert_eq!(r.isolated_counts()[0].1, "huawei.com/Ascend910");
        assert!(!r.node_scoped());
        let text = serde_json::to_string(&r).unwrap();
        assert!(
            text.contains(
                r#""isolation":{"by":"manually-separate-npu","resource":"huawei.com/Ascend910"}"#
            ),
            "{text}"
        );
        // An unknown-only record marks nothing: nothing failed.
        r.unknown_only = true;
        assert!(r.marks().is_empty());
    }

    #[test]
    fn the_record_round_trips_and_keeps_its_canary_state_as_text() {
        let mut r = QuarantineRecord::new(
            "n1",
            vec![RecordDevice::new("gpu3", "xid-79")],
            "2026-11-30T00:00:00.000Z",
            "replica-0",
            "2026-12-01T00:00:00.000Z".into(),
        );
        r.canary = Some(CanaryRun {
            job: "faultline/faultline-canary-1".into(),
            started: "2026-11-30T00:10:00.000Z".into(),
            state: CanaryState::Running,
            finished: None,
        });
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""state":"running""#), "{text}");
        assert_eq!(serde_json::from_str::<QuarantineRecord>(&text).unwrap(), r);
        assert_eq!(r.canary.unwrap().job_name(), "faultline-canary-1");
        let odd: CanaryState = serde_json::from_str(r#""paused""#).unwrap();
        assert_eq!(
            odd,
            CanaryState::Failed,
            "an unknown state is not a running canary"
        );
        assert_eq!(r.fingerprint, "n1/gpu3=xid-79");
    }

    #[test]
    fn an_eviction_pass_merges_into_a_record_changed_meanwhile() {
        let mut before = QuarantineRecord::new("n1", vec![], "t", "a", "e".into());
        before.evicted.push("ns/old/1".into());
        let mut ours = before.clone();
        ours.evicted.push("ns/p1/2".into());
        ours.act("evict ns/p1", "t2", "a");
        ours.eviction_blocked
            .insert("ns/p2/3".into(), "2026-01-01T00:00:05.000Z".into());
        ours.eviction_failed
            .insert("ns/p3/4".into(), "HTTP 500".into());
        // Meanwhile a person added an action and an earlier refusal is on the Node.
        let mut now = before.clone();
        now.act("release gpu5", "t1", "user:bob");
        now.eviction_blocked
            .insert("ns/p2/3".into(), "2026-01-01T00:00:01.000Z".into());
        now.merge_eviction_pass(
            &before,
            &ours,
            &["ns/p1/2".into(), "ns/p2/3".into(), "ns/p3/4".into()],
        );
        assert_eq!(now.evicted, vec!["ns/old/1", "ns/p1/2"]);
        assert_eq!(now.actions.len(), 2, "theirs and ours");
        assert_eq!(
            now.eviction_blocked["ns/p2/3"], "2026-01-01T00:00:01.000Z",
            "the earliest refusal"
        );
        assert_eq!(now.eviction_failed["ns/p3/4"], "HTTP 500");
    }

    #[test]
    fn long_action_lists_keep_the_first_and_the_latest() {
        let mut r = QuarantineRecord::new("n1", vec![], "t", "a", "e".into());
        for i in 0..100 {
            r.act(format!("a{i}"), "t", "a");
        }
        let back: QuarantineRecord = serde_json::from_str(&r.to_annotation()).unwrap();
        let (head, tail) = ACTIONS_KEEP;
        assert_eq!(back.actions.len(), head + tail);
        assert_eq!(back.actions[0].action, "a0");
        assert_eq!(back.actions.last().unwrap().action, "a99");
    }

    #[test]
    fn history_is_bounded_in_count_and_bytes() {
        let rec = |i: usize, pad: usize| {
            let mut r = QuarantineRecord::new(&format!("n{i}"), vec![], "t", "a", "e".into());
            r.source = "x".repeat(pad);
            r
        };
        let many: Vec<QuarantineRecord> = (0..15).map(|i| rec(i, 10)).collect();
        let kept: Vec<QuarantineRecord> = serde_json::from_str(&history_text(&many)).unwrap();
        assert_eq!(kept.len(), HISTORY_KEEP);
        assert_eq!(kept.last().unwrap().node, "n14");
        let big: Vec<QuarantineRecord> = (0..5).map(|i| rec(i, 30_000)).collect();
        let text = history_text(&big);
        assert!(text.len() <= HISTORY_MAX_BYTES, "{}", text.len());
        let kept: Vec<QuarantineRecord> = serde_json::from_str(&text).unwrap();
        assert_eq!(kept.last().unwrap().node, "n4");
    }
}
