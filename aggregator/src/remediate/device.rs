//! The device path of isolation: a failed GPU is kept from new work by its
//! own DeviceTaintRule (DRA), or by the device plugin that already took it out of the
//! node's allocatable, and the node's other devices stay schedulable. The node path
//! (`isolate.rs`) takes over for the node's own faults, for `node_after_devices` failed
//! devices, and wherever no device can be isolated alone (`device_taint::scope`).
//!
//! A rule is proposed with effect `None` first; the device-taint eviction controller
//! reports what `NoExecute` would evict, and only when that equals faultline's own count
//! of the pods holding the device (their claims, counted as the controller counts:
//! `device_taint::would_be_evicted`) is the effect switched to `NoSchedule`. The
//! prediction is written once per generation of the rule: on a disagreement the pass
//! asks once for a fresh one (`Dra::resimulate`). A disagreement that stands is
//! announced and acted on neither way. The record on
//! the Node (no taint) lists the rules, so evictions, releases and `describe` work as
//! on the node path. Budgets: new device quarantines ask the device budget (faultline's
//! rules, counted cluster-wide), the breaker and dry-run apply as for nodes.

use std::collections::BTreeSet;

use faultline_common::sync::Locked;
use k8s_openapi::api::core::v1::Pod;

use super::announce::audit;
use super::error::{quarantine_error, Outcome, RemediateError};
use super::patch::NodePatch;
use super::policy::Mode;
use super::prediction::created_ms;
use super::record::{
    describe, fingerprint, label_value, DeviceIsolation, DeviceRule, LiveNode, QuarantineRecord,
    DEVICES_LABEL, SCOPE_LABEL,
};
use super::remediator::Remediator;
use crate::device_taint::{
    holders, is_ours, node_fault, plugin_scope, rejecting, rejections, rule_name, scope,
    taint_value, taken_out, tolerates_forever, Backend, Dra, Effect, Failed, NodeWhy, PluginScope,
    Prediction, QuarantineError, Scope, REJECTION_WINDOW_MS, TAINT_KEY,
};
use crate::metrics::{Action, ActionResult};
use crate::model::RecordDevice;
use crate::shard::Fence;

/// Where isolation goes on from the device path.
pub(super) enum DevicePath {
    /// Done on the device path.
    Done(Outcome),
    /// The node path, and why (none: no device path was looked for).
    Node(Option<NodeWhy>),
}

/// The finding codes of a record device, as the rules file's node faults name them: its
/// reasons, and its NVML recovery action as `recovery-<action>`.
fn codes(d: &RecordDevice) -> Vec<String> {
    let mut c: Vec<String> = d
        .reason
        .split(',')
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty())
        .collect();
    if let Some(a) = d.recovery_action {
        c.push(format!("recovery-{}", a.as_str()));
    }
    c
}

impl Remediator {
    /// The DRA reader/writer of this cluster as it stands, if the device path is on.
    pub(super) fn dra(&self) -> Option<Dra> {
        let q = self.devices.as_ref()?;
        let api = q.api.locked().clone();
        let dra = Dra::maybe(self.client.clone(), api, q.drivers.clone());
        Some(dra.remembering(q.missing_claims.clone()))
    }

    /// The device path for `devices` (all failed) of `live`, when it applies.
    pub(super) async fn isolate_devices(
        &self,
        live: &LiveNode,
        existing: Option<&QuarantineRecord>,
        devices: &[RecordDevice],
        fence: &Fence,
    ) -> Result<DevicePath, RemediateError> {
        let (Some(q), Some(dra)) = (&self.devices, self.dra()) else {
            return Ok(DevicePath::Node(None));
        };
        // A node on the node path stays there until released.
        if existing.is_some_and(|r| r.node_scoped()) {
            return Ok(DevicePath::Node(None));
        }
        let rules = q.rules.borrow().clone();
        // A node whose kubelet keeps refusing pods for lack of devices: the node's.
        let pods = self.pods_on(&live.name).await?;
        let refused = rejections(&pods, self.clock.now_ms(), REJECTION_WINDOW_MS);
        if let Some(why) = rejecting(&rules, refused) {
            return Ok(DevicePath::Node(Some(why)));
        }
        let codes: Vec<Vec<String>> = devices.iter().map(codes).collect();
        let failed: Vec<Failed<'_>> = devices
            .iter()
            .zip(&codes)
            .map(|(d, c)| Failed {
                id: d.uuid.as_deref().unwrap_or(&d.id),
                reasons: c,
            })
            .collect();
        let with_rules = dra.has_rules() && q.backend != Backend::DevicePlugin;
        let index = if with_rules && node_fault(&rules, &failed).is_none() {
            match dra.index_node(&live.name).await {
                Ok(ix) => ix,
                Err(e) => return Ok(self.unreadable(&live.name, e)),
            }
        } else {
            Default::default()
        };
        match scope(&rules, &failed, with_rules, |id| {
            index.by_uuid(id).is_some()
        }) {
            Scope::Devices => {
                let mut picked = Vec::new();
                for (d, f) in devices.iter().zip(&failed) {
                    if let Some(ix) = index.by_uuid(f.id) {
                        // The GPU, and every MIG partition carved from it: each is
                        // allocatable on its own, and each fails with it.
                        let whole = std::iter::once((f.id.to_string(), ix));
                        let parts = index
                            .partitions_of(f.id)
                            .iter()
                            .map(|(u, p)| (u.clone(), p));
                        for (uuid, ix) in whole.chain(parts) {
                            picked.push(DeviceRule {
                                id: d.id.clone(),
                                uuid,
                                driver: ix.device.driver.clone(),
                                pool: ix.device.pool.clone(),
                                device: ix.device.device.clone(),
                                rule: rule_name(&ix.device),
                                effect: Effect::None.as_str().into(),
                                predicted: None,
                            });
                        }
                    }
                }
                // A rule of another owner under faultline's name is never touched.
                for r in &picked {
                    let rule = match dra.rule(&r.device_ref()).await {
                        Ok(rule) => rule,
                        Err(e) => return Ok(self.unreadable(&live.name, e)),
                    };
                    if rule.as_ref().is_some_and(|o| !is_ours(o)) {
                        let why = NodeWhy::ForeignRule {
                            device: r.id.clone(),
                            rule: r.rule.clone(),
                        };
                        return Ok(DevicePath::Node(Some(why)));
                    }
                }
                match self
                    .isolate_rules(live, existing, devices, picked, (&dra, &pods), fence)
                    .await
                {
                    // A cluster that has no effect None (1.33, 1.34): the node path,
                    // said in the record's reason and counted.
                    Err(RemediateError::RuleRefused { device, why }) => {
                        tracing::warn!(node = %live.name, %device, %why, "the API server refused the proposed DeviceTaintRule: the node path");
                        if let Some(m) = self.announce.metrics() {
                            m.remediation_error("dra");
                        }
                        Ok(DevicePath::Node(Some(NodeWhy::RuleRefused { device, why })))
                    }
                    // No agreement by the deadline: the rules are gone, the node path,
                    // said in the record's reason and the Event, and counted.
                    Err(RemediateError::NoAgreement { device, rule, why }) => {
                        tracing::warn!(node = %live.name, %device, %rule, %why, "no agreement on the device's rule by its deadline: the node path");
                        self.announce
                            .metric(Action::QuarantineDevice, ActionResult::GivenUp);
                        Ok(DevicePath::Node(Some(NodeWhy::NoAgreement {
                            device,
                            rule,
                            why,
                        })))
                    }
                    r => r.map(DevicePath::Done),
                }
            }
            // `dra`: no rule can select it, and the plugin's isolation is not taken.
            Scope::Node(why @ (NodeWhy::NoDeviceApi | NodeWhy::NotPublished { .. }))
                if q.backend == Backend::Dra =>
            {
                Ok(DevicePath::Node(Some(why)))
            }
            Scope::Node(why @ (NodeWhy::NoDeviceApi | NodeWhy::NotPublished { .. })) => {
                // No rule can select it: the device plugin's own isolation, if it took
                // the devices out already.
                let Some(resource) = self.accelerator_resource(live) else {
                    return Ok(DevicePath::Node(Some(why)));
                };
                // Huawei's device plugin separated every failed chip for good already.
                if q.ascend_device_info && node_fault(&rules, &failed).is_none() {
                    if let Some(message) = self
                        .separated_by_plugin(live, existing, &resource, devices)
                        .await
                    {
                        let isolation = DeviceIsolation::ManuallySeparateNpu { resource };
                        return self
                            .record_device_isolation(
                                live, existing, devices, isolation, message, fence,
                            )
                            .await
                            .map(DevicePath::Done);
                    }
                }
                match plugin_scope(&rules, &failed, taken_out(&live.node, &resource)) {
                    PluginScope::AlreadyOut { taken_out } => {
                        let isolation = DeviceIsolation::DevicePlugin {
                            resource: resource.clone(),
                            taken_out,
                        };
                        let message = format!(
                            "the device plugin took {taken_out} {resource} out of the node's allocatable; that stands, the node is not tainted"
                        );
                        self.record_device_isolation(
                            live, existing, devices, isolation, message, fence,
                        )
                        .await
                        .map(DevicePath::Done)
                    }
                    PluginScope::Node(why) => Ok(DevicePath::Node(Some(why))),
                }
            }
            Scope::Node(why) => Ok(DevicePath::Node(Some(why))),
        }
    }

    /// A DRA read failed before anything was written: the node path, as before the
    /// device path (a cluster whose RBAC lacks `resource.k8s.io` keeps working), logged
    /// and counted (`remediation_errors_total{kind="dra"}`).
    fn unreadable(&self, node: &str, e: QuarantineError) -> DevicePath {
        tracing::warn!(node, error = %e, "cannot read the node's DRA devices or rules: the node path");
        if let Some(m) = self.announce.metrics() {
            m.remediation_error("dra");
        }
        DevicePath::Node(Some(NodeWhy::Unreadable { why: e.to_string() }))
    }

    /// [`Remediator::dra_holders`], an error logged and counted and taken as none: an
    /// eviction pass goes on with the pods the kubelet says hold the devices.
    pub(super) async fn dra_holders_or_none(
        &self,
        node: &str,
        pods: &[Pod],
        record: &QuarantineRecord,
    ) -> BTreeSet<String> {
        match self.dra_holders(node, pods, record).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(node, error = %e, "cannot read the claims of the node's pods: DRA holders not evicted this pass");
                if let Some(m) = self.announce.metrics() {
                    m.remediation_error("dra");
                }
                BTreeSet::new()
            }
        }
    }

    /// The accelerator resource the Node offers (capacity), of those looked for.
    fn accelerator_resource(&self, live: &LiveNode) -> Option<String> {
        let capacity = live.node.status.as_ref()?.capacity.as_ref()?;
        self.resources
            .iter()
            .find(|r| capacity.contains_key(r.as_str()))
            .cloned()
    }

    /// Quarantine `picked` (one rule each): propose, judge, enforce, record.
    async fn isolate_rules(
        &self,
        live: &LiveNode,
        existing: Option<&QuarantineRecord>,
        devices: &[RecordDevice],
        mut picked: Vec<DeviceRule>,
        (dra, pods): (&Dra, &[Pod]),
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let q = self.devices.as_ref().expect("the device path is on");
        let node = live.name.as_str();
        let known: Vec<&DeviceRule> = existing
            .map(|r| r.rules().iter().collect())
            .unwrap_or_default();
        let enforced = |r: &DeviceRule| {
            known
                .iter()
                .any(|k| k.rule == r.rule && k.effect != Effect::None.as_str())
        };
        if picked.iter().all(enforced) && existing.is_some() {
            return Ok(Outcome::AlreadyDone);
        }
        let new: usize = picked
            .iter()
            .filter(|r| !known.iter().any(|k| k.rule == r.rule))
            .count();
        let _budget_turn = if new > 0 && self.mode == Mode::Enforce {
            let turn = self.budget.turn().await;
            let now = self.ours_swept(dra).await?;
            if now + new > q.max_devices {
                let why = format!(
                    "device budget: {now} devices quarantined alone, at most {}",
                    q.max_devices
                );
                return self
                    .hold_back(node, why, devices, Action::QuarantineDevice)
                    .await;
            }
            Some(turn)
        } else {
            None
        };
        let names = picked
            .iter()
            .map(|r| format!("{} ({}, DeviceTaintRule {})", r.id, r.device, r.rule))
            .collect::<Vec<_>>()
            .join(", ");
        if !fence.holds() {
            return Err(RemediateError::NotHolder);
        }
        if self.mode == Mode::DryRun {
            let what = format!(
                "taint {names} with effect {} ({}); the node's other devices stay schedulable",
                q.effect.as_str(),
                describe(devices)
            );
            return Ok(self.would_quarantine_device(node, devices, what).await);
        }
        let claims = dra.claims_of(pods).await.map_err(quarantine_error)?;
        let (sequence, shard) = (self.sequence_hint(), fence.shard_id().unwrap_or(0));
        let mut waiting = Vec::new();
        // The first rule past its deadline, and why; the last judgement's words.
        let mut overdue: Option<(String, String, String)> = None;
        let mut last = String::new();
        for r in &mut picked {
            let d = devices.iter().find(|d| d.id == r.id);
            let reason = d.map(|d| d.reason.as_str()).unwrap_or("failed");
            let dev = r.device_ref();
            let proposed = fence
                .write(dra.propose(&dev, &r.uuid, reason, sequence, shard))
                .await?;
            let rule = match proposed {
                Ok(rule) => rule,
                Err(QuarantineError::Api(kube::Error::Api(s))) if s.code == 422 => {
                    return Err(RemediateError::RuleRefused {
                        device: r.id.clone(),
                        why: s.message,
                    })
                }
                Err(e) => return Err(quarantine_error(e)),
            };
            let effect = rule["spec"]["taint"]["effect"]
                .as_str()
                .unwrap_or("None")
                .to_string();
            if effect != Effect::None.as_str() {
                r.effect = effect;
                continue;
            }
            // When it was proposed (a rule of an earlier pass keeps its first time).
            let proposed_ms = created_ms(&rule);
            let verdict = self
                .prediction(dra, rule, &dev, (&claims, pods), q.prediction_wait, fence)
                .await?;
            match verdict {
                Prediction::Agrees(n) => {
                    fence
                        .write(dra.enforce(&dev, q.effect))
                        .await?
                        .map_err(quarantine_error)?;
                    r.effect = q.effect.as_str().into();
                    r.predicted = Some(n);
                }
                Prediction::Disagrees {
                    controller,
                    faultline,
                } => {
                    last = format!("the controller would evict {controller} pods, faultline counts {faultline} holding it");
                    self.announce
                        .metric(Action::QuarantineDevice, ActionResult::Disagreed);
                    self.announce.event(node, "FaultlineDevicePredictionDisagrees", &format!("{}/{controller}/{faultline}", r.rule),
                        format!("{} ({}): the device-taint controller would evict {controller} pods, faultline counts {faultline} holding it; neither acted on (DeviceTaintRule {} stays at effect None)", r.id, r.device, r.rule),
                        true, devices).await;
                    waiting.push(r.rule.clone());
                }
                Prediction::Pending => {
                    last = "no prediction (the controller does not run, or wrote none for this generation)".into();
                    waiting.push(r.rule.clone());
                }
                // Never guessed at: the node path now, not at the deadline.
                Prediction::Unreadable(words) => {
                    waiting.push(r.rule.clone());
                    let why = format!("the controller's prediction cannot be read: {words:?}");
                    overdue.get_or_insert((r.id.clone(), r.rule.clone(), why));
                }
            }
            let age_ms = proposed_ms.map(|p| self.clock.now_ms().saturating_sub(p));
            if waiting.last() == Some(&r.rule)
                && age_ms.is_some_and(|a| a >= q.prediction_deadline.as_millis() as u64)
            {
                overdue.get_or_insert((
                    r.id.clone(),
                    r.rule.clone(),
                    format!(
                        "still none {:?} after the proposal: {last}",
                        q.prediction_deadline
                    ),
                ));
            }
        }
        if let Some((device, rule, why)) = overdue {
            // No rule is left without an owner: every rule of this pass that no record
            // holds goes, at None or enforced by it (the node path taints the whole
            // node; faultline evicts, never the rule at NoSchedule).
            let recorded = |r: &DeviceRule| known.iter().any(|k| k.rule == r.rule);
            for r in picked.iter().filter(|r| !recorded(r)) {
                match fence.write(dra.release(&r.device_ref())).await? {
                    Ok(_) | Err(QuarantineError::NotOurs(_)) => {}
                    Err(e) => return Err(quarantine_error(e)),
                }
            }
            return Err(RemediateError::NoAgreement { device, rule, why });
        }
        picked.retain(|r| !waiting.contains(&r.rule));
        if picked.is_empty() {
            return Ok(Outcome::Waiting(format!(
                "DeviceTaintRule {} at effect None: the controller's prediction is awaited or disagrees",
                waiting.join(", ")
            )));
        }
        let mut rules: Vec<DeviceRule> = known.into_iter().cloned().collect();
        for r in &picked {
            rules.retain(|k| k.rule != r.rule);
            rules.push(r.clone());
        }
        let isolated: Vec<RecordDevice> = devices
            .iter()
            .filter(|d| rules.iter().any(|r| r.id == d.id))
            .cloned()
            .collect();
        let message = format!(
            "quarantined {names} with effect {}; the node's other devices stay schedulable",
            q.effect.as_str()
        );
        let isolation = DeviceIsolation::DeviceTaintRule { rules };
        self.record_device_isolation(live, existing, &isolated, isolation, message, fence)
            .await
    }

    /// Write the record of a device isolation (no taint): devices, how, the devices
    /// label, the condition, an Event naming the devices.
    async fn record_device_isolation(
        &self,
        live: &LiveNode,
        existing: Option<&QuarantineRecord>,
        devices: &[RecordDevice],
        isolation: DeviceIsolation,
        message: String,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let node = live.name.as_str();
        if self.mode == Mode::DryRun {
            let what = format!(
                "record {} without tainting the node: {message}",
                describe(devices)
            );
            return Ok(self.would_quarantine_device(node, devices, what).await);
        }
        let fp = fingerprint(node, devices);
        if existing.is_some_and(|r| r.fingerprint == fp && r.isolation.as_ref() == Some(&isolation))
        {
            return Ok(Outcome::AlreadyDone);
        }
        let now = self.clock.rfc3339();
        let mut record = existing
            .cloned()
            .unwrap_or_else(|| self.new_record(node, vec![], &now));
        record.devices = devices.to_vec();
        record.fingerprint = fp;
        record.last_seen = now.clone();
        record.isolation = Some(isolation);
        record.act(format!("quarantine-device: {message}"), &now, &self.actor);
        let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        let mut patch = NodePatch::on(&live.node);
        let value = label_value(&ids);
        if record.owned_label || !live.has_label(DEVICES_LABEL) {
            patch.label(DEVICES_LABEL, &value);
            record.owned_label = true;
        }
        patch.label(SCOPE_LABEL, "device");
        patch.record(&record);
        self.apply(node, patch, fence).await?;
        let summary = format!("{} failed on {node}: {message}", describe(devices));
        self.condition(
            node,
            (false, "DeviceQuarantined"),
            summary.clone(),
            &now,
            fence,
        )
        .await?;
        self.held_back.release(node);
        self.announce
            .metric(Action::QuarantineDevice, ActionResult::Ok);
        audit("quarantine-device", node, devices, &self.actor, &message);
        self.announce
            .event(
                node,
                "FaultlineDeviceQuarantined",
                &format!("{}/{}", record.fingerprint, record.first_seen),
                summary,
                true,
                devices,
            )
            .await;
        Ok(Outcome::Isolated)
    }

    /// Dry run: announce what a device quarantine would do (`what`), once per fault.
    async fn would_quarantine_device(
        &self,
        node: &str,
        devices: &[RecordDevice],
        what: String,
    ) -> Outcome {
        self.announce
            .metric(Action::QuarantineDevice, ActionResult::DryRun);
        self.announce
            .event(
                node,
                "FaultlineWouldQuarantineDevice",
                &fingerprint(node, devices),
                format!("dry-run: would {what}"),
                true,
                devices,
            )
            .await;
        Outcome::Announced
    }

    /// The UIDs of `pods` whose claims hold one of `devices` (DRA): the pods to evict
    /// for them, each found in its claim's namespace by name and uid, as upstream
    /// resolves `reservedFor` (a claim cannot name another namespace's pods). Empty
    /// where the device path is off or the node has no DRA devices.
    pub(super) async fn dra_holders(
        &self,
        node: &str,
        pods: &[Pod],
        record: &QuarantineRecord,
    ) -> Result<BTreeSet<String>, RemediateError> {
        let Some(dra) = self.dra() else {
            return Ok(BTreeSet::new());
        };
        // Each device with the value of its rule's taint (none on the node path).
        let mut refs: Vec<(crate::device_taint::DeviceRef, Option<String>)> = record
            .rules()
            .iter()
            .map(|r| {
                let reason = record.devices.iter().find(|d| d.id == r.id);
                let value = taint_value(reason.map_or("failed", |d| d.reason.as_str()));
                (r.device_ref(), Some(value))
            })
            .collect();
        if refs.is_empty() {
            let index = dra.index_node(node).await.map_err(quarantine_error)?;
            refs = super::holders::node_path_refs(&index, &record.devices);
        }
        let node_path = record.rules().is_empty();
        if refs.is_empty() {
            // Nothing published names the failed devices (the driver took them out):
            // the kubelet's own report still does.
            return Ok(super::kubelet_dra::holders(pods, &[], node_path, &[]));
        }
        let claims = dra.claims_of(pods).await.map_err(quarantine_error)?;
        // A claim that tolerates its device's taint for ever (NoExecute, no seconds) is
        // left, as the device-taint eviction controller leaves it.
        let mut out = BTreeSet::new();
        for (r, value) in &refs {
            for h in holders(&claims, r) {
                let tolerates = value.as_deref().is_some_and(|v| {
                    claims.iter().any(|c| {
                        c.pointer("/metadata/namespace").and_then(|n| n.as_str())
                            == Some(h.namespace.as_str())
                            && c.pointer("/metadata/name").and_then(|n| n.as_str())
                                == Some(h.claim.as_str())
                            && tolerates_forever(c, r, TAINT_KEY, v)
                    })
                });
                if !tolerates && pods.iter().any(|p| h.is_pod(p)) {
                    out.insert(h.uid);
                }
            }
        }
        out.extend(super::kubelet_dra::holders(pods, &refs, node_path, &claims));
        Ok(out)
    }
}
