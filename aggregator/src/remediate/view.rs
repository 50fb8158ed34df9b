//! What remediation's decisions read of Kubernetes objects, as typed views. The strings
//! of the API (a pod's phase, the `Ready` condition, the mirror-pod annotation, an owner
//! of kind `DaemonSet`, the kubelet's allocated devices) are read here, once; the pure
//! policy (`policy.rs`) decides on these views and never on raw objects.

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};

use super::record::CANARY_LABEL;

/// The kubelet's annotation on a static (mirror) pod.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A pod as eviction decides on it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodView {
    /// `Succeeded` or `Failed`.
    pub finished: bool,
    /// Deletion requested already.
    pub terminating: bool,
    /// A static pod's mirror (the API cannot evict it).
    pub mirror: bool,
    /// Owned by a DaemonSet (evicted, it would come straight back).
    pub daemon: bool,
    /// faultline's own canary (runs on the quarantined node on purpose).
    pub canary: bool,
    /// A container or init container asks for one of the accelerator resources.
    pub accelerator: bool,
    /// The devices of those resources the kubelet says it holds (KEP-4680's
    /// `allocatedResourcesStatus`); empty where the kubelet does not say.
    pub held: Vec<String>,
}

impl PodView {
    /// The view of `pod` for accelerator resources `resources` (e.g. `nvidia.com/gpu`).
    pub fn of(pod: &Pod, resources: &[String]) -> Self {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        let accelerator = pod.spec.as_ref().is_some_and(|spec| {
            spec.containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
                .any(|c| {
                    c.resources.as_ref().is_some_and(|r| {
                        [r.limits.as_ref(), r.requests.as_ref()]
                            .into_iter()
                            .flatten()
                            .any(|m| m.keys().any(|k| resources.contains(k)))
                    })
                })
        });
        PodView {
            finished: matches!(
                status.and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            ),
            terminating: meta.deletion_timestamp.is_some(),
            mirror: meta
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)),
            daemon: meta
                .owner_references
                .as_ref()
                .is_some_and(|o| o.iter().any(|r| r.kind == "DaemonSet")),
            canary: meta
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(CANARY_LABEL)),
            accelerator,
            held: held(pod, resources),
        }
    }
}

/// The devices of `resources` a pod holds: what the kubelet reports
/// (`allocatedResourcesStatus`), where Huawei's device plugin names the real chips
/// (`huawei.com/AscendReal`) those instead of the kubelet's Ascend ids, which
/// under Volcano are aliases of other chips.
fn held(pod: &Pod, resources: &[String]) -> Vec<String> {
    let mut held: Vec<String> = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|cs| cs.allocated_resources_status.iter().flatten())
        .filter(|rs| resources.contains(&rs.name))
        .flat_map(|rs| rs.resources.iter().flatten().map(|r| r.resource_id.clone()))
        .collect();
    let real = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(faultline_common::ascend::REAL_CHIPS_ANNOTATION))
        .filter(|v| v.len() <= 4096);
    if let Some(real) = real {
        let chips: Vec<String> = real
            .split(',')
            .map(str::trim)
            .filter(|c| faultline_common::ascend::chip_of_device_name(c).is_some())
            .map(String::from)
            .collect();
        if !chips.is_empty() {
            held.retain(|id| faultline_common::ascend::chip_of_device_name(id).is_none());
            held.extend(chips);
        }
    }
    held
}

/// A Node as the unknown guard decides on it: its `Ready` condition, `None` when it has
/// none (a Node object without a kubelet is not "NotReady").
pub fn node_ready(node: &Node) -> Option<bool> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status == "True")
}

/// The value of label `key` on `node` (a budget's failure domain).
pub fn label(node: &Node, key: &str) -> Option<String> {
    node.metadata.labels.as_ref()?.get(key).cloned()
}

/// A canary Job as its verdict reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobView {
    /// A pod of it succeeded.
    pub succeeded: bool,
    /// A pod of it failed.
    pub failed: bool,
}

impl JobView {
    /// The view of `job`.
    pub fn of(job: &Job) -> Self {
        let status = job.status.as_ref();
        JobView {
            succeeded: status.and_then(|s| s.succeeded).unwrap_or(0) > 0,
            failed: status.and_then(|s| s.failed).unwrap_or(0) > 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn readiness_of_a_node() {
        let n = |conds: serde_json::Value| -> Node {
            serde_json::from_value(
                json!({"metadata": {"name": "n"}, "status": {"conditions": conds}}),
            )
            .unwrap()
        };
        assert_eq!(
            node_ready(&n(json!([{"type": "Ready", "status": "True"}]))),
            Some(true)
        );
        assert_eq!(
            node_ready(&n(json!([{"type": "Ready", "status": "Unknown"}]))),
            Some(false)
        );
        assert_eq!(node_ready(&n(json!([]))), None);
    }

    #[test]
    fn a_jobs_outcome() {
        let job = |v: serde_json::Value| JobView::of(&serde_json::from_value(v).unwrap());
        assert_eq!(job(json!({"metadata": {"name": "c"}})), JobView::default());
        assert!(job(json!({"metadata": {"name": "c"}, "status": {"succeeded": 1}})).succeeded);
        assert!(job(json!({"metadata": {"name": "c"}, "status": {"failed": 2}})).failed);
    }

    /// What a pod's view reads, field by field, from the API's strings.
    #[test]
    fn a_pods_view() {
        let res = vec!["nvidia.com/gpu".to_string()];
        let pod = |v: serde_json::Value| PodView::of(&serde_json::from_value(v).unwrap(), &res);
        let gpu = json!({"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
        let v = pod(
            json!({"metadata": {"name": "p"}, "spec": gpu, "status": {"phase": "Running",
            "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
            "allocatedResourcesStatus": [{"name": "nvidia.com/gpu", "resources": [{"resourceID": "GPU-1", "health": "Healthy"}]},
                                         {"name": "example.com/nic", "resources": [{"resourceID": "nic0"}]}]}]}}),
        );
        assert!(
            v.accelerator && !v.finished && !v.terminating && !v.mirror && !v.daemon && !v.canary
        );
        assert_eq!(v.held, vec!["GPU-1"], "only the accelerator's devices");
        assert!(
            pod(json!({"metadata": {"name": "p"}, "spec": gpu, "status": {"phase": "Failed"}}))
                .finished
        );
        assert!(pod(json!({"metadata": {"name": "p", "deletionTimestamp": "2026-12-01T00:00:00Z"}, "spec": gpu})).terminating);
        assert!(pod(json!({"metadata": {"name": "p", "annotations": {"kubernetes.io/config.mirror": "x"}}, "spec": gpu})).mirror);
        assert!(pod(json!({"metadata": {"name": "p", "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u"}]}, "spec": gpu})).daemon);
        assert!(pod(json!({"metadata": {"name": "p", "labels": {"faultline.io/canary": "1"}}, "spec": gpu})).canary);
        assert!(
            !pod(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}))
                .accelerator
        );
    }
}
