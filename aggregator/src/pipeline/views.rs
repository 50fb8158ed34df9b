//! What the pipeline shows: each node's published entry, the devices a quarantine names,
//! the counts. Read-only views of [`Pipeline`].

use faultline_common::fault::{
    shard_of_hash, AgentReach, FaultSummary, NodeFaults, NpuFault, FAULT_VERSION,
};
use faultline_common::state::DeviceState;
use faultline_common::time::rfc3339_ms as rfc3339;
use faultline_common::DeviceStatus;

use super::node::{record_device, Last, Node};
use super::Pipeline;
use crate::model::{DeviceView, RecordDevice};

impl Pipeline {
    /// The published entry of one node.
    pub fn node_faults(&self, name: &str) -> Option<NodeFaults> {
        self.nodes.get(name).map(|n| Self::faults(name, n))
    }

    /// The published entries of the nodes of shard `shard` of `shards` (every node
    /// with 1), in no order.
    pub fn shard_faults(
        &self,
        shard: u32,
        shards: u32,
    ) -> impl Iterator<Item = (&String, NodeFaults)> {
        self.nodes
            .iter()
            .filter(move |(_, n)| shards <= 1 || shard_of_hash(n.name_hash, shards) == shard)
            .map(|(name, n)| (name, Self::faults(name, n)))
    }

    /// The published entry of node `name`.
    fn faults(name: &str, n: &Node) -> NodeFaults {
        let npus: Vec<NpuFault> = n
            .devices
            .iter()
            .map(|(id, d)| {
                // Readings from the last document, if it listed the device.
                let last = n.last(id);
                let text = |f: fn(&Last) -> &Option<Box<str>>| {
                    last.and_then(|l| f(l).as_deref().map(String::from))
                };
                NpuFault {
                    id: id.clone(),
                    status: d.state.status,
                    reason: d.state.reason.clone(),
                    since: rfc3339(d.state.since_ms),
                    temperature_c: last.and_then(|l| l.temperature_c),
                    power_w: last.and_then(|l| l.power_w),
                    ecc_errors: last.and_then(|l| l.ecc_errors),
                    pcie_link_status: text(|l| &l.pcie_link_status),
                    uuid: text(|l| &l.uuid),
                    pci_bus_id: text(|l| &l.pci_bus_id),
                    recovery_action: last.and_then(|l| l.recovery_action),
                    quarantine: n.drain.as_ref().and_then(|x| {
                        x.marks
                            .iter()
                            .find(|(m, _)| m == id)
                            .map(|(_, q)| q.clone())
                    }),
                }
            })
            .collect();
        NodeFaults {
            version: FAULT_VERSION.into(),
            timestamp: rfc3339(n.changed_ms),
            node: name.to_string(),
            agent: AgentReach {
                sources: n.sources.clone(),
                last_seen: n.last_seen_ms.map(rfc3339),
                ..n.reach.clone()
            },
            summary: FaultSummary::of(npus.iter().map(|d| &d.status)),
            npus,
            readings_at: None,
            verdict: None,
            trimmed: None,
            drain: n
                .drain
                .as_ref()
                .map(|d| d.notices.clone())
                .unwrap_or_default(),
        }
    }

    /// The failed devices of a node, for its quarantine record.
    pub fn failed_devices(&self, name: &str) -> Vec<RecordDevice> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        n.devices
            .iter()
            .filter(|(_, d)| d.state.status == DeviceStatus::Failed)
            .map(|(id, d)| record_device(n, id, d.state.reason.clone().unwrap_or_default()))
            .collect()
    }

    /// The devices of a node unknown for at least `tolerance_ms` (none failed: a failed
    /// device is isolation's business).
    pub fn unknown_devices(&self, name: &str, tolerance_ms: u64, now_ms: u64) -> Vec<RecordDevice> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        if n.devices
            .values()
            .any(|d| d.state.status == DeviceStatus::Failed)
        {
            return Vec::new();
        }
        n.devices
            .iter()
            .filter(|(_, d)| {
                d.state.status == DeviceStatus::Unknown
                    && now_ms.saturating_sub(d.state.since_ms) >= tolerance_ms
            })
            .map(|(id, d)| {
                record_device(
                    n,
                    id,
                    d.state.reason.clone().unwrap_or_else(|| "unknown".into()),
                )
            })
            .collect()
    }

    /// What a release decision needs to know of a node's devices: state, clean streak
    /// and since when, with the identities a record may name them by.
    pub fn device_views(&self, name: &str) -> Vec<DeviceView> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        n.devices
            .iter()
            .map(|(id, d)| DeviceView {
                device: record_device(n, id, d.state.reason.clone().unwrap_or_default()),
                status: d.state.status,
                clean_streak: n.state_of(d, self.ticks, self.last_tick_ms).clean_streak,
                since_ms: d.state.since_ms,
            })
            .collect()
    }

    /// The agent-side id of a device known by UUID or bus id, if the node reports it.
    pub fn device_id(&self, node: &str, key: &str) -> Option<String> {
        self.device_views(node)
            .into_iter()
            .find(|v| v.device.is(key))
            .map(|v| v.device.id)
    }

    /// Counts over every device.
    pub fn summary(&self) -> FaultSummary {
        FaultSummary::of(
            self.nodes
                .values()
                .flat_map(|n| n.devices.values().map(|d| &d.state.status)),
        )
    }

    /// The state of one device (tests and the API).
    pub fn device_state(&self, node: &str, device: &str) -> Option<DeviceState> {
        let n = self.nodes.get(node)?;
        let d = n.devices.get(device)?;
        Some(n.state_of(d, self.ticks, self.last_tick_ms))
    }
}
