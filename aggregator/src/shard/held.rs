//! Which shards this replica holds, and until when, on its own clock: what the Lease
//! loop grants and every writer asks before it writes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use faultline_common::sync::Locked;
use tokio::sync::watch;

/// Whether a hold granted `until` (`None`: not granted) lets a write go at `now`: the
/// fence's one decision, pure, so the model checker asks exactly this.
pub fn holding(until: Option<Instant>, now: Instant) -> bool {
    until.is_some_and(|u| now < u)
}

/// Which shards this replica holds, and until when (its own clock). Followers of the
/// agents watch the set (`subscribe`): a replica follows only its shards' nodes.
#[derive(Clone)]
pub struct Held {
    inner: Arc<Mutex<BTreeMap<u32, Instant>>>,
    changes: Arc<watch::Sender<BTreeSet<u32>>>,
    /// Per shard, the sequence this replica last published (its renewals carry it).
    published: Arc<Mutex<BTreeMap<u32, u64>>>,
    /// Per shard, when a write last passed the fence: a release waits out the margin
    /// from there, so a write in flight lands before another replica can take over.
    admitted: Arc<Mutex<BTreeMap<u32, Instant>>>,
    /// Shards whose hold ran out on this replica's clock and came back with a renewal,
    /// since the writers last asked ([`Held::take_lapsed`]).
    lapsed: Arc<Mutex<BTreeSet<u32>>>,
}

impl Default for Held {
    fn default() -> Self {
        Held {
            inner: Arc::default(),
            changes: Arc::new(watch::channel(BTreeSet::new()).0),
            published: Arc::default(),
            admitted: Arc::default(),
            lapsed: Arc::default(),
        }
    }
}

impl Held {
    /// Shard `shard` was published as of `sequence` (the writers say so).
    pub fn note_published(&self, shard: u32, sequence: u64) {
        self.published.locked().insert(shard, sequence);
    }

    /// The sequence of shard `shard` this replica last published, if it did.
    pub fn published(&self, shard: u32) -> Option<u64> {
        self.published.locked().get(&shard).copied()
    }

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
        holding(self.inner.locked().get(&shard).copied(), Instant::now())
    }

    /// Whether a write for `shard` may go now, noting when it went (what the fence asks
    /// right before every write), and how long it may take: the hold left. `None`: the
    /// hold does not stand.
    pub fn admit(&self, shard: u32) -> Option<Duration> {
        let now = Instant::now();
        let until = self.inner.locked().get(&shard).copied()?;
        if !holding(Some(until), now) {
            return None;
        }
        // Noted after the check: a later instant, so a release waits longer, never less.
        self.admitted.locked().insert(shard, Instant::now());
        Some(until.saturating_duration_since(now))
    }

    /// When the writes that passed the fence of `shards` have landed, if that is still
    /// to come: `margin` after the last one went. A release waits until then, or the
    /// next holder's pass could meet this replica's eviction or taint landing late.
    pub fn quiet_at(&self, shards: &[u32], margin: Duration) -> Option<Instant> {
        let admitted = self.admitted.locked();
        let last = shards.iter().filter_map(|s| admitted.get(s)).max()?;
        Some(*last + margin).filter(|u| *u > Instant::now())
    }

    /// The shards whose hold ran out and was renewed since the last call. The fence let
    /// no write of theirs go meanwhile, so a change written then was skipped, and the
    /// next write of an unchanged shard is a refresh away (30 min by default): the 5,000-
    /// node memory test saw two shards stay published empty, their holds having run
    /// out for a moment between two ticks, which did not see it.
    pub fn take_lapsed(&self) -> BTreeSet<u32> {
        std::mem::take(&mut *self.lapsed.locked())
    }

    /// Shards held now.
    pub fn shards(&self) -> Vec<u32> {
        let now = Instant::now();
        self.inner
            .locked()
            .iter()
            .filter(|(_, u)| holding(Some(**u), now))
            .map(|(s, _)| *s)
            .collect()
    }

    /// Count `shard` as held until `until` (what a successful renewal does; also for
    /// tests of the writers).
    pub fn grant(&self, shard: u32, until: Instant) {
        let _ = self.set(shard, Some(until));
    }

    /// Count `shard` as held until `until` (`None`: released); whether the shards
    /// granted changed.
    pub(super) fn set(&self, shard: u32, until: Option<Instant>) -> bool {
        let mut g = self.inner.locked();
        match until {
            Some(u) => {
                if let Some(before) = g.insert(shard, u) {
                    if !holding(Some(before), Instant::now()) {
                        self.lapsed.locked().insert(shard);
                    }
                }
            }
            None => {
                g.remove(&shard);
                self.published.locked().remove(&shard);
            }
        }
        let keys: BTreeSet<u32> = g.keys().copied().collect();
        drop(g);
        self.changes.send_if_modified(|s| {
            let changed = *s != keys;
            *s = keys;
            changed
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_waits_a_margin_after_the_last_write_the_fence_let_go() {
        let held = Held::default();
        let margin = Duration::from_secs(60);
        assert!(held.admit(1).is_none(), "not held: no write goes");
        assert_eq!(held.quiet_at(&[1], margin), None, "a refused write is none");
        held.grant(1, Instant::now() + Duration::from_secs(60));
        let before = Instant::now();
        assert!(held.admit(1).is_some());
        let after = Instant::now();
        let _ = held.set(1, None);
        let q = held.quiet_at(&[0, 1], margin).expect("a write went");
        assert!(q >= before + margin && q <= after + margin, "{q:?}");
        assert_eq!(held.quiet_at(&[0], margin), None, "another shard's");
        assert_eq!(held.quiet_at(&[1], Duration::ZERO), None, "past: no wait");
    }

    /// What a new holder and the Lease loop read back: the shards granted (a hold run
    /// out is still granted until released), the sequence last published per shard, and
    /// the end of a release's wait, which is over at the instant it names.
    #[tokio::test(start_paused = true)]
    async fn granted_shards_published_sequences_and_the_quiet_instant() {
        let held = Held::default();
        let s = Duration::from_secs(1);
        held.grant(3, Instant::now() + s);
        held.grant(5, Instant::now() + 2 * s);
        assert_eq!(held.keys(), BTreeSet::from([3, 5]));
        assert_eq!(held.published(3), None);
        held.note_published(3, 41);
        held.note_published(5, 7);
        assert_eq!((held.published(3), held.published(5)), (Some(41), Some(7)));
        assert!(held.admit(5).is_some());
        tokio::time::advance(s).await;
        assert_eq!(
            held.keys(),
            BTreeSet::from([3, 5]),
            "3 ran out, still granted"
        );
        assert_eq!(held.quiet_at(&[5], 2 * s), Some(Instant::now() + s));
        tokio::time::advance(s).await;
        assert_eq!(held.quiet_at(&[5], 2 * s), None, "over at its instant");
        let _ = held.set(3, None);
        assert_eq!(held.keys(), BTreeSet::from([5]));
    }

    /// A renewal that comes back after the hold ran out marks the shard (once); a take
    /// and a renewal in time do not.
    #[tokio::test(start_paused = true)]
    async fn a_hold_renewed_after_it_ran_out_is_marked_lapsed_once() {
        let held = Held::default();
        let s = Duration::from_secs(1);
        held.grant(1, Instant::now() + 2 * s);
        held.grant(2, Instant::now() + 2 * s);
        assert!(held.take_lapsed().is_empty(), "a take is no lapse");
        tokio::time::advance(s).await;
        held.grant(1, Instant::now() + 2 * s);
        assert!(held.take_lapsed().is_empty(), "renewed in time");
        tokio::time::advance(2 * s).await;
        assert_eq!(held.shards(), Vec::<u32>::new(), "both ran out");
        held.grant(1, Instant::now() + 2 * s);
        assert_eq!(held.take_lapsed(), BTreeSet::from([1]));
        assert!(held.take_lapsed().is_empty(), "taken once");
        let _ = held.set(2, None);
        held.grant(2, Instant::now() + 2 * s);
        assert!(held.take_lapsed().is_empty(), "released, then taken anew");
    }
}
