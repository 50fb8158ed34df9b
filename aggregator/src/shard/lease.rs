//! Shard ownership by Kubernetes Leases (`<name>-shard-<i>`), one fenced loop per
//! replica. A replica holds a shard while its renewals succeed; it counts the shard as
//! its own only until `renewed_at + duration - margin` on its own clock, checks that
//! before every write, and drops it the moment a renewal is refused (a 409 on the
//! resourceVersion or another holder).
//!
//! Another replica takes a shard only once the Lease has not changed for the lease
//! duration *as this replica observed it*, on its own clock: the holder's `renewTime`
//! is another machine's clock and is never compared with ours, so clock skew between
//! replicas cannot make two holders (client-go's `leaderelection.go`: `observedTime`,
//! `observedRawRecord`, `isLeaseValid`). Defaults follow client-go's leader election:
//! 15 s duration, 2 s retry period.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Lease timing.
#[derive(Debug, Clone, Copy)]
pub struct LeaseConfig {
    /// How long a lease lasts without renewal.
    pub duration: Duration,
    /// How often holders renew and others look.
    pub retry: Duration,
    /// Stop writing this long before the lease would run out.
    pub margin: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            duration: Duration::from_secs(15),
            retry: Duration::from_secs(2),
            margin: Duration::from_secs(3),
        }
    }
}

/// Which shards this replica holds, and until when (its own clock).
#[derive(Clone, Default)]
pub struct Held {
    inner: Arc<Mutex<BTreeMap<u32, Instant>>>,
}

impl Held {
    /// Whether this replica may write `shard` now.
    pub fn holds(&self, shard: u32) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&shard)
            .is_some_and(|until| Instant::now() < *until)
    }

    /// Shards held now.
    pub fn shards(&self) -> Vec<u32> {
        let now = Instant::now();
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, u)| now < **u)
            .map(|(s, _)| *s)
            .collect()
    }

    /// Count `shard` as held until `until` (what a successful renewal does; also for
    /// tests of the writers).
    pub fn grant(&self, shard: u32, until: Instant) {
        self.set(shard, Some(until));
    }

    fn set(&self, shard: u32, until: Option<Instant>) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match until {
            Some(u) => {
                g.insert(shard, u);
            }
            None => {
                g.remove(&shard);
            }
        }
    }
}

/// The Lease of a shard.
pub fn lease_name(name: &str, shard: u32) -> String {
    format!("{name}-shard-{shard}")
}

fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// What a replica last saw of a Lease held by another, and when, on its own clock.
#[derive(Debug, Clone, PartialEq)]
struct Observed {
    /// The holder's record as it was (holder, renew and acquire times, duration,
    /// transitions): a change of any of them is the holder alive.
    record: LeaseSpec,
    /// When this replica saw it change last.
    at: Instant,
}

/// The Leases of other holders as this replica observed them, per shard.
#[derive(Debug, Default)]
pub struct Observations(BTreeMap<u32, Observed>);

impl Observations {
    /// Note `spec` as seen `now`; whether its holder's lease has run out: a holder is
    /// named, and the record has not changed for its duration as we saw it.
    fn expired(&mut self, shard: u32, spec: &LeaseSpec, duration: Duration, now: Instant) -> bool {
        if spec.holder_identity.as_deref().is_none_or(str::is_empty) {
            return true;
        }
        let seen = self.0.entry(shard).or_insert_with(|| Observed {
            record: spec.clone(),
            at: now,
        });
        if seen.record != *spec {
            *seen = Observed {
                record: spec.clone(),
                at: now,
            };
        }
        let dur = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(1) as u64))
            .unwrap_or(duration);
        now.duration_since(seen.at) > dur
    }

    /// Forget a shard's observation (it is ours now, or gone).
    fn forget(&mut self, shard: u32) {
        self.0.remove(&shard);
    }
}

/// This replica's shard Leases.
pub struct ShardLeases {
    /// The Lease API in the aggregator's namespace.
    pub api: Api<Lease>,
    /// Base name: `<name>-shard-<i>`.
    pub name: String,
    /// This replica's identity (`holderIdentity`).
    pub me: String,
    /// Number of shards.
    pub shards: u32,
    /// Timing.
    pub cfg: LeaseConfig,
    /// What we hold, shared with the writers.
    pub held: Held,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Where this replica's API is reached (annotated on the Leases it holds, so the
    /// alert intake of another replica can hand alerts of this shard over).
    pub url: Option<String>,
    /// Others' Leases as observed; owned by this loop.
    pub observed: Observations,
}

/// The annotation on a shard Lease naming its holder's API.
pub const URL_ANNOTATION: &str = "faultline.io/url";

impl ShardLeases {
    /// One pass over every shard: renew what we hold, take what has expired.
    pub async fn pass(&mut self) {
        let (api, name, me, cfg, held, metrics) = (
            &self.api,
            &self.name,
            self.me.as_str(),
            &self.cfg,
            &self.held,
            &self.metrics,
        );
        for shard in 0..self.shards {
            let lname = lease_name(name, shard);
            let started = Instant::now();
            let outcome = match api.get_opt(&lname).await {
                Ok(None) => {
                    let lease = Lease {
                        metadata: ObjectMeta {
                            name: Some(lname.clone()),
                            annotations: self
                                .url
                                .as_ref()
                                .map(|u| [(URL_ANNOTATION.to_string(), u.clone())].into()),
                            ..Default::default()
                        },
                        spec: Some(LeaseSpec {
                            holder_identity: Some(me.to_string()),
                            lease_duration_seconds: Some(cfg.duration.as_secs() as i32),
                            acquire_time: Some(now_micro()),
                            renew_time: Some(now_micro()),
                            lease_transitions: Some(0),
                            ..Default::default()
                        }),
                    };
                    api.create(&PostParams::default(), &lease)
                        .await
                        .map(|_| true)
                }
                Ok(Some(mut lease)) => {
                    let spec = lease.spec.get_or_insert_with(Default::default);
                    let mine = spec.holder_identity.as_deref() == Some(me);
                    let expired = !mine
                        && self
                            .observed
                            .expired(shard, spec, cfg.duration, Instant::now());
                    if mine || expired {
                        self.observed.forget(shard);
                        if !mine {
                            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                            spec.acquire_time = Some(now_micro());
                            spec.holder_identity = Some(me.to_string());
                        }
                        spec.renew_time = Some(now_micro());
                        spec.lease_duration_seconds = Some(cfg.duration.as_secs() as i32);
                        // The holder's URL, or none: never the previous holder's.
                        match &self.url {
                            Some(u) => {
                                lease
                                    .metadata
                                    .annotations
                                    .get_or_insert_with(Default::default)
                                    .insert(URL_ANNOTATION.to_string(), u.clone());
                            }
                            None => {
                                if let Some(a) = lease.metadata.annotations.as_mut() {
                                    a.remove(URL_ANNOTATION);
                                }
                            }
                        }
                        // The resourceVersion we read makes this a compare-and-swap.
                        api.replace(&lname, &PostParams::default(), &lease)
                            .await
                            .map(|_| true)
                    } else {
                        Ok(false)
                    }
                }
                Err(e) => Err(e),
            };
            let was = held.holds(shard);
            match outcome {
                Ok(true) => {
                    self.held
                        .set(shard, Some(started + cfg.duration - cfg.margin));
                    if !was {
                        tracing::info!(shard, lease = %lname, "shard lease acquired");
                    }
                }
                Ok(false) => {
                    if was {
                        tracing::warn!(shard, lease = %lname, "shard lease held by another replica; stopping writes");
                    }
                    held.set(shard, None);
                }
                // Refused (another replica won the race): ours no more, at once.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    if was {
                        tracing::warn!(shard, lease = %lname, "shard lease lost to a conflicting update; stopping writes");
                    }
                    held.set(shard, None);
                }
                // Could not ask: keep what we have until it runs out on our own clock.
                Err(e) => {
                    metrics.lease_error();
                    tracing::warn!(shard, lease = %lname, error = %e, "lease renewal failed");
                }
            }
            metrics.set_lease(shard, held.holds(shard));
        }
    }

    /// Renew and acquire until cancelled; on cancel, release what we hold so another
    /// replica takes over at once.
    pub async fn run(mut self, cancel: CancellationToken) {
        loop {
            self.pass().await;
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(self.cfg.retry) => {}
            }
        }
        let (api, name, me, held) = (&self.api, &self.name, &self.me, &self.held);
        for shard in held.shards() {
            held.set(shard, None);
            let lname = lease_name(name, shard);
            if let Ok(mut lease) = api.get(&lname).await {
                if let Some(spec) = lease
                    .spec
                    .as_mut()
                    .filter(|s| s.holder_identity.as_deref() == Some(me.as_str()))
                {
                    spec.holder_identity = None;
                    spec.renew_time = None;
                    let _ = api.replace(&lname, &PostParams::default(), &lease).await;
                    tracing::info!(shard, "shard lease released");
                }
            }
        }
    }
}
