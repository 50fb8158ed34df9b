//! Writing one shard Lease: creating it (or labelling one a version before the label
//! made), and renewing or taking it, each a compare-and-swap on its resourceVersion.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;

use super::lease::{
    lease_name, now_micro, ShardLeases, AGGREGATOR_LABEL, SEQUENCE_ANNOTATION, URL_ANNOTATION,
};

impl ShardLeases {
    /// Create the Lease of a shard nobody ever held. One that exists unlabelled (made by
    /// a version before the label) is labelled instead, so that the next pass sees it
    /// and judges it like any other: never taken without being observed.
    pub(super) async fn create(&self, shard: u32) -> Result<bool, kube::Error> {
        match self.create_new(shard).await {
            Err(kube::Error::Api(s)) if s.code == 409 => {
                self.adopt(shard).await?;
                Ok(false)
            }
            r => r,
        }
    }

    /// Label a shard Lease that exists without [`AGGREGATOR_LABEL`] (the label only, as a
    /// compare-and-swap on what was read: its holder and times stay as they are).
    pub(super) async fn adopt(&self, shard: u32) -> Result<(), kube::Error> {
        let lname = lease_name(&self.name, shard);
        let Some(mut l) = self.api.get_opt(&lname).await? else {
            return Ok(());
        };
        let labels = l.metadata.labels.get_or_insert_with(Default::default);
        if labels.get(AGGREGATOR_LABEL) != Some(&self.name) {
            labels.insert(AGGREGATOR_LABEL.to_string(), self.name.clone());
            self.api.replace(&lname, &PostParams::default(), &l).await?;
            tracing::info!(shard, lease = %lname, "labelled a shard lease made before the label");
        }
        Ok(())
    }

    pub(super) async fn create_new(&self, shard: u32) -> Result<bool, kube::Error> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(lease_name(&self.name, shard)),
                labels: Some([(AGGREGATOR_LABEL.to_string(), self.name.clone())].into()),
                annotations: self
                    .url
                    .as_ref()
                    .map(|u| [(URL_ANNOTATION.to_string(), u.clone())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.me.clone()),
                lease_duration_seconds: Some(self.cfg.duration.as_secs() as i32),
                acquire_time: Some(now_micro()),
                renew_time: Some(now_micro()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        self.api
            .create(&PostParams::default(), &lease)
            .await
            .map(|_| true)
    }

    /// Renew our Lease, or take one that is free. A renewal the API refuses with a 409
    /// (the Lease read from the cache was behind) is tried once more on a fresh read, if
    /// that still shows this replica as the holder. One that failed on its connection
    /// (no answer from the API: a pooled connection closed as the request left) is sent
    /// once more at once: it is a compare-and-swap, so a first one that did land makes
    /// the second a 409, taken as above.
    pub(super) async fn renew(&self, shard: u32, lease: Lease) -> Result<bool, kube::Error> {
        let mine = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            == Some(self.me.as_str());
        let first = match self.replace_lease(shard, lease.clone()).await {
            Err(e @ (kube::Error::Service(_) | kube::Error::HyperError(_))) => {
                tracing::debug!(shard, error = %e, "lease renewal failed on its connection; sent once more");
                self.replace_lease(shard, lease).await
            }
            r => r,
        };
        match first {
            Err(kube::Error::Api(s)) if s.code == 409 && mine => {
                let fresh = self.api.get(&lease_name(&self.name, shard)).await?;
                let still = fresh
                    .spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_deref())
                    == Some(self.me.as_str());
                if !still {
                    return Ok(false);
                }
                self.replace_lease(shard, fresh).await
            }
            r => r,
        }
    }

    /// Write `lease` as held by this replica, renewed now (a compare-and-swap on its
    /// resourceVersion), with the label, this replica's URL and the shard's sequence.
    pub(super) async fn replace_lease(
        &self,
        shard: u32,
        mut lease: Lease,
    ) -> Result<bool, kube::Error> {
        let lname = lease_name(&self.name, shard);
        let spec = lease.spec.get_or_insert_with(Default::default);
        let mine = spec.holder_identity.as_deref() == Some(self.me.as_str());
        if !mine {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.acquire_time = Some(now_micro());
            spec.holder_identity = Some(self.me.clone());
        }
        spec.renew_time = Some(now_micro());
        spec.lease_duration_seconds = Some(self.cfg.duration.as_secs() as i32);
        lease
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(AGGREGATOR_LABEL.to_string(), self.name.clone());
        let annotations = lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        // The holder's URL, or none: never the previous holder's.
        match &self.url {
            Some(u) => {
                annotations.insert(URL_ANNOTATION.to_string(), u.clone());
            }
            None => {
                annotations.remove(URL_ANNOTATION);
            }
        }
        // The sequence this replica published; a new holder's none yet: not the last
        // holder's, which it has not confirmed.
        match self.held.published(shard).filter(|_| mine) {
            Some(seq) => {
                annotations.insert(SEQUENCE_ANNOTATION.to_string(), seq.to_string());
            }
            None => {
                annotations.remove(SEQUENCE_ANNOTATION);
            }
        }
        // The resourceVersion we read makes this a compare-and-swap.
        self.api
            .replace(&lname, &PostParams::default(), &lease)
            .await
            .map(|_| true)
    }
}

#[cfg(test)]
mod tests {
    use faultline_test_apiserver::{ApiServer, Faults};
    use serde_json::json;

    use super::*;

    const URL: &str = "http://10.0.0.1:8080";

    /// The test API server with the `faultline` namespace, and replica `me`'s Leases
    /// (15 s, retried every 2 s, its URL annotated; no fair sharing).
    async fn leases(me: &str) -> (ApiServer, ShardLeases) {
        let (server, mut leases, _) = crate::shard::lease::tests::leases(me, false).await;
        leases.url = Some(URL.into());
        (server, leases)
    }

    fn lease_writes(server: &ApiServer) -> usize {
        server
            .calls()
            .iter()
            .filter(|c| c.method == "PUT" && c.uri.contains("/leases/"))
            .count()
    }

    /// A new shard Lease says who holds it, for how long, since when, and where that
    /// replica's API is; a refused creation is an error, not a Lease someone else made.
    #[tokio::test]
    async fn a_new_lease_names_its_holder_timing_and_url() {
        let (server, l) = leases("r1").await;
        assert!(l.create(2).await.unwrap());
        let v = server
            .get("leases", "faultline", "faultline-shard-2")
            .unwrap();
        let spec = &v["spec"];
        assert_eq!(spec["holderIdentity"], "r1");
        assert_eq!(spec["leaseDurationSeconds"], 15);
        assert_eq!(spec["leaseTransitions"], 0);
        for t in ["acquireTime", "renewTime"] {
            let at = spec[t]
                .as_str()
                .and_then(faultline_common::time::parse_rfc3339_ms);
            let age = faultline_common::time::now_ms().abs_diff(at.unwrap_or(0));
            assert!(age < 10_000, "{t}: {v}");
        }
        assert_eq!(v["metadata"]["annotations"][URL_ANNOTATION], URL);
        assert_eq!(v["metadata"]["labels"][AGGREGATOR_LABEL], "faultline");

        server.set_faults(Faults {
            write_error_rate: 1.0,
            ..Default::default()
        });
        assert!(l.create(3).await.is_err(), "a 500 is an error");
        server.set_faults(Faults::default());
        // One that exists (another replica's, made meanwhile): not ours, and labelled.
        server
            .create(
                "leases",
                "faultline",
                json!({"metadata": {"name": "faultline-shard-3"},
                "spec": {"holderIdentity": "r2", "leaseDurationSeconds": 15}}),
            )
            .unwrap();
        assert!(!l.create(3).await.unwrap());
        let v = server
            .get("leases", "faultline", "faultline-shard-3")
            .unwrap();
        assert_eq!(v["spec"]["holderIdentity"], "r2");
        assert_eq!(v["metadata"]["labels"][AGGREGATOR_LABEL], "faultline");
    }

    /// A renewal written from a stale read (409) is sent once more on a fresh read while
    /// this replica still holds the Lease; once another holds it, the renewal is given
    /// up, not sent again. A takeover (the read showed another holder) that meets a 409
    /// is the error.
    #[tokio::test]
    async fn a_stale_renewal_is_sent_again_only_while_still_held() {
        let (server, l) = leases("r1").await;
        assert!(l.create(0).await.unwrap());
        let stale: Lease = l.api.get("faultline-shard-0").await.unwrap();
        assert!(l.renew(0, stale.clone()).await.unwrap());
        let before = lease_writes(&server);
        assert!(
            l.renew(0, stale.clone()).await.unwrap(),
            "written on a fresh read"
        );
        assert_eq!(lease_writes(&server) - before, 2);
        let v = server
            .get("leases", "faultline", "faultline-shard-0")
            .unwrap();
        assert_eq!(
            v["spec"]["leaseTransitions"], 0,
            "a renewal is no transition"
        );

        // r2 takes it.
        let mut theirs = v;
        theirs["spec"]["holderIdentity"] = json!("r2");
        server
            .update("leases", "faultline", "faultline-shard-0", theirs, None)
            .unwrap();
        let before = lease_writes(&server);
        assert!(!l.renew(0, stale).await.unwrap(), "given up");
        assert_eq!(lease_writes(&server) - before, 1);
        assert_eq!(
            server
                .get("leases", "faultline", "faultline-shard-0")
                .unwrap()["spec"]["holderIdentity"],
            "r2"
        );

        // A takeover from a read that went stale: the 409 itself.
        let read: Lease = l.api.get("faultline-shard-0").await.unwrap();
        let mut moved = server
            .get("leases", "faultline", "faultline-shard-0")
            .unwrap();
        moved["spec"]["renewTime"] = json!("2026-12-07T00:00:00.000000Z");
        server
            .update("leases", "faultline", "faultline-shard-0", moved, None)
            .unwrap();
        let before = lease_writes(&server);
        let e = l.renew(0, read).await;
        assert!(
            matches!(e, Err(kube::Error::Api(ref s)) if s.code == 409),
            "{e:?}"
        );
        assert_eq!(lease_writes(&server) - before, 1);
    }

    /// Taking a Lease over counts a transition and restarts its acquire time.
    #[tokio::test]
    async fn a_takeover_counts_a_transition() {
        let (server, l) = leases("r1").await;
        server
            .create(
                "leases",
                "faultline",
                json!({"metadata": {"name": "faultline-shard-1"},
                "spec": {"holderIdentity": "r2", "leaseDurationSeconds": 15, "leaseTransitions": 3,
                    "acquireTime": "2026-01-01T00:00:00.000000Z"}}),
            )
            .unwrap();
        let read: Lease = l.api.get("faultline-shard-1").await.unwrap();
        assert!(l.replace_lease(1, read).await.unwrap());
        let v = server
            .get("leases", "faultline", "faultline-shard-1")
            .unwrap();
        assert_eq!(v["spec"]["holderIdentity"], "r1");
        assert_eq!(v["spec"]["leaseTransitions"], 4);
        assert_ne!(v["spec"]["acquireTime"], "2026-01-01T00:00:00.000000Z");
    }
}
