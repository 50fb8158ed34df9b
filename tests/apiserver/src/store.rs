//! The write path, as the registry's generic store and etcd carry it out
//! (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go): create, update
//! and delete stamp a new resourceVersion, validate, keep the object and record a watch
//! event. Every event also passes the kubelets' watches (`kubelet.rs`) and the meter
//! (`costs.rs`: the stored object's size, what etcd keeps).

use axum::http::StatusCode;
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::changes::Change;
use crate::dra;
use crate::kinds::{api_version, kind_of_plural};
use crate::release::{Release, RESOURCE_GROUP};
use crate::{
    disruption, lifecycle, now_rfc3339, status_body, validation, ApiError, ApiServer, Inner, Kind,
    WatchEvent, CONFIGMAP_MAX_BYTES,
};

impl ApiServer {
    fn stamp(g: &mut Inner, obj: &mut Value, k: &Kind, ns: &str) {
        g.rv += 1;
        let rv = g.rv.to_string();
        obj["apiVersion"] = json!(api_version(k));
        obj["kind"] = json!(k.kind);
        let meta = obj["metadata"].as_object_mut().expect("checked by caller");
        meta.insert("resourceVersion".into(), json!(rv));
        if k.namespaced {
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
    }

    /// The decoding and defaulting a kind gets before validation: a Secret's
    /// `stringData` moves into `data` and its `type` defaults to `Opaque`
    /// (`validation::normalize_secret`).
    fn normalize(k: &Kind, obj: &mut Value) -> Result<(), ApiError> {
        if k.plural == "secrets" {
            validation::normalize_secret(obj)
                .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", e))?;
        }
        Ok(())
    }

    fn validate(k: &Kind, ns: &str, obj: &Value, release: &Release) -> Result<(), ApiError> {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        let invalid = |e: String| ApiError::invalid(k.kind, name, e);
        validation::object_name(k.plural, name).map_err(invalid)?;
        match k.plural {
            "configmaps" => validation::configmap(obj).map_err(invalid)?,
            "secrets" => validation::secret(obj).map_err(invalid)?,
            "events" => validation::event(ns, obj).map_err(invalid)?,
            "devicetaintrules" => dra::device_taint_rule(obj, release).map_err(invalid)?,
            "resourceslices" => dra::resource_slice(obj, release).map_err(invalid)?,
            "resourceclaims" => dra::resource_claim(obj).map_err(invalid)?,
            _ => {}
        }
        if k.plural == "configmaps" {
            let size: usize = ["data", "binaryData"]
                .iter()
                .filter_map(|f| obj.get(*f).and_then(Value::as_object))
                .flat_map(|m| {
                    m.iter()
                        .map(|(key, v)| key.len() + v.as_str().map_or(0, str::len))
                })
                .sum();
            if size > CONFIGMAP_MAX_BYTES {
                return Err(invalid(format!(
                    "[]: Too long: must have at most {CONFIGMAP_MAX_BYTES} bytes"
                )));
            }
        }
        Ok(())
    }

    /// Create an object (as the API would: name, uid, resourceVersion, timestamps).
    pub fn create(&self, plural: &str, ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        if self.lock().release.versions(k).is_empty() {
            // Not served by the release played: a kind this cluster does not have.
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("the server could not find the requested resource ({plural})"),
            ));
        }
        if !obj.get("metadata").is_some_and(Value::is_object) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "metadata is required",
            ));
        }
        Self::normalize(k, &mut obj)?;
        let mut g = self.lock();
        let name = match obj.pointer("/metadata/name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match obj
                .pointer("/metadata/generateName")
                .and_then(Value::as_str)
            {
                Some(prefix) => {
                    let suffix: String = (0..5)
                        .map(|_| (b'a' + g.rng.random_range(0..26u8)) as char)
                        .collect();
                    format!("{prefix}{suffix}")
                }
                None => {
                    return Err(ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        "metadata.name: Required value",
                    ))
                }
            },
        };
        let ns = if k.namespaced { ns } else { "" };
        if k.namespaced && ns.is_empty() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "a namespace is required",
            ));
        }
        let key = (plural.to_string(), ns.to_string(), name.clone());
        if g.objects.contains_key(&key) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{plural} \"{name}\" already exists"),
            ));
        }
        obj["metadata"]["name"] = json!(name);
        if k.group == RESOURCE_GROUP {
            dra::prepare_for_create(plural, &mut obj, &now_rfc3339());
        }
        let release = g.release;
        Self::validate(k, ns, &obj, &release)?;
        g.uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", g.uid);
        {
            let meta = obj["metadata"].as_object_mut().expect("checked");
            meta.insert("uid".into(), json!(uid));
            meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
            meta.remove("generateName");
        }
        if plural == "pods" && obj.pointer("/status/phase").is_none() {
            obj["status"]["phase"] = json!("Running");
        }
        // The PodDisruptionBudget strategy's PrepareForCreate: generation 1.
        if plural == "poddisruptionbudgets" {
            obj["metadata"]["generation"] = json!(1);
        }
        Self::stamp(&mut g, &mut obj, k, ns);
        g.put(key.clone(), obj.clone());
        Self::record(
            &mut g,
            &self.events,
            Change {
                key,
                kind: k.kind,
                event: "ADDED",
                object: obj.clone(),
                prev: None,
                charge: Some(("create", k.plural.to_string())),
            },
        );
        Self::after_write(&mut g, &self.events, plural, ns);
        Ok(obj)
    }

    /// Replace an object; a stale `metadata.resourceVersion` is a 409 Conflict.
    pub fn update(
        &self,
        plural: &str,
        ns: &str,
        name: &str,
        obj: Value,
        subresource: Option<&str>,
    ) -> Result<Value, ApiError> {
        self.update_as("update", plural, ns, name, obj, subresource)
    }

    /// [`ApiServer::update`], charged to `verb` (`update` or `patch`) in the costs.
    pub(crate) fn update_as(
        &self,
        verb: &'static str,
        plural: &str,
        ns: &str,
        name: &str,
        mut obj: Value,
        subresource: Option<&str>,
    ) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        let ns = if k.namespaced { ns } else { "" };
        let key = (plural.to_string(), ns.to_string(), name.to_string());
        let mut g = self.lock();
        let cur = g
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(plural, name))?;
        if let Some(rv) = obj
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
        {
            if !rv.is_empty()
                && Some(rv)
                    != cur
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
            {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "Conflict",
                    format!("Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
                ));
            }
        }
        if !obj.get("metadata").is_some_and(Value::is_object) {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "metadata is required",
            ));
        }
        Self::normalize(k, &mut obj)?;
        // The status subresource changes status only; the main resource everything else.
        match subresource {
            Some("status") => {
                let status = obj.get("status").cloned().unwrap_or(Value::Null);
                obj = cur.clone();
                obj["status"] = status;
            }
            _ => {
                if let Some(st) = cur.get("status") {
                    if !matches!(k.plural, "configmaps" | "secrets") {
                        obj["status"] = st.clone();
                    }
                }
            }
        }
        for f in [
            "uid",
            "creationTimestamp",
            "name",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            match cur.pointer(&format!("/metadata/{f}")) {
                Some(v) => obj["metadata"][f] = v.clone(),
                None => {
                    if let Some(m) = obj["metadata"].as_object_mut() {
                        m.remove(f);
                    }
                }
            }
        }
        // The PodDisruptionBudget strategy's PrepareForUpdate: a new spec is a new
        // generation (pkg/registry/policy/poddisruptionbudget/strategy.go).
        if k.plural == "poddisruptionbudgets" && obj.get("spec") != cur.get("spec") {
            let generation = cur
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            obj["metadata"]["generation"] = json!(generation + 1);
        }
        if k.group == RESOURCE_GROUP {
            dra::prepare_for_update(k.plural, &cur, &mut obj, &now_rfc3339());
        }
        validation::immutable_update(k.plural, &cur, &obj)
            .map_err(|e| ApiError::invalid(k.kind, name, e))?;
        let release = g.release;
        Self::validate(k, ns, &obj, &release)?;
        Self::stamp(&mut g, &mut obj, k, ns);
        g.put(key.clone(), obj.clone());
        let resource = match subresource {
            Some(sub) => format!("{}/{sub}", k.plural),
            None => k.plural.to_string(),
        };
        Self::record(
            &mut g,
            &self.events,
            Change {
                key,
                kind: k.kind,
                event: "MODIFIED",
                object: obj.clone(),
                prev: Some(cur),
                charge: Some((verb, resource)),
            },
        );
        Self::after_write(&mut g, &self.events, k.plural, ns);
        Ok(obj)
    }

    /// Delete an object; returns it.
    pub fn delete(&self, plural: &str, ns: &str, name: &str) -> Result<Value, ApiError> {
        let k = kind_of_plural(plural)?;
        let ns = if k.namespaced { ns } else { "" };
        let key = (plural.to_string(), ns.to_string(), name.to_string());
        let mut g = self.lock();
        let prev = g
            .take(&key)
            .ok_or_else(|| ApiError::not_found(plural, name))?;
        g.rv += 1;
        let mut obj = prev.clone();
        obj["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        g.terminating.remove(&key);
        Self::record(
            &mut g,
            &self.events,
            Change {
                key,
                kind: k.kind,
                event: "DELETED",
                object: obj.clone(),
                prev: Some(prev),
                charge: None,
            },
        );
        Self::after_write(&mut g, &self.events, k.plural, ns);
        Ok(obj)
    }

    /// What the controllers do after a write: the disruption controller recomputes
    /// the budgets of the namespace when a pod or a budget changed.
    fn after_write(g: &mut Inner, tx: &broadcast::Sender<WatchEvent>, plural: &str, ns: &str) {
        if matches!(plural, "pods" | "poddisruptionbudgets") {
            lifecycle::sync_budgets(g, tx, ns);
        }
    }

    /// The Eviction subresource, as pkg/registry/core/pod/storage/eviction.go judges
    /// it: a pod that is finished, pending or terminating goes at once (`canIgnorePDB`);
    /// more than one matching PodDisruptionBudget is a 500; otherwise the one budget's
    /// `status` decides (`disruption::judge`: "still being processed", no disruption
    /// allowed, the unready-pod rule), and an allowed eviction uses one disruption
    /// before the pod is deleted gracefully with `grace` (the Eviction's
    /// `deleteOptions.gracePeriodSeconds`).
    pub fn evict(
        &self,
        ns: &str,
        name: &str,
        grace: Option<i64>,
        uid: Option<&str>,
    ) -> Result<Value, ApiError> {
        let pod = self
            .get("pods", ns, name)
            .ok_or_else(|| ApiError::not_found("pods", name))?;
        if self.lock().faults.node_churn {
            if let Some(node) = pod.pointer("/spec/nodeName").and_then(Value::as_str) {
                self.churn_node(node);
            }
        }
        let phase = pod.pointer("/status/phase").and_then(Value::as_str);
        let can_ignore = matches!(phase, Some("Succeeded" | "Failed" | "Pending"))
            || pod.pointer("/metadata/deletionTimestamp").is_some();
        if !can_ignore {
            let mut g = self.lock();
            let budgets: Vec<Value> = g
                .objects
                .iter()
                .filter(|((p, n, _), _)| p == "poddisruptionbudgets" && n == ns)
                .map(|(_, v)| v.clone())
                .collect();
            let matching = disruption::covering(&budgets, &pod);
            if matching.len() > 1 {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                ));
            }
            if let Some(pdb) = matching.first() {
                if let disruption::Judgement::Decrement(status) =
                    disruption::judge(pdb, &pod, crate::clock::now())?
                {
                    let pdb_name = pdb
                        .pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let key = ("poddisruptionbudgets".to_string(), ns.to_string(), pdb_name);
                    lifecycle::write_status(&mut g, &self.events, key, (*pdb).clone(), status);
                }
            }
        }
        // The uid precondition (`deleteOptions.preconditions.uid`), as eviction.go's
        // addConditionAndDeletePod checks it against the pod in store: after the budget's
        // judgement (a decrement stands, as upstream's does).
        let stored = pod.pointer("/metadata/uid").and_then(Value::as_str);
        if let Some(u) = uid.filter(|u| !u.is_empty() && Some(*u) != stored) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on Pod \"{name}\": the UID in the precondition ({u}) does not match the UID in record ({}). The object might have been deleted and then recreated",
                    stored.unwrap_or("")
                ),
            ));
        }
        self.delete_with_grace("pods", ns, name, grace)?;
        Ok(status_body(StatusCode::CREATED, "", ""))
    }

    /// Bump a Node's resourceVersion, as a kubelet status update does.
    pub fn churn_node(&self, node: &str) {
        if let Some(mut n) = self.get("nodes", "", node) {
            n["status"]["faultlineTestHeartbeat"] = json!(now_rfc3339());
            let _ = self.update("nodes", "", node, n, Some("status"));
        }
    }
}
