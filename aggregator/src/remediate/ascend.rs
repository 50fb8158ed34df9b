//! Huawei's Ascend device plugin: a failed chip the plugin has
//! separated for good already (`ManuallySeparateNPU` in its per-node ConfigMap) keeps
//! the plugin's isolation, and faultline adds none (`device_taint::ascend` reads the list
//! as the plugin does).

use k8s_openapi::api::core::v1::ConfigMap;

use super::record::{fingerprint, DeviceIsolation, LiveNode, QuarantineRecord};
use super::remediator::Remediator;
use crate::device_taint::ascend;
use crate::model::RecordDevice;

impl Remediator {
    /// Whether Huawei's device plugin lists every one of `devices` (chips of
    /// `resource`, matched by the physical id their agent learned) in
    /// `ManuallySeparateNPU` of the node's ConfigMap: what to record, if so. A read that
    /// fails is logged and counted (`remediation_errors_total{kind="ascend"}`); a record
    /// of these very devices as the plugin's isolation stands then (one failed read does
    /// not move it), anything else is taken as "not separated": the paths below go on
    /// as without the plugin's list.
    pub(super) async fn separated_by_plugin(
        &self,
        live: &LiveNode,
        existing: Option<&QuarantineRecord>,
        resource: &str,
        devices: &[RecordDevice],
    ) -> Option<String> {
        if ascend::name_prefixes(resource).is_empty() {
            return None;
        }
        let name = format!("{}{}", ascend::DEVICE_INFO_PREFIX, live.name);
        let cms: kube::Api<ConfigMap> =
            kube::Api::namespaced(self.client.clone(), ascend::DEVICE_INFO_NAMESPACE);
        let value = match cms.get_opt(&name).await {
            Ok(cm) => cm
                .and_then(|cm| cm.data)
                .and_then(|mut d| d.remove(ascend::MANUALLY_SEPARATE_KEY))?,
            Err(e) => {
                tracing::warn!(node = %live.name, error = %e, "cannot read {}/{name}: ManuallySeparateNPU not honoured this pass", ascend::DEVICE_INFO_NAMESPACE);
                if let Some(m) = self.announce.metrics() {
                    m.remediation_error("ascend");
                }
                let kept = existing.is_some_and(|r| {
                    r.fingerprint == fingerprint(&live.name, devices)
                        && matches!(
                            r.isolation,
                            Some(DeviceIsolation::ManuallySeparateNpu { .. })
                        )
                });
                return kept.then(|| "kept: the plugin's list could not be read".to_string());
            }
        };
        let separated = ascend::manually_separated(&value, resource);
        let chips: Vec<(&str, Option<u32>)> =
            devices.iter().map(|d| (d.id.as_str(), d.phy_id)).collect();
        ascend::separated_already(&chips, &separated).then(|| {
            let ids: Vec<&str> = chips.iter().map(|c| c.0).collect();
            format!(
                "Huawei's device plugin separated {} for good (ManuallySeparateNPU in {}/{name}); that stands, the node is not tainted",
                ids.join(", "),
                ascend::DEVICE_INFO_NAMESPACE
            )
        })
    }
}
