//! The canary of an auto release: a probe Job pinned to the node, tolerating
//! faultline's taint, that must succeed before the node goes back to work. One runs at a
//! time; a failed, vanished or timed-out canary is recorded and announced, and the next
//! try waits another cool-down.

use faultline_common::fault::fnv1a64;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Toleration;
use kube::api::{Api, DeleteParams, PostParams};

use super::announce::audit;
use super::error::{Outcome, RemediateError};
use super::patch::NodePatch;
use super::policy::{canary_retry_wait, canary_verdict, CanarySpec, Mode};
use super::record::{
    CanaryRun, CanaryState, LiveNode, QuarantineRecord, ReleaseRequest, CANARY_LABEL, TAINT_EFFECT,
};
use super::remediator::Remediator;
use super::view::JobView;
use crate::metrics::{Action, ActionResult};
use crate::shard::Fence;

/// The canary Job: the template, named, pinned to the node, tolerating faultline's
/// taint, never restarted in place, cleaned up an hour after it ends.
pub fn canary_job(template: &Job, name: &str, node: &str, taint_key: &str) -> Job {
    let mut job = template.clone();
    job.metadata.name = Some(name.to_string());
    job.metadata.generate_name = None;
    job.metadata.namespace = None;
    job.metadata.resource_version = None;
    job.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("app.kubernetes.io/managed-by".into(), "faultline".into());
    job.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("faultline.io/canary-node".into(), node.to_string());
    let spec = job.spec.get_or_insert_with(Default::default);
    spec.template
        .metadata
        .get_or_insert_with(Default::default)
        .labels
        .get_or_insert_with(Default::default)
        .insert(CANARY_LABEL.into(), "true".into());
    spec.backoff_limit.get_or_insert(0);
    spec.ttl_seconds_after_finished.get_or_insert(3600);
    let pod = spec.template.spec.get_or_insert_with(Default::default);
    pod.node_name = Some(node.to_string());
    if pod.restart_policy.is_none() {
        pod.restart_policy = Some("Never".into());
    }
    pod.tolerations
        .get_or_insert_with(Default::default)
        .push(Toleration {
            key: Some(taint_key.to_string()),
            operator: Some("Exists".into()),
            effect: Some(TAINT_EFFECT.into()),
            ..Default::default()
        });
    job
}

/// The name of the `attempt`th canary of a record first seen at `first_seen`.
fn canary_name(node: &str, first_seen: &str, attempt: u32) -> String {
    format!(
        "faultline-canary-{:012x}",
        fnv1a64(format!("{node}/{first_seen}/{attempt}").as_bytes()) & 0xffff_ffff_ffff
    )
}

impl Remediator {
    /// The canary step of an auto release of `live` whose devices proved healthy:
    /// read the one running (release when it succeeded, record a failure), or start
    /// one. `release` is the request to carry out once it succeeds.
    pub(super) async fn canary_step(
        &self,
        live: &LiveNode,
        mut record: QuarantineRecord,
        canary: &CanarySpec,
        release: ReleaseRequest,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let node = live.name.as_str();
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), &canary.namespace);
        match record.canary.clone() {
            Some(c) if c.state == CanaryState::Running => {
                let job = jobs.get_opt(c.job_name()).await?;
                match canary_verdict(
                    &c,
                    job.as_ref().map(JobView::of),
                    canary.timeout,
                    self.clock.now_ms(),
                ) {
                    CanaryState::Succeeded => {
                        let mut r = release;
                        r.reason = format!("{}; canary {} succeeded", r.reason, c.job);
                        record.canary = Some(CanaryRun {
                            state: CanaryState::Succeeded,
                            finished: Some(self.clock.rfc3339()),
                            ..c
                        });
                        self.release_record(live, record, r, false, fence).await
                    }
                    CanaryState::Failed => {
                        record.canary = Some(CanaryRun {
                            state: CanaryState::Failed,
                            finished: Some(self.clock.rfc3339()),
                            ..c.clone()
                        });
                        record.act(
                            format!("canary {} failed", c.job),
                            &self.clock.rfc3339(),
                            &self.actor,
                        );
                        let mut patch = NodePatch::on(&live.node);
                        patch.record(&record);
                        self.apply(node, patch, fence).await?;
                        if job.is_some() {
                            let _ = jobs.delete(c.job_name(), &DeleteParams::background()).await;
                        }
                        self.announce.metric(Action::Canary, ActionResult::Failed);
                        self.announce.event(node, "FaultlineCanaryFailed", &c.job, format!("canary {} failed: the node stays quarantined; another try after the cool-down", c.job), true, &record.devices).await;
                        Ok(Outcome::Waiting(format!("canary {} failed", c.job)))
                    }
                    CanaryState::Running => {
                        Ok(Outcome::Waiting(format!("canary {} running", c.job)))
                    }
                }
            }
            last => {
                if let Some(why) =
                    canary_retry_wait(last.as_ref(), self.release.cooldown, self.clock.now_ms())
                {
                    return Ok(Outcome::Waiting(why));
                }
                self.start_canary(live, record, canary, &jobs, fence).await
            }
        }
    }

    async fn start_canary(
        &self,
        live: &LiveNode,
        mut record: QuarantineRecord,
        canary: &CanarySpec,
        jobs: &Api<Job>,
        fence: &Fence,
    ) -> Result<Outcome, RemediateError> {
        let node = live.name.as_str();
        if !fence.holds() {
            return Err(RemediateError::NotHolder);
        }
        if self.mode == Mode::DryRun {
            self.announce.metric(Action::Canary, ActionResult::DryRun);
            self.announce
                .event(
                    node,
                    "FaultlineWouldRunCanary",
                    &record.first_seen,
                    "dry-run: would run the canary Job, then release".into(),
                    false,
                    &record.devices,
                )
                .await;
            return Ok(Outcome::Announced);
        }
        let name = canary_name(node, &record.first_seen, record.canary_attempts);
        record.canary_attempts += 1;
        let mut job = canary_job(&canary.template, &name, node, &self.taint.key);
        self.device_canary(&record, &mut job, &name);
        let made = match fence
            .write(jobs.create(&PostParams::default(), &job))
            .await?
        {
            Ok(j) => j,
            // Created by a pass whose answer was lost: it is ours.
            Err(kube::Error::Api(e)) if e.code == 409 => jobs.get(&name).await?,
            Err(e) => return Err(e.into()),
        };
        let uid = made.metadata.uid.unwrap_or_default();
        self.create_canary_claim(&record, &canary.namespace, &name, &uid)
            .await?;
        let job_ref = format!("{}/{name}", canary.namespace);
        let now = self.clock.rfc3339();
        record.canary = Some(CanaryRun {
            job: job_ref.clone(),
            started: now.clone(),
            state: CanaryState::Running,
            finished: None,
        });
        record.act(format!("canary {job_ref}"), &now, &self.actor);
        let mut patch = NodePatch::on(&live.node);
        patch.record(&record);
        self.apply(node, patch, fence).await?;
        self.announce.metric(Action::Canary, ActionResult::Started);
        audit("canary", node, &record.devices, &self.actor, &job_ref);
        self.announce.event(node, "FaultlineCanaryStarted", &job_ref, format!("devices healthy past the cool-down: canary Job {job_ref} must succeed before the release"), false, &record.devices).await;
        Ok(Outcome::Waiting(format!("canary {job_ref} started")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canary_job_is_pinned_tolerates_the_taint_and_never_retries() {
        let template: Job = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "probe", "namespace": "x", "resourceVersion": "9"},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "probe"}]}}}
        }))
        .unwrap();
        let job = canary_job(
            &template,
            "faultline-canary-1",
            "gpu-1",
            "nvidia.com/gpu-fault",
        );
        assert_eq!(job.metadata.name.as_deref(), Some("faultline-canary-1"));
        assert!(job.metadata.namespace.is_none() && job.metadata.resource_version.is_none());
        let spec = job.spec.unwrap();
        assert_eq!(spec.backoff_limit, Some(0));
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.node_name.as_deref(), Some("gpu-1"));
        assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
        let t = &pod.tolerations.unwrap()[0];
        assert_eq!(
            (t.key.as_deref(), t.operator.as_deref(), t.effect.as_deref()),
            (
                Some("nvidia.com/gpu-fault"),
                Some("Exists"),
                Some("NoSchedule")
            )
        );
        assert_eq!(
            spec.template.metadata.unwrap().labels.unwrap()[CANARY_LABEL],
            "true"
        );
        // Each attempt its own name, stable for the same attempt.
        assert_eq!(canary_name("n", "t", 0), canary_name("n", "t", 0));
        assert_ne!(canary_name("n", "t", 0), canary_name("n", "t", 1));
    }
}
