//! Shard ownership by Kubernetes Leases (`<name>-shard-<i>`), one fenced loop per
//! replica: this file carries out what [`super::plan`] decides. A pass lists the Leases
//! once, lets the [`Observer`] judge them on this replica's own clock, asks [`plan`] what
//! to renew, take and hand back, and does it. A replica holds a shard while its renewals
//! succeed; it counts the shard as its own only until `renewed_at + duration - margin`
//! on its own clock, checks that before every write, and drops it the moment a renewal
//! is refused (a 409 on the resourceVersion or another holder). Every take and renewal
//! is a compare-and-swap on the resourceVersion read. Defaults follow client-go's leader
//! election: 15 s duration, 2 s retry period.
//!
//! Every replica also renews a member Lease (`<name>-member-<me>`) so the others can
//! count it. A shard handed back is written once more first; a shard taken is seeded
//! from its last published document (through [`SeedSource`]) before this replica
//! writes it, so a change of holder changes no published status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::held::Held;
use super::plan::{plan, Listing, Observer, PlanInput, Record, ShardView};
pub use super::sharing::{SeedSource, Sharing};
use super::timing::bounded;
pub use super::timing::LeaseConfig;
use crate::metrics::Metrics;
use crate::model::{FinalWrite, ShardEvent, Takeover};

/// How a shard's Lease came to be renewed by a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Taken {
    /// Listed with this replica as its holder.
    Renewed,
    /// Listed free (or expired): taken.
    Free,
}

/// The Lease of a shard.
pub fn lease_name(name: &str, shard: u32) -> String {
    format!("{name}-shard-{shard}")
}

pub(super) fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// What the plan compares of a Lease: its record, as plain values.
fn record(spec: &LeaseSpec) -> Record {
    let nanos = |t: &Option<MicroTime>| t.as_ref().map(|t| t.0.as_nanosecond());
    Record {
        holder: spec.holder_identity.clone(),
        renew: nanos(&spec.renew_time),
        acquire: nanos(&spec.acquire_time),
        transitions: spec.lease_transitions,
        duration_secs: spec.lease_duration_seconds,
    }
}

/// A Lease released as client-go's leader election releases one: no holder (`""`), a
/// duration of 1 s, renewed and acquired now, the transitions kept. Tools that read
/// Leases the client-go way (kubectl, controllers' own checks) see it free at once.
fn release(spec: &mut LeaseSpec) {
    let now = now_micro();
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(now.clone());
    spec.acquire_time = Some(now);
}

/// How long after a Lease's expiry (as observed) the loop passes, to find it out.
const PAST_EXPIRY: Duration = Duration::from_millis(20);

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
    pub observer: Observer,
    /// Fair share, seeding and graceful hand-back; `None`: take every shard
    /// that is free, as one replica alone would.
    pub share: Option<Sharing>,
}

/// The annotation on a shard Lease naming its holder's API.
pub const URL_ANNOTATION: &str = "faultline.io/url";
/// The annotation on a shard Lease with the sequence its holder last published; with
/// the Lease's `renewTime` it says how fresh the shard is without a rewrite of its
/// pages.
pub const SEQUENCE_ANNOTATION: &str = "faultline.io/sequence";
/// The label on every Lease of an aggregator (shards and members): its `--name`. The
/// Leases are listed by it, from the API server's cache.
pub const AGGREGATOR_LABEL: &str = "faultline.io/aggregator";
/// The label on member Leases: the aggregator's `--name`.
pub const MEMBER_LABEL: &str = "faultline.io/member-of";

impl ShardLeases {
    /// An observer for this replica's Leases (what [`ShardLeases::observer`] starts as).
    pub fn observer_for(me: &str, cfg: &LeaseConfig) -> Observer {
        Observer::new(me, cfg.duration)
    }

    /// One pass: renew our member Lease; list every Lease once; judge them; plan; renew
    /// what we keep, hand one back, take free shards up to our share.
    pub async fn pass(&mut self) {
        // Side by side (under a slow API server, every call in sequence made
        // a pass as long as their sum, and the renewals came later than the holds last).
        // Each call bounded by half a hold: one that hangs holds up no pass past that.
        let deadline = self.cfg.call_deadline();
        let (member, listed) = tokio::join!(
            bounded(deadline, "member lease", self.renew_member()),
            bounded(deadline, "lease list", self.list())
        );
        if let Err(e) = member {
            tracing::warn!(error = %e, "member lease renewal failed");
        }
        let (listing, mut leases) = match listed {
            Ok(l) => l,
            Err(e) => {
                // Could not ask: keep what we have until it runs out on our own clock.
                self.metrics.lease_error();
                for shard in 0..self.shards {
                    self.metrics.set_lease(shard, self.held.holds(shard));
                }
                tracing::warn!(error = %e, "lease list failed");
                let live = self.share.as_ref().and_then(|s| s.last_live.as_ref());
                self.metrics
                    .set_ownership(self.held.shards().len(), live.map_or(1, Vec::len));
                return;
            }
        };
        let now = Instant::now();
        let seen = self.observer.pass(&listing, self.shards, now);
        let live = match self.share.as_mut() {
            Some(sh) => {
                sh.last_live = Some(seen.live.clone());
                Some(seen.live.clone())
            }
            None => None,
        };
        if self.share.is_some() {
            self.remove_stale(&seen.stale).await;
        }
        let (joined, hold_off) = self
            .share
            .as_ref()
            .map_or((false, None), |s| (s.joined, s.hold_off));
        let p = plan(&PlanInput {
            me: &self.me,
            shards: &seen.shards,
            live: live.as_deref(),
            joined,
            hold_off,
            retry: self.cfg.retry,
            now,
        });
        if let Some(sh) = self.share.as_mut() {
            sh.joined = p.joined;
            sh.hold_off = p.hold_off;
        }
        for shard in &p.others {
            if self.held.holds(*shard) {
                tracing::warn!(
                    shard,
                    "shard lease held by another replica; stopping writes"
                );
            }
            self.set_held(*shard, None).await;
            self.metrics.set_lease(*shard, false);
        }
        // Every renewal at once, each bounded by the client's timeout: one slow or hung
        // Lease delays neither the others' renewals nor, beyond that bound, the pass.
        let started = Instant::now();
        let this = &*self;
        let renewals: Vec<_> = p
            .renew
            .iter()
            .filter_map(|shard| {
                let lease = leases.remove(shard)?;
                let renewal = bounded(deadline, "lease renewal", this.renew(*shard, lease));
                Some(async move { (*shard, renewal.await) })
            })
            .collect();
        let renewed = futures_util::future::join_all(renewals).await;
        // Their outcomes side by side too: a shard seeded after a restart reads its pages,
        // and a seed in sequence per shard made the last shards' holds run out before
        // they were set (at 2 s of latency, 4 s a seed, 8 shards).
        futures_util::future::join_all(
            renewed
                .into_iter()
                .map(|(shard, r)| self.outcome(shard, r, started, Taken::Renewed)),
        )
        .await;
        // The kept shards are renewed; now the one handed back goes.
        if let Some(shard) = p.hand_back {
            if let Some(lease) = leases.remove(&shard) {
                self.hand_back(shard, lease).await;
            }
        }
        let mut taken = 0;
        for shard in p.take {
            if taken >= p.room {
                break;
            }
            let previous = match &seen.shards[&shard] {
                ShardView::Free { previous } => previous.clone(),
                _ => None,
            };
            let started = Instant::now();
            self.observer.forget_shard(shard);
            let r = match leases.remove(&shard) {
                Some(l) => bounded(deadline, "lease take", self.renew(shard, l)).await,
                None => bounded(deadline, "lease create", self.create(shard)).await,
            };
            if matches!(r, Ok(true)) {
                taken += 1;
                if previous.is_some_and(|p| p != self.me) {
                    self.metrics.takeover();
                }
            }
            self.outcome(shard, r, started, Taken::Free).await;
        }
        let n = self.held.shards().len();
        self.metrics
            .set_ownership(n, live.as_ref().map_or(1, Vec::len));
    }

    /// Renew our member Lease (fair sharing only).
    async fn renew_member(&self) -> Result<(), kube::Error> {
        if self.share.is_none() {
            return Ok(());
        }
        let lname = format!("{}-member-{}", self.name, self.me);
        let spec = LeaseSpec {
            holder_identity: Some(self.me.clone()),
            lease_duration_seconds: Some(self.cfg.duration.as_secs() as i32),
            renew_time: Some(now_micro()),
            ..Default::default()
        };
        let labels: BTreeMap<String, String> = [
            (MEMBER_LABEL.to_string(), self.name.clone()),
            (AGGREGATOR_LABEL.to_string(), self.name.clone()),
        ]
        .into();
        let r = match self.api.get_opt(&lname).await {
            Ok(Some(mut l)) => {
                l.spec = Some(spec);
                l.metadata
                    .labels
                    .get_or_insert_with(Default::default)
                    .extend(labels);
                self.api
                    .replace(&lname, &PostParams::default(), &l)
                    .await
                    .map(|_| ())
            }
            Ok(None) => {
                let l = Lease {
                    metadata: ObjectMeta {
                        name: Some(lname.clone()),
                        labels: Some(labels),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api
                    .create(&PostParams::default(), &l)
                    .await
                    .map(|_| ())
            }
            Err(e) => Err(e),
        };
        r
    }

    /// This aggregator's Leases in one list (by [`AGGREGATOR_LABEL`], from the API
    /// server's watch cache: `resourceVersion=0`): what the plan reads (the
    /// shards' records, and the members' where fair sharing counts them: without it no
    /// member's expiry wakes the loop), and the shard Leases themselves by shard (a
    /// renewal or take replaces the one read: a compare-and-swap, so a read the cache
    /// served late costs a 409 and a fresh read, never a shard).
    async fn list(&self) -> Result<(Listing, BTreeMap<u32, Lease>), kube::Error> {
        let mut listing = Listing::default();
        let mut leases = BTreeMap::new();
        let names: BTreeMap<String, u32> = (0..self.shards)
            .map(|s| (lease_name(&self.name, s), s))
            .collect();
        let lp = ListParams::default()
            .labels(&format!("{AGGREGATOR_LABEL}={}", self.name))
            .match_any();
        for l in self.api.list(&lp).await?.items {
            let Some(name) = l.metadata.name.as_deref() else {
                continue;
            };
            let spec = l.spec.clone().unwrap_or_default();
            if let Some(shard) = names.get(name) {
                listing.shards.insert(*shard, record(&spec));
                leases.insert(*shard, l);
            } else if self.share.is_some()
                && l.metadata.labels.as_ref().and_then(|m| m.get(MEMBER_LABEL)) == Some(&self.name)
            {
                if let Some(who) = spec.holder_identity.clone().filter(|h| !h.is_empty()) {
                    listing.members.insert(who, record(&spec));
                }
            }
        }
        Ok((listing, leases))
    }

    /// Note what others' Leases show now, between passes (every quarter retry period,
    /// one list): a renewal is seen within that, not up to a retry period late, so a
    /// dead holder's leases run out, as this replica counts them, that much sooner after
    /// its last renewal (the loop wakes at each expiry). Whether another replica let a
    /// shard go (released) or left (its member Lease deleted) since: pass at once.
    async fn observe(&mut self) -> bool {
        let deadline = self.cfg.call_deadline();
        match bounded(deadline, "lease list", self.list()).await {
            Ok((listing, _)) => self.observer.between(&listing, self.shards, Instant::now()),
            Err(e) => {
                self.metrics.lease_error();
                tracing::warn!(error = %e, "lease list failed");
                false
            }
        }
    }

    /// Remove the member Leases of replicas long gone (the observer found them stale).
    async fn remove_stale(&mut self, stale: &[String]) {
        for who in stale {
            let lname = format!("{}-member-{who}", self.name);
            if self.api.delete(&lname, &Default::default()).await.is_ok() {
                self.observer.forget_member(who);
                tracing::info!(replica = %who, "removed the member lease of a replica long gone");
            }
        }
    }

    /// What a renewal or a take came to.
    async fn outcome(
        &self,
        shard: u32,
        r: Result<bool, kube::Error>,
        started: Instant,
        taken: Taken,
    ) {
        let lname = lease_name(&self.name, shard);
        let was = self.held.holds(shard);
        let granted = self.held.keys().contains(&shard);
        match r {
            Ok(true) => {
                if granted && !was {
                    self.metrics.hold_lapse();
                    tracing::warn!(shard, lease = %lname, "the shard's hold ran out on this replica's clock before its renewal came back; held again (no writes meanwhile)");
                }
                // Seed from the last published document before this replica writes the
                // shard, then count it as held. Not for a renewal of a Lease this
                // replica still has granted, even if the hold ran out on its clock
                // meanwhile: the Lease named us as its holder, and the renewal swapped
                // exactly that version, so no other replica has written the shard since
                // our last renewal (every renewal after a lapse seeded again,
                // in sequence, and the holds never caught up).
                if !(granted && taken == Taken::Renewed) {
                    self.seed(shard).await;
                    tracing::info!(shard, lease = %lname, "shard lease acquired");
                }
                self.set_held(shard, Some(self.cfg.hold_until(started)))
                    .await;
            }
            Ok(false) => {
                if was {
                    tracing::warn!(shard, lease = %lname, "shard lease held by another replica; stopping writes");
                }
                self.set_held(shard, None).await;
            }
            // Refused (another replica won the race): ours no more, at once.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if was {
                    tracing::warn!(shard, lease = %lname, "shard lease lost to a conflicting update; stopping writes");
                }
                self.set_held(shard, None).await;
            }
            // Could not ask: keep what we have until it runs out on our own clock.
            Err(e) => {
                self.metrics.lease_error();
                tracing::warn!(shard, lease = %lname, error = %e, "lease renewal failed");
            }
        }
        self.metrics.set_lease(shard, self.held.holds(shard));
    }

    /// Hand the core loop the shard's last published document (none: nothing to seed).
    async fn seed(&self, shard: u32) {
        let Some(sharing) = &self.share else {
            return;
        };
        let nodes = sharing.seeds.read(shard).await;
        let devices: usize = nodes.iter().map(|n| n.npus.len()).sum();
        self.metrics.seeded(devices);
        let taken = ShardEvent::Taken(Takeover { shard, nodes });
        let _ = sharing.events.send(taken).await;
    }

    /// Count `shard` as held until `until` (`None`: not held), and tell the core loop
    /// when the shards granted changed: after the seed of a shard taken, in one stream.
    async fn set_held(&self, shard: u32, until: Option<Instant>) {
        if self.held.set(shard, until) {
            if let Some(sharing) = &self.share {
                let _ = sharing.events.send(ShardEvent::Held).await;
            }
        }
    }

    /// Write the shard once more, then release its Lease for another replica.
    async fn hand_back(&self, shard: u32, mut lease: Lease) {
        if let Some(sharing) = &self.share {
            let (done, wait) = oneshot::channel();
            let last = ShardEvent::FinalWrite(FinalWrite { shard, done });
            if sharing.events.send(last).await.is_ok() {
                let _ = tokio::time::timeout(Duration::from_secs(2), wait).await;
            }
        }
        self.set_held(shard, None).await;
        self.drain(&[shard]).await;
        self.metrics.set_lease(shard, false);
        self.metrics.rebalance();
        if let Some(spec) = lease.spec.as_mut() {
            release(spec);
        }
        let lname = lease_name(&self.name, shard);
        let pp = PostParams::default();
        let release = self.api.replace(&lname, &pp, &lease);
        match bounded(self.cfg.call_deadline(), "lease hand-back", release).await {
            Ok(_) => tracing::info!(shard, "shard handed back to even out the shares"),
            Err(e) => {
                tracing::warn!(shard, error = %e, "handing the shard back failed; the next pass finds it ours again")
            }
        }
    }

    /// Wait until the writes that passed the fence of `shards` (closed already) have
    /// landed: [`Held::quiet_at`]. A crashed holder's Lease runs out that late at least.
    async fn drain(&self, shards: &[u32]) {
        if let Some(until) = self.held.quiet_at(shards, self.cfg.margin) {
            tracing::info!(
                ?until,
                "writes may be in flight; releasing once they have landed"
            );
            tokio::time::sleep_until(until).await;
        }
    }

    /// Renew and acquire until cancelled; on cancel, release what we hold (and our
    /// membership) so another replica takes over at once.
    pub async fn run(mut self, cancel: CancellationToken) {
        'passes: loop {
            self.pass().await;
            self.metrics.lease_pass();
            let next_pass = Instant::now() + self.cfg.retry;
            // Until the next pass: observe others' Leases every quarter retry period, and
            // pass at once just past the soonest expiry, or when one has run out.
            loop {
                let now = Instant::now();
                let expiry = self.observer.next_expiry(now).map(|t| t + PAST_EXPIRY);
                let observe_at = now + self.cfg.retry / 4;
                let wake = expiry
                    .map_or(observe_at, |t| t.min(observe_at))
                    .min(next_pass);
                // Cancel first: the same inputs take the same branch (the replays).
                tokio::select! {
                    biased;
                    _ = cancel.cancelled() => break 'passes,
                    _ = tokio::time::sleep_until(wake) => {}
                }
                if wake >= next_pass || expiry.is_some_and(|t| wake >= t) || self.observe().await {
                    break;
                }
            }
        }
        let held = self.held.shards();
        for &shard in &held {
            self.set_held(shard, None).await;
        }
        self.drain(&held).await;
        let (api, name, me) = (&self.api, &self.name, &self.me);
        for shard in held {
            let lname = lease_name(name, shard);
            if let Ok(mut lease) = api.get(&lname).await {
                if let Some(spec) = lease
                    .spec
                    .as_mut()
                    .filter(|s| s.holder_identity.as_deref() == Some(me.as_str()))
                {
                    release(spec);
                    let _ = api.replace(&lname, &PostParams::default(), &lease).await;
                    tracing::info!(shard, "shard lease released");
                }
            }
        }
        if self.share.is_some() {
            // Gone: the others count one replica fewer at their next pass.
            let _ = api
                .delete(&format!("{name}-member-{me}"), &Default::default())
                .await;
        }
    }
}

#[cfg(test)]
#[path = "lease_tests.rs"]
pub(super) mod tests;
