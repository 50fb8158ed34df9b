//! The device-taint eviction controller's prediction for a rule at effect `None`, judged
//! against faultline's own count of the device's holders, on a real
//! controller's terms:
//!
//! - faultline counts as the controller counts ([`would_be_evicted`]): scheduled pods
//!   that are not terminating, whose claims do not tolerate the taint for good;
//! - the controller writes its prediction once per generation of the rule, when that
//!   generation is written, and never again; pods come and go after. On a
//!   disagreement the pass asks once for a fresh one ([`Dra::resimulate`]: a spec
//!   change), counts again, and waits once more.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use super::error::quarantine_error;
use super::error::RemediateError;
use super::remediator::Remediator;
use crate::device_taint::{
    judge, would_be_evicted, would_evict, DeviceRef, Dra, Holder, Prediction, Watched, TAINT_KEY,
};
use crate::shard::Fence;

/// Which holders are pods of `pods`, by namespace, name and uid ([`Holder::is`]),
/// scheduled and not terminating: those the device-taint eviction controller counts
/// (it skips the others).
fn running(pods: &[Pod]) -> impl Fn(&Holder) -> bool + '_ {
    move |h| {
        pods.iter().any(|p| {
            h.is_pod(p)
                && p.metadata.deletion_timestamp.is_none()
                && p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some_and(|n| !n.is_empty())
        })
    }
}

/// When `rule` was made (its `creationTimestamp`), in milliseconds.
pub(super) fn created_ms(rule: &Value) -> Option<u64> {
    rule.pointer("/metadata/creationTimestamp")
        .and_then(Value::as_str)
        .and_then(faultline_common::time::parse_rfc3339_ms)
}

impl Remediator {
    /// How many devices faultline's rules quarantine now (the device budget's count),
    /// deleting on the way every rule of faultline's left at `None` more than twice the
    /// deadline ago: no pass waits on it any more (a pass decides by the deadline), so
    /// it is an earlier fault's, left when its device recovered or its replica went. A
    /// `None` rule evicts nothing: deleting it is safe, and leaves no rule waiting.
    pub(super) async fn ours_swept(&self, dra: &Dra) -> Result<usize, RemediateError> {
        // Without the device path's settings nothing is old enough (0: made before
        // the epoch).
        let before = self.devices.as_ref().map_or(0, |q| {
            let orphan = 2 * q.prediction_deadline.as_millis() as u64;
            self.clock.now_ms().saturating_sub(orphan)
        });
        let (enforced, idle) = dra.ours_and_idle(before).await.map_err(quarantine_error)?;
        for rule in &idle {
            let name = rule.pointer("/metadata/name").and_then(Value::as_str);
            match dra.delete_as_read(rule).await {
                Ok(true) => {
                    tracing::info!(rule = ?name, "a DeviceTaintRule left at None by an earlier fault: deleted")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(rule = ?name, error = %e, "cannot delete a DeviceTaintRule left at None; the next sweep tries again")
                }
            }
        }
        Ok(enforced)
    }

    /// The controller's prediction for `dev`'s rule (as proposed: `rule`) against
    /// faultline's count from `claims` of `pods`: waits up to `wait` for it, asks once
    /// more on a disagreement. `Pending` when none came in time.
    pub(super) async fn prediction(
        &self,
        dra: &Dra,
        mut rule: Value,
        dev: &DeviceRef,
        (claims, pods): (&[Value], &[Pod]),
        wait: Duration,
        fence: &Fence,
    ) -> Result<Prediction, RemediateError> {
        let value = rule["spec"]["taint"]["value"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let taint = (TAINT_KEY, value.as_str());
        let mut ours = would_be_evicted(claims, dev, taint, running(pods));
        let mut deadline = tokio::time::Instant::now() + wait;
        let mut asked_again = false;
        loop {
            let p = judge(would_evict(&rule), &ours);
            let late = tokio::time::Instant::now() >= deadline;
            match p {
                Prediction::Pending if !late => {}
                // The prediction is of the pods when the rule's generation was
                // written, and is never updated; pods came and went since. Once per
                // pass, ask for a fresh one and count again.
                Prediction::Disagrees { .. } if !asked_again => {
                    asked_again = true;
                    let now_secs = self.clock.now_ms() / 1000;
                    rule = fence
                        .write(dra.resimulate(dev, now_secs))
                        .await?
                        .map_err(quarantine_error)?;
                    let claims = dra.claims_of(pods).await.map_err(quarantine_error)?;
                    ours = would_be_evicted(&claims, dev, taint, running(pods));
                    deadline = tokio::time::Instant::now() + wait;
                    continue;
                }
                p => return Ok(p),
            }
            match dra
                .rule_after(dev, &rule, deadline)
                .await
                .map_err(quarantine_error)?
            {
                Watched::Changed(again) => rule = again,
                // The deadline: judged once more, late.
                Watched::Unchanged => {}
                Watched::Gone => return Ok(Prediction::Pending),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(namespace: &str, name: &str, uid: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"nodeName": "n1", "containers": []}
        }))
        .unwrap()
    }

    /// A claim of namespace `tenant` whose `reservedFor` names a pod of `train` (its name
    /// and uid) holds nothing there: upstream looks the pod up in the claim's namespace.
    /// Matched on the uid alone, the `train` pod was counted and evicted.
    #[test]
    fn a_claim_holds_only_pods_of_its_own_namespace() {
        let h = Holder {
            namespace: "tenant".into(),
            pod: "worker-0".into(),
            uid: "u-1".into(),
            claim: "gpu".into(),
        };
        let other_ns = [pod("train", "worker-0", "u-1")];
        assert!(!h.is_pod(&other_ns[0]));
        assert!(!running(&other_ns)(&h), "not counted");
        let own = [pod("tenant", "worker-0", "u-1")];
        assert!(h.is_pod(&own[0]) && running(&own)(&h));
        // The same name with another uid is another pod (recreated): not the holder.
        assert!(!running(&[pod("tenant", "worker-0", "u-2")])(&h));
    }
}
