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
//!
//! Fair share (issue 11): every replica renews a member Lease (`<name>-member-<me>`)
//! and counts the live ones, observed the same way. It holds at most
//! `ceil(shards / live)` shards: it takes free or expired shards up to that, hands one
//! back when it holds more, or holds the full share while another live replica holds
//! less than `floor(shards / live)` (a newcomer). A shard handed back is written once
//! more first; a shard taken is seeded from its last published document before this
//! replica writes it, so a change of holder changes no published status.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faultline_common::fault::NodeFaults;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::model::{FinalWrite, Takeover};

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

/// Which shards this replica holds, and until when (its own clock). Followers of the
/// agents watch the set (`subscribe`): a replica follows only its shards' nodes.
#[derive(Clone)]
pub struct Held {
    inner: Arc<Mutex<BTreeMap<u32, Instant>>>,
    changes: Arc<watch::Sender<BTreeSet<u32>>>,
}

impl Default for Held {
    fn default() -> Self {
        Held {
            inner: Arc::default(),
            changes: Arc::new(watch::channel(BTreeSet::new()).0),
        }
    }
}

impl Held {
    /// The set of shards held, as it changes (grants and releases, not expiry).
    pub fn subscribe(&self) -> watch::Receiver<BTreeSet<u32>> {
        self.changes.subscribe()
    }

    /// The shards granted and not released, whether or not their hold has run out on
    /// this replica's clock (the set [`Held::subscribe`] sends).
    pub fn keys(&self) -> BTreeSet<u32> {
        self.changes.borrow().clone()
    }

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
        let keys: BTreeSet<u32> = g.keys().copied().collect();
        drop(g);
        self.changes.send_if_modified(|s| {
            let changed = *s != keys;
            *s = keys;
            changed
        });
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
pub struct Observed {
    /// The holder's record as it was (holder, renew and acquire times, duration,
    /// transitions): a change of any of them is the holder alive.
    record: LeaseSpec,
    /// When this replica saw it change last.
    at: Instant,
}

impl Observed {
    /// The duration its record states, else `default`.
    fn duration(&self, default: Duration) -> Duration {
        self.record
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(1) as u64))
            .unwrap_or(default)
    }
}

/// Note a member Lease's record as seen `now`; whether that replica is live: its record
/// changed within its duration as we observed it, on our own clock.
fn note_member(
    members: &mut BTreeMap<String, Observed>,
    who: String,
    spec: &LeaseSpec,
    duration: Duration,
    now: Instant,
) -> bool {
    let seen = members.entry(who).or_insert_with(|| Observed {
        record: spec.clone(),
        at: now,
    });
    if seen.record != *spec {
        *seen = Observed {
            record: spec.clone(),
            at: now,
        };
    }
    spec.renew_time.is_some() && now.duration_since(seen.at) <= seen.duration(duration)
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
        now.duration_since(seen.at) > seen.duration(duration)
    }

    /// The soonest moment, after `now`, that a lease observed would run out: the Lease
    /// loop looks again then rather than up to a retry period later (a dead holder's
    /// shards are taken as soon as its leases run out; issue 11). Leases already out are
    /// not counted (that would spin while this replica is at its share).
    fn next_expiry(&self, duration: Duration, now: Instant) -> Option<Instant> {
        self.0
            .values()
            .map(|o| o.at + o.duration(duration))
            .filter(|t| *t > now)
            .min()
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
    /// Fair share, seeding and graceful hand-back (issue 11); `None`: take every shard
    /// that is free, as one replica alone would.
    pub share: Option<Sharing>,
}

/// What fair sharing needs: the shard ConfigMaps to seed from, and the core loop to
/// hand takeovers and final writes to.
pub struct Sharing {
    /// The shard ConfigMaps (`<name>-shard-<i>`) in the aggregator's namespace.
    pub configmaps: Api<ConfigMap>,
    /// ConfigMaps per shard (`--pages`): each is read to seed a shard taken.
    pub pages: u32,
    /// Takeovers, to the core loop (before the shard counts as held).
    pub takeovers: mpsc::Sender<Takeover>,
    /// Final writes, to the core loop (before a shard is handed back).
    pub final_writes: mpsc::Sender<FinalWrite>,
    /// Other replicas' member Leases as observed, by name.
    pub members: BTreeMap<String, Observed>,
    /// After handing a shard back, take none until then: the replica short of its share
    /// gets the first look (else the one handing back could take its shard again).
    pub hold_off: Option<Instant>,
    /// The live replicas of the last pass that could count them.
    pub last_live: Option<Vec<String>>,
    /// The members were counted once: this replica has announced itself.
    pub joined: bool,
}

impl Sharing {
    /// Fair sharing through these channels.
    pub fn new(
        configmaps: Api<ConfigMap>,
        takeovers: mpsc::Sender<Takeover>,
        final_writes: mpsc::Sender<FinalWrite>,
    ) -> Self {
        Sharing {
            configmaps,
            pages: 1,
            takeovers,
            final_writes,
            members: BTreeMap::new(),
            hold_off: None,
            last_live: None,
            joined: false,
        }
    }
}

/// The annotation on a shard Lease naming its holder's API.
pub const URL_ANNOTATION: &str = "faultline.io/url";
/// The label on member Leases: the aggregator's `--name`.
pub const MEMBER_LABEL: &str = "faultline.io/member-of";

/// One shard as a pass found it.
enum Seen {
    /// Ours: renew it (the Lease read, for a compare-and-swap).
    Mine(Box<Lease>),
    /// Nobody's (absent, released or run out): the Lease, if there is one, and the
    /// holder it had.
    Free(Option<Box<Lease>>, Option<String>),
    /// Another live holder's.
    Other(String),
}

/// The shares of `shards` among `live` replicas: (at most, at least).
pub fn share(shards: u32, live: usize) -> (usize, usize) {
    let (s, l) = (shards as usize, live.max(1));
    (s.div_ceil(l), s / l)
}

/// Rendezvous order: the shards a replica prefers first, so replicas taking free shards
/// at once mostly reach for different ones.
fn preference(me: &str, shard: u32) -> u64 {
    faultline_common::fault::fnv1a64(format!("{me}/{shard}").as_bytes())
}

impl ShardLeases {
    /// One pass: renew our member Lease and count the live replicas; renew what we hold;
    /// take free shards up to our share; hand one back when we hold too many.
    pub async fn pass(&mut self) {
        self.renew_member().await;
        // Every Lease in one list (the shards' and the members'), not a read per shard.
        let listed = self.list().await;
        let live = self.members(listed.as_ref().ok()).await;
        let mut seen = BTreeMap::new();
        match listed {
            Ok(mut leases) => {
                for shard in 0..self.shards {
                    let lease = leases.remove(&lease_name(&self.name, shard));
                    seen.insert(shard, self.look(shard, lease));
                }
            }
            Err(e) => {
                // Could not ask: keep what we have until it runs out on our own clock.
                self.metrics.lease_error();
                for shard in 0..self.shards {
                    self.metrics.set_lease(shard, self.held.holds(shard));
                }
                tracing::warn!(error = %e, "lease list failed");
            }
        }
        let mine: Vec<u32> = seen
            .iter()
            .filter(|(_, s)| matches!(s, Seen::Mine(_)))
            .map(|(k, _)| *k)
            .collect();
        let (most, least) = match &live {
            Some(l) => share(self.shards, l.len()),
            // Alone (no fair sharing, or the members never counted): every shard; a
            // shard nobody writes is worse than an uneven share.
            None => (self.shards as usize, 0),
        };
        // Joining: the first pass that counts the members only registers this one and
        // takes nothing, so replicas started together see each other before any of them
        // claims the free shards (else the first claims every shard and hands them back
        // one pass at a time). Costs one retry period at start.
        if let (Some(sh), Some(_)) = (self.share.as_mut(), &live) {
            if !sh.joined {
                sh.joined = true;
                sh.hold_off = Some(Instant::now() + self.cfg.retry);
            }
        }
        // Hand back: above the share; or at a share above the floor while a live
        // replica is below it (a newcomer), one per pass.
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for s in seen.values() {
            if let Seen::Other(h) = s {
                *counts.entry(h.as_str()).or_default() += 1;
            }
        }
        let starving = live.as_ref().is_some_and(|l| {
            l.iter()
                .any(|r| *r != self.me && counts.get(r.as_str()).copied().unwrap_or(0) < least)
        });
        // One shard per pass at most: each hand-back waits for a final write, and the
        // shards kept must be renewed in time.
        let give = usize::from(
            mine.len() > most || (live.is_some() && mine.len() == most && most > least && starving),
        );
        let mut by_pref = mine.clone();
        by_pref.sort_by_key(|s| preference(&self.me, *s));
        let release: BTreeSet<u32> = by_pref.iter().rev().take(give).copied().collect();
        let mut held_now = mine.len() - release.len();
        let mut free = Vec::new();
        let mut handing_back = Vec::new();
        for (shard, s) in seen {
            match s {
                Seen::Mine(lease) if release.contains(&shard) => handing_back.push((shard, lease)),
                Seen::Mine(lease) => {
                    let started = Instant::now();
                    let r = self.renew(shard, *lease).await;
                    self.outcome(shard, r, started).await;
                }
                Seen::Free(lease, previous) => free.push((shard, lease, previous)),
                Seen::Other(_) => {
                    if self.held.holds(shard) {
                        tracing::warn!(
                            shard,
                            "shard lease held by another replica; stopping writes"
                        );
                    }
                    self.held.set(shard, None);
                    self.metrics.set_lease(shard, false);
                }
            }
        }
        // The kept shards are renewed; now the one handed back goes.
        for (shard, lease) in handing_back {
            self.hand_back(shard, *lease).await;
        }
        // Free shards, in this replica's order of preference, up to its share; none for
        // two retry periods after handing one back.
        if !release.is_empty() {
            if let Some(sh) = self.share.as_mut() {
                sh.hold_off = Some(Instant::now() + 2 * self.cfg.retry);
            }
        }
        let holding_off = self
            .share
            .as_ref()
            .and_then(|s| s.hold_off)
            .is_some_and(|t| Instant::now() < t);
        free.sort_by_key(|(s, _, _)| preference(&self.me, *s));
        for (shard, lease, previous) in free {
            if held_now >= most || holding_off {
                break;
            }
            let started = Instant::now();
            let r = match lease {
                Some(l) => self.renew(shard, *l).await,
                None => self.create(shard).await,
            };
            if matches!(r, Ok(true)) {
                held_now += 1;
                if previous.is_some_and(|p| p != self.me) {
                    self.metrics.takeover();
                }
            }
            self.outcome(shard, r, started).await;
        }
        let n = self.held.shards().len();
        self.metrics
            .set_ownership(n, live.as_ref().map_or(1, Vec::len));
    }

    /// Renew our member Lease (fair sharing only).
    async fn renew_member(&mut self) {
        if self.share.is_none() {
            return;
        }
        let lname = format!("{}-member-{}", self.name, self.me);
        let spec = LeaseSpec {
            holder_identity: Some(self.me.clone()),
            lease_duration_seconds: Some(self.cfg.duration.as_secs() as i32),
            renew_time: Some(now_micro()),
            ..Default::default()
        };
        let r = match self.api.get_opt(&lname).await {
            Ok(Some(mut l)) => {
                l.spec = Some(spec);
                self.api
                    .replace(&lname, &PostParams::default(), &l)
                    .await
                    .map(|_| ())
            }
            Ok(None) => {
                let l = Lease {
                    metadata: ObjectMeta {
                        name: Some(lname.clone()),
                        labels: Some([(MEMBER_LABEL.to_string(), self.name.clone())].into()),
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
        if let Err(e) = r {
            tracing::warn!(error = %e, "member lease renewal failed");
        }
    }

    /// Every Lease of the namespace, by name: one list for the shards and the members.
    async fn list(&self) -> Result<BTreeMap<String, Lease>, kube::Error> {
        Ok(self
            .api
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|l| Some((l.metadata.name.clone()?, l)))
            .collect())
    }

    /// The member Leases among `leases`, with their specs.
    fn member_specs<'a>(
        &self,
        leases: &'a BTreeMap<String, Lease>,
    ) -> impl Iterator<Item = (String, &'a LeaseSpec)> + use<'a, '_> {
        leases.values().filter_map(|l| {
            let labels = l.metadata.labels.as_ref()?;
            if labels.get(MEMBER_LABEL) != Some(&self.name) {
                return None;
            }
            let spec = l.spec.as_ref()?;
            let who = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
            Some((who, spec))
        })
    }

    /// Note what others' Leases show now, between passes (every quarter retry period,
    /// one list): a renewal is seen within that, not up to a retry period late, so a
    /// dead holder's leases run out, as this replica counts them, that much sooner after
    /// its last renewal (the loop wakes at each expiry). Whether another replica let a
    /// shard go (released) or left (its member Lease deleted) since: pass at once.
    async fn observe(&mut self) -> bool {
        let leases = match self.list().await {
            Ok(l) => l,
            Err(e) => {
                self.metrics.lease_error();
                tracing::warn!(error = %e, "lease list failed");
                return false;
            }
        };
        let now = Instant::now();
        let mut changed = false;
        for shard in 0..self.shards {
            let Some(spec) = leases
                .get(&lease_name(&self.name, shard))
                .and_then(|l| l.spec.as_ref())
            else {
                continue;
            };
            match spec.holder_identity.as_deref() {
                Some(h) if h == self.me => {}
                Some(h) if !h.is_empty() => {
                    self.observed.expired(shard, spec, self.cfg.duration, now);
                }
                // Released: news once (the observation goes with it).
                _ => changed |= self.observed.0.remove(&shard).is_some(),
            }
        }
        let members: Vec<(String, LeaseSpec)> = self
            .member_specs(&leases)
            .filter(|(who, _)| *who != self.me)
            .map(|(w, s)| (w, s.clone()))
            .collect();
        let duration = self.cfg.duration;
        if let Some(sharing) = self.share.as_mut() {
            let before = sharing.members.len();
            sharing
                .members
                .retain(|k, _| members.iter().any(|(w, _)| w == k));
            changed |= sharing.members.len() != before;
            for (who, spec) in members {
                note_member(&mut sharing.members, who, &spec, duration, now);
            }
        }
        changed
    }

    /// Count the live members among `leases` (us included) and remove the member Leases
    /// of replicas long gone; `None` when fair sharing is off or the Leases could not be
    /// listed (then the replicas are counted as last counted).
    async fn members(&mut self, leases: Option<&BTreeMap<String, Lease>>) -> Option<Vec<String>> {
        self.share.as_ref()?;
        let Some(leases) = leases else {
            tracing::warn!("cannot list member leases; counting the replicas as last counted");
            return self.share.as_ref()?.last_live.clone();
        };
        let specs: Vec<(String, LeaseSpec)> = self
            .member_specs(leases)
            .map(|(w, s)| (w, s.clone()))
            .collect();
        let (me, duration) = (self.me.clone(), self.cfg.duration);
        let sharing = self.share.as_mut()?;
        let now = Instant::now();
        let mut live = vec![me.clone()];
        let mut names = BTreeSet::new();
        for (who, spec) in specs {
            names.insert(who.clone());
            if who == me {
                continue;
            }
            if note_member(&mut sharing.members, who.clone(), &spec, duration, now) {
                live.push(who);
            }
        }
        sharing.members.retain(|k, _| names.contains(k));
        live.sort();
        live.dedup();
        // Member Leases of replicas long gone (a crash leaves one behind, and a new pod
        // has a new name): removed once unchanged for ten durations.
        let stale: Vec<String> = sharing
            .members
            .iter()
            .filter(|(_, o)| now.duration_since(o.at) > 10 * self.cfg.duration)
            .map(|(k, _)| k.clone())
            .collect();
        for who in stale {
            let lname = format!("{}-member-{who}", self.name);
            if self.api.delete(&lname, &Default::default()).await.is_ok() {
                sharing.members.remove(&who);
                tracing::info!(replica = %who, "removed the member lease of a replica long gone");
            }
        }
        sharing.last_live = Some(live.clone());
        Some(live)
    }

    /// One shard's Lease as listed (`None`: there is none).
    fn look(&mut self, shard: u32, lease: Option<Lease>) -> Seen {
        let Some(lease) = lease else {
            return Seen::Free(None, None);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        if holder.as_deref() == Some(self.me.as_str()) {
            self.observed.forget(shard);
            return Seen::Mine(Box::new(lease));
        }
        if self
            .observed
            .expired(shard, &spec, self.cfg.duration, Instant::now())
        {
            return Seen::Free(Some(Box::new(lease)), holder);
        }
        Seen::Other(holder.unwrap_or_default())
    }

    /// Create the Lease of a shard nobody ever held.
    async fn create(&self, shard: u32) -> Result<bool, kube::Error> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(lease_name(&self.name, shard)),
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

    /// Renew our Lease, or take one that is free.
    async fn renew(&mut self, shard: u32, mut lease: Lease) -> Result<bool, kube::Error> {
        let lname = lease_name(&self.name, shard);
        let spec = lease.spec.get_or_insert_with(Default::default);
        let mine = spec.holder_identity.as_deref() == Some(self.me.as_str());
        self.observed.forget(shard);
        if !mine {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.acquire_time = Some(now_micro());
            spec.holder_identity = Some(self.me.clone());
        }
        spec.renew_time = Some(now_micro());
        spec.lease_duration_seconds = Some(self.cfg.duration.as_secs() as i32);
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
        self.api
            .replace(&lname, &PostParams::default(), &lease)
            .await
            .map(|_| true)
    }

    /// What a renewal or a take came to.
    async fn outcome(&self, shard: u32, r: Result<bool, kube::Error>, started: Instant) {
        let lname = lease_name(&self.name, shard);
        let was = self.held.holds(shard);
        match r {
            Ok(true) => {
                if !was {
                    // Seed from the last published document before this replica writes
                    // the shard, then count it as held.
                    self.seed(shard).await;
                    tracing::info!(shard, lease = %lname, "shard lease acquired");
                }
                self.held
                    .set(shard, Some(started + self.cfg.duration - self.cfg.margin));
            }
            Ok(false) => {
                if was {
                    tracing::warn!(shard, lease = %lname, "shard lease held by another replica; stopping writes");
                }
                self.held.set(shard, None);
            }
            // Refused (another replica won the race): ours no more, at once.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if was {
                    tracing::warn!(shard, lease = %lname, "shard lease lost to a conflicting update; stopping writes");
                }
                self.held.set(shard, None);
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
        // The shard's ConfigMaps: page 0 has its Lease's name (`<name>-shard-<i>`),
        // further pages `<name>-shard-<i>-page-<p>`; each read by name (RBAC can name
        // them), a missing one is nothing to seed.
        let mut t = Takeover {
            shard,
            nodes: Vec::new(),
        };
        for page in 0..sharing.pages.max(1) {
            let cm = crate::publish::configmap::page_name(&self.name, shard, page);
            match sharing.configmaps.get_opt(&cm).await {
                Ok(Some(c)) => self.seed_from(shard, c.data.unwrap_or_default(), &mut t),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(shard, configmap = %cm, error = %e, "cannot read the shard's last document; its devices there start unknown")
                }
            }
        }
        let devices: usize = t.nodes.iter().map(|n| n.npus.len()).sum();
        self.metrics.seeded(devices);
        let _ = sharing.takeovers.send(t).await;
    }

    /// The node entries of one of the shard's ConfigMaps, into `t`.
    fn seed_from(&self, shard: u32, data: BTreeMap<String, String>, t: &mut Takeover) {
        for (k, v) in &data {
            if k == "fault.json" {
                continue;
            }
            match serde_json::from_str::<NodeFaults>(v) {
                Ok(n) if faultline_common::fault::shard_of(&n.node, self.shards) == shard => {
                    t.nodes.push(n)
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(shard, key = %k, error = %e, "unreadable entry in the shard's document; not seeded")
                }
            }
        }
    }

    /// The soonest expiry still to come of the shard and member Leases observed.
    fn next_expiry(&self, now: Instant) -> Option<Instant> {
        let shards = self.observed.next_expiry(self.cfg.duration, now);
        let members = self.share.as_ref().and_then(|sh| {
            sh.members
                .values()
                .map(|o| o.at + o.duration(self.cfg.duration))
                .filter(|t| *t > now)
                .min()
        });
        shards.into_iter().chain(members).min()
    }

    /// Write the shard once more, then release its Lease for another replica.
    async fn hand_back(&self, shard: u32, mut lease: Lease) {
        if let Some(sharing) = &self.share {
            let (done, wait) = oneshot::channel();
            if sharing
                .final_writes
                .send(FinalWrite { shard, done })
                .await
                .is_ok()
            {
                let _ = tokio::time::timeout(Duration::from_secs(2), wait).await;
            }
        }
        self.held.set(shard, None);
        self.metrics.set_lease(shard, false);
        self.metrics.rebalance();
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = None;
        }
        let lname = lease_name(&self.name, shard);
        match self
            .api
            .replace(&lname, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!(shard, "shard handed back to even out the shares"),
            Err(e) => {
                tracing::warn!(shard, error = %e, "handing the shard back failed; the next pass finds it ours again")
            }
        }
    }

    /// Renew and acquire until cancelled; on cancel, release what we hold (and our
    /// membership) so another replica takes over at once.
    pub async fn run(mut self, cancel: CancellationToken) {
        'passes: loop {
            self.pass().await;
            let next_pass = Instant::now() + self.cfg.retry;
            // Until the next pass: observe others' Leases every quarter retry period, and
            // pass at once just past the soonest expiry, or when one has run out.
            loop {
                let now = Instant::now();
                let expiry = self.next_expiry(now).map(|t| t + Duration::from_millis(20));
                let observe_at = now + self.cfg.retry / 4;
                let wake = expiry
                    .map_or(observe_at, |t| t.min(observe_at))
                    .min(next_pass);
                tokio::select! {
                    _ = cancel.cancelled() => break 'passes,
                    _ = tokio::time::sleep_until(wake.into()) => {}
                }
                if wake >= next_pass || expiry.is_some_and(|t| wake >= t) || self.observe().await {
                    break;
                }
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
        if self.share.is_some() {
            // Gone: the others count one replica fewer at their next pass.
            let _ = api
                .delete(&format!("{name}-member-{me}"), &Default::default())
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loop wakes just past the soonest expiry still to come, never for one past.
    #[test]
    fn the_next_expiry_is_the_soonest_still_to_come() {
        let spec = |holder: &str, secs: i32| LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(secs),
            ..Default::default()
        };
        let mut o = Observations::default();
        let t0 = Instant::now();
        let d = Duration::from_secs(15);
        assert!(!o.expired(0, &spec("a", 15), d, t0));
        assert!(!o.expired(1, &spec("b", 5), d, t0 + Duration::from_secs(1)));
        assert_eq!(
            o.next_expiry(d, t0 + Duration::from_secs(2)),
            Some(t0 + Duration::from_secs(6))
        );
        // b has run out: a's is next.
        assert!(o.expired(1, &spec("b", 5), d, t0 + Duration::from_secs(7)));
        assert_eq!(
            o.next_expiry(d, t0 + Duration::from_secs(7)),
            Some(t0 + Duration::from_secs(15))
        );
        assert_eq!(o.next_expiry(d, t0 + Duration::from_secs(16)), None);
    }
}
