//! `fault.json`: the versioned snapshot the aggregator publishes for workload pods and
//! dashboards. Per node it keeps seed 003's shape (`version`, `timestamp`, `node`,
//! `npus[]` with `id`, `status`, `temperature_c`, `power_w`, `ecc_errors`,
//! `pcie_link_status`, `reason`; `summary` with `total`, `healthy`, `degraded`,
//! `failed`) and adds the smoothed state's `since`, device identity and the agent's
//! reachability. Its JSON Schema is generated from these types
//! (`schema/fault.v1.schema.json`); a test fails when the committed copy is stale.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::reading::DeviceStatus;

/// The `version` of every document of this shape.
pub const FAULT_VERSION: &str = "faultline.fault/v1";

/// One shard's document: every node of the shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultDocument {
    /// [`FAULT_VERSION`].
    pub version: String,
    /// When this document was written (RFC 3339).
    pub timestamp: String,
    /// Increases by one with every write of this shard by any writer.
    pub sequence: u64,
    /// Which shard (0-based) and of how many.
    pub shard: u32,
    /// Number of shards.
    pub shards: u32,
    /// The replica that wrote it.
    pub writer: String,
    /// Counts over every device of the shard.
    pub summary: FaultSummary,
    /// Nodes by name.
    pub nodes: BTreeMap<String, NodeFaults>,
}

/// The `fault.json` key of a shard ConfigMap: the shard's counts and each node's
/// counts. The full entry of a node is its own key, `<node>.json`, so no node's data is
/// stored twice and a shard of ~350 nodes x 8 devices stays under the ConfigMap limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShardIndex {
    /// [`FAULT_VERSION`].
    pub version: String,
    /// When this shard was written (RFC 3339).
    pub timestamp: String,
    /// Increases by one with every write of this shard by any writer.
    pub sequence: u64,
    /// Which shard (0-based).
    pub shard: u32,
    /// Number of shards.
    pub shards: u32,
    /// The replica that wrote it.
    pub writer: String,
    /// Counts over every device of the shard.
    pub summary: FaultSummary,
    /// Each node's counts; its entry is the key `<node>.json`.
    pub nodes: BTreeMap<String, FaultSummary>,
}

impl ShardIndex {
    /// The index of a shard document.
    pub fn of(doc: &FaultDocument) -> Self {
        ShardIndex {
            version: doc.version.clone(),
            timestamp: doc.timestamp.clone(),
            sequence: doc.sequence,
            shard: doc.shard,
            shards: doc.shards,
            writer: doc.writer.clone(),
            summary: doc.summary,
            nodes: doc
                .nodes
                .iter()
                .map(|(k, v)| (k.clone(), v.summary))
                .collect(),
        }
    }
}

/// One node: seed 003's document shape, so its consumer works on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeFaults {
    /// [`FAULT_VERSION`].
    pub version: String,
    /// When this node's entry last changed (RFC 3339).
    pub timestamp: String,
    /// Node name.
    pub node: String,
    /// Whether the aggregator reaches the node's agent.
    pub agent: AgentReach,
    /// Every device, sorted by id.
    pub npus: Vec<NpuFault>,
    /// Counts by status.
    pub summary: FaultSummary,
    /// When the readings shown (`temperature_c`, `power_w`, ...) were taken (RFC 3339):
    /// in the node's own `fault.json`, the agent's latest sample; absent in the cluster
    /// view, whose readings are as of `agent.last_seen`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readings_at: Option<String>,
    /// In the node's own `fault.json` (served by its agent): whose verdict this is and how
    /// fresh. Absent in the cluster view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<VerdictSource>,
    /// Devices left out of `npus` (the healthy ones first) so that the ConfigMap page
    /// holding this entry stays within the API's size limit; `summary` still counts
    /// them. Absent when every device is listed (one node's entry never stops
    /// its page's other nodes from being published).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trimmed: Option<u32>,
    /// Pods of this node asked to checkpoint before they are evicted from a failed
    /// device. Absent where no pod on the node opted in
    /// (`faultline.io/checkpoint-grace`), so documents without it read as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drain: Vec<DrainNotice>,
}

/// A drain intent: one pod on a failed device is evicted at `evict_after` at the
/// latest, and at once when it says it has checkpointed (it exits, or acknowledges
/// through its node's agent: `POST /v1/drain/ack`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DrainNotice {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's UID (what an acknowledgement names).
    pub uid: String,
    /// The pod's addresses (`status.podIPs`): its node's agent takes an
    /// acknowledgement only from one of them. Empty for a pod on the host's network
    /// (any process of the node has that address): such a pod acknowledges by exiting.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_ips: Vec<String>,
    /// The failed devices the pod uses (ids on the node).
    pub devices: Vec<String>,
    /// Why, as in `npus[].reason` (`xid-79`, `recovery-gpu-reset`): one per cause,
    /// sorted. Written as v1 has it, one `reason` string, comma-joined.
    #[serde(rename = "reason", with = "reason_list")]
    #[schemars(with = "String")]
    pub reasons: Vec<String>,
    /// When the intent was published (RFC 3339).
    pub requested: String,
    /// The pod is evicted at this time at the latest (RFC 3339).
    pub evict_after: String,
    /// When faultline got the pod's acknowledgement (RFC 3339): it is evicted now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged: Option<String>,
}

/// Where a node's own `fault.json` got its statuses, and whether they can still be
/// trusted (once the aggregator falls silent the file says so, with a bounded
/// age; it never silently keeps saying "healthy").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VerdictSource {
    /// The aggregator replica that published it; absent before any verdict arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
    /// The writer's sequence of this entry (increases with each new entry it publishes).
    pub sequence: u64,
    /// When the writer published this entry (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published: Option<String>,
    /// When the node last heard from the aggregator: this entry, or its confirmation
    /// (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmed: Option<String>,
    /// No verdict yet, or none confirmed within `stale_after_s`: every device that the
    /// last verdict called healthy is `unknown` (reason `verdict-stale`); degraded and
    /// failed ones keep their status.
    pub stale: bool,
    /// How long a verdict holds without a confirmation, in seconds.
    pub stale_after_s: u64,
}

/// What an aggregator sends a node's agent (`PUT /v1/fault`, bearer token): its verdict
/// on the node, or a confirmation that the last one still holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Delivery {
    /// The aggregator replica sending it.
    pub writer: String,
    /// The writer's sequence of `entry` (a confirmation names the one it confirms).
    pub sequence: u64,
    /// When the writer published the entry (RFC 3339).
    pub published: String,
    /// How long the agent may serve it without a confirmation, in milliseconds.
    pub stale_after_ms: u64,
    /// The node it is for: a signed delivery names it, so that it cannot be replayed
    /// to another node (a confirmation has no entry to say so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// When the writer sent it (milliseconds since the epoch), increasing with every
    /// message: an agent that checks signatures takes none that is not newer than the
    /// last it took, so a recorded delivery or confirmation cannot be played again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_ms: Option<u64>,
    /// The digest of the entry's JSON (`sha256:<hex>`, [`crate::seal::digest`]): a
    /// confirmation confirms only the entry with this digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The node's entry; absent in a confirmation of (`writer`, `sequence`), which the
    /// agent answers 409 when it does not hold that entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<NodeFaults>,
}

impl NodeFaults {
    /// The digest of this entry's JSON, as a [`Delivery`] names it.
    pub fn digest(&self) -> String {
        crate::seal::digest(&serde_json::to_vec(self).unwrap_or_default())
    }
}

/// The agent as the aggregator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentReach {
    /// The last request to the agent succeeded.
    pub reachable: bool,
    /// When the aggregator last heard from it (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
    /// The last error, while unreachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The agent's sources and whether each is up, from its last document.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceReach>,
}

/// One of an agent's sources (`nvml`, `kmsg`, `dcmi`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SourceReach {
    /// The source's name.
    pub name: String,
    /// Its last attempt succeeded.
    pub up: bool,
}

/// One device's smoothed state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NpuFault {
    /// Device id on the node (`gpu3`, `npu0`, `npu3-1`).
    pub id: String,
    /// Smoothed status.
    pub status: DeviceStatus,
    /// Why it is not healthy; `null` when healthy.
    pub reason: Option<String>,
    /// Since when it has had this status (RFC 3339).
    pub since: String,
    /// Last temperature (C).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<f64>,
    /// Last power (W).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// ECC errors since driver load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_errors: Option<u64>,
    /// `up` or `down`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_link_status: Option<String>,
    /// Device UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// PCI bus id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// The repair NVIDIA's driver says the GPU needs (NVML's recovery action):
    /// `gpu-reset`, `node-reboot`, `drain-p2p`, `drain-and-reset`,
    /// `recover-imex-domain`, `bus-reset`, `system-reboot`, or `none`. Absent where the
    /// driver does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_action: Option<crate::reading::RecoveryAction>,
    /// How the device is kept from new work while faultline quarantines it;
    /// absent when it is not quarantined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<QuarantineMark>,
}

/// How a quarantined device is kept from new work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct QuarantineMark {
    /// `device-taint-rule` (this device alone, DRA), `device-plugin` (the plugin took
    /// it out of the node's allocatable), `manually-separate-npu` (Huawei's device
    /// plugin), or `node-taint` (the whole node).
    pub by: String,
    /// The DeviceTaintRule's name, for `device-taint-rule`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// The rule's effect (`NoSchedule`, `NoExecute`), the node taint's key, or the
    /// extended resource (`device-plugin`, `manually-separate-npu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Counts by status; `total` is their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultSummary {
    /// All devices.
    pub total: u32,
    /// Healthy.
    pub healthy: u32,
    /// Degraded.
    pub degraded: u32,
    /// Failed.
    pub failed: u32,
    /// Unknown.
    pub unknown: u32,
}

impl FaultSummary {
    /// Count statuses.
    pub fn of<'a>(statuses: impl IntoIterator<Item = &'a DeviceStatus>) -> Self {
        let mut s = FaultSummary::default();
        for st in statuses {
            s.total += 1;
            match st {
                DeviceStatus::Healthy => s.healthy += 1,
                DeviceStatus::Degraded => s.degraded += 1,
                DeviceStatus::Failed => s.failed += 1,
                DeviceStatus::Unknown => s.unknown += 1,
            }
        }
        s
    }

    /// Add another summary.
    pub fn add(&mut self, o: &FaultSummary) {
        self.total += o.total;
        self.healthy += o.healthy;
        self.degraded += o.degraded;
        self.failed += o.failed;
        self.unknown += o.unknown;
    }
}

/// The shard of a node: FNV-1a of its name modulo the shard count. Stable across
/// replicas, restarts and versions.
pub fn shard_of(node: &str, shards: u32) -> u32 {
    shard_of_hash(fnv1a64(node.as_bytes()), shards)
}

/// [`shard_of`] from the name's [`fnv1a64`], for a caller that keeps it.
pub fn shard_of_hash(hash: u64, shards: u32) -> u32 {
    (hash % u64::from(shards.max(1))) as u32
}

/// The page of its shard's ConfigMaps a node's entry is written to, of `pages`
/// (a shard of 625 nodes x 8 devices is more than one ConfigMap holds): the same
/// stable hash as [`shard_of`], its quotient by the shards taken modulo the pages.
pub fn page_of(node: &str, shards: u32, pages: u32) -> u32 {
    if pages <= 1 {
        return 0;
    }
    ((fnv1a64(node.as_bytes()) / u64::from(shards.max(1))) % u64::from(pages)) as u32
}

/// The ConfigMap of page `page` of shard `shard` of the aggregator named `name`:
/// `<name>-shard-<i>` (page 0, with the shard's `fault.json`), then
/// `<name>-shard-<i>-page-<p>`.
pub fn page_name(name: &str, shard: u32, page: u32) -> String {
    if page == 0 {
        format!("{name}-shard-{shard}")
    } else {
        format!("{name}-shard-{shard}-page-{page}")
    }
}

/// The shard and page of a ConfigMap named by [`page_name`] for `name`.
pub fn parse_page_name(name: &str, cm: &str) -> Option<(u32, u32)> {
    let rest = cm.strip_prefix(name)?.strip_prefix("-shard-")?;
    match rest.split_once("-page-") {
        None => Some((rest.parse().ok()?, 0)),
        Some((s, p)) => Some((s.parse().ok()?, p.parse().ok().filter(|p| *p > 0)?)),
    }
}

/// FNV-1a, 64 bits: a stable hash for names derived from content.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The JSON Schemas, as committed in `schema/`: the whole document (the file sink's
/// `fault.json`, the aggregator's `/v1/faults`), a shard ConfigMap's `fault.json`, and
/// one node's `<node>.json`.
pub fn json_schemas() -> [(&'static str, serde_json::Value); 3] {
    let v = |s: schemars::Schema| serde_json::to_value(s).unwrap_or_default();
    [
        (
            "fault.v1.schema.json",
            v(schemars::schema_for!(FaultDocument)),
        ),
        (
            "shard-index.v1.schema.json",
            v(schemars::schema_for!(ShardIndex)),
        ),
        ("node.v1.schema.json", v(schemars::schema_for!(NodeFaults))),
    ]
}

/// `DrainNotice::reasons` as fault.json v1 writes them: one string, the reasons
/// joined by commas (a reason code has no comma).
mod reason_list {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(reasons: &[String], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&reasons.join(","))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        let joined = String::deserialize(d)?;
        Ok(joined
            .split(',')
            .filter(|r| !r.is_empty())
            .map(String::from)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_schemas_are_current() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../schema");
        for (name, schema) in json_schemas() {
            let now = serde_json::to_string_pretty(&schema).unwrap() + "\n";
            let path = format!("{dir}/{name}");
            if std::env::var_os("FAULTLINE_UPDATE_SCHEMA").is_some() {
                std::fs::write(&path, &now).unwrap();
                continue;
            }
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                now == committed,
                "schema/{name} is stale: run FAULTLINE_UPDATE_SCHEMA=1 cargo test -p faultline-common and commit it"
            );
        }
    }

    #[test]
    fn shards_are_stable_and_spread() {
        assert_eq!(shard_of("gpu-node-1", 1), 0);
        assert_eq!(shard_of("gpu-node-1", 8), shard_of("gpu-node-1", 8));
        let mut counts = [0u32; 8];
        for i in 0..8000 {
            counts[shard_of(&format!("node-{i}"), 8) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    #[test]
    fn a_node_entry_satisfies_the_seed_consumer_shape() {
        let n = NodeFaults {
            version: FAULT_VERSION.into(),
            timestamp: "2026-11-29T10:00:00.000Z".into(),
            node: "atlas900-node-042".into(),
            agent: AgentReach {
                reachable: true,
                last_seen: None,
                error: None,
                sources: Vec::new(),
            },
            npus: vec![NpuFault {
                id: "npu1".into(),
                status: DeviceStatus::Failed,
                reason: Some("npu-offline".into()),
                since: "2026-11-29T09:59:58.000Z".into(),
                temperature_c: Some(40.0),
                power_w: Some(1.0),
                ecc_errors: Some(0),
                pcie_link_status: Some("down".into()),
                uuid: None,
                pci_bus_id: None,
                recovery_action: None,
                quarantine: None,
            }],
            summary: FaultSummary::of(&[DeviceStatus::Failed]),
            readings_at: None,
            verdict: None,
            trimmed: None,
            drain: Vec::new(),
        };
        let v = serde_json::to_value(&n).unwrap();
        assert_eq!(v["node"], "atlas900-node-042");
        assert_eq!(v["npus"][0]["status"], "failed");
        assert_eq!(v["npus"][0]["reason"], "npu-offline");
        assert_eq!(v["summary"]["failed"], 1);
    }

    #[test]
    fn a_drain_s_reasons_are_one_comma_joined_string_on_the_wire() {
        let notice = DrainNotice {
            namespace: "ml".into(),
            pod: "p".into(),
            uid: "u-1".into(),
            pod_ips: vec![],
            devices: vec!["gpu0".into(), "gpu1".into()],
            reasons: vec!["row-remap-failure".into(), "xid-79".into()],
            requested: "2026-12-06T00:00:00Z".into(),
            evict_after: "2026-12-06T00:05:00Z".into(),
            acknowledged: None,
        };
        let v = serde_json::to_value(&notice).unwrap();
        assert_eq!(v["reason"], "row-remap-failure,xid-79");
        assert!(v.get("reasons").is_none(), "v1 has one reason field");
        let back: DrainNotice = serde_json::from_value(v).unwrap();
        assert_eq!(back, notice);
        let mut v = serde_json::to_value(&notice).unwrap();
        v["reason"] = "".into();
        let none: DrainNotice = serde_json::from_value(v).unwrap();
        assert!(none.reasons.is_empty(), "an empty string is no reason");
    }
}
