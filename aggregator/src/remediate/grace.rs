//! A pod's checkpoint grace as the cluster says it: its own
//! `faultline.io/checkpoint-grace` annotation, else its namespace's (read once per
//! namespace and pass), judged by [`super::drain::grace`].

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;

use super::drain::{grace, BadGrace, GRACE_ANNOTATION};
use super::remediator::Remediator;

/// The namespaces' grace annotations read in one pass, each namespace once.
#[derive(Default)]
pub struct NamespaceGraces(BTreeMap<String, Option<String>>);

impl Remediator {
    /// How long `pod` may checkpoint ([`grace`]); the namespace is read only when the
    /// pod has no annotation and the cluster allows any grace. A namespace that cannot
    /// be read counts as one without the annotation (logged).
    pub(super) async fn grace_of(
        &self,
        pod: &Pod,
        namespaces: &mut NamespaceGraces,
    ) -> Result<Duration, BadGrace> {
        if self.max_grace.is_zero() {
            return Ok(Duration::ZERO);
        }
        let own = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(GRACE_ANNOTATION))
            .cloned();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let of_ns = match (&own, namespaces.0.get(&ns)) {
            (Some(_), _) => None,
            (None, Some(v)) => v.clone(),
            (None, None) => {
                let api: Api<Namespace> = Api::all(self.client.clone());
                let v = match api.get_metadata_opt(&ns).await {
                    Ok(n) => n
                        .and_then(|n| n.metadata.annotations)
                        .and_then(|mut a| a.remove(GRACE_ANNOTATION)),
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "cannot read the namespace's checkpoint grace; none assumed");
                        None
                    }
                };
                namespaces.0.insert(ns, v.clone());
                v
            }
        };
        grace(own.as_deref(), of_ns.as_deref(), self.max_grace)
    }
}
