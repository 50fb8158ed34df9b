//! The kubelet's word on devices (KEP-4680): every Pod's
//! `status.containerStatuses[].allocatedResourcesStatus` names the devices it holds and
//! their health as the device plugin reports it. An `Unhealthy` device is a verdict
//! (the same path as the intake's); an `Unknown` one is an alert only, never an action.
//!
//! Pods are listed, then watched from the list's resourceVersion; each (node, device,
//! health) is reported once until its health changes.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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

/// The devices of `pod` that are not healthy, among `resources`.
pub fn unhealthy_devices(pod: &Pod, resources: &[String]) -> Vec<PodDevice> {
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
/// (node, device, health).
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
    let mut backoff = Duration::from_secs(1);
    while !cancel.is_cancelled() {
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list pods for allocatedResourcesStatus");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = cancel.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        backoff = Duration::from_secs(1);
        for p in &list.items {
            for d in report(p, &mut seen) {
                if tx.send(d).await.is_err() {
                    return;
                }
            }
        }
        // Healthy again (or gone): forget, so a new failure is reported again.
        seen.retain(|(node, id), _| {
            list.items.iter().any(|p| {
                unhealthy_devices(p, &resources)
                    .iter()
                    .any(|d| d.node == *node && d.id == *id)
            })
        });
        let rv = list.metadata.resource_version.unwrap_or_default();
        let wp = WatchParams::default().timeout(290);
        let stream = match api.watch(&wp, &rv).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "cannot watch pods; listing again");
                continue;
            }
        };
        futures_util::pin_mut!(stream);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = cancel.cancelled() => return,
            };
            match ev {
                Some(Ok(WatchEvent::Added(p) | WatchEvent::Modified(p))) => {
                    for d in report(&p, &mut seen) {
                        if tx.send(d).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Ok(WatchEvent::Deleted(_) | WatchEvent::Bookmark(_))) => {}
                Some(Ok(WatchEvent::Error(_))) | Some(Err(_)) | None => break,
            }
        }
    }
}
