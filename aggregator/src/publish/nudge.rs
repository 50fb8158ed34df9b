//! Pod freshness. Kubelet refreshes a mounted ConfigMap only when it syncs the pod:
//! every `syncFrequency` (1 min) plus up to 50% jitter, so 60-90 s. A change to the Pod
//! object itself triggers a sync at once (what Kyverno's "refresh-volumes-in-pods"
//! policy relies on). So when a device turns degraded or failed, right after the shard's
//! ConfigMap is written, the workload pods on that node get an annotation
//! (`faultline.io/fault-refresh`) and see the new `/config/<node>.json` within seconds.
//!
//! Only pods of the namespaces the shards are published into are nudged: a pod can
//! mount only ConfigMaps of its own namespace, so a pod elsewhere reads no fault.json to
//! refresh (and faultline needs no right to patch pods there).
//!
//! Cost: one pod LIST (by `spec.nodeName`) per alarming node and one PATCH per pod,
//! each a pod update that watchers of pods also see. A token bucket (`--nudge-rate` per
//! second, bursts of twice that) bounds it; `--nudge-rate 0` turns it off. Pods past the
//! budget are counted and simply wait for kubelet's own refresh.
//!
//! Nudges run beside the writes ([`Nudger::detach`]), at most [`IN_FLIGHT`] batches at a
//! time: a shard's next write, and the replica's next urgent write, never wait for the
//! pod list and patches of the last one (at 2 s of API latency each nudge held
//! the next fault's write back by 4 s). A batch past that bound is counted (`busy`) and
//! its pods wait for kubelet, as those past the budget do.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Semaphore;

use faultline_common::supervise::spawn_contained;
use faultline_common::sync::Locked;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};

use crate::metrics::{Metrics, Nudge};

/// The annotation set on nudged pods.
pub const ANNOTATION: &str = "faultline.io/fault-refresh";

/// Nudge batches (one per shard write) running at once.
pub const IN_FLIGHT: usize = 8;

struct Bucket {
    tokens: f64,
    last: Instant,
}

/// Nudges pods, within a budget.
pub struct Nudger {
    api: Api<Pod>,
    selector: String,
    /// The publish namespaces: only their pods are nudged.
    namespaces: Vec<String>,
    rate: f64,
    bucket: Mutex<Bucket>,
    metrics: Arc<Metrics>,
    in_flight: Arc<Semaphore>,
}

impl Nudger {
    /// `rate` nudges per second (bursts of `2 x rate`), pods matching `selector` in
    /// `namespaces`.
    pub fn new(
        api: Api<Pod>,
        selector: String,
        namespaces: Vec<String>,
        rate: f64,
        metrics: Arc<Metrics>,
    ) -> Self {
        Nudger {
            api,
            selector,
            namespaces,
            rate,
            bucket: Mutex::new(Bucket {
                tokens: rate * 2.0,
                last: Instant::now(),
            }),
            metrics,
            in_flight: Arc::new(Semaphore::new(IN_FLIGHT)),
        }
    }

    /// Nudge the pods of `nodes` in a task of their own (after the write that changed
    /// their entries, so the sync a nudge causes finds the new content); nothing waits
    /// for it. Past [`IN_FLIGHT`] batches the nodes are counted `busy` and left to
    /// kubelet's own refresh.
    pub fn detach(self: &Arc<Self>, nodes: Vec<String>, stamp: String) {
        if nodes.is_empty() {
            return;
        }
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            for node in &nodes {
                self.metrics.nudge(Nudge::Busy);
                tracing::debug!(node, "nudges busy; the pods wait for kubelet's refresh");
            }
            return;
        };
        let me = self.clone();
        let batch = async move {
            for node in nodes {
                me.nudge(&node, &stamp).await;
            }
            drop(permit);
        };
        spawn_contained("pod nudges", batch, |_| {});
    }

    fn take(&self) -> bool {
        let mut b = self.bucket.locked();
        let now = Instant::now();
        b.tokens =
            (b.tokens + now.duration_since(b.last).as_secs_f64() * self.rate).min(self.rate * 2.0);
        b.last = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Nudge the running pods on `node`; returns how many were patched.
    pub async fn nudge(&self, node: &str, stamp: &str) -> usize {
        // From the watch cache (resourceVersion=0): a nudge needs no quorum read.
        let mut lp = ListParams::default()
            .match_any()
            .fields(&format!("spec.nodeName={node}"));
        if !self.selector.is_empty() {
            lp = lp.labels(&self.selector);
        }
        let pods = match self.api.list(&lp).await {
            Ok(l) => l.items,
            Err(e) => {
                self.metrics.nudge(Nudge::Error);
                tracing::warn!(node, error = %e, "cannot list pods to nudge");
                return 0;
            }
        };
        let mut done = 0;
        for p in pods {
            let finished = matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded") | Some("Failed")
            );
            if p.metadata.deletion_timestamp.is_some() || finished {
                continue;
            }
            let (Some(name), Some(ns)) =
                (p.metadata.name.as_deref(), p.metadata.namespace.as_deref())
            else {
                continue;
            };
            if !self.namespaces.iter().any(|n| n == ns) {
                continue;
            }
            if !self.take() {
                self.metrics.nudge(Nudge::RateLimited);
                continue;
            }
            let api: Api<Pod> = Api::namespaced(self.api.clone().into_client(), ns);
            let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION: stamp}}});
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    self.metrics.nudge(Nudge::Ok);
                    done += 1;
                }
                Err(e) => {
                    self.metrics.nudge(Nudge::Error);
                    tracing::debug!(pod = name, namespace = ns, error = %e, "nudge failed");
                }
            }
        }
        done
    }
}
