//! Isolation: a node whose accelerator failed gets faultline's taint (NoSchedule), the
//! devices label, the `AcceleratorHealthy=False` condition, an Event and its quarantine
//! record, in one resourceVersion-guarded patch plus the status condition. Idempotent:
//! a second pass for the same fault changes nothing and announces nothing. Within the
//! budget and the breaker.
//!
//! Also here: the unknown guard (devices unknown past the tolerance get the node a
//! NoSchedule taint valued `unknown`, never an eviction) and holding a node back when a
//! budget is spent.

use std::time::Duration;

use k8s_openapi::api::core::v1::Taint;

use super::announce::audit;
use super::device::DevicePath;
use super::error::{Outcome, RemediateError};
use super::patch::NodePatch;
use super::policy::{breaker_stops, not_suppressed, young, Mode, Step, PLACE_TTL};
use super::record::{
    describe, fingerprint, history_of, label_value, LiveNode, QuarantineRecord,
    ANNOUNCE_RETRY_SECS, CONDITION, DEVICES_LABEL, SCOPE_LABEL, UNKNOWN_MARK,
};
use super::remediator::Remediator;
use super::view::node_ready;
use crate::metrics::{Action, ActionResult};
use crate::model::RecordDevice;
use crate::shard::Fence;

impl Remediator {
    /// A write under a place in the budget ledger taken at `placed_ms` may go: the place
    /// is younger than half its [`PLACE_TTL`], so no replica drops it while the write
    /// (bounded by the hold) is in flight, whatever their clocks' skew.
    fn place_fresh(&self, placed_ms: u64) -> Result<(), RemediateError> {
        let took = Duration::from_millis(self.clock.now_ms().saturating_sub(placed_ms));
        if took >= PLACE_TTL / 2 {
            return Err(RemediateError::PlaceExpired(took));
        }
        Ok(())
    }

    /// What a pass that took `node`'s place in the budget does with `result`: a write
    /// that surely did not land (never sent, or refused with a 4xx) gives the place
    /// back. A 5xx, a timeout or a write given up at the hold's end may still land:
    /// their place stays until it expires.
    async fn under_place<T>(
        &self,
        node: &str,
        placed: bool,
        result: Result<T, RemediateError>,
    ) -> Result<T, RemediateError> {
        let surely_not = match &result {
            Ok(_) => false,
            Err(RemediateError::Api(kube::Error::Api(s))) => (400..500).contains(&s.code),
            Err(RemediateError::NotHolder | RemediateError::PlaceExpired(_)) => true,
            Err(_) => false,
        };
        if placed && surely_not {
            self.budget.give_back(node, &self.actor).await;
        }
        result
    }

    /// The devices of `devices` a person has not released within the dedup window.
    fn not_suppressed(&self, live: &LiveNode, devices: Vec<RecordDevice>) -> Vec<RecordDevice> {
        not_suppressed(
            &history_of(&live.node),
            live.record.as_ref(),
            devices,
            self.release.dedup_window,
            self.clock.now_ms(),
        )
    }

    /// What isolation and the unknown guard first ask: remediation on, the breaker
    /// closed, and devices a person has not released within the dedup window. The live
    /// Node and those devices, or the outcome that ends the pass here.
    async fn open_pass(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
    ) -> Result<Result<(LiveNode, Vec<RecordDevice>), Outcome>, RemediateError> {
        if self.mode == Mode::Off || devices.is_empty() {
            return Ok(Err(Outcome::Off));
        }
        if breaker_stops(Step::Isolate) && self.breaker_open().await? {
            return Ok(Err(Outcome::BreakerOpen));
        }
        let live = self.read(node).await?;
        let devices = self.not_suppressed(&live, devices);
        if devices.is_empty() {
            return Ok(Err(Outcome::Suppressed));
        }
        Ok(Ok((live, devices)))
    }

    /// Isolate `node` for `devices` (all failed), `fence` asked before every write: the
    /// shard Lease. A pass that loses it stops where it is. Idempotent: a second pass for
    /// the same fault changes nothing and announces nothing.
    pub async fn isolate(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let (live, fresh) = match self.open_pass(node, devices).await? {
            Ok(pass) => pass,
            Err(outcome) => return Ok(outcome),
        };
        let existing = live.record.clone();
        // Devices join a record and leave it only by a release: a device that is no
        // longer failed in this pass (or came from an alert the agents do not see)
        // stays until someone, or the auto release, proves it healthy.
        let mut devices: Vec<RecordDevice> = existing
            .as_ref()
            .filter(|r| !r.unknown_only)
            .map(|r| r.devices.clone())
            .unwrap_or_default();
        for d in fresh {
            if !devices.iter().any(|x| x.same_device(&d)) {
                devices.push(d);
            }
        }
        // One device alone where the cluster can; else the node, and why.
        let node_why = match self
            .isolate_devices(&live, existing.as_ref(), &devices, fence)
            .await?
        {
            DevicePath::Done(outcome) => return Ok(outcome),
            DevicePath::Node(why) => why,
        };
        // On a DRA cluster, the device that publishes each failed UUID while its slice
        // still does: kept in the record, it finds the holders after the driver took
        // the device out.
        // Read once per new fault (the record's fingerprint), not every pass.
        let new_fault = existing
            .as_ref()
            .is_none_or(|r| r.fingerprint != fingerprint(node, &devices));
        if let Some(dra) = self.dra().filter(|_| new_fault) {
            if let Ok(index) = dra.index_node(node).await {
                super::holders::map_devices(&index, &mut devices);
            }
        }
        let fp = fingerprint(node, &devices);
        let taints = live.taints();
        let has_taint = taints
            .iter()
            .any(|t| t.key == self.taint.key && t.effect == self.taint.effect);
        let has_condition = live
            .node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == CONDITION && c.status == "False")
            });
        let same_fault = existing.as_ref().is_some_and(|r| r.fingerprint == fp);
        if same_fault && has_taint && has_condition {
            self.announce_again(existing.as_ref()).await;
            return Ok(Outcome::AlreadyDone);
        }
        // A node not yet quarantined is quarantined only within the budget. Decisions
        // are taken one at a time in this replica (check, then write), so concurrent
        // passes cannot all see room for one more. (Replicas decide for their own shards;
        // across replicas the count can exceed the budget by at most replicas - 1.)
        // A node the unknown guard tainted (an unknown-only record, the same taint key)
        // is not quarantined yet: its first failure asks the budget like any other
        // (the randomized schedules found it skipped the budget).
        let unquarantined = match &existing {
            // Unknown-only, or only devices quarantined alone: the node is not yet.
            Some(r) => r.unknown_only || !r.node_scoped(),
            None => !has_taint,
        };
        // Across replicas the count includes the ledger's places: this node's is taken
        // before its taint is written, so the budget holds exactly.
        let _budget_turn = if unquarantined && self.mode == Mode::Enforce {
            let turn = self.budget.turn().await;
            // The place is timed from before the ledger's write stamps it, however long
            // that compare-and-swap took (up to 8 reads and writes).
            let asked = self.clock.now_ms();
            let me = (self.actor.as_str(), &self.clock);
            if let Some(why) = self.budget.refusal(&self.nodes, &live.node, me).await? {
                return self
                    .hold_back(node, why, &devices, Action::Quarantine)
                    .await;
            }
            Some((turn, asked))
        } else {
            None
        };
        let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        let summary = format!(
            "{} failed on {node}: {}{}",
            ids.join(", "),
            describe(&devices),
            node_why
                .as_ref()
                .map(|w| format!("; the node, not the device: {}", w.describe()))
                .unwrap_or_default()
        );
        let placed = _budget_turn.is_some();
        if !fence.holds() {
            return self
                .under_place(node, placed, Err(RemediateError::NotHolder))
                .await;
        }
        if self.mode == Mode::DryRun {
            tracing::warn!(node, devices = ?ids, taint = %self.taint.key, "dry-run: would quarantine");
            self.announce
                .metric(Action::Quarantine, ActionResult::DryRun);
            self.announce
                .event(
                    node,
                    "FaultlineWouldQuarantine",
                    &fp,
                    format!("dry-run: would taint {} ({summary})", self.taint.key),
                    true,
                    &devices,
                )
                .await;
            return Ok(Outcome::Announced);
        }

        let now = self.clock.rfc3339();
        let mut record = existing.unwrap_or_else(|| self.new_record(node, vec![], &now));
        record.unknown_only = false;
        record.devices = devices;
        if let Some(why) = &node_why {
            record.node_why = Some(why.describe());
        }
        record.fingerprint = fp;
        record.last_seen = now.clone();
        let mut patch = NodePatch::on(&live.node);
        if live.has_label(SCOPE_LABEL) {
            // Escalated from a device quarantine: the node's now (its rules stay,
            // and go with the release).
            patch.remove_label(SCOPE_LABEL);
        }
        if !has_taint {
            let mut t = taints;
            t.push(self.taint.clone());
            patch.taints(&t);
            record.owned_taint = Some(self.taint.key.clone());
            record.act("taint", &now, &self.actor);
        }
        let labels = live.node.metadata.labels.clone().unwrap_or_default();
        let label_value = label_value(&ids);
        let label_ok = labels.get(DEVICES_LABEL).is_some_and(|v| *v == label_value);
        if !label_ok && (record.owned_label || !labels.contains_key(DEVICES_LABEL)) {
            patch.label(DEVICES_LABEL, &label_value);
            record.owned_label = true;
            record.act("label", &now, &self.actor);
        }
        patch.record(&record);
        if let Some((_, at)) = &_budget_turn {
            let fresh = self.place_fresh(*at);
            self.under_place(node, placed, fresh).await?;
        }
        // Taint, label and record in one write, unless only the condition was missing.
        if !(same_fault && has_taint) {
            let applied = self.apply(node, patch, fence).await;
            self.under_place(node, placed, applied).await?;
        }
        self.condition(
            node,
            (false, "AcceleratorFailed"),
            summary.clone(),
            &now,
            fence,
        )
        .await?;
        self.held_back.release(node);
        if !(same_fault && has_taint) {
            self.announce.metric(Action::Quarantine, ActionResult::Ok);
            audit(
                "quarantine",
                node,
                &record.devices,
                &self.actor,
                &self.taint.key,
            );
        }
        // Also when only the condition was missing: a pass cut short before its Event
        // announces now, and one that did meets the Event's name and stays quiet.
        self.announce
            .event(
                node,
                "FaultlineQuarantined",
                &format!("{}/{}", record.fingerprint, record.first_seen),
                format!("tainted {} ({summary})", self.taint.key),
                true,
                &record.devices,
            )
            .await;
        Ok(Outcome::Isolated)
    }

    /// A pass cut short after the condition (an answer lost) has not announced yet: do
    /// it now. Known Events cost nothing; one this replica has not seen costs one create
    /// answered 409. Only while the record is young: Events expire (1 h by default), and
    /// an old quarantine was announced long ago.
    async fn announce_again(&self, record: Option<&QuarantineRecord>) {
        let Some(r) = record
            .filter(|r| !r.unknown_only && young(r, self.clock.now_ms(), ANNOUNCE_RETRY_SECS))
        else {
            return;
        };
        self.announce
            .event(
                &r.node,
                "FaultlineQuarantined",
                &format!("{}/{}", r.fingerprint, r.first_seen),
                format!(
                    "tainted {} ({} failed)",
                    self.taint.key,
                    r.devices
                        .iter()
                        .map(|d| format!("{}={}", d.id, d.reason))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                true,
                &r.devices,
            )
            .await;
    }

    /// Record and announce a node held back by a budget (the nodes', or the devices'
    /// for `Action::QuarantineDevice`): once per node, and one alert for the first
    /// node held back while others pass.
    pub(super) async fn hold_back(
        &self,
        node: &str,
        why: String,
        devices: &[RecordDevice],
        action: Action,
    ) -> Result<Outcome, RemediateError> {
        let hold = self.held_back.hold(node);
        if let Some(m) = self.announce.metrics() {
            m.set_held_back(hold.count);
        }
        self.announce.metric(action, ActionResult::HeldBack);
        // One Event per node and hour at most, across replicas and restarts: the
        // Event's name says so. It is asked for on every pass that holds the node back,
        // not only the first: an announcement the API refused (a 500) is made by the
        // next pass, never lost (found by the randomized schedules).
        let hour = self
            .clock
            .rfc3339()
            .get(..13)
            .unwrap_or_default()
            .to_string();
        if hold.first_for_node {
            tracing::warn!(node, %why, "quarantine held back by the budget");
        }
        self.announce
            .event(
                node,
                "FaultlineHeldBack",
                &format!("{}/{hour}", fingerprint(node, devices)),
                format!("not quarantined: {why}"),
                true,
                devices,
            )
            .await;
        if hold.first_overall {
            tracing::error!(%why, "quarantine budget exhausted: further failed nodes are held back");
        }
        // The one alert for the budget, asked for while a single node is held back.
        if hold.count == 1 {
            self.announce.event(node, "FaultlineBudgetExhausted", &hour, format!("quarantine budget exhausted ({why}); failed nodes are held back until quarantines are released"), true, devices).await;
        }
        Ok(Outcome::HeldBack(why))
    }

    /// Devices unknown for longer than the tolerance: the node may get the NoSchedule
    /// taint (value `unknown`) so no new work lands on devices nobody can see, but
    /// nothing is ever evicted for it, and a node that is itself NotReady is left to
    /// Kubernetes' node lifecycle. Within the budget and the breaker, like isolation.
    pub async fn guard_unknown(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let (live, devices) = match self.open_pass(node, devices).await? {
            Ok(pass) => pass,
            Err(outcome) => return Ok(outcome),
        };
        if node_ready(&live.node) == Some(false) {
            return Ok(Outcome::LeftToKubernetes);
        }
        let taints = live.taints();
        if taints.iter().any(|t| t.key == self.taint.key) || live.record.is_some() {
            return Ok(Outcome::AlreadyDone);
        }
        let _turn = self.budget.turn().await;
        // A dry run asks the count and takes no place.
        let me = (self.mode == Mode::Enforce).then_some((self.actor.as_str(), &self.clock));
        // Timed from before the ledger's write, as in `isolate`.
        let placed = self.clock.now_ms();
        if let Some(why) = self.budget.unknown_refusal(&self.nodes, node, me).await? {
            return self
                .hold_back(node, why, &devices, Action::Quarantine)
                .await;
        }
        let taken = self.mode == Mode::Enforce;
        let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        if !fence.holds() {
            return self
                .under_place(node, taken, Err(RemediateError::NotHolder))
                .await;
        }
        if self.mode == Mode::DryRun {
            self.announce
                .metric(Action::TaintUnknown, ActionResult::DryRun);
            self.announce
                .event(
                    node,
                    "FaultlineWouldCordonUnknown",
                    &fingerprint(node, &devices),
                    format!(
                        "dry-run: would taint {}=unknown: {} unknown past the tolerance",
                        self.taint.key,
                        ids.join(", ")
                    ),
                    true,
                    &devices,
                )
                .await;
            return Ok(Outcome::Announced);
        }
        let now = self.clock.rfc3339();
        // The label only if nobody else set it: what faultline did not add it never removes.
        let label_free = !live.has_label(DEVICES_LABEL);
        let mut record = QuarantineRecord {
            owned_taint: Some(self.taint.key.clone()),
            owned_label: label_free,
            unknown_only: true,
            ..self.new_record(node, devices.clone(), &now)
        };
        record.act("taint-unknown", &now, &self.actor);
        let mut t = taints;
        t.push(Taint {
            value: Some(UNKNOWN_MARK.into()),
            ..self.taint.clone()
        });
        let mut patch = NodePatch::on(&live.node);
        patch.taints(&t);
        if label_free {
            patch.label(DEVICES_LABEL, UNKNOWN_MARK);
        }
        patch.record(&record);
        let fresh = self.place_fresh(placed);
        self.under_place(node, taken, fresh).await?;
        let applied = self.apply(node, patch, fence).await;
        self.under_place(node, taken, applied).await?;
        audit(
            "taint-unknown",
            node,
            &devices,
            &self.actor,
            &self.taint.key,
        );
        self.announce.metric(Action::TaintUnknown, ActionResult::Ok);
        self.announce
            .event(
                node,
                "FaultlineUnknownCordoned",
                &format!("{}/{}", record.fingerprint, record.first_seen),
                format!(
                    "tainted {}=unknown:NoSchedule: {} unknown past the tolerance; nothing evicted",
                    self.taint.key,
                    ids.join(", ")
                ),
                true,
                &devices,
            )
            .await;
        Ok(Outcome::Isolated)
    }
}
