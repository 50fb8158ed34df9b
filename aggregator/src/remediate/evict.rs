//! Eviction: the pods on a quarantined node that use a failed device leave through the
//! Eviction API, so PodDisruptionBudgets hold. Each pod at most once per fault (the
//! record on the Node remembers), never DaemonSet, mirror, finished or terminating pods
//! (`policy::wants_eviction`). A 429 (a budget) is retried by later passes until the
//! deadline, then announced and left (or deleted, with `--force-delete-after-deadline`);
//! a 404 counts as done. Within the eviction rate and the breaker.

use std::time::Duration;

use faultline_common::time::{age_secs, now_rfc3339};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams, ListParams};

use super::announce::audit;
use super::error::RemediateError;
use super::patch::NodePatch;
use super::policy::{blocked, wants_eviction, Blocked, Mode};
use super::record::{describe, QuarantineRecord};
use super::remediator::Remediator;
use crate::shard::Fence;

/// What an eviction pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Evictions {
    /// Evicted now.
    pub evicted: Vec<String>,
    /// Refused by a budget (429), or past the eviction rate: to retry.
    pub blocked: Vec<String>,
    /// Refused past the deadline: announced and left alone.
    pub given_up: Vec<String>,
}

/// How one pod's eviction went.
enum PodEviction {
    /// Gone (evicted now, or already): record it.
    Evicted,
    /// Deleted past the deadline: recorded already.
    Deleted,
    /// Refused: to retry.
    Blocked,
    /// Refused past the deadline and left: recorded already.
    GivenUp,
}

impl Remediator {
    /// Evict the pods on `node` that use a failed device (see the module).
    pub async fn evict(&self, node: &str, fence: &Fence) -> Result<Evictions, RemediateError> {
        let mut out = Evictions::default();
        if self.mode == Mode::Off || self.breaker_open().await? {
            return Ok(out);
        }
        let live = self.read(node).await?;
        let Some(mut record) = live.record.clone().filter(|r| !r.unknown_only) else {
            return Ok(out);
        };
        let all: Api<Pod> = Api::all(self.client.clone());
        let pods = all
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?;
        let mut changed = false;
        let targets: Vec<&Pod> = pods
            .items
            .iter()
            .filter(|p| wants_eviction(p, &self.resources, &record.devices))
            .collect();
        for pod in targets {
            let (Some(name), Some(ns)) = (
                pod.metadata.name.as_deref(),
                pod.metadata.namespace.as_deref(),
            ) else {
                continue;
            };
            let key = format!("{ns}/{name}/{}", pod.metadata.uid.as_deref().unwrap_or(""));
            if record.evicted.contains(&key) {
                continue;
            }
            if self.mode == Mode::DryRun {
                self.announce.metric("evict", "dry-run");
                self.announce
                    .event(
                        node,
                        "FaultlineWouldEvict",
                        &key,
                        format!("dry-run: would evict {ns}/{name}"),
                        true,
                        &record.devices,
                    )
                    .await;
                continue;
            }
            if !fence.holds() {
                return Err(RemediateError::NotHolder);
            }
            // Past the eviction rate the pod waits for a later pass.
            if !self.rate.take() {
                out.blocked.push(key);
                continue;
            }
            match self.evict_pod(node, pod, &key, &mut record).await? {
                PodEviction::Evicted => {
                    audit("evict", node, &record.devices, &self.actor, &key);
                    record.eviction_blocked.remove(&key);
                    record.evicted.push(key.clone());
                    record.act(format!("evict {ns}/{name}"), &now_rfc3339(), &self.actor);
                    changed = true;
                    self.announce.metric("evict", "ok");
                    self.announce
                        .event(
                            node,
                            "FaultlineEvicted",
                            &key,
                            format!(
                                "evicted {ns}/{name} from a failed device: {}",
                                describe(&record.devices)
                            ),
                            true,
                            &record.devices,
                        )
                        .await;
                    self.announce.pod_event(pod, &record.devices).await;
                    out.evicted.push(key);
                }
                PodEviction::Deleted => {
                    changed = true;
                    out.evicted.push(key);
                }
                PodEviction::Blocked => {
                    changed = true;
                    out.blocked.push(key);
                }
                PodEviction::GivenUp => {
                    changed = true;
                    out.given_up.push(key);
                }
            }
        }
        if changed {
            // The record first tests the Node's resourceVersion: a pass that raced
            // another writer fails here and the next pass starts from the live Node
            // (the evictions it made are then seen as 404s or already gone pods).
            let mut patch = NodePatch::on(&live.node);
            patch.record(&record);
            self.apply(node, patch, fence).await?;
        }
        Ok(out)
    }

    /// Ask the Eviction API for one pod; on a budget's refusal, apply the deadline.
    async fn evict_pod(
        &self,
        node: &str,
        pod: &Pod,
        key: &str,
        record: &mut QuarantineRecord,
    ) -> Result<PodEviction, RemediateError> {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        match api.evict(name, &EvictParams::default()).await {
            Ok(_) => return Ok(PodEviction::Evicted),
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(PodEviction::Evicted),
            Err(kube::Error::Api(e)) if e.code == 429 => {}
            Err(e) => return Err(e.into()),
        }
        let since = record
            .eviction_blocked
            .entry(key.to_string())
            .or_insert_with(now_rfc3339)
            .clone();
        let waited = age_secs(&since).unwrap_or(0.0).max(0.0);
        match blocked(
            Duration::from_secs_f64(waited),
            self.eviction_deadline,
            self.force_delete,
        ) {
            Blocked::Retry => Ok(PodEviction::Blocked),
            Blocked::GiveUp => {
                self.announce.metric("evict", "given-up");
                self.announce.event(node, "FaultlineEvictionBlocked", key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; left alone", waited as u64), true, &record.devices).await;
                record.evicted.push(key.to_string());
                Ok(PodEviction::GivenUp)
            }
            Blocked::Delete => {
                // Explicitly configured: past the deadline the pod is deleted (with its
                // grace period), its budget notwithstanding.
                match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
                audit("delete", node, &record.devices, &self.actor, key);
                self.announce.metric("evict", "deleted");
                record.eviction_blocked.remove(key);
                record.evicted.push(key.to_string());
                record.act(
                    format!("delete {ns}/{name} (budget refused past the deadline)"),
                    &now_rfc3339(),
                    &self.actor,
                );
                self.announce.event(node, "FaultlinePodDeleted", key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; deleted (--force-delete-after-deadline)", waited as u64), true, &record.devices).await;
                self.announce.pod_event(pod, &record.devices).await;
                Ok(PodEviction::Deleted)
            }
        }
    }
}
