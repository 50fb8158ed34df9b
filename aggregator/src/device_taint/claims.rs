//! The claims of a node's pods, read one by one and bounded: what holds a device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};
use kube::api::{Api, DynamicObject};
use kube::Client;

use super::api::resource;
use crate::aged::Aged;

/// Claims read at most per call of [`read`] (a node's pods; 8 GPUs and a few
/// claims per pod need a few dozen).
pub const MAX_CLAIM_READS: usize = 256;
/// Claim reads in flight at once.
pub const CLAIM_READS_AT_ONCE: usize = 16;
/// How long a claim found missing, named by a pod that is not running, is not asked
/// for again.
pub const MISSING_CLAIM_TTL: Duration = Duration::from_secs(30);
/// Claims found missing remembered at most (the oldest forgotten first).
const MISSING_CLAIMS_KEPT: usize = 16_384;

/// Claims (namespace, name) found missing, and when: shared by the passes of a
/// replica ([`super::DeviceQuarantine::missing_claims`]).
pub type MissingClaims = Arc<std::sync::Mutex<Aged<(String, String), ()>>>;

/// The claims `pods` use (`spec.resourceClaims[].resourceClaimName`, and
/// `status.resourceClaimStatuses` for claims made from a template), each read once:
/// a node's pods, not every claim of the cluster. At most [`MAX_CLAIM_READS`] per
/// call, [`CLAIM_READS_AT_ONCE`] at a time: one pod that names 2,000 claims that do
/// not exist cost 700-800 GETs a second for as long as its node stayed quarantined,
/// all at once. The claims are taken round robin over the pods, running pods first,
/// so one pod that names thousands crowds no other pod's out; past the bound the
/// rest are left, logged. A claim found missing that no running pod names is not
/// asked for again for [`MISSING_CLAIM_TTL`] (such a pod holds nothing: the kubelet
/// runs no pod whose claims are not there), so the next calls read the rest, then
/// none.
pub async fn read(
    client: &Client,
    missing: &MissingClaims,
    pods: &[k8s_openapi::api::core::v1::Pod],
) -> Result<Vec<DynamicObject>, kube::Error> {
    // Running pods first: their claims are the ones that hold devices now.
    let mut pods: Vec<&k8s_openapi::api::core::v1::Pod> = pods.iter().collect();
    pods.sort_by_key(|p| {
        !(p.metadata.deletion_timestamp.is_none()
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    });
    let running = |p: &k8s_openapi::api::core::v1::Pod| {
        p.metadata.deletion_timestamp.is_none()
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    };
    let per_pod: Vec<Vec<(String, String)>> = pods
        .iter()
        .map(|p| {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let direct = p
                .spec
                .iter()
                .flat_map(|s| s.resource_claims.iter().flatten())
                .filter_map(|c| c.resource_claim_name.clone());
            let made = p
                .status
                .iter()
                .flat_map(|s| s.resource_claim_statuses.iter().flatten())
                .filter_map(|c| c.resource_claim_name.clone());
            // A pod that asked for an extended resource (`nvidia.com/gpu`) on a DRA
            // node: the scheduler made its claim, named only here (KEP-5004).
            let extended = p
                .status
                .iter()
                .filter_map(|s| s.extended_resource_claim_status.as_ref())
                .map(|e| e.resource_claim_name.clone())
                .filter(|n| !n.is_empty());
            direct
                .chain(made)
                .chain(extended)
                .map(|n| (ns.clone(), n))
                .collect()
        })
        .collect();
    // Round robin over the pods: each pod's first claim before any pod's second, so
    // one pod that names thousands cannot crowd the others' out of the bound.
    let of_running: std::collections::BTreeSet<&(String, String)> = pods
        .iter()
        .zip(&per_pod)
        .filter(|(p, _)| running(p))
        .flat_map(|(_, l)| l)
        .collect();
    let now = Instant::now();
    // Those found missing within the TTL, as the passes left them (one look).
    let known: std::collections::BTreeSet<(String, String)> = {
        let mut m = missing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.expire(now, MISSING_CLAIM_TTL);
        per_pod
            .iter()
            .flatten()
            .filter(|c| !of_running.contains(c) && m.contains_key(c))
            .cloned()
            .collect()
    };
    let known_missing = |c: &(String, String)| known.contains(c);
    let mut seen = std::collections::BTreeSet::new();
    let mut order = Vec::new();
    let longest = per_pod.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        for c in per_pod.iter().filter_map(|l| l.get(i)) {
            if !known_missing(c) && seen.insert(c.clone()) {
                order.push(c.clone());
            }
        }
    }
    if order.len() > MAX_CLAIM_READS {
        tracing::warn!(
            claims = order.len(),
            read = MAX_CLAIM_READS,
            "the node's pods name more claims than are read in one pass; the rest are left"
        );
        order.truncate(MAX_CLAIM_READS);
    }
    // A node's 8 claims in one round trip's time, not 8; a bounded number at once.
    let reads = order.into_iter().map(|(ns, name)| {
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &ns,
            &resource("v1", "ResourceClaim", "resourceclaims"),
        );
        async move { api.get_opt(&name).await.map(|c| ((ns, name), c)) }
    });
    let read: Vec<((String, String), Option<DynamicObject>)> = futures_util::stream::iter(reads)
        .buffer_unordered(CLAIM_READS_AT_ONCE)
        .try_collect()
        .await?;
    let mut missing = missing
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (c, found) in &read {
        match found {
            Some(_) => missing.remove(c),
            None if !of_running.contains(c) => {
                missing.make_room(MISSING_CLAIMS_KEPT);
                missing.touch(c.clone(), now, || ());
            }
            None => {}
        }
    }
    drop(missing);
    Ok(read.into_iter().filter_map(|(_, c)| c).collect())
}
