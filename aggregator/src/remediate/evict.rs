//! Eviction: the pods on a quarantined node that use a failed device leave through the
//! Eviction API, so PodDisruptionBudgets hold. Each pod at most once per fault (the
//! record on the Node remembers), never DaemonSet, mirror, finished or terminating pods
//! (`policy::wants_eviction`). Within the eviction rate and the breaker.
//!
//! What an answer means (pkg/registry/core/pod/storage/eviction.go):
//! - 201 or 404: gone; 409: the uid precondition failed, the name is another pod's
//!   now (the pod judged is gone: never the new one evicted);
//! - 429 with the cause `DisruptionBudget`: a budget refuses; retried by later passes
//!   until `--eviction-deadline`, then announced and left (or deleted, with
//!   `--force-delete-after-deadline`);
//! - 429 without that cause: API Priority and Fairness is shedding load; nothing more is
//!   asked this pass, and the deadline does not start;
//! - anything else (500 for two budgets, 403 from RBAC, ...): recorded against that pod
//!   with the reason and announced; the pass goes on with the other pods.
//!
//! The record is written at the end with a test of the Node's resourceVersion; when the
//! Node changed meanwhile (the kubelet updates its status every few seconds) the pass
//! reads it again and carries its changes over, a few times at most.

use std::time::Duration;

use faultline_common::fault::DrainNotice;
use faultline_common::time::rfc3339_ms;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

use super::announce::audit;
use super::drain::{acknowledged, drain_step, notice, DrainStep, Drained};
use super::error::RemediateError;
use super::grace::NamespaceGraces;
use super::patch::NodePatch;
use super::policy::{
    blocked, breaker_stops, record_evicts, wants_device_eviction, Blocked, Mode, Step,
};
use super::record::{describe, LiveNode, QuarantineRecord};
use super::remediator::Remediator;
use super::view::PodView;
use crate::metrics::{Action, ActionResult};
use crate::shard::Fence;

/// Record writes tried at most when the Node keeps changing under the pass.
const RECORD_WRITE_ATTEMPTS: usize = 4;

/// What an eviction pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Evictions {
    /// Evicted now.
    pub evicted: Vec<String>,
    /// Refused by a budget (429), past the eviction rate, or not asked because the API
    /// is shedding load: to retry.
    pub blocked: Vec<String>,
    /// Refused past the deadline: announced and left alone.
    pub given_up: Vec<String>,
    /// Failed otherwise (recorded with the reason): to retry.
    pub failed: Vec<String>,
    /// Warned and not evicted yet: waiting for their acknowledgement or
    /// deadline.
    pub draining: Vec<String>,
    /// The node's drain intents as they stand after the pass, to publish (`None`: the
    /// pass did not look, and what is published stays).
    pub drains: Option<Vec<DrainNotice>>,
    /// When the next intent falls due (ms, on the remediator's clock): the node's pass
    /// must run again then.
    pub wake_ms: Option<u64>,
    /// How the node's quarantined devices are kept from new work, for `fault.json`
    /// (`None`: the pass did not look).
    pub marks: Option<Vec<(String, faultline_common::fault::QuarantineMark)>>,
}

/// How one pod's eviction went.
enum PodEviction {
    /// Gone (evicted now, or already): record it.
    Evicted,
    /// Deleted past the deadline: recorded already.
    Deleted,
    /// Refused by its budget: to retry.
    Blocked,
    /// Refused past the deadline and left: recorded already.
    GivenUp,
    /// API Priority and Fairness refused the request: stop asking this pass.
    Throttled,
    /// Failed otherwise: recorded already.
    Failed,
}

/// A pod's namespace, name and record key (`namespace/name/uid`: each pod at most once
/// per fault, a new pod of the same name is another).
pub(super) fn pod_key(pod: &Pod) -> Option<(&str, &str, String)> {
    let (name, ns) = (
        pod.metadata.name.as_deref()?,
        pod.metadata.namespace.as_deref()?,
    );
    let key = format!("{ns}/{name}/{}", pod.metadata.uid.as_deref().unwrap_or(""));
    Some((ns, name, key))
}

/// Whether a 429 is a disruption budget's (the Status names the cause), not API
/// Priority and Fairness shedding load.
fn is_budget_refusal(e: &kube::core::Status) -> bool {
    e.details
        .as_ref()
        .is_some_and(|d| d.causes.iter().any(|c| c.reason == "DisruptionBudget"))
}

impl Remediator {
    /// The pods of `node`, from the watch cache (resourceVersion=0): a node being
    /// remediated is tainted, so no new pod lands there, and a pod the cache has not
    /// seen yet waits for the next pass.
    pub(super) async fn pods_on(&self, node: &str) -> Result<Vec<Pod>, RemediateError> {
        let all: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default()
            .match_any()
            .fields(&format!("spec.nodeName={node}"));
        Ok(all.list(&lp).await?.items)
    }

    /// Whether `pod` still runs, by a consistent read (not the watch cache): there,
    /// the same pod (its uid), neither terminating nor finished.
    async fn still_runs(&self, pod: &Pod) -> Result<bool, RemediateError> {
        let (Some(name), Some(ns)) = (&pod.metadata.name, &pod.metadata.namespace) else {
            return Ok(false);
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let Some(now) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let view = PodView::of(&now, &self.resources);
        Ok(now.metadata.uid == pod.metadata.uid && !view.terminating && !view.finished)
    }

    /// Evict the pods on `node` that use a failed device (see the module); a pod that
    /// asked for time to checkpoint is warned first (`drain.rs`), and evicted once
    /// `acks` (pod UID, the intent's `requested`) answer its intent or its deadline
    /// passed.
    pub async fn evict(
        &self,
        node: &str,
        acks: &[(String, String)],
        fence: &Fence,
    ) -> Result<Evictions, RemediateError> {
        let mut out = Evictions::default();
        if self.mode == Mode::Off || (breaker_stops(Step::Evict) && self.breaker_open().await?) {
            return Ok(out);
        }
        let live = self.read(node).await?;
        out.drains = Some(Vec::new());
        out.marks = Some(
            live.record
                .as_ref()
                .map(QuarantineRecord::marks)
                .unwrap_or_default(),
        );
        let Some(before) = live
            .record
            .clone()
            .filter(|r| record_evicts(r.unknown_only))
        else {
            return Ok(out);
        };
        if self.mode == Mode::DryRun {
            self.would_evict(node, &before.devices).await?;
            return Ok(out);
        }
        let mut record = before.clone();
        let pods = self.pods_on(node).await?;
        // DRA pods hold their devices through claims.
        let claimed = self.dra_holders_or_none(node, &pods, &record).await;
        let device_scoped = !record.node_scoped();
        let targets: Vec<&Pod> = pods
            .iter()
            .filter(|p| {
                let holds = p.metadata.uid.as_ref().is_some_and(|u| claimed.contains(u));
                wants_device_eviction(
                    &PodView::of(p, &self.resources),
                    &record.devices,
                    holds,
                    device_scoped,
                )
            })
            .collect();
        let mut touched = Vec::new();
        self.drains_left(node, &targets, &mut record, &mut touched);
        let mut throttled = false;
        let mut namespaces = NamespaceGraces::default();
        for pod in targets {
            let Some((ns, name, key)) = pod_key(pod) else {
                continue;
            };
            if record.evicted.contains(&key) {
                continue;
            }
            if !fence.holds() {
                return Err(RemediateError::NotHolder);
            }
            // The pods came from the watch cache, which may lag: a pod evicted by an
            // earlier pass whose record was not written (its hold ended first, the
            // write failed) can still be listed there as running. A consistent read
            // decides, so no pod is asked twice.
            if !self.still_runs(pod).await? {
                record.evicted.push(key.clone());
                record.act(
                    format!("{ns}/{name} gone before its eviction"),
                    &self.clock.rfc3339(),
                    &self.actor,
                );
                touched.push(key);
                continue;
            }
            let drained = match self
                .drain_step(node, pod, &key, acks, &mut record, &mut namespaces)
                .await
            {
                Ok(d) => d,
                Err(at) => {
                    // Woken at the deadline (the earliest of the pass's decisions: one
                    // that passes while the pass runs is still woken for).
                    out.wake_ms = Some(out.wake_ms.map_or(at, |w| w.min(at)));
                    touched.push(key.clone());
                    out.draining.push(key);
                    continue;
                }
            };
            // Past the eviction rate, or while the API sheds load, the pod waits for a
            // later pass.
            if throttled || !self.rate.take() {
                out.blocked.push(key);
                continue;
            }
            touched.push(key.clone());
            let outcome = self.evict_pod(node, pod, &key, &mut record, fence).await?;
            // Given up or deleted past the budget's deadline: its intent ends too.
            if record.evicted.contains(&key) {
                record.drains.remove(&key);
            }
            match outcome {
                PodEviction::Evicted => {
                    audit("evict", node, &record.devices, &self.actor, &key);
                    record.eviction_blocked.remove(&key);
                    record.eviction_failed.remove(&key);
                    record.evicted.push(key.clone());
                    let why = match drained {
                        Drained::NoGrace => String::new(),
                        d => {
                            record.drains.remove(&key);
                            self.announce.metric(Action::Drain, d.result());
                            format!(" (drain intent {})", d.as_str())
                        }
                    };
                    record.act(
                        format!("evict {ns}/{name}{why}"),
                        &self.clock.rfc3339(),
                        &self.actor,
                    );
                    self.announce.metric(Action::Evict, ActionResult::Ok);
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
                PodEviction::Deleted => out.evicted.push(key),
                PodEviction::Blocked => out.blocked.push(key),
                PodEviction::GivenUp => out.given_up.push(key),
                PodEviction::Throttled => {
                    throttled = true;
                    out.blocked.push(key);
                }
                PodEviction::Failed => out.failed.push(key),
            }
        }
        out.drains = Some(record.drains.values().cloned().collect());
        if record != before {
            self.write_eviction_record(&live, &before, record, &touched, fence)
                .await?;
        }
        Ok(out)
    }

    /// Intents of pods no longer on the failed device (they exited, finished or were
    /// deleted): they acknowledged by leaving; the intent goes.
    fn drains_left(
        &self,
        node: &str,
        targets: &[&Pod],
        record: &mut QuarantineRecord,
        touched: &mut Vec<String>,
    ) {
        let here: Vec<String> = targets
            .iter()
            .filter_map(|p| pod_key(p))
            .map(|k| k.2)
            .collect();
        let gone: Vec<String> = record
            .drains
            .keys()
            .filter(|k| !here.contains(k))
            .cloned()
            .collect();
        for key in gone {
            record.drains.remove(&key);
            self.announce.metric(Action::Drain, ActionResult::Left);
            tracing::info!(node, pod = %key, "drain intent ended: the pod left before its eviction");
            record.act(
                format!("drain {key}: the pod left"),
                &self.clock.rfc3339(),
                &self.actor,
            );
            touched.push(key);
        }
    }

    /// Whether to evict `pod` now (and why), or the time (ms) it waits until: it was
    /// warned and waits for its acknowledgement or deadline (a new intent is recorded
    /// and announced here).
    async fn drain_step(
        &self,
        node: &str,
        pod: &Pod,
        key: &str,
        acks: &[(String, String)],
        record: &mut QuarantineRecord,
        namespaces: &mut NamespaceGraces,
    ) -> Result<Drained, u64> {
        let now = self.clock.now_ms();
        let held = record.drains.get(key);
        let intent =
            held.map(|n| faultline_common::time::parse_rfc3339_ms(&n.evict_after).unwrap_or(0));
        // An acknowledgement answers one intent (its `requested`), never a later one
        // for the same pod; once recorded it stands (the agent keeps only the latest).
        let acked = held.is_some_and(|n| acknowledged(n, acks));
        // Asked once per pod: one whose eviction was already tried without an intent (a
        // budget refused it, or it failed) stays without one, and costs no namespace
        // read on every later pass.
        let tried =
            record.eviction_blocked.contains_key(key) || record.eviction_failed.contains_key(key);
        let grace = if intent.is_some() || tried {
            std::time::Duration::ZERO
        } else {
            match self.grace_of(pod, namespaces).await {
                Ok(g) => g,
                Err(why) => {
                    self.announce.metric(Action::Drain, ActionResult::Invalid);
                    self.announce
                        .pod_note(
                            pod,
                            "FaultlineBadCheckpointGrace",
                            "bad-grace",
                            format!("{why}: evicted without a warning"),
                        )
                        .await;
                    std::time::Duration::ZERO
                }
            }
        };
        match drain_step(grace, intent, acked, now) {
            DrainStep::Evict(d) => {
                if let Some(n) = record.drains.get_mut(key).filter(|_| acked) {
                    n.acknowledged.get_or_insert_with(|| rfc3339_ms(now));
                }
                Ok(d)
            }
            DrainStep::Wait(at) => Err(at),
            DrainStep::Request(at) => {
                // The reasons as fault.json gives them (`npus[].reason`).
                let mut reasons: Vec<String> =
                    record.devices.iter().map(|d| d.reason.clone()).collect();
                reasons.sort_unstable();
                reasons.dedup();
                let n = notice(
                    pod,
                    record.devices.iter().map(|d| d.id.clone()).collect(),
                    reasons,
                    now,
                    at,
                );
                let message = format!(
                    "checkpoint now: evicted at {} at the latest, at once when acknowledged ({}); from a failed device: {}",
                    n.evict_after,
                    "exit, or POST /v1/drain/ack to the node's agent",
                    describe(&record.devices)
                );
                audit("drain-intent", node, &record.devices, &self.actor, key);
                record.act(
                    format!("drain {key} until {}", n.evict_after),
                    &rfc3339_ms(now),
                    &self.actor,
                );
                record.drains.insert(key.to_string(), n);
                self.announce.metric(Action::Drain, ActionResult::Ok);
                self.announce
                    .pod_note(pod, "FaultlineDrainRequested", "drain", message.clone())
                    .await;
                self.announce
                    .event(
                        node,
                        "FaultlineDrainRequested",
                        key,
                        format!("{key}: {message}"),
                        true,
                        &record.devices,
                    )
                    .await;
                Err(at)
            }
        }
    }

    /// Write the record of an eviction pass, testing the Node's resourceVersion; when
    /// the Node changed meanwhile, read it again and carry the pass's changes over.
    async fn write_eviction_record(
        &self,
        live: &LiveNode,
        before: &QuarantineRecord,
        ours: QuarantineRecord,
        touched: &[String],
        fence: &Fence,
    ) -> Result<(), RemediateError> {
        let node = live.name.as_str();
        let (mut on, mut record) = (live.node.clone(), ours.clone());
        let mut attempt = 1;
        loop {
            let mut patch = NodePatch::on(&on);
            patch.record(&record);
            match self.apply(node, patch, fence).await {
                Ok(()) => return Ok(()),
                Err(RemediateError::Api(kube::Error::Api(e)))
                    if (e.code == 409 || e.code == 422) && attempt < RECORD_WRITE_ATTEMPTS =>
                {
                    attempt += 1;
                    self.announce.metric(Action::Record, ActionResult::Retried);
                    let fresh = self.read(node).await?;
                    let Some(mut now) = fresh.record.clone() else {
                        // Released meanwhile: nothing left to record against.
                        return Ok(());
                    };
                    now.merge_eviction_pass(before, &ours, touched);
                    (on, record) = (fresh.node, now);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Ask the Eviction API for one pod; on a budget's refusal, apply the deadline.
    async fn evict_pod(
        &self,
        node: &str,
        pod: &Pod,
        key: &str,
        record: &mut QuarantineRecord,
        fence: &Fence,
    ) -> Result<PodEviction, RemediateError> {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        // Only the pod judged, by its uid: an eviction that lands late (past the
        // Lease's hold, a slow API) must not evict the pod made since under the same
        // name (a StatefulSet's), which may hold a healthy GPU elsewhere. Written out:
        // kube's `EvictParams` sends its delete options as `delete_options`, a field
        // the API server does not know and drops.
        let eviction = serde_json::json!({
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": name, "namespace": ns},
            "deleteOptions": {"preconditions": {"uid": pod.metadata.uid}},
        });
        // Sent while the shard's hold stands, given up when it ends.
        let sent: Result<serde_json::Value, _> = fence
            .write(api.create_subresource("eviction", name, &PostParams::default(), &eviction))
            .await?;
        match sent {
            Ok(_) => return Ok(PodEviction::Evicted),
            // Gone, or replaced by another pod of the name (409: "The object might have
            // been deleted and then recreated"): the pod judged is gone either way.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {
                return Ok(PodEviction::Evicted)
            }
            Err(kube::Error::Api(e)) if e.code == 429 && is_budget_refusal(&e) => {}
            Err(kube::Error::Api(e)) if e.code == 429 => {
                self.announce.metric(Action::Evict, ActionResult::Throttled);
                tracing::info!(node, pod = %key, message = %e.message, "the API is shedding load: evictions wait for the next pass");
                return Ok(PodEviction::Throttled);
            }
            Err(kube::Error::Api(e)) => {
                let why = format!("HTTP {}: {}", e.code, e.message);
                return Ok(self.eviction_failed(node, key, why, e.code, record).await);
            }
            // No answer (a timeout, a reset): the next pass asks again.
            Err(e) => return Err(e.into()),
        }
        let since = record
            .eviction_blocked
            .entry(key.to_string())
            .or_insert_with(|| self.clock.rfc3339())
            .clone();
        record.eviction_failed.remove(key);
        let waited = self.clock.age_secs(&since).unwrap_or(0.0).max(0.0);
        match blocked(
            Duration::from_secs_f64(waited),
            self.eviction_deadline,
            self.force_delete,
        ) {
            Blocked::Retry => Ok(PodEviction::Blocked),
            Blocked::GiveUp => {
                self.announce.metric(Action::Evict, ActionResult::GivenUp);
                self.announce.event(node, "FaultlineEvictionBlocked", key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; left alone", waited as u64), true, &record.devices).await;
                record.evicted.push(key.to_string());
                Ok(PodEviction::GivenUp)
            }
            Blocked::Delete => {
                // Explicitly configured: past the deadline the pod is deleted (with its
                // grace period), its budget notwithstanding.
                // Only the pod judged (its uid), as the eviction.
                let dp = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: pod.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                match fence.write(api.delete(name, &dp)).await? {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
                audit("delete", node, &record.devices, &self.actor, key);
                self.announce.metric(Action::Evict, ActionResult::Deleted);
                record.eviction_blocked.remove(key);
                record.evicted.push(key.to_string());
                record.act(
                    format!("delete {ns}/{name} (budget refused past the deadline)"),
                    &self.clock.rfc3339(),
                    &self.actor,
                );
                self.announce.event(node, "FaultlinePodDeleted", key, format!("{ns}/{name}: its disruption budget refused eviction for {}s; deleted (--force-delete-after-deadline)", waited as u64), true, &record.devices).await;
                self.announce.pod_event(pod, &record.devices).await;
                Ok(PodEviction::Deleted)
            }
        }
    }

    /// Record a pod's failed eviction with its reason and announce it once per code.
    async fn eviction_failed(
        &self,
        node: &str,
        key: &str,
        why: String,
        code: u16,
        record: &mut QuarantineRecord,
    ) -> PodEviction {
        self.announce.metric(Action::Evict, ActionResult::Failed);
        tracing::warn!(node, pod = %key, %why, "eviction failed; the next pass retries");
        self.announce
            .event(
                node,
                "FaultlineEvictionFailed",
                &format!("{key}/{code}"),
                format!("{key}: eviction failed ({why}); retried by the next pass"),
                true,
                &record.devices,
            )
            .await;
        record.eviction_failed.insert(key.to_string(), why);
        PodEviction::Failed
    }
}
