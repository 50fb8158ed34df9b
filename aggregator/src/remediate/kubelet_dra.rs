//! The kubelet's own DRA health report (KEP-4680, beta in 1.36) as evidence of which
//! pod holds which device. For a DRA device the kubelet writes, in each container's
//! `allocatedResourcesStatus`, an entry named `claim:<claim>/<request>` whose resources
//! are `<driver>/<pool>/<device>` with the driver's health. It names the exact pod and
//! device, and it stays when the driver no longer publishes the device (NVIDIA's
//! republishes only healthy ones), where no slice can say who held it.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::device_taint::{tolerates_forever, DeviceRef, TAINT_KEY};

/// One device a pod's claim holds, as the kubelet reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    /// The claim's name (in the pod's namespace).
    pub claim: String,
    /// `<driver>/<pool>/<device>`.
    pub device: String,
    /// The driver said `Unhealthy`.
    pub unhealthy: bool,
}

/// The DRA entries of `pod`'s containers and init containers.
pub(super) fn entries(pod: &Pod) -> Vec<Entry> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .flat_map(|cs| cs.allocated_resources_status.iter().flatten())
        .filter_map(|rs| {
            let claim = rs.name.strip_prefix("claim:")?.split('/').next()?;
            Some((claim.to_string(), rs.resources.iter().flatten()))
        })
        .flat_map(|(claim, resources)| {
            resources.map(move |r| Entry {
                claim: claim.clone(),
                device: r.resource_id.clone(),
                unhealthy: r.health.as_deref() == Some("Unhealthy"),
            })
        })
        .collect()
}

/// The uids of `pods` the kubelet says hold one of `refs` (each with its rule's taint
/// value, none on the node path), or, on the node path, any device its driver calls
/// unhealthy. A claim of `claims` that tolerates its rule's taint for ever is left, as
/// the device-taint eviction controller leaves it.
pub(super) fn holders(
    pods: &[Pod],
    refs: &[(DeviceRef, Option<String>)],
    node_path: bool,
    claims: &[Value],
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for p in pods {
        let (Some(uid), Some(ns)) = (&p.metadata.uid, &p.metadata.namespace) else {
            continue;
        };
        for e in entries(p) {
            let named = refs.iter().find(|(r, _)| r.resource_id() == e.device);
            if named.is_none() && !(node_path && e.unhealthy) {
                continue;
            }
            let tolerates = named.is_some_and(|(r, value)| {
                value.as_deref().is_some_and(|v| {
                    claims.iter().any(|c| {
                        c.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns)
                            && c.pointer("/metadata/name").and_then(Value::as_str)
                                == Some(e.claim.as_str())
                            && tolerates_forever(c, r, TAINT_KEY, v)
                    })
                })
            });
            if !tolerates {
                out.insert(uid.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(entries: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": "train", "name": "p", "uid": "u1"},
            "spec": {"containers": []},
            "status": {"containerStatuses": [{"name": "c", "ready": true, "restartCount": 0,
                "image": "x", "imageID": "", "allocatedResourcesStatus": entries}]}
        }))
        .unwrap()
    }

    fn gpu(device: &str) -> DeviceRef {
        DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: device.into(),
        }
    }

    #[test]
    fn only_claim_entries_name_dra_devices() {
        let p = pod(json!([
            {"name": "claim:p-gpu/gpu", "resources": [{"resourceID": "gpu.nvidia.com/n1/gpu-3", "health": "Unhealthy"}]},
            {"name": "nvidia.com/gpu", "resources": [{"resourceID": "GPU-1", "health": "Healthy"}]},
        ]));
        assert_eq!(
            entries(&p),
            [Entry {
                claim: "p-gpu".into(),
                device: "gpu.nvidia.com/n1/gpu-3".into(),
                unhealthy: true
            }]
        );
    }

    #[test]
    fn a_pod_is_a_holder_of_a_device_named_or_unhealthy_on_the_node_path() {
        let healthy = pod(json!([{"name": "claim:p-gpu/gpu",
            "resources": [{"resourceID": "gpu.nvidia.com/n1/gpu-3", "health": "Healthy"}]}]));
        let pods = [healthy];
        // The device path: the rule's device names it, whatever the health.
        let refs = [(gpu("gpu-3"), Some("xid-79".to_string()))];
        assert_eq!(holders(&pods, &refs, false, &[]).len(), 1);
        // Another device: not a holder.
        let other = [(gpu("gpu-4"), Some("xid-79".to_string()))];
        assert!(holders(&pods, &other, false, &[]).is_empty());
        // The node path, the failed device no longer published: an unhealthy one.
        let sick = [pod(json!([{"name": "claim:p-gpu/gpu",
            "resources": [{"resourceID": "gpu.nvidia.com/n1/gpu-3", "health": "Unhealthy"}]}]))];
        assert_eq!(holders(&sick, &[], true, &[]).len(), 1);
        assert!(
            holders(&pods, &[], true, &[]).is_empty(),
            "healthy: not a guess"
        );
        assert!(
            holders(&sick, &[], false, &[]).is_empty(),
            "device path: named only"
        );
        // A claim that tolerates the taint for ever (NoExecute, no seconds) is left.
        let tolerant = json!({"metadata": {"namespace": "train", "name": "p-gpu"},
            "status": {"allocation": {"devices": {"results": [{"driver": "gpu.nvidia.com",
                "pool": "n1", "device": "gpu-3",
                "tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoExecute"}]}]}}}});
        assert!(holders(&pods, &refs, false, &[tolerant]).is_empty());
    }
}
