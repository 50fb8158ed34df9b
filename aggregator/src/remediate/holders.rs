//! What an eviction pass would do without doing it: the pods a dry run announces, the
//! devices the kubelet itself reports on a node, and an alert that names no device
//! any agent or pod of its node reports.

use super::error::RemediateError;
use super::evict::pod_key;
use super::grace::NamespaceGraces;
use super::policy::{wants_device_eviction, Mode};
use super::record::QuarantineRecord;
use super::remediator::Remediator;
use super::view::PodView;
use crate::device_taint::{DeviceIndex, DeviceRef};
use crate::metrics::{Action, ActionResult};
use crate::model::RecordDevice;

/// The node path on a DRA cluster: the failed devices by their UUIDs (or, where the
/// driver no longer publishes one, by the device the record kept), and the MIG
/// partitions carved from them.
pub(super) fn node_path_refs(
    index: &DeviceIndex,
    devices: &[RecordDevice],
) -> Vec<(DeviceRef, Option<String>)> {
    let mut refs = Vec::new();
    for d in devices {
        let Some(u) = d.uuid.as_deref() else {
            continue;
        };
        match index.by_uuid(u) {
            Some(ix) => refs.push((ix.device.clone(), None)),
            None => refs.extend(
                d.dra
                    .as_deref()
                    .and_then(DeviceRef::from_resource_id)
                    .map(|r| (r, None)),
            ),
        }
        refs.extend(
            index
                .partitions_of(u)
                .iter()
                .map(|(_, p)| (p.device.clone(), None)),
        );
    }
    refs
}

/// `devices`, each with the DRA device that publishes its UUID now, where one does.
pub(super) fn map_devices(index: &DeviceIndex, devices: &mut [RecordDevice]) {
    for d in devices.iter_mut().filter(|d| d.dra.is_none()) {
        if let Some(ix) = d.uuid.as_deref().and_then(|u| index.by_uuid(u)) {
            d.dra = Some(ix.device.resource_id());
        }
    }
}

impl Remediator {
    /// Dry run: announce the pods an eviction pass would evict for `devices` (a dry run
    /// writes no record, so [`Remediator::evict`] has none to work from). Each pod is
    /// announced once.
    pub async fn would_evict(
        &self,
        node: &str,
        devices: &[crate::model::RecordDevice],
    ) -> Result<usize, RemediateError> {
        if self.mode != Mode::DryRun || devices.is_empty() {
            return Ok(0);
        }
        let pods = self.pods_on(node).await?;
        // DRA pods hold the failed devices through their claims: a record of
        // these devices, never written, tells which.
        let probe = QuarantineRecord::new(node, devices.to_vec(), "", &self.actor, String::new());
        let claimed = self.dra_holders_or_none(node, &pods, &probe).await;
        let mut n = 0;
        let mut namespaces = NamespaceGraces::default();
        for pod in pods.iter().filter(|p| {
            let holds = p.metadata.uid.as_ref().is_some_and(|u| claimed.contains(u));
            wants_device_eviction(&PodView::of(p, &self.resources), devices, holds, false)
        }) {
            let Some((ns, name, key)) = pod_key(pod) else {
                continue;
            };
            // What enforce would do first for a pod that asked for time.
            let warn = match self.grace_of(pod, &mut namespaces).await {
                Ok(g) if !g.is_zero() => format!(
                    " after warning it to checkpoint (grace {}s, or its acknowledgement)",
                    g.as_secs()
                ),
                _ => String::new(),
            };
            if self
                .announce
                .event(
                    node,
                    "FaultlineWouldEvict",
                    &key,
                    format!("dry-run: would evict {ns}/{name}{warn}"),
                    true,
                    devices,
                )
                .await
            {
                self.announce.metric(Action::Evict, ActionResult::DryRun);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Which of `devices` the kubelet reports for a pod of `node`
    /// (`allocatedResourcesStatus`), in order.
    pub async fn kubelet_reports(
        &self,
        node: &str,
        devices: &[crate::model::RecordDevice],
    ) -> Result<Vec<bool>, RemediateError> {
        let pods = self.pods_on(node).await?;
        let ids: Vec<String> = pods
            .iter()
            .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
            .flatten()
            .flat_map(|cs| cs.allocated_resources_status.iter().flatten())
            .filter(|rs| self.resources.contains(&rs.name))
            .flat_map(|rs| rs.resources.iter().flatten().map(|r| r.resource_id.clone()))
            .collect();
        Ok(devices
            .iter()
            .map(|d| ids.iter().any(|id| d.is(id)))
            .collect())
    }

    /// Announce an alert that names a device neither the node's agent nor the kubelet
    /// reports: nothing is acted on for it.
    pub async fn announce_unattributed(&self, node: &str, device: &crate::model::RecordDevice) {
        self.announce
            .metric(Action::Alert, ActionResult::Unattributed);
        tracing::warn!(node, device = %device.id, reason = %device.reason, "alert names a device no agent or pod of the node reports: announced, not acted on");
        // One Event per node, counting the repeats (every alert naming a new
        // device made an Event of its own).
        self.announce
            .repeated_event(
                node,
                "FaultlineAlertUnattributed",
                format!(
                    "alerts name devices that neither the agent nor the kubelet of {node} reports: not acted on (latest: {} ({}))",
                    device.id, device.reason
                ),
                true,
                std::slice::from_ref(device),
            )
            .await;
    }
}
