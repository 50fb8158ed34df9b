//! Release: a quarantine ends when a person asks (`faultline release`, or the
//! `faultline.io/release` annotation), or, for unknown-only records and with `--release
//! auto`, once the devices prove healthy (clean samples, the cool-down, the canary).
//! Only what faultline added is removed (its taint, its label); the record moves to the
//! Node's history. With named devices only those are released and the rest stay.
//!
//! A record past its expiry that cannot be released is extended by another
//! `--quarantine-expiry` and announced (seed 004: a failed check extends the
//! quarantine; nothing is released without proof).

use k8s_openapi::api::core::v1::Taint;

use super::announce::audit;
use super::error::{Outcome, RemediateError};
use super::patch::NodePatch;
use super::policy::{breaker_stops, expired, release_readiness, Mode, Readiness, Step};
use super::record::{
    describe, fingerprint, history_of, history_text, label_value, named_or_all, LiveNode,
    QuarantineRecord, ReleaseRequest, Released, DEVICES_LABEL, HISTORY_ANNOTATION,
    RECORD_ANNOTATION, SCOPE_LABEL, TAINT_EFFECT,
};
use super::remediator::Remediator;
use crate::metrics::{Action, ActionResult};
use crate::model::{DeviceView, RecordDevice};
use crate::shard::Fence;

impl Remediator {
    /// One release pass over a quarantined node: a person's request first; else, for
    /// unknown-only records or with `--release auto`, a release once `views` (the
    /// pipeline's devices of the node) prove health, after the cool-down and the canary;
    /// then the expiry. `at_ms` is the time of `views`; the expiry is judged on this
    /// replica's clock.
    pub async fn release_pass(
        &self,
        node: &str,
        views: &[DeviceView],
        at_ms: u64,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        if self.mode == Mode::Off {
            return Ok(Outcome::Off);
        }
        // Never true for a release (the breaker is not even read): asked so that the
        // one rule of what an open breaker stops is the one the model checker checks.
        if breaker_stops(Step::Release) && self.breaker_open().await? {
            return Ok(Outcome::BreakerOpen);
        }
        let live = self.read(node).await?;
        if let Some(req) = ReleaseRequest::of(&live.node) {
            return self.release_live(&live, req, true, fence).await;
        }
        let Some(record) = live.record.clone() else {
            return Ok(Outcome::AlreadyDone);
        };
        let outcome = self
            .release_check(&live, record.clone(), views, at_ms, fence)
            .await?;
        if let (Outcome::Waiting(why), true, Mode::Enforce) =
            (&outcome, expired(&record, self.clock.now_ms()), self.mode)
        {
            self.extend(node, why, fence).await?;
        }
        Ok(outcome)
    }

    /// Extend an expired record by another expiry period, and say so.
    async fn extend(&self, node: &str, why: &str, fence: &Fence) -> Result<(), RemediateError> {
        // Read again: the check may have written the record (a canary).
        let live = self.read(node).await?;
        let Some(mut r) = live.record else {
            return Ok(());
        };
        let old = r.expiry.clone().unwrap_or_default();
        r.expiry = Some(self.expiry_from_now());
        r.act(format!("extend: {why}"), &self.clock.rfc3339(), &self.actor);
        let mut patch = NodePatch::on(&live.node);
        patch.record(&r);
        self.apply(node, patch, fence).await?;
        self.announce.metric(Action::Extend, ActionResult::Ok);
        self.announce
            .event(
                node,
                "FaultlineQuarantineExtended",
                &old,
                format!(
                    "quarantine expired and extended to {}: {why}",
                    r.expiry.as_deref().unwrap_or("")
                ),
                true,
                &r.devices,
            )
            .await;
        Ok(())
    }

    /// Whether `record` may go by itself now, and if so the canary or the release.
    async fn release_check(
        &self,
        live: &LiveNode,
        record: QuarantineRecord,
        views: &[DeviceView],
        now_ms: u64,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let reason = match release_readiness(&record, views, &self.release, now_ms) {
            Readiness::Waiting(why) => return Ok(Outcome::Waiting(why)),
            Readiness::Ready(reason) => reason,
        };
        let auto = ReleaseRequest {
            devices: vec![],
            actor: self.actor.clone(),
            reason,
        };
        match self.release.canary.clone().filter(|_| !record.unknown_only) {
            None => self.release_live(live, auto, false, fence).await,
            Some(canary) => self.canary_step(live, record, &canary, auto, fence).await,
        }
    }

    /// Release a node as a person asked (`faultline release`, or the annotation).
    pub async fn release(
        &self,
        node: &str,
        req: ReleaseRequest,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let live = self.read(node).await?;
        self.release_live(&live, req, true, fence).await
    }

    /// Release `live` (all devices, or those `req` names).
    async fn release_live(
        &self,
        live: &LiveNode,
        req: ReleaseRequest,
        manual: bool,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let Some(record) = live.record.clone() else {
            // Nothing to release: clear the request so it does not linger.
            if ReleaseRequest::of(&live.node).is_some() && self.mode == Mode::Enforce {
                let mut patch = NodePatch::on(&live.node);
                patch.clear_request(&live.node);
                self.apply(&live.name, patch, fence).await?;
                tracing::info!(node = %live.name, "release asked for a node without a quarantine record; request cleared");
            }
            return Ok(Outcome::AlreadyDone);
        };
        self.release_record(live, record, req, manual, fence).await
    }

    /// Carry a release out: the record's devices that `req` names (all, when it names
    /// none), removing only the taint and label faultline added, and keeping the record
    /// as history.
    pub(super) async fn release_record(
        &self,
        live: &LiveNode,
        mut record: QuarantineRecord,
        req: ReleaseRequest,
        manual: bool,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let node = live.name.clone();
        let t0 = std::time::Instant::now();
        if !fence.holds() {
            return Err(RemediateError::NotHolder);
        }
        let named: Vec<RecordDevice> = record
            .devices
            .iter()
            .filter(|d| req.devices.iter().any(|k| d.is(k)))
            .cloned()
            .collect();
        let partial = !req.devices.is_empty() && named.len() < record.devices.len();
        if !req.devices.is_empty() && named.is_empty() {
            return self.ignore_request(live, &record, &req, fence).await;
        }
        let what = if partial {
            named
                .iter()
                .map(|d| d.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            "all devices".to_string()
        };
        if self.mode == Mode::DryRun {
            self.announce.metric(Action::Release, ActionResult::DryRun);
            self.announce
                .event(
                    &node,
                    "FaultlineWouldRelease",
                    &format!("{}/{}", record.first_seen, what),
                    format!("dry-run: would release {what} ({})", req.reason),
                    false,
                    &record.devices,
                )
                .await;
            return Ok(Outcome::Announced);
        }
        // The devices' DeviceTaintRules go first: a rule deletion that fails keeps the
        // record, and the next pass tries again.
        let released = named_or_all(&named, &record.devices);
        self.release_rules(&node, &mut record, &released, fence)
            .await?;
        let at = self.clock.rfc3339();
        let mut patch = NodePatch::on(&live.node);
        patch.clear_request(&live.node);
        record.act(format!("release {what}: {}", req.reason), &at, &req.actor);
        if partial {
            record.devices.retain(|d| !named.contains(d));
            for d in &named {
                record.released_devices.insert(d.id.clone(), at.clone());
            }
            record.fingerprint = fingerprint(&node, &record.devices);
            if record.owned_label {
                let ids: Vec<&str> = record.devices.iter().map(|d| d.id.as_str()).collect();
                patch.label(DEVICES_LABEL, &label_value(&ids));
            }
            patch.record(&record);
        } else {
            self.undo_quarantine(live, &mut patch, &mut record, &req, manual, &at);
        }
        self.apply(&node, patch, fence).await?;
        if !partial {
            // The node's place in the budget goes with its quarantine.
            self.budget.forget(&node).await;
            // The record is gone already: a failure here leaves only a stale condition,
            // which the next quarantine overwrites.
            let message = format!("released by {}: {}", req.actor, req.reason);
            let released = self.condition(&node, (true, "Released"), message, &at, fence);
            if let Err(e) = released.await {
                tracing::warn!(node = %node, error = %e, "released, but the condition was not updated");
            }
        }
        self.announce.metric(Action::Release, ActionResult::Ok);
        self.announce
            .action_time(Action::Release, t0.elapsed().as_secs_f64());
        let devices = named_or_all(&named, &record.devices);
        audit("release", &node, &devices, &req.actor, &what);
        self.announce
            .event(
                &node,
                "FaultlineReleased",
                &format!("{}/{}/{at}", record.first_seen, what),
                format!(
                    "released {what} by {}: {} ({})",
                    req.actor,
                    req.reason,
                    describe(&devices)
                ),
                false,
                &devices,
            )
            .await;
        Ok(Outcome::Released)
    }

    /// The whole-record part of a release: faultline's own taint (key and NoSchedule)
    /// and label go, the record moves to the history.
    fn undo_quarantine(
        &self,
        live: &LiveNode,
        patch: &mut NodePatch,
        record: &mut QuarantineRecord,
        req: &ReleaseRequest,
        manual: bool,
        at: &str,
    ) {
        if let Some(key) = &record.owned_taint {
            let taints = live.taints();
            let kept: Vec<Taint> = taints
                .iter()
                .filter(|t| !(t.key == *key && t.effect == TAINT_EFFECT))
                .cloned()
                .collect();
            if kept.len() != taints.len() {
                patch.taints(&kept);
            }
        }
        if record.owned_label && live.has_label(DEVICES_LABEL) {
            patch.remove_label(DEVICES_LABEL);
        }
        if live.has_label(SCOPE_LABEL) {
            patch.remove_label(SCOPE_LABEL);
        }
        patch.remove_annotation(RECORD_ANNOTATION);
        record.released = Some(Released {
            at: at.to_string(),
            actor: req.actor.clone(),
            reason: req.reason.clone(),
            manual,
        });
        let mut history = history_of(&live.node);
        history.push(record.clone());
        patch.annotation(HISTORY_ANNOTATION, history_text(&history));
    }

    /// A request that names no quarantined device: cleared and announced.
    async fn ignore_request(
        &self,
        live: &LiveNode,
        record: &QuarantineRecord,
        req: &ReleaseRequest,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        tracing::warn!(node = %live.name, asked = ?req.devices, "release names no quarantined device; request cleared");
        if self.mode == Mode::Enforce {
            let mut patch = NodePatch::on(&live.node);
            patch.clear_request(&live.node);
            self.apply(&live.name, patch, fence).await?;
        }
        self.announce
            .event(
                &live.name,
                "FaultlineReleaseIgnored",
                &format!("{}/{}", record.first_seen, req.devices.join(",")),
                format!(
                    "release of {} ignored: not quarantined here",
                    req.devices.join(", ")
                ),
                true,
                &record.devices,
            )
            .await;
        Ok(Outcome::AlreadyDone)
    }
}
