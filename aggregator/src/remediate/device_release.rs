//! Releasing a device quarantine's rules: only faultline's are deleted, and a device
//! its driver still taints is reported.

use super::announce::audit;
use super::error::quarantine_error;
use super::error::RemediateError;
use super::record::{DeviceIsolation, DeviceRule, QuarantineRecord};
use super::remediator::Remediator;
use crate::device_taint::QuarantineError;
use crate::model::RecordDevice;
use crate::shard::Fence;

impl Remediator {
    /// Delete the rules of `released` (records' devices by id), only faultline's. A
    /// rule another owner holds now is announced and left. Driver-owned taints that
    /// still block a device (in its ResourceSlice) are reported.
    pub(super) async fn release_rules(
        &self,
        node: &str,
        record: &mut QuarantineRecord,
        released: &[RecordDevice],
        fence: &Fence,
    ) -> Result<(), RemediateError> {
        let Some(DeviceIsolation::DeviceTaintRule { rules }) = record.isolation.as_mut() else {
            return Ok(());
        };
        let Some(dra) = self.dra() else {
            return Ok(());
        };
        let (gone, kept): (Vec<DeviceRule>, Vec<DeviceRule>) = rules
            .drain(..)
            .partition(|r| released.iter().any(|d| d.id == r.id));
        *rules = kept;
        for r in &gone {
            let failed = match fence.write(dra.release(&r.device_ref())).await {
                Ok(Ok(_)) => {
                    audit("release-device", node, released, &self.actor, &r.rule);
                    continue;
                }
                Ok(Err(QuarantineError::NotOurs(name))) => {
                    tracing::warn!(node, rule = %name, "DeviceTaintRule is no longer faultline's: left alone");
                    self.announce.event(node, "FaultlineRuleNotOurs", &name, format!("DeviceTaintRule {name} of {} is no longer faultline's (no managed-by label): left alone", r.id), true, released).await;
                    continue;
                }
                Ok(Err(e)) => quarantine_error(e),
                // The hold ended first: this replica deletes nothing more.
                Err(lost) => RemediateError::from(lost),
            };
            // Put it back: the next pass deletes it.
            if let Some(DeviceIsolation::DeviceTaintRule { rules }) = record.isolation.as_mut() {
                rules.push(r.clone());
            }
            return Err(failed);
        }
        if let Ok(index) = dra.index_node(node).await {
            for r in &gone {
                let Some(ix) = index.by_uuid(&r.uuid) else {
                    continue;
                };
                let taints: Vec<String> = ix
                    .taints
                    .iter()
                    .map(|t| format!("{}={}:{}", t.key, t.value, t.effect))
                    .collect();
                if !taints.is_empty() {
                    self.announce.event(node, "FaultlineDeviceStillTainted", &format!("{}/{}", r.rule, taints.join(",")),
                        format!("{} ({}) released by faultline, but its driver still taints it: {} (removed by the driver, e.g. when it restarts)", r.id, r.device, taints.join(", ")), true, released).await;
                }
            }
        }
        Ok(())
    }
}
