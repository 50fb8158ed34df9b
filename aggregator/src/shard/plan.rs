//! The shard plan: what one replica does with the shard Leases in a pass,
//! decided from what it observed, before any Lease is written. No I/O and no clock of its
//! own: the caller passes `now`, so table tests (and a model checker) call exactly what
//! the Lease loop calls. `lease.rs` lists the Leases, hands them to [`Observer`], asks
//! [`plan`] and carries the plan out.
//!
//! Two layers, both pure:
//! - [`Observer`] keeps when this replica saw each other holder's record change, on its
//!   own clock (client-go's `leaderelection.go`: `observedTime`, `observedRawRecord`): a
//!   holder's lease runs out once its record has not changed for its duration *as this
//!   replica observed it*. The holder's own timestamps are another machine's clock and are
//!   never compared with ours, so clock skew cannot make two holders.
//! - [`plan`] is one function from what a pass observed (each shard mine, free or another
//!   live holder's; the live replicas; the hold-off) to what to renew, take and hand back.
//!
//! Fair share: a replica holds at most `ceil(shards / live)` shards: it takes
//! free or expired shards up to that, hands one back when it holds more, or holds the
//! full share while another live replica holds less than `floor(shards / live)` (a
//! newcomer, starving). One hand-back per pass, then no take for two retry periods, so
//! the replica short of its share gets the first look.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::time::Instant;

/// The parts of a Lease's record that change when its holder renews: any change of them
/// is the holder alive. Plain values, so the plan needs no Kubernetes types.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Record {
    /// `holderIdentity`; `None` or empty: released.
    pub holder: Option<String>,
    /// `renewTime` in nanoseconds since the epoch (the holder's clock: compared for
    /// change only, never with ours).
    pub renew: Option<i128>,
    /// `acquireTime`, the same way.
    pub acquire: Option<i128>,
    /// `leaseTransitions`.
    pub transitions: Option<i32>,
    /// `leaseDurationSeconds`.
    pub duration_secs: Option<i32>,
}

impl Record {
    /// The holder, when one is named.
    pub fn holder(&self) -> Option<&str> {
        self.holder.as_deref().filter(|h| !h.is_empty())
    }

    /// The duration the record states, else `default`.
    fn duration(&self, default: Duration) -> Duration {
        self.duration_secs
            .map(|s| Duration::from_secs(s.max(1) as u64))
            .unwrap_or(default)
    }
}

/// A record as this replica last saw it change, and when (its own clock).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Seen {
    record: Record,
    at: Instant,
}

impl Seen {
    fn until(&self, default: Duration) -> Instant {
        self.at + self.record.duration(default)
    }
}

/// Note `record` as seen `now`: a change restarts its clock.
fn note(seen: &mut BTreeMap<String, Seen>, key: &str, record: &Record, now: Instant) -> Instant {
    match seen.get_mut(key) {
        Some(s) if s.record == *record => s.at,
        Some(s) => {
            *s = Seen {
                record: record.clone(),
                at: now,
            };
            now
        }
        None => {
            seen.insert(
                key.to_string(),
                Seen {
                    record: record.clone(),
                    at: now,
                },
            );
            now
        }
    }
}

/// One shard as a pass found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardView {
    /// Held by this replica.
    Mine,
    /// Nobody's: no Lease, released, or run out as observed; with the holder it had.
    Free {
        /// The holder named on the Lease, if any (a takeover when it is another).
        previous: Option<String>,
    },
    /// Another replica's, alive as observed.
    Other(String),
}

/// What one list of the Leases showed: each shard's record (`None`: no Lease) and the
/// member Leases of this aggregator, by replica.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Per shard `0..shards`; a shard missing here has no Lease.
    pub shards: BTreeMap<u32, Record>,
    /// The member Leases (`<name>-member-<replica>`), by the replica they name.
    pub members: BTreeMap<String, Record>,
}

/// Others' Leases as this replica observed them, on its own clock. Owned by the Lease
/// loop; every method takes `now`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Observer {
    me: String,
    duration: Duration,
    shards: BTreeMap<String, Seen>,
    members: BTreeMap<String, Seen>,
}

/// What a pass observed: each shard's view, the live replicas (this one included, sorted)
/// and the member Leases long unchanged, to remove.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Per shard.
    pub shards: BTreeMap<u32, ShardView>,
    /// The live replicas, this one included, sorted.
    pub live: Vec<String>,
    /// Replicas whose member Lease has not changed for ten durations (a crash leaves one
    /// behind, and a new pod has a new name).
    pub stale: Vec<String>,
}

impl Observer {
    /// An observer for replica `me`; `duration` is the lease duration a record that
    /// states none is given.
    pub fn new(me: &str, duration: Duration) -> Self {
        Observer {
            me: me.to_string(),
            duration,
            shards: BTreeMap::new(),
            members: BTreeMap::new(),
        }
    }

    /// One shard's Lease as listed (`None`: there is none).
    pub fn shard(&mut self, shard: u32, record: Option<&Record>, now: Instant) -> ShardView {
        let key = shard.to_string();
        let Some(record) = record else {
            self.shards.remove(&key);
            return ShardView::Free { previous: None };
        };
        match record.holder() {
            Some(h) if h == self.me => {
                self.shards.remove(&key);
                ShardView::Mine
            }
            None => {
                self.shards.remove(&key);
                ShardView::Free { previous: None }
            }
            Some(h) => {
                let at = note(&mut self.shards, &key, record, now);
                if now.duration_since(at) > record.duration(self.duration) {
                    ShardView::Free {
                        previous: Some(h.to_string()),
                    }
                } else {
                    ShardView::Other(h.to_string())
                }
            }
        }
    }

    /// The shards and members of `listing`, as a pass sees them (shards `0..shards`).
    pub fn pass(&mut self, listing: &Listing, shards: u32, now: Instant) -> Observation {
        let views = (0..shards)
            .map(|s| (s, self.shard(s, listing.shards.get(&s), now)))
            .collect();
        let (live, stale) = self.members(&listing.members, now);
        Observation {
            shards: views,
            live,
            stale,
        }
    }

    /// Note the member Leases; the live replicas (this one included, sorted) and the
    /// stale ones. A member is live while its record changed within its duration as we
    /// observed it, and it names a renewal.
    fn members(
        &mut self,
        members: &BTreeMap<String, Record>,
        now: Instant,
    ) -> (Vec<String>, Vec<String>) {
        self.members
            .retain(|k, _| members.contains_key(k) && *k != self.me);
        let mut live = vec![self.me.clone()];
        for (who, record) in members {
            if *who == self.me {
                continue;
            }
            let at = note(&mut self.members, who, record, now);
            if record.renew.is_some() && now.duration_since(at) <= record.duration(self.duration) {
                live.push(who.clone());
            }
        }
        live.sort();
        live.dedup();
        let stale = self
            .members
            .iter()
            .filter(|(_, s)| now.duration_since(s.at) > 10 * self.duration)
            .map(|(k, _)| k.clone())
            .collect();
        (live, stale)
    }

    /// A stale member's Lease was removed: forget it.
    pub fn forget_member(&mut self, who: &str) {
        self.members.remove(who);
    }

    /// A shard became ours (or its take was tried): forget what we saw of it.
    pub fn forget_shard(&mut self, shard: u32) {
        self.shards.remove(&shard.to_string());
    }

    /// Note what others' Leases show between passes; whether that is news worth a pass at
    /// once: a shard released by its holder, or a member gone, since we last looked.
    pub fn between(&mut self, listing: &Listing, shards: u32, now: Instant) -> bool {
        let mut news = false;
        for shard in 0..shards {
            let Some(record) = listing.shards.get(&shard) else {
                continue;
            };
            let key = shard.to_string();
            match record.holder() {
                Some(h) if h == self.me => {}
                Some(_) => {
                    note(&mut self.shards, &key, record, now);
                }
                None => news |= self.shards.remove(&key).is_some(),
            }
        }
        let before = self.members.len();
        self.members.retain(|k, _| listing.members.contains_key(k));
        news |= self.members.len() != before;
        for (who, record) in &listing.members {
            if *who != self.me {
                note(&mut self.members, who, record, now);
            }
        }
        news
    }

    /// The soonest moment after `now` that a lease observed (shard or member) runs out:
    /// the loop looks again just then. Leases already out are not counted (that would
    /// spin while this replica is at its share).
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.shards
            .values()
            .chain(self.members.values())
            .map(|s| s.until(self.duration))
            .filter(|t| *t > now)
            .min()
    }
}

/// What a pass decides from, besides the shards' views: the replicas and the hold-off.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput<'a> {
    /// This replica.
    pub me: &'a str,
    /// Every shard's view.
    pub shards: &'a BTreeMap<u32, ShardView>,
    /// The live replicas (this one included); `None`: fair sharing is off or they could
    /// not be counted yet, so this replica takes every shard it can, as one alone would
    /// (a shard nobody writes is worse than an uneven share).
    pub live: Option<&'a [String]>,
    /// Whether this replica has counted the members before (announced itself).
    pub joined: bool,
    /// No take before this (set by a hand-back or by joining).
    pub hold_off: Option<Instant>,
    /// The Lease retry period: the hold-offs are counted in it.
    pub retry: Duration,
    /// Now, on this replica's clock.
    pub now: Instant,
}

/// What to do with the Leases in one pass, in this order: renew `renew`, hand back
/// `hand_back` (after a final write), then try `take` in order until `room` were taken.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Shards held and kept: renew each.
    pub renew: Vec<u32>,
    /// A shard held and handed back this pass (at most one).
    pub hand_back: Option<u32>,
    /// Free shards in this replica's order of preference.
    pub take: Vec<u32>,
    /// How many of `take` to take at most (a failed take lets the next one be tried).
    pub room: usize,
    /// Shards another live replica holds: this replica must not write them.
    pub others: Vec<u32>,
    /// The hold-off from now on.
    pub hold_off: Option<Instant>,
    /// Whether this replica has now joined.
    pub joined: bool,
}

/// The shares of `shards` among `live` replicas: (at most, at least).
pub fn share(shards: u32, live: usize) -> (usize, usize) {
    let (s, l) = (shards as usize, live.max(1));
    (s.div_ceil(l), s / l)
}

/// Rendezvous order: the shards a replica prefers first, so replicas taking free shards
/// at once mostly reach for different ones.
pub fn preference(me: &str, shard: u32) -> u64 {
    faultline_common::fault::fnv1a64(format!("{me}/{shard}").as_bytes())
}

/// The plan of one pass.
pub fn plan(input: &PlanInput<'_>) -> Plan {
    let shards = input.shards.len() as u32;
    let mine: Vec<u32> = filter(input.shards, |v| *v == ShardView::Mine);
    let others: Vec<u32> = filter(input.shards, |v| matches!(v, ShardView::Other(_)));
    let (most, least) = match input.live {
        Some(l) => share(shards, l.len()),
        None => (shards as usize, 0),
    };
    let mut hold_off = input.hold_off;
    let mut joined = input.joined;
    // Joining: the first pass that counts the members takes nothing, so replicas started
    // together see each other before any of them claims the free shards (else the first
    // claims every shard and hands them back one pass at a time). Costs one retry period.
    if input.live.is_some() && !joined {
        joined = true;
        hold_off = Some(input.now + input.retry);
    }
    // Hand back: above the share; or at a share above the floor while another live
    // replica is below it (a newcomer). One per pass: each waits for a final write, and
    // the shards kept must be renewed in time.
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for v in input.shards.values() {
        if let ShardView::Other(h) = v {
            *counts.entry(h.as_str()).or_default() += 1;
        }
    }
    let starving = input.live.is_some_and(|l| {
        l.iter()
            .any(|r| r != input.me && counts.get(r.as_str()).copied().unwrap_or(0) < least)
    });
    let give = mine.len() > most
        || (input.live.is_some() && mine.len() == most && most > least && starving);
    let hand_back = give
        .then(|| {
            mine.iter()
                .copied()
                .max_by_key(|s| preference(input.me, *s))
        })
        .flatten();
    if hand_back.is_some() {
        hold_off = Some(input.now + 2 * input.retry);
    }
    let holding_off = hold_off.is_some_and(|t| input.now < t);
    let mut take: Vec<u32> = filter(input.shards, |v| matches!(v, ShardView::Free { .. }));
    take.sort_by_key(|s| preference(input.me, *s));
    // A hand-back holds off (and leaves this replica at or above its share): no take.
    let room = if holding_off {
        0
    } else {
        most.saturating_sub(mine.len())
    };
    Plan {
        renew: mine.into_iter().filter(|s| Some(*s) != hand_back).collect(),
        hand_back,
        take,
        room,
        others,
        hold_off,
        joined,
    }
}

fn filter(shards: &BTreeMap<u32, ShardView>, keep: impl Fn(&ShardView) -> bool) -> Vec<u32> {
    shards
        .iter()
        .filter(|(_, v)| keep(v))
        .map(|(s, _)| *s)
        .collect()
}

/// The shards of `plan` this replica will hold if every renewal and `room` takes succeed
/// (for tests and the model checker: the plan's intended holding).
pub fn intended(plan: &Plan) -> BTreeSet<u32> {
    plan.renew
        .iter()
        .chain(plan.take.iter().take(plan.room))
        .copied()
        .collect()
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
