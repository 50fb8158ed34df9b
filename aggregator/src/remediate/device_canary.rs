//! A device canary: the probe Job of a device quarantine asks, through a ResourceClaim
//! of its own, for the very devices the record quarantines (the devices in their slots
//! now), tolerating their taint.

use super::error::{quarantine_error, RemediateError};
use super::record::{DeviceRule, QuarantineRecord};
use super::remediator::Remediator;

/// The claim of a device canary: each quarantined device of `rules` exactly (its
/// driver and UUID, a CEL selector), tolerating faultline's taint, owned by the Job.
pub fn canary_claim(
    rules: &[DeviceRule],
    class: &str,
    name: &str,
    job_uid: &str,
) -> serde_json::Value {
    let requests: Vec<serde_json::Value> = rules
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let cel = format!(
                "device.driver == {driver:?} && device.attributes[{driver:?}].uuid == {uuid:?}",
                driver = r.driver,
                uuid = r.uuid
            );
            serde_json::json!({"name": format!("device-{i}"), "exactly": {
                "deviceClassName": class,
                "selectors": [{"cel": {"expression": cel}}],
                // Any effect for the scheduler; `NoExecute` written out for the
                // device-taint eviction controller, which honours no other (it deleted
                // a canary under `--device-taint-effect NoExecute`).
                "tolerations": [
                    {"key": crate::device_taint::rule::TAINT_KEY, "operator": "Exists"},
                    {"key": crate::device_taint::rule::TAINT_KEY, "operator": "Exists", "effect": "NoExecute"},
                ],
            }})
        })
        .collect();
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "faultline"},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job_uid}]},
        "spec": {"devices": {"requests": requests}},
    })
}

impl Remediator {
    /// A device canary's Job: the pod asks, through a claim of its own, for
    /// the very devices the record quarantines, tolerating their taint. The claim is
    /// made after the Job, owned by it (the garbage collector removes it with the Job);
    /// the pod waits for it. Nothing is done for a record of the node path.
    pub(super) fn device_canary(
        &self,
        record: &QuarantineRecord,
        job: &mut k8s_openapi::api::batch::v1::Job,
        name: &str,
    ) {
        if record.rules().is_empty() {
            return;
        }
        let Some(spec) = job.spec.as_mut().and_then(|s| s.template.spec.as_mut()) else {
            return;
        };
        spec.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
            name: "devices".into(),
            resource_claim_name: Some(name.to_string()),
            ..Default::default()
        }]);
        for c in &mut spec.containers {
            c.resources
                .get_or_insert_with(Default::default)
                .claims
                .get_or_insert_with(Default::default)
                .push(k8s_openapi::api::core::v1::ResourceClaim {
                    name: "devices".into(),
                    ..Default::default()
                });
        }
    }

    /// Make the claim of a device canary's Job (see [`Remediator::device_canary`]).
    pub(super) async fn create_canary_claim(
        &self,
        record: &QuarantineRecord,
        namespace: &str,
        name: &str,
        job_uid: &str,
    ) -> Result<(), RemediateError> {
        let Some(q) = self.devices.as_ref().filter(|_| !record.rules().is_empty()) else {
            return Ok(());
        };
        // The device in the rule's slot now: a GPU swapped there since the fault
        // publishes another UUID, and the canary tests the new one (selected by the old
        // UUID it would never be allocated, and the release never come).
        let mut rules = record.rules().to_vec();
        if let Some(dra) = self.dra() {
            let index = dra
                .index_node(&record.node)
                .await
                .map_err(quarantine_error)?;
            for r in &mut rules {
                match index.uuid_of(&r.device_ref()) {
                    Some(now) if now != r.uuid => {
                        tracing::info!(node = %record.node, device = %r.device, was = %r.uuid, now, "a GPU swapped in the quarantined slot: the canary tests the new one");
                        r.uuid = now.to_string();
                    }
                    _ => {}
                }
            }
        }
        let claim = canary_claim(&rules, &q.device_class, name, job_uid);
        let ar = kube::api::ApiResource {
            group: "resource.k8s.io".into(),
            version: "v1".into(),
            api_version: "resource.k8s.io/v1".into(),
            kind: "ResourceClaim".into(),
            plural: "resourceclaims".into(),
        };
        let api: kube::Api<kube::api::DynamicObject> =
            kube::Api::namespaced_with(self.client.clone(), namespace, &ar);
        let obj: kube::api::DynamicObject = serde_json::from_value(claim)
            .map_err(|e| RemediateError::Device(format!("canary claim: {e}")))?;
        match api.create(&kube::api::PostParams::default(), &obj).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_taint::{tolerates_forever, TAINT_KEY};

    /// Under `--device-taint-effect NoExecute` the device-taint eviction controller
    /// spares only a claim whose allocation tolerates the taint with effect `NoExecute`
    /// written out. The canary's toleration had no effect: the controller deleted the
    /// canary's pod, and an auto release never succeeded.
    #[test]
    fn the_canary_tolerates_its_taint_as_the_eviction_controller_reads_it() {
        let r = DeviceRule {
            id: "gpu3".into(),
            uuid: "GPU-3".into(),
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: "gpu-3".into(),
            rule: "faultline-gpu-3-n1".into(),
            effect: "NoExecute".into(),
            predicted: None,
        };
        let claim = canary_claim(std::slice::from_ref(&r), "gpu.nvidia.com", "canary", "u1");
        // Allocated as the scheduler allocates it: the request's tolerations copied
        // into the result for the device.
        let tolerations = claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"].clone();
        let allocated = serde_json::json!({"status": {"allocation": {"devices": {"results": [{
            "request": "device-0", "driver": r.driver, "pool": r.pool, "device": r.device,
            "tolerations": tolerations,
        }]}}}});
        assert!(tolerates_forever(
            &allocated,
            &r.device_ref(),
            TAINT_KEY,
            "xid-79"
        ));
        // And the scheduler's view: a toleration of any effect is there too.
        assert!(tolerations
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t.get("effect").is_none() && t["operator"] == "Exists"));
    }
}
