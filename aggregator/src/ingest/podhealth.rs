//! The kubelet's word on devices (KEP-4680): every Pod's
//! `status.containerStatuses[].allocatedResourcesStatus` names the devices it holds and
//! their health as the device plugin reports it. An `Unhealthy` device is a verdict
//! (the same path as the intake's); an `Unknown` one is an alert only, never an action.
//!
//! Off by default (`--watch-pod-health`): `allocatedResourcesStatus` needs the
//! `ResourceHealthStatus` feature gate, alpha and off by default through 1.32, and
//! watching every Pod costs a cluster-wide list and watch. When on, Pods come from a
//! `kube::runtime::watcher`; each (node, device, health) is reported once until its
//! health changes, and again on every re-list.
//! [`forward_verdicts`] turns what is reported into the core loop's verdicts.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::{IntakeResult, Metrics};
use crate::model::{Provenance, RecordDevice, Verdict};

/// A device's health as a pod's status tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodDevice {
    /// The node the pod runs on.
    pub node: String,
    /// The resource (`nvidia.com/gpu`).
    pub resource: String,
    /// The device plugin's id of the device (often the UUID).
    pub id: String,
    /// `Unhealthy` or `Unknown`.
    pub health: String,
    /// `namespace/name` of the pod that told.
    pub pod: String,
}

/// The devices of `pod` that are not healthy, among `resources` (none for a pod that
/// finished or is going away).
pub fn unhealthy_devices(pod: &Pod, resources: &[String]) -> Vec<PodDevice> {
    // A finished or terminating pod's status is frozen: its word is history, not now.
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if finished || pod.metadata.deletion_timestamp.is_some() {
        return Vec::new();
    }
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let name = format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or(""),
        pod.metadata.name.as_deref().unwrap_or("")
    );
    let mut out = Vec::new();
    for cs in pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
    {
        for rs in cs.allocated_resources_status.iter().flatten() {
            if !resources.contains(&rs.name) {
                continue;
            }
            for r in rs.resources.iter().flatten() {
                let health = r.health.as_deref().unwrap_or("Unknown");
                if health != "Healthy" && !node.is_empty() {
                    let d = PodDevice {
                        node: node.clone(),
                        resource: rs.name.clone(),
                        id: r.resource_id.clone(),
                        health: health.to_string(),
                        pod: name.clone(),
                    };
                    if !out.contains(&d) {
                        out.push(d);
                    }
                }
            }
        }
    }
    out
}

/// Watch every Pod and send each device that turns Unhealthy or Unknown, once per
/// (node, device, health), from a `kube::runtime::watcher` (a consistent list in
/// pages, bookmarks, 410 handling, backoff after errors). `api` must come
/// from a client without a read timeout.
pub async fn run(
    api: Api<Pod>,
    resources: Vec<String>,
    tx: mpsc::Sender<PodDevice>,
    cancel: CancellationToken,
) {
    // (node, device) -> last health sent.
    let mut seen: BTreeMap<(String, String), String> = BTreeMap::new();
    let report = |pod: &Pod, seen: &mut BTreeMap<(String, String), String>| {
        let mut out = Vec::new();
        for d in unhealthy_devices(pod, &resources) {
            let key = (d.node.clone(), d.id.clone());
            if seen.get(&key) != Some(&d.health) {
                seen.insert(key, d.health.clone());
                out.push(d);
            }
        }
        out
    };
    // A consistent list in pages of 500: at `resourceVersion=0` the watch
    // cache ignores the limit and sends every Pod of the cluster in one answer
    // (staging/src/k8s.io/apiserver/pkg/storage/cacher/delegator.go), which a replica
    // would hold whole; pages from storage are bounded, and only a (re)list pays for them.
    let cfg = watcher::Config::default().page_size(500);
    let stream = watcher(api, cfg).default_backoff();
    let mut stream = std::pin::pin!(stream);
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = cancel.cancelled() => return,
        };
        let pod = match ev {
            // Level, not edge: every re-list sends what is unhealthy now again, so a
            // replica that took a shard over since hears it, and what turned healthy or
            // went away is forgotten.
            Some(Ok(Event::Init)) => {
                seen.clear();
                continue;
            }
            Some(Ok(Event::InitApply(p) | Event::Apply(p))) => p,
            Some(Ok(Event::Delete(_) | Event::InitDone)) => continue,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "pod watch for allocatedResourcesStatus failed; retrying with backoff");
                continue;
            }
            None => return,
        };
        for d in report(&pod, &mut seen) {
            if tx.send(d).await.is_err() {
                return;
            }
        }
    }
}

/// What the kubelet's word on a device means: an `Unhealthy` device is a verdict
/// (source `kubelet`); anything else is an alert only, never an action.
pub fn verdict(d: PodDevice) -> Option<Verdict> {
    if d.health != "Unhealthy" {
        return None;
    }
    let device = RecordDevice {
        uuid: d.id.starts_with("GPU-").then(|| d.id.clone()),
        source: Some(Provenance::Kubelet),
        metric: Some(format!("{} allocatedResourcesStatus", d.resource)),
        value: Some(d.health.clone()),
        ..RecordDevice::new(d.id.clone(), "kubelet:Unhealthy")
    };
    Some(Verdict {
        node: d.node,
        device,
    })
}

/// Hand what [`run`] sends to the core loop as verdicts, counting and logging each.
pub async fn forward_verdicts(
    mut rx: mpsc::Receiver<PodDevice>,
    verdicts: mpsc::Sender<Verdict>,
    metrics: Arc<Metrics>,
) {
    while let Some(d) = rx.recv().await {
        let (node, id, pod, health) = (
            d.node.clone(),
            d.id.clone(),
            d.pod.clone(),
            d.health.clone(),
        );
        let Some(v) = verdict(d) else {
            metrics.intake_alert(IntakeResult::KubeletUnknown);
            tracing::warn!(node = %node, device = %id, pod = %pod, health = %health, "the kubelet cannot tell this device's health: alert only, no action");
            continue;
        };
        metrics.intake_alert(IntakeResult::KubeletUnhealthy);
        tracing::warn!(node = %node, device = %id, pod = %pod, "the kubelet reports the device unhealthy");
        if verdicts.send(v).await.is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(phase: &str, health: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "n1", "containers": [{"name": "c"}]},
            "status": {"phase": phase, "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
                "allocatedResourcesStatus": [{"name": "nvidia.com/gpu", "resources": [
                    {"resourceID": "GPU-a", "health": health}, {"resourceID": "GPU-b", "health": "Healthy"}]}]}]}
        }))
        .unwrap()
    }

    #[test]
    fn only_running_pods_speak_for_their_devices() {
        let res = vec!["nvidia.com/gpu".to_string()];
        let d = unhealthy_devices(&pod("Running", "Unhealthy"), &res);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].node.as_str(), d[0].id.as_str()), ("n1", "GPU-a"));
        assert_eq!(d[0].pod, "ns/p");
        assert_eq!(
            unhealthy_devices(&pod("Running", "Unknown"), &res)[0].health,
            "Unknown"
        );
        // A finished pod's status is frozen: not evidence of now.
        assert!(unhealthy_devices(&pod("Failed", "Unhealthy"), &res).is_empty());
        assert!(unhealthy_devices(&pod("Succeeded", "Unhealthy"), &res).is_empty());
        // Unhealthy is a verdict, Unknown is not.
        let v = verdict(d[0].clone()).unwrap();
        assert_eq!(
            (v.node.as_str(), v.device.uuid.as_deref()),
            ("n1", Some("GPU-a"))
        );
        assert_eq!(v.device.reason, "kubelet:Unhealthy");
        assert!(verdict(unhealthy_devices(&pod("Running", "Unknown"), &res)[0].clone()).is_none());
        // Other resources are not ours.
        assert!(unhealthy_devices(
            &pod("Running", "Unhealthy"),
            &["huawei.com/Ascend910".into()]
        )
        .is_empty());
    }
}
