//! When the core loop writes, and what (one owner for the write timing, apart
//! from the loop that carries the writes out). Pure: every method takes `now`, and the
//! caller passes the jittered spacing, so the tests move time themselves.
//!
//! A document is written at most every `--write-interval` (jittered), and a shard
//! whose nodes did not change every `--refresh` (the sink then writes only the pages
//! whose content moved: readings, an agent's last contact;), one write at a
//! time; each shard has its own refresh, spread over the period. A shard where a device turned failed gets an urgent write of its
//! own, `--urgent-spacing` after that shard's last write, beside the other write if one
//! is in flight (the file sink, which has no shards: its one document, after the previous
//! write). A shard just taken is written at once, and with fair sharing only once it is
//! seeded from its last holder's document.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// The write timing of the core loop (its flags).
#[derive(Debug, Clone, Copy)]
pub struct WriteTiming {
    /// `--write-interval`.
    pub interval: Duration,
    /// `--urgent-spacing`.
    pub urgent_spacing: Duration,
    /// `--refresh`.
    pub refresh: Duration,
    /// `--reconcile-interval`.
    pub reconcile: Duration,
    /// `--shutdown-timeout`.
    pub shutdown: Duration,
}

/// What one write carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WritePlan {
    /// Shards where a device turned failed: written first.
    pub urgent: BTreeSet<u32>,
    /// Shards whose nodes changed.
    pub changed: BTreeSet<u32>,
    /// Shards written: the changed ones and those due their refresh.
    pub include: BTreeSet<u32>,
    /// Shards due their refresh (every shard held when `whole`): their pages whose
    /// readings moved are rewritten too. The one judge of `--refresh`.
    pub refresh: BTreeSet<u32>,
    /// Every shard held (the first write, a final write, after a failed write).
    pub whole: bool,
}

/// What an urgent write carries: `shards`, their changed pages, and the pages of
/// `refresh` (those never refreshed) whose readings alone moved.
#[derive(Debug, PartialEq, Eq)]
pub struct UrgentPlan {
    pub shards: BTreeSet<u32>,
    pub refresh: BTreeSet<u32>,
}

/// The write timing's state: what changed since the last write, and when each shard was
/// last written. Owned by the core loop.
#[derive(Debug)]
pub struct WriteSchedule {
    timing: WriteTiming,
    /// Something changed since the last write.
    dirty: bool,
    /// A device turned failed, on the file sink (its one document).
    urgent: bool,
    /// With shards: those where a device turned failed since they were last written.
    urgent_shards: BTreeSet<u32>,
    /// When each shard's last write started (for the urgent spacing).
    shard_written: HashMap<u32, Instant>,
    /// Shards whose nodes changed since the last write; when only node changes are due,
    /// only they are written.
    changed: BTreeSet<u32>,
    /// Something other than a node's change is due (the first write, a final write, a
    /// failed write): the next write covers every shard held.
    whole: bool,
    /// When each shard was last written (its refresh counts from it), spread over the
    /// refresh period, so that no write carries every shard at once.
    written: HashMap<u32, Instant>,
    /// When the last (non-urgent) write started; `None`: due at once.
    last_write: Option<Instant>,
    /// The jittered interval before the next write.
    spacing: Duration,
    /// The shards held at the last look.
    held: Vec<u32>,
    /// With fair sharing: the shards seeded since this replica took them; a shard is
    /// written only once seeded (a takeover changes no published status).
    seeded: Option<BTreeSet<u32>>,
    /// The shards granted at the last look (fair sharing).
    granted: BTreeSet<u32>,
}

/// When the next write is due after one at `last` (`None`: now): `urgent_spacing`
/// after it when a device turned failed since, `spacing` (the jittered interval) when
/// anything else changed, and otherwise a refresh after the write of the shard
/// written longest ago (`oldest`), never sooner than `spacing`. Changes between two
/// writes are one write: urgency and dirtiness are flags, not a queue.
pub fn write_due(
    last: Option<Instant>,
    urgent: bool,
    dirty: bool,
    spacing: Duration,
    t: &WriteTiming,
    oldest: Option<Instant>,
) -> Option<Instant> {
    let last = last?;
    let at = if urgent {
        last + t.urgent_spacing
    } else if dirty {
        last + spacing
    } else {
        let beat = oldest.unwrap_or(last) + t.refresh;
        beat.max(last + spacing)
    };
    Some(at)
}

/// The shards of `held` whose refresh is due at `now`: never written, or last
/// written a refresh ago.
fn refresh_due(
    held: &[u32],
    written: &HashMap<u32, Instant>,
    refresh: Duration,
    now: Instant,
) -> BTreeSet<u32> {
    held.iter()
        .copied()
        .filter(|s| {
            written
                .get(s)
                .is_none_or(|t| now.saturating_duration_since(*t) >= refresh)
        })
        .collect()
}

/// After a write of every shard in `shards` at `now`: their refreshes spread evenly
/// over the next period (the i-th of n counts as written i/n of a period earlier), so
/// the next ones come a shard or two at a time.
fn spread(shards: &[u32], written: &mut HashMap<u32, Instant>, refresh: Duration, now: Instant) {
    let n = shards.len().max(1) as u32;
    for (i, s) in shards.iter().enumerate() {
        let back = refresh * (i as u32) / n;
        written.insert(*s, now.checked_sub(back).unwrap_or(now));
    }
}

impl WriteSchedule {
    /// A schedule whose first write is due at once, for the shards `held`; `spacing` is
    /// the first jittered interval.
    pub fn new(timing: WriteTiming, held: Vec<u32>, spacing: Duration) -> Self {
        WriteSchedule {
            timing,
            dirty: true,
            urgent: false,
            urgent_shards: BTreeSet::new(),
            shard_written: HashMap::new(),
            changed: BTreeSet::new(),
            whole: true,
            written: HashMap::new(),
            last_write: None,
            spacing,
            held,
            seeded: None,
            granted: BTreeSet::new(),
        }
    }

    /// Fair sharing: a shard is written only once seeded from its last holder's
    /// document.
    pub fn seed_before_writing(&mut self) {
        self.seeded = Some(BTreeSet::new());
    }

    /// The shards seeded since taken (`None`: no fair sharing, every shard may be written).
    pub fn seeded(&self) -> Option<&BTreeSet<u32>> {
        self.seeded.as_ref()
    }

    /// A node changed; `shard` is its shard (`None`: the file sink's one document).
    pub fn changed(&mut self, shard: Option<u32>) {
        self.dirty = true;
        match shard {
            Some(s) => {
                self.changed.insert(s);
            }
            None => self.whole = true,
        }
    }

    /// A device of a node of `shard` turned failed: an urgent write.
    pub fn urgent(&mut self, shard: Option<u32>) {
        match shard {
            Some(s) => {
                self.urgent_shards.insert(s);
            }
            None => self.urgent = true,
        }
    }

    /// A shard was taken and seeded: written once granted, by a write of its own.
    pub fn seeded_shard(&mut self, shard: u32) {
        if let Some(s) = self.seeded.as_mut() {
            s.insert(shard);
        }
        self.changed.insert(shard);
        self.dirty = true;
    }

    /// A shard is to be written once more before it is handed back: every shard, now.
    pub fn final_write(&mut self) {
        self.dirty = true;
        self.whole = true;
        self.last_write = None;
    }

    /// The last write failed: the next one covers every shard.
    pub fn write_failed(&mut self) {
        self.dirty = true;
        self.whole = true;
    }

    /// The shards held now (`held`) and granted (`granted`, fair sharing): a shard just
    /// taken is written at once by an urgent write of its own, beside any write in
    /// flight, and the others are not rewritten with it (a takeover of three
    /// shards was three rewrites of all eleven). A shard released is seeded afresh when
    /// taken again; judged on the grants, not the holds: a hold that ran out on our clock
    /// and was renewed is not a new take (no new seed comes).
    pub fn held(&mut self, held: Vec<u32>, granted: Option<BTreeSet<u32>>) {
        if held != self.held {
            for s in held.iter().filter(|s| !self.held.contains(s)) {
                self.urgent_shards.insert(*s);
                self.changed.insert(*s);
                self.shard_written.remove(s);
            }
            self.dirty = true;
            self.held = held;
        }
        if let (Some(seeded), Some(granted)) = (self.seeded.as_mut(), granted) {
            for gone in self.granted.iter().filter(|x| !granted.contains(x)) {
                seeded.remove(gone);
            }
            self.granted = granted;
        }
    }

    /// Shards whose hold ran out and was renewed (`lapsed`, [`Held::take_lapsed`]): a
    /// write may have skipped them meanwhile, so each still held is written again at
    /// once, like a shard just taken (but not seeded again: the Lease still named us).
    ///
    /// [`Held::take_lapsed`]: crate::shard::Held::take_lapsed
    pub fn held_again(&mut self, lapsed: BTreeSet<u32>) {
        for s in lapsed.into_iter().filter(|s| self.held.contains(s)) {
            self.urgent_shards.insert(s);
            self.changed.insert(s);
            self.dirty = true;
        }
    }

    /// When the next write is due (`None`: at once).
    pub fn due(&self) -> Option<Instant> {
        let oldest = self
            .held
            .iter()
            .filter_map(|s| self.written.get(s))
            .min()
            .copied();
        write_due(
            self.last_write,
            self.urgent,
            self.dirty,
            self.spacing,
            &self.timing,
            oldest,
        )
    }

    /// When shard `s` may have an urgent write: `--urgent-spacing` after its last write
    /// (`None`: never written, at once).
    fn urgent_at(&self, s: u32) -> Option<Instant> {
        self.shard_written
            .get(&s)
            .map(|t| *t + self.timing.urgent_spacing)
    }

    /// When the next urgent write is due: the soonest of the urgent shards' spacing
    /// after its last write (`None`: no shard is urgent).
    pub fn urgent_due(&self, now: Instant) -> Option<Instant> {
        self.urgent_shards
            .iter()
            .map(|s| self.urgent_at(*s).unwrap_or(now))
            .min()
    }

    /// An urgent write at `now`: the urgent shards whose spacing has passed (`None`:
    /// none is ready). It rewrites their changed pages only, so their refresh stays due
    /// when it was; a shard never refreshed (just taken) gets its refresh in it, so a
    /// take is one write of each page, not a take and a refresh half a second later.
    pub fn take_urgent(&mut self, now: Instant) -> Option<UrgentPlan> {
        let ready: BTreeSet<u32> = self
            .urgent_shards
            .iter()
            .filter(|s| self.urgent_at(**s).is_none_or(|t| now >= t))
            .copied()
            .collect();
        if ready.is_empty() {
            return None;
        }
        self.urgent_shards.retain(|s| !ready.contains(s));
        self.changed.retain(|s| !ready.contains(s));
        let refresh: BTreeSet<u32> = ready
            .iter()
            .copied()
            .filter(|s| !self.written.contains_key(s))
            .collect();
        for s in &ready {
            self.shard_written.insert(*s, now);
        }
        for s in &refresh {
            self.written.insert(*s, now);
        }
        Some(UrgentPlan {
            shards: ready,
            refresh,
        })
    }

    /// A write at `now` of the shards `held`: every shard when asked for and after a
    /// failed write (it may have been any); else the shards whose nodes changed and
    /// those due their refresh. The urgent shards it carries are urgent no more.
    /// `next_spacing` is the jittered interval before the write after it.
    pub fn take_write(&mut self, held: &[u32], now: Instant, next_spacing: Duration) -> WritePlan {
        let whole = self.whole;
        let changed = std::mem::take(&mut self.changed);
        let due = refresh_due(held, &self.written, self.timing.refresh, now);
        let include: BTreeSet<u32> = changed.union(&due).copied().collect();
        // Only a refresh restarts a shard's refresh: a shard whose nodes keep changing
        // still has the readings of its other pages rewritten every `--refresh`.
        let refresh: BTreeSet<u32> = if whole {
            spread(held, &mut self.written, self.timing.refresh, now);
            held.iter().copied().collect()
        } else {
            for s in &due {
                self.written.insert(*s, now);
            }
            due
        };
        let urgent: BTreeSet<u32> = if whole {
            std::mem::take(&mut self.urgent_shards)
        } else {
            let (carried, rest) = std::mem::take(&mut self.urgent_shards)
                .into_iter()
                .partition(|s| include.contains(s));
            self.urgent_shards = rest;
            carried
        };
        for s in held.iter().filter(|s| whole || include.contains(s)) {
            self.shard_written.insert(*s, now);
        }
        self.last_write = Some(now);
        self.whole = false;
        self.spacing = next_spacing;
        // A failed write makes the schedule dirty again (`write_failed`).
        self.dirty = false;
        self.urgent = false;
        WritePlan {
            urgent,
            changed,
            include,
            refresh,
            whole,
        }
    }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
