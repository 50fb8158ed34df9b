//! Find the API: the newest version of `resource.k8s.io` that
//! serves DeviceTaintRule, from discovery, as kubectl finds a resource
//! (staging/src/k8s.io/client-go/discovery/discovery_client.go: the group's versions
//! from `/apis`, each version's resources from `/apis/<group>/<version>`).
//!
//! Which releases serve which version (kube-apiserver's
//! staging/src/k8s.io/apiserver/pkg/features/kube_features.go, gate
//! `DRADeviceTaintRules`): `v1alpha3` in 1.35 (alpha, off by default), `v1beta2` in 1.36
//! (beta, **off** by default: an administrator turns it on), `v1` from 1.37 (GA, on).
//! The versions share their fields (`spec.deviceSelector{driver,pool,device}`,
//! `spec.taint{key,value,effect,timeAdded}`, `status.conditions`), so one writer serves
//! all three. Where none is served, faultline keeps working: a device fault takes the
//! node path, as before.

use std::cmp::Ordering;

use faultline_common::sync::Locked;
use kube::api::ApiResource;
use kube::Client;

/// The group of Dynamic Resource Allocation.
pub const GROUP: &str = "resource.k8s.io";
/// The resource, as discovery names it.
pub const RESOURCE: &str = "devicetaintrules";

/// Where DeviceTaintRules are served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaintApi {
    /// `v1`, `v1beta2` or `v1alpha3`.
    pub version: String,
}

impl TaintApi {
    /// `resource.k8s.io/<version>`, the objects' `apiVersion`.
    pub fn api_version(&self) -> String {
        format!("{GROUP}/{}", self.version)
    }
}

/// How Kubernetes orders versions: GA above beta above alpha, then by major and by
/// the number after the stage; a version not of that form below all of them
/// (staging/src/k8s.io/apimachinery/pkg/version/helpers.go
/// `CompareKubeAwareVersionStrings`).
pub fn kube_version_order(a: &str, b: &str) -> Ordering {
    rank(a).cmp(&rank(b))
}

fn rank(v: &str) -> (u8, u64, u64) {
    let Some(rest) = v.strip_prefix('v') else {
        return (0, 0, 0);
    };
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let Ok(major) = rest[..digits].parse::<u64>() else {
        return (0, 0, 0);
    };
    let tail = &rest[digits..];
    let stage = |prefix: &str, s: u8| {
        tail.strip_prefix(prefix)
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| (s, major, n))
    };
    if tail.is_empty() {
        (3, major, 0)
    } else {
        stage("beta", 2)
            .or_else(|| stage("alpha", 1))
            .unwrap_or((0, 0, 0))
    }
}

/// The newest version that lists DeviceTaintRule: `served` is each version of the
/// group with whether its resource list has `devicetaintrules`.
pub fn newest_with_rules<'a>(served: impl IntoIterator<Item = (&'a str, bool)>) -> Option<String> {
    served
        .into_iter()
        .filter(|(_, has)| *has)
        .map(|(v, _)| v)
        .filter(|v| rank(v).0 > 0)
        .max_by(|a, b| kube_version_order(a, b))
        .map(str::to_string)
}

/// Ask the cluster. `Ok(None)`: no version serves DeviceTaintRule (no DRA, a release
/// before 1.35, or the gate off), and device faults take the node path. An error is
/// the API's (unreachable, 5xx, refused): the caller says so and asks again later,
/// never concluding "none" from it. A version whose resource list is not found (404:
/// it went away between the two calls) counts as not serving.
pub async fn discover(client: &Client) -> Result<Option<TaintApi>, kube::Error> {
    let groups = client.list_api_groups().await?;
    let Some(group) = groups.groups.iter().find(|g| g.name == GROUP) else {
        return Ok(None);
    };
    let mut served = Vec::new();
    for v in &group.versions {
        let has = match client.list_api_group_resources(&v.group_version).await {
            Ok(list) => list
                .resources
                .iter()
                .any(|r| r.name == RESOURCE && r.verbs.iter().any(|verb| verb == "create")),
            Err(kube::Error::Api(s)) if s.code == 404 => false,
            Err(e) => return Err(e),
        };
        served.push((v.version.as_str(), has));
    }
    Ok(newest_with_rules(served).map(|version| TaintApi { version }))
}

/// How often the API is looked for again once found (or found absent): a cluster
/// upgraded to 1.37, or a gate turned on, is noticed within this.
pub const REDISCOVER: std::time::Duration = std::time::Duration::from_secs(600);
/// How soon a failed discovery is tried again.
pub const RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// Where [`follow`] keeps its last answer for the remediation passes.
pub type Found = std::sync::Arc<std::sync::Mutex<Option<TaintApi>>>;

/// Find the API at start and again every `every` (an error retried after `retry`),
/// until `cancel`: each answer logged when it changes and shown as the gauge
/// `faultline_aggregator_device_taint_api{version}`; an error counted as a
/// `discovery` remediation error and the last answer kept.
pub async fn follow(
    client: Client,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    found_at: Found,
    every: std::time::Duration,
    retry: std::time::Duration,
    cancel: tokio_util::sync::CancellationToken,
) {
    let mut last: Option<Option<TaintApi>> = None;
    loop {
        let wait = match discover(&client).await {
            Ok(found) => {
                *found_at.locked() = found.clone();
                if last.as_ref() != Some(&found) {
                    match &found {
                        Some(api) => tracing::info!(api = %api.api_version(), "DeviceTaintRule served: a failed device can be quarantined alone"),
                        None => tracing::info!("no DeviceTaintRule served (no DRA device taints): a device fault takes the node path"),
                    }
                    metrics.device_taint_api(found.as_ref().map(|a| a.version.as_str()));
                    last = Some(found);
                }
                every
            }
            Err(e) => {
                tracing::warn!(error = %e, "looking for DeviceTaintRule failed; the last answer stands");
                metrics.remediation_error("discovery");
                retry
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// [`follow`], every 10 minutes (an error again after 30 s), to run as a task.
pub fn following(
    client: &Client,
    metrics: &std::sync::Arc<crate::metrics::Metrics>,
    found_at: Found,
    cancel: &tokio_util::sync::CancellationToken,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    follow(
        client.clone(),
        metrics.clone(),
        found_at,
        REDISCOVER,
        RETRY,
        cancel.clone(),
    )
}

/// The `resource.k8s.io` resource `kind` (`plural`) at `version`.
pub(super) fn resource(version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: version.into(),
        api_version: format!("{GROUP}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_as_kubernetes_orders_them() {
        let mut v = vec![
            "v1alpha3",
            "v1",
            "v1beta2",
            "v1beta1",
            "v2",
            "v10alpha1",
            "foo",
            "v1alpha10",
        ];
        v.sort_by(|a, b| kube_version_order(b, a));
        assert_eq!(
            v,
            [
                "v2",
                "v1",
                "v1beta2",
                "v1beta1",
                "v10alpha1",
                "v1alpha10",
                "v1alpha3",
                "foo"
            ]
        );
    }

    #[test]
    fn the_newest_version_that_lists_the_resource_wins() {
        assert_eq!(
            newest_with_rules([("v1", true), ("v1beta2", true)]).as_deref(),
            Some("v1")
        );
        // 1.36 with the gate on: v1 serves slices and claims, only v1beta2 the rules.
        assert_eq!(
            newest_with_rules([("v1", false), ("v1beta2", true)]).as_deref(),
            Some("v1beta2")
        );
        assert_eq!(
            newest_with_rules([("v1", false), ("v1alpha3", true)]).as_deref(),
            Some("v1alpha3")
        );
        assert_eq!(newest_with_rules([("v1", false)]), None);
        assert_eq!(newest_with_rules([("latest", true)]), None);
        assert_eq!(newest_with_rules([]), None);
    }
}
