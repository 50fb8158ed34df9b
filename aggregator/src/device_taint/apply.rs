//! The writes of a device quarantine, through the real `kube`
//! client: read the slices and claims, propose a rule with effect `None`, read the
//! device-taint eviction controller's prediction, enforce (`NoSchedule`) only when
//! it agrees with faultline's own count, and release. A rule without faultline's label
//! is never changed or deleted, whatever its name.
//!
//! The caller decides (budgets, breaker, dry-run, the shard's fence); this module only
//! writes what it is told, and refuses what would touch another owner's rule.

use futures_util::TryStreamExt;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, Preconditions,
    WatchEvent, WatchParams,
};
use kube::Client;
use serde_json::{json, Value};

use super::api::{resource, TaintApi};
use super::claims::{self, MissingClaims};
use super::index::{holders, DeviceIndex, DeviceRef, Holder, Slice};
use super::rule::{is_ours, rule_name, rule_object, would_evict, Effect, Reported};

/// Why a write was not made.
#[derive(Debug, thiserror::Error)]
pub enum QuarantineError {
    #[error("DeviceTaintRule {0} exists and is not faultline's (no app.kubernetes.io/managed-by=faultline): left alone")]
    NotOurs(String),
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("unreadable {what}: {why}")]
    Decode { what: String, why: String },
    #[error("the cluster serves no DeviceTaintRule")]
    NoApi,
}

/// What became of a rule watched for a change.
#[derive(Debug, Clone, PartialEq)]
pub enum Watched {
    /// It changed: as it is now.
    Changed(Value),
    /// Not changed by the deadline.
    Unchanged,
    /// Deleted.
    Gone,
}

/// What the controller's prediction says against faultline's own count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prediction {
    /// Not reported yet for this generation (or no controller runs).
    Pending,
    /// The controller would evict exactly the pods faultline counts.
    Agrees(u64),
    /// It would evict another number: act on neither, announce.
    Disagrees { controller: u64, faultline: u64 },
    /// It reported, in words faultline cannot read: act on neither; the node path.
    Unreadable(String),
}

/// Compare the controller's prediction with faultline's holders of the device.
pub fn judge(predicted: Reported, ours: &[Holder]) -> Prediction {
    let faultline = ours.len() as u64;
    match predicted {
        Reported::NotYet => Prediction::Pending,
        Reported::Unreadable(words) => Prediction::Unreadable(words),
        Reported::Pods(n) if n == faultline => Prediction::Agrees(n),
        Reported::Pods(controller) => Prediction::Disagrees {
            controller,
            faultline,
        },
    }
}

/// The DRA objects of one cluster, at the versions it serves.
#[derive(Clone)]
pub struct Dra {
    client: Client,
    taints: Option<TaintApi>,
    drivers: Vec<String>,
    missing: MissingClaims,
}

fn as_json(o: &DynamicObject) -> Result<Value, QuarantineError> {
    serde_json::to_value(o).map_err(|e| QuarantineError::Decode {
        what: "object".into(),
        why: e.to_string(),
    })
}

impl Dra {
    /// `taints`: where DeviceTaintRules are served ([`super::discover`]); `drivers`:
    /// the DRA drivers whose devices faultline may quarantine (`gpu.nvidia.com`, …).
    pub fn new(client: Client, taints: TaintApi, drivers: Vec<String>) -> Self {
        Dra::maybe(client, Some(taints), drivers)
    }

    /// Slices and claims only, where no DeviceTaintRule is served (`taints` `None`):
    /// a DRA pod of a failed device is still found and evicted on the node path.
    pub fn maybe(client: Client, taints: Option<TaintApi>, drivers: Vec<String>) -> Self {
        Dra {
            client,
            taints,
            drivers,
            missing: MissingClaims::default(),
        }
    }

    /// Remember claims found missing in `missing` (a replica's, across passes).
    pub fn remembering(mut self, missing: MissingClaims) -> Self {
        self.missing = missing;
        self
    }

    /// Whether DeviceTaintRules can be written.
    pub fn has_rules(&self) -> bool {
        self.taints.is_some()
    }

    fn rules(&self) -> Result<Api<DynamicObject>, QuarantineError> {
        let v = self.taints.as_ref().ok_or(QuarantineError::NoApi)?;
        Ok(Api::all_with(
            self.client.clone(),
            &resource(&v.version, "DeviceTaintRule", "devicetaintrules"),
        ))
    }

    /// The allowlisted drivers' devices on `node` (field selector `spec.nodeName`,
    /// pkg/registry/resource/resourceslice/strategy.go): one list, the node's own
    /// slices, whatever the cluster's size. A pool of a node-local driver lives on its
    /// node, so its completeness is judged as [`Dra::index`] judges it.
    pub async fn index_node(&self, node: &str) -> Result<DeviceIndex, QuarantineError> {
        let api: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("v1", "ResourceSlice", "resourceslices"),
        );
        let list = match api
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
        {
            Ok(l) => l,
            // No resource.k8s.io/v1 (before 1.34): no DRA devices.
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(DeviceIndex::default()),
            Err(e) => return Err(e.into()),
        };
        let mut slices = Vec::new();
        for o in &list.items {
            if let Some(s) = Slice::from_json(&as_json(o)?) {
                slices.push(s);
            }
        }
        Ok(DeviceIndex::build(&slices, &self.drivers))
    }

    /// The claims `pods` use, as [`claims::read`] reads them (bounded, those found
    /// missing remembered).
    pub async fn claims_of(
        &self,
        pods: &[k8s_openapi::api::core::v1::Pod],
    ) -> Result<Vec<Value>, QuarantineError> {
        claims::read(&self.client, &self.missing, pods)
            .await?
            .iter()
            .map(as_json)
            .collect()
    }

    /// How many devices faultline's rules quarantine now, cluster-wide (the device
    /// budget counts them on every replica alike): its rules with an effect. A rule
    /// left at `None` (a proposal whose prediction never came, a replica that died
    /// waiting) keeps nothing from new work and counts for nothing; before, 64 of them
    /// held every later device quarantine in the cluster back. And faultline's rules at
    /// `None` made before `made_before_ms` (each as read: its name, uid and
    /// resourceVersion are a delete's preconditions).
    pub async fn ours_and_idle(
        &self,
        made_before_ms: u64,
    ) -> Result<(usize, Vec<Value>), QuarantineError> {
        let lp = ListParams::default().labels("app.kubernetes.io/managed-by=faultline");
        let rules = self.rules()?.list(&lp).await?;
        let none = |r: &&DynamicObject| r.data["spec"]["taint"]["effect"] == Effect::None.as_str();
        let enforced = rules.items.iter().filter(|r| !none(r)).count();
        let idle = rules
            .items
            .iter()
            .filter(none)
            .filter(|r| {
                r.metadata
                    .creation_timestamp
                    .as_ref()
                    .is_some_and(|t| (t.0.as_millisecond().max(0) as u64) < made_before_ms)
            })
            .map(as_json)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((enforced, idle))
    }

    /// Delete `rule` (as read, at effect `None`) if it is still that object, still ours
    /// and still at `None` ([`Dra::delete_judged`]). `Ok(false)`: it changed or went
    /// meanwhile, and is left.
    pub async fn delete_as_read(&self, rule: &Value) -> Result<bool, QuarantineError> {
        let uid = |r: &Value| {
            r.pointer("/metadata/uid")
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let Some(name) = rule.pointer("/metadata/name").and_then(Value::as_str) else {
            return Ok(false);
        };
        let first = uid(rule);
        self.delete_judged(name, Some(rule.clone()), |r| {
            Ok(is_ours(r)
                && uid(r) == first
                && r["spec"]["taint"]["effect"] == Effect::None.as_str())
        })
        .await
    }

    /// The allowlisted drivers' devices, from every ResourceSlice (`resource.k8s.io/v1`,
    /// served from 1.34), one list per driver (field selector `spec.driver`).
    pub async fn index(&self) -> Result<DeviceIndex, QuarantineError> {
        let api: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("v1", "ResourceSlice", "resourceslices"),
        );
        let mut slices = Vec::new();
        for d in &self.drivers {
            let list = api
                .list(&ListParams::default().fields(&format!("spec.driver={d}")))
                .await?;
            for o in &list.items {
                if let Some(s) = Slice::from_json(&as_json(o)?) {
                    slices.push(s);
                }
            }
        }
        Ok(DeviceIndex::build(&slices, &self.drivers))
    }

    /// The pods that hold `device` through their claims, in every namespace.
    pub async fn holders(&self, device: &DeviceRef) -> Result<Vec<Holder>, QuarantineError> {
        let api: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("v1", "ResourceClaim", "resourceclaims"),
        );
        let list = api.list(&ListParams::default()).await?;
        let claims = list
            .items
            .iter()
            .map(as_json)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(holders(&claims, device))
    }

    /// The rule of `device`, if there is one (ours or not).
    pub async fn rule(&self, device: &DeviceRef) -> Result<Option<Value>, QuarantineError> {
        match self.rules()?.get_opt(&rule_name(device)).await? {
            Some(o) => Ok(Some(as_json(&o)?)),
            None => Ok(None),
        }
    }

    /// The rule of `device` once it changes from `rule` (its resourceVersion), watched
    /// by name until `until`: one watch, where polling for the controller's prediction
    /// was a GET every 10 ms for the whole wait (about 20 a second per device, and for
    /// ever where no controller runs). A watch that ends early (the server's timeout, an
    /// expired version) reads the rule once instead.
    pub async fn rule_after(
        &self,
        device: &DeviceRef,
        rule: &Value,
        until: tokio::time::Instant,
    ) -> Result<Watched, QuarantineError> {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Ok(Watched::Unchanged);
        }
        let rv = rule["metadata"]["resourceVersion"].as_str().unwrap_or("0");
        let wp = WatchParams::default()
            .fields(&format!("metadata.name={}", rule_name(device)))
            .timeout(left.as_secs().clamp(1, 290) as u32);
        let api = self.rules()?;
        let stream = match api.watch(&wp, rv).await {
            Ok(s) => s,
            // Refused (an install whose RBAC predates the watch verb) or failed: one read
            // half a second on, as a slow poll, rather than no prediction at all.
            Err(e) => {
                tracing::debug!(error = %e, "cannot watch the DeviceTaintRule; reading it again");
                let soon = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
                tokio::time::sleep_until(until.min(soon)).await;
                return self.read_again(device, rule).await;
            }
        };
        futures_util::pin_mut!(stream);
        loop {
            let next = match tokio::time::timeout_at(until, stream.try_next()).await {
                Err(_) => return Ok(Watched::Unchanged),
                Ok(next) => next?,
            };
            match next {
                Some(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                    let now = as_json(&o)?;
                    if now["metadata"]["resourceVersion"] != rule["metadata"]["resourceVersion"] {
                        return Ok(Watched::Changed(now));
                    }
                }
                Some(WatchEvent::Deleted(_)) => return Ok(Watched::Gone),
                Some(WatchEvent::Bookmark(_)) => {}
                // Ended early, or the version expired (410): one read says where it is.
                Some(WatchEvent::Error(_)) | None => {
                    let again = self.read_again(device, rule).await?;
                    if again == Watched::Unchanged {
                        // Wait out the rest rather than ask again at once.
                        tokio::time::sleep_until(until).await;
                    }
                    return Ok(again);
                }
            }
        }
    }

    /// One read of `device`'s rule, against `rule` as last seen (its resourceVersion).
    async fn read_again(
        &self,
        device: &DeviceRef,
        rule: &Value,
    ) -> Result<Watched, QuarantineError> {
        let seen = &rule["metadata"]["resourceVersion"];
        Ok(match self.rule(device).await? {
            Some(now) if now["metadata"]["resourceVersion"] != *seen => Watched::Changed(now),
            Some(_) => Watched::Unchanged,
            None => Watched::Gone,
        })
    }

    /// Propose a quarantine: the device's rule with effect `None`, so the controller
    /// reports what it would evict and nothing changes. A rule of ours already there is
    /// kept (a replica that restarted, a second fault): its effect is left as it is.
    pub async fn propose(
        &self,
        device: &DeviceRef,
        uuid: &str,
        reason: &str,
        sequence: u64,
        shard: u32,
    ) -> Result<Value, QuarantineError> {
        if let Some(r) = self.rule(device).await? {
            return if is_ours(&r) {
                Ok(r)
            } else {
                Err(QuarantineError::NotOurs(rule_name(device)))
            };
        }
        let obj = rule_object(
            self.taints.as_ref().ok_or(QuarantineError::NoApi)?,
            device,
            uuid,
            Effect::None,
            reason,
            sequence,
            shard,
        );
        let o: DynamicObject =
            serde_json::from_value(obj).map_err(|e| QuarantineError::Decode {
                what: "rule".into(),
                why: e.to_string(),
            })?;
        match self.rules()?.create(&PostParams::default(), &o).await {
            Ok(made) => as_json(&made),
            // Another replica made it between our read and our write: read it again.
            Err(kube::Error::Api(s)) if s.code == 409 => match self.rule(device).await? {
                Some(r) if is_ours(&r) => Ok(r),
                _ => Err(QuarantineError::NotOurs(rule_name(device))),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// The controller's prediction for the device's rule against faultline's count.
    pub async fn prediction(
        &self,
        device: &DeviceRef,
        ours: &[Holder],
    ) -> Result<Prediction, QuarantineError> {
        let Some(r) = self.rule(device).await? else {
            return Ok(Prediction::Pending);
        };
        Ok(judge(would_evict(&r), ours))
    }

    /// Enforce: the rule's effect becomes `NoSchedule` (`NoExecute` only where the
    /// operator opted in: it deletes pods, bypassing their PodDisruptionBudgets).
    pub async fn enforce(
        &self,
        device: &DeviceRef,
        effect: Effect,
    ) -> Result<Value, QuarantineError> {
        self.patch_ours(
            device,
            |_| json!({"op": "replace", "path": "/spec/taint/effect", "value": effect.as_str()}),
        )
        .await
    }

    /// Ask the controller for a fresh prediction: the rule's `spec.taint.timeAdded`
    /// moves on (to `now_secs`, or a second past its own), a spec change, after which
    /// the device-taint eviction controller simulates `NoExecute` again and writes the
    /// condition for the new generation (1.35, 1.36 and 1.37 alike:
    /// `maybeUpdateRuleStatus` compares the condition's `observedGeneration`; the
    /// real-cluster test `a_stale_prediction_is_asked_again` on each).
    pub async fn resimulate(
        &self,
        device: &DeviceRef,
        now_secs: u64,
    ) -> Result<Value, QuarantineError> {
        self.patch_ours(device, |r| {
            let was = r
                .pointer("/spec/taint/timeAdded")
                .and_then(Value::as_str)
                .and_then(faultline_common::time::parse_rfc3339_ms)
                .map_or(0, |ms| ms / 1000);
            let at = faultline_common::time::rfc3339_ms(now_secs.max(was + 1) * 1000);
            json!({"op": "add", "path": "/spec/taint/timeAdded", "value": at})
        })
        .await
    }

    /// One JSON-patch operation (`op`, from the rule as read) on the device's rule,
    /// only if it is ours. The patch tests the rule's uid and faultline's label, which
    /// the API server checks against the object it writes: a rule replaced meanwhile,
    /// or relabelled to another owner, is not written (422). Not its resourceVersion:
    /// the eviction controller writes the rule's status at any time.
    async fn patch_ours(
        &self,
        device: &DeviceRef,
        op: impl FnOnce(&Value) -> Value,
    ) -> Result<Value, QuarantineError> {
        let name = rule_name(device);
        let Some(r) = self.rule(device).await? else {
            return Err(QuarantineError::Decode {
                what: format!("rule {name}"),
                why: "not found".into(),
            });
        };
        if !is_ours(&r) {
            return Err(QuarantineError::NotOurs(name));
        }
        let patch = json!([
            {"op": "test", "path": "/metadata/uid", "value": r["metadata"]["uid"]},
            {"op": "test", "path": "/metadata/labels/app.kubernetes.io~1managed-by", "value": "faultline"},
            op(&r),
        ]);
        let p: json_patch::Patch =
            serde_json::from_value(patch).map_err(|e| QuarantineError::Decode {
                what: "patch".into(),
                why: e.to_string(),
            })?;
        let done = self
            .rules()?
            .patch(&name, &PatchParams::default(), &Patch::<()>::Json(p))
            .await?;
        as_json(&done)
    }

    /// Release: delete the device's rule, only if it is ours ([`Dra::delete_judged`]).
    /// `Ok(false)`: there was none.
    pub async fn release(&self, device: &DeviceRef) -> Result<bool, QuarantineError> {
        let name = rule_name(device);
        self.delete_judged(&name, None, |r| {
            if is_ours(r) {
                Ok(true)
            } else {
                Err(QuarantineError::NotOurs(name.clone()))
            }
        })
        .await
    }

    /// Delete rule `name` while `judge` keeps it (as read: `read`, else read now),
    /// preconditioned on the uid and resourceVersion it was judged at. A 409 (the
    /// controller wrote its status meanwhile) reads and judges again, three times at
    /// most. `Ok(false)`: there was none, or `judge` left it.
    async fn delete_judged(
        &self,
        name: &str,
        mut read: Option<Value>,
        judge: impl Fn(&Value) -> Result<bool, QuarantineError>,
    ) -> Result<bool, QuarantineError> {
        let mut tries = 0;
        loop {
            let r = match read.take() {
                Some(r) => r,
                None => match self.rules()?.get_opt(name).await? {
                    Some(o) => as_json(&o)?,
                    None => return Ok(false),
                },
            };
            if !judge(&r)? {
                return Ok(false);
            }
            let text = |p: &str| r.pointer(p).and_then(Value::as_str).map(str::to_string);
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: text("/metadata/uid"),
                    resource_version: text("/metadata/resourceVersion"),
                }),
                ..DeleteParams::default()
            };
            tries += 1;
            match self.rules()?.delete(name, &dp).await {
                Ok(_) => return Ok(true),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
                Err(kube::Error::Api(s)) if s.code == 409 && tries < 3 => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pod: &str) -> Holder {
        Holder {
            namespace: "t".into(),
            pod: pod.into(),
            uid: format!("u-{pod}"),
            claim: format!("c-{pod}"),
        }
    }

    #[test]
    fn the_prediction_is_acted_on_only_when_it_agrees() {
        let ours = [holder("a"), holder("b")];
        assert_eq!(judge(Reported::NotYet, &ours), Prediction::Pending);
        assert_eq!(judge(Reported::Pods(2), &ours), Prediction::Agrees(2));
        assert_eq!(
            judge(Reported::Pods(3), &ours),
            Prediction::Disagrees {
                controller: 3,
                faultline: 2
            }
        );
        assert_eq!(judge(Reported::Pods(0), &[]), Prediction::Agrees(0));
        assert_eq!(
            judge(Reported::Pods(1), &[]),
            Prediction::Disagrees {
                controller: 1,
                faultline: 0
            }
        );
        assert_eq!(
            judge(Reported::Unreadable("x".into()), &ours),
            Prediction::Unreadable("x".into())
        );
    }
}
