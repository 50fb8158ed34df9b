//! Every node's kubelet, played by the test: there is no container runtime here, so the
//! Node objects, their heartbeats and their pods' lives are written as a kubelet writes
//! them (pkg/kubelet/nodestatus, pkg/kubelet/status), and the real controllers react.
//!
//! - Nodes: created Ready with an InternalIP, capacity and allocatable; their Lease in
//!   `kube-node-lease` renewed every 10 s (the node lifecycle controller's heartbeat).
//! - Pods the real scheduler bound to a node: after [`Kubelet::start_delay`] (an image
//!   pull), an address of the node's own range is given, the [`PodHook`] told, and the
//!   status written Running and Ready (so the endpointslice controller makes their
//!   endpoints), or, where the hook says so, Succeeded or Failed (a Job's pod).
//! - Pods being deleted (a `deletionTimestamp`): the hook told, and after
//!   [`Kubelet::stop_delay`] (the containers stopping), deleted for good with grace 0 and
//!   the pod's uid as precondition, as the kubelet's status manager does.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// A Node the test makes.
#[derive(Debug, Clone)]
pub struct FakeNode {
    pub name: String,
    /// Its InternalIP, also the first address of its pods' range: node `i` of
    /// [`FakeNode::gpu`] is 10.244.`i+1`.1, its pods 10.244.`i+1`.2 on. The
    /// endpointslice controller refuses loopback addresses, so the tests run in a
    /// network namespace of their own where 10.244.0.0/16 is local
    /// ([`crate::network_namespace`]).
    pub ip: String,
    pub labels: BTreeMap<String, String>,
    /// Capacity, also allocatable.
    pub resources: BTreeMap<String, String>,
}

impl FakeNode {
    /// GPU node `i` named `name`: `nvidia.com/gpu.present=true`, 8 `nvidia.com/gpu`,
    /// 64 CPUs, 512 GiB, 110 pods.
    pub fn gpu(name: &str, i: u8) -> Self {
        let labels = [
            ("kubernetes.io/hostname", name),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
            ("nvidia.com/gpu.present", "true"),
        ];
        let resources = [
            ("cpu", "64"),
            ("memory", "512Gi"),
            ("pods", "110"),
            ("ephemeral-storage", "1Ti"),
            ("nvidia.com/gpu", "8"),
        ];
        FakeNode {
            name: name.into(),
            ip: format!("10.244.{}.1", u16::from(i) + 1),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            resources: resources
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn pod_ip(&self, n: u32) -> String {
        let prefix = self
            .ip
            .rsplit_once('.')
            .map(|(p, _)| p)
            .unwrap_or("10.244.0");
        format!("{prefix}.{}", 2 + n % 250)
    }
}

/// What a pod does once started, as its hook says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodPhase {
    Running,
    Succeeded,
    Failed,
}

/// Told of each pod's life: `Some(ip)` as it starts at that address (the phase it
/// takes is the answer), `None` as it stops (the answer is ignored).
pub type PodHook = Arc<
    dyn Fn(Pod, Option<String>) -> Pin<Box<dyn Future<Output = PodPhase> + Send>> + Send + Sync,
>;

/// The kubelets of the test's nodes, until dropped.
pub struct Kubelet {
    cancel: CancellationToken,
    nodes: Vec<FakeNode>,
}

/// Delays of a pod's life, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Delays {
    /// From binding to Running (an image pull).
    pub start: u64,
    /// From the deletion's start to the final delete (containers stopping).
    pub stop: u64,
}

impl Default for Delays {
    fn default() -> Self {
        Delays {
            start: 500,
            stop: 500,
        }
    }
}

impl Kubelet {
    /// Make `nodes` and run their kubelets with `client`, telling `hook` of each pod.
    pub async fn start(
        client: kube::Client,
        nodes: Vec<FakeNode>,
        delays: Delays,
        hook: Option<PodHook>,
    ) -> anyhow::Result<Kubelet> {
        let api: Api<Node> = Api::all(client.clone());
        for n in &nodes {
            let node: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": n.name, "labels": n.labels},
            }))?;
            api.create(&PostParams::default(), &node).await?;
            api.patch_status(
                &n.name,
                &PatchParams::default(),
                &Patch::Merge(node_status(n)),
            )
            .await?;
        }
        let cancel = CancellationToken::new();
        tokio::spawn(heartbeats(client.clone(), nodes.clone(), cancel.clone()));
        tokio::spawn(pods(client, nodes.clone(), delays, hook, cancel.clone()));
        Ok(Kubelet { cancel, nodes })
    }

    /// The nodes.
    pub fn nodes(&self) -> &[FakeNode] {
        &self.nodes
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn now() -> String {
    // RFC 3339 with microseconds (MicroTime), from the system clock.
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let secs = t.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        t.subsec_micros()
    )
}

/// Days since 1970-01-01 -> (year, month, day) (Howard Hinnant's civil_from_days).
fn civil(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Seconds-precision time (`metav1.Time`).
fn now_secs() -> String {
    let t = now();
    format!("{}Z", &t[..19])
}

fn node_status(n: &FakeNode) -> serde_json::Value {
    let t = now_secs();
    let cond = |ty: &str, status: &str, reason: &str| {
        json!({"type": ty, "status": status, "reason": reason, "message": "faultline's test kubelet",
               "lastHeartbeatTime": t, "lastTransitionTime": t})
    };
    json!({"status": {
        "capacity": n.resources,
        "allocatable": n.resources,
        "addresses": [
            {"type": "InternalIP", "address": n.ip},
            {"type": "Hostname", "address": n.name},
        ],
        "conditions": [
            cond("Ready", "True", "KubeletReady"),
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
        "nodeInfo": {
            "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "6.1.0",
            "osImage": "faultline test node", "containerRuntimeVersion": "none://0",
            "kubeletVersion": "v0.0.0-faultline-test", "kubeProxyVersion": "",
            "operatingSystem": "linux", "architecture": "amd64",
        },
    }})
}

/// Renew each node's Lease every 10 s (its duration is 40 s).
async fn heartbeats(client: kube::Client, nodes: Vec<FakeNode>, cancel: CancellationToken) {
    let api: Api<Lease> = Api::namespaced(client, "kube-node-lease");
    loop {
        for n in &nodes {
            let lease = json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": n.name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": n.name, "leaseDurationSeconds": 40, "renewTime": now()},
            });
            let pp = PatchParams::apply("faultline-test-kubelet").force();
            if let Err(e) = api.patch(&n.name, &pp, &Patch::Apply(lease)).await {
                tracing::warn!(node = %n.name, error = %e, "test kubelet: node Lease not renewed");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
    }
}

/// What the kubelet has done with a pod (by uid).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seen {
    Starting,
    Stopping,
}

async fn pods(
    client: kube::Client,
    nodes: Vec<FakeNode>,
    delays: Delays,
    hook: Option<PodHook>,
    cancel: CancellationToken,
) {
    let api: Api<Pod> = Api::all(client.clone());
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
    let mut next_ip: HashMap<String, u32> = HashMap::new();
    loop {
        let ev = tokio::select! {
            _ = cancel.cancelled() => return,
            ev = stream.next() => ev,
        };
        let pod = match ev {
            Some(Ok(Event::Apply(p) | Event::InitApply(p))) => p,
            Some(Ok(Event::Delete(p))) => {
                // Gone (force-deleted, or our final delete): stop it if it ran.
                let uid = p.metadata.uid.clone().unwrap_or_default();
                let was = seen.lock().unwrap().remove(&uid);
                if was == Some(Seen::Starting) {
                    if let Some(h) = &hook {
                        h(p, None).await;
                    }
                }
                continue;
            }
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "test kubelet: pod watch failed");
                continue;
            }
            None => return,
        };
        let Some(node) = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .and_then(|n| nodes.iter().find(|f| &f.name == n))
        else {
            continue;
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        let state = seen.lock().unwrap().get(&uid).copied();
        if pod.metadata.deletion_timestamp.is_some() {
            if state == Some(Seen::Stopping) {
                continue;
            }
            seen.lock().unwrap().insert(uid.clone(), Seen::Stopping);
            let (api, hook) = (
                Api::<Pod>::namespaced(client.clone(), &ns(&pod)),
                hook.clone(),
            );
            tokio::spawn(async move {
                if state == Some(Seen::Starting) {
                    if let Some(h) = &hook {
                        h(pod.clone(), None).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(delays.stop)).await;
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: Some(uid),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                let name = pod.metadata.name.clone().unwrap_or_default();
                if let Err(e) = api.delete(&name, &dp).await {
                    tracing::debug!(pod = %name, error = %e, "test kubelet: final delete");
                }
            });
            continue;
        }
        if state.is_some() || !(phase.is_empty() || phase == "Pending") {
            continue;
        }
        seen.lock().unwrap().insert(uid.clone(), Seen::Starting);
        let n = next_ip.entry(node.name.clone()).or_default();
        let ip = node.pod_ip(*n);
        *n += 1;
        let (api, hook, host) = (
            Api::<Pod>::namespaced(client.clone(), &ns(&pod)),
            hook.clone(),
            node.ip.clone(),
        );
        let seen = seen.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delays.start)).await;
            if seen.lock().unwrap().get(&uid) != Some(&Seen::Starting) {
                return;
            }
            let phase = match &hook {
                Some(h) => h(pod.clone(), Some(ip.clone())).await,
                None => PodPhase::Running,
            };
            let name = pod.metadata.name.clone().unwrap_or_default();
            let status = pod_status(&pod, &ip, &host, phase);
            if let Err(e) = api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                .await
            {
                tracing::warn!(pod = %name, error = %e, "test kubelet: pod status not written");
            }
        });
    }
}

fn ns(pod: &Pod) -> String {
    pod.metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into())
}

fn pod_status(pod: &Pod, ip: &str, host: &str, phase: PodPhase) -> serde_json::Value {
    let t = now_secs();
    let running = phase == PodPhase::Running;
    let ready = if running { "True" } else { "False" };
    let cond = |ty: &str, status: &str| json!({"type": ty, "status": status, "lastProbeTime": null, "lastTransitionTime": t});
    let containers: Vec<serde_json::Value> = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let state = match phase {
                PodPhase::Running => json!({"running": {"startedAt": t}}),
                PodPhase::Succeeded => json!({"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t, "finishedAt": t}}),
                PodPhase::Failed => json!({"terminated": {"exitCode": 1, "reason": "Error", "startedAt": t, "finishedAt": t}}),
            };
            json!({
                "name": c.name, "image": c.image.clone().unwrap_or_default(), "imageID": "",
                "ready": running, "started": running, "restartCount": 0, "state": state,
            })
        })
        .collect();
    json!({"status": {
        "phase": match phase {
            PodPhase::Running => "Running",
            PodPhase::Succeeded => "Succeeded",
            PodPhase::Failed => "Failed",
        },
        "hostIP": host, "hostIPs": [{"ip": host}],
        "podIP": ip, "podIPs": [{"ip": ip}],
        "startTime": t,
        "conditions": [
            cond("PodReadyToStartContainers", "True"),
            cond("Initialized", "True"),
            cond("ContainersReady", ready),
            cond("Ready", ready),
            cond("PodScheduled", "True"),
        ],
        "containerStatuses": containers,
    }})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_are_right() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(20_428), (2025, 12, 6));
        assert_eq!(civil(11_016), (2000, 2, 29));
    }

    #[test]
    fn pods_of_a_node_get_addresses_of_its_range() {
        let n = FakeNode::gpu("n1", 0);
        assert_eq!(n.ip, "10.244.1.1");
        assert_eq!(
            (n.pod_ip(0), n.pod_ip(1)),
            ("10.244.1.2".into(), "10.244.1.3".into())
        );
    }
}
