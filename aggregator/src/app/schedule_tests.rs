//! Tests of the write schedule: when the core loop writes, and which shards.

use super::*;

fn timing() -> WriteTiming {
    WriteTiming {
        interval: Duration::from_secs(1),
        urgent_spacing: Duration::from_millis(50),
        refresh: Duration::from_secs(30),
        reconcile: Duration::from_secs(10),
        shutdown: Duration::from_secs(20),
    }
}

const SPACING: Duration = Duration::from_millis(1100);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn set(s: &[u32]) -> BTreeSet<u32> {
    s.iter().copied().collect()
}

/// A failed device is written `--urgent-spacing` after the
/// last write, whatever the interval; other changes wait for the jittered interval;
/// nothing changed waits for the refresh; the first write is at once.
#[test]
fn write_scheduling() {
    let t = timing();
    let last = Instant::now();
    let spacing = Duration::from_millis(1100);
    assert!(
        write_due(None, false, false, spacing, &t, None).is_none(),
        "first: now"
    );
    assert_eq!(
        write_due(Some(last), true, true, spacing, &t, None),
        Some(last + t.urgent_spacing)
    );
    assert_eq!(
        write_due(Some(last), false, true, spacing, &t, None),
        Some(last + spacing)
    );
    assert_eq!(
        write_due(Some(last), false, false, spacing, &t, Some(last)),
        Some(last + t.refresh)
    );
    // The shard written longest ago decides, but never sooner than the interval.
    let earlier = last - Duration::from_secs(20);
    assert_eq!(
        write_due(Some(last), false, false, spacing, &t, Some(earlier)),
        Some(earlier + t.refresh)
    );
    let long_ago = last - Duration::from_secs(60);
    assert_eq!(
        write_due(Some(last), false, false, spacing, &t, Some(long_ago)),
        Some(last + spacing)
    );
}

/// After a write of every shard, the shards' refreshs are spread over
/// the period, so each later write carries one or two shards, never all; a shard
/// never written is due at once.
#[test]
fn refreshs_are_spread_over_the_period() {
    let beat = Duration::from_secs(30);
    let now = Instant::now() + Duration::from_secs(100);
    let shards: Vec<u32> = (0..32).collect();
    let mut written = HashMap::new();
    assert_eq!(refresh_due(&shards, &written, beat, now).len(), 32);
    spread(&shards, &mut written, beat, now);
    assert!(refresh_due(&shards, &written, beat, now).is_empty());
    // Each second of the next period finds about one shard due.
    let mut most = 0;
    for sec in 1..=30 {
        let at = now + Duration::from_secs(sec);
        let due = refresh_due(&shards, &written, beat, at);
        for s in &due {
            written.insert(*s, at);
        }
        most = most.max(due.len());
    }
    assert!(most <= 2, "{most} shards due at once");
    assert!(
        refresh_due(&shards, &written, beat, now + Duration::from_secs(30)).is_empty(),
        "every shard written within the period"
    );
}

/// The first write is due at once and carries every shard; after it, a change of one
/// shard's node is written alone, after the spacing, not every shard with it.
#[test]
fn the_first_write_is_whole_then_only_changed_shards() {
    let t0 = Instant::now();
    let mut s = WriteSchedule::new(timing(), vec![0, 1, 2], SPACING);
    assert_eq!(s.due(), None, "the first write: at once");
    let p = s.take_write(&[0, 1, 2], t0, SPACING);
    assert!(p.whole);
    assert_eq!(
        p.include,
        set(&[0, 1, 2]),
        "never written: due their refresh"
    );
    // Nothing changed: the next is a refresh away (the spread's oldest shard).
    assert!(s.due().is_some_and(|d| d > t0 + SPACING));
    s.changed(Some(2));
    assert_eq!(s.due(), Some(t0 + SPACING));
    let p = s.take_write(&[0, 1, 2], t0 + SPACING, SPACING);
    assert!(!p.whole);
    assert_eq!(p.include, set(&[2]));
    assert_eq!(p.changed, set(&[2]));
    // That write counts for the urgent spacing of the shard it carried, not the others
    // (cargo-mutants: `whole || include` taken as `&&` survived).
    let t1 = t0 + SPACING;
    s.urgent(Some(2));
    s.urgent(Some(0));
    assert_eq!(
        s.urgent_due(t1),
        Some(t0 + ms(50)),
        "shard 0: spaced from t0"
    );
    assert_eq!(
        s.take_urgent(t1).map(|u| u.shards),
        Some(set(&[0])),
        "shard 2: just written"
    );
    assert_eq!(s.urgent_due(t1), Some(t1 + ms(50)));
}

/// A shard where a device turned failed is written by an urgent write of its
/// own, `--urgent-spacing` after that shard's last write, and only it.
#[test]
fn a_failed_device_gets_a_write_of_its_own_after_the_spacing() {
    let t0 = Instant::now();
    let mut s = WriteSchedule::new(timing(), vec![0, 1, 2], SPACING);
    s.take_write(&[0, 1, 2], t0, SPACING);
    s.changed(Some(1));
    s.urgent(Some(1));
    assert_eq!(s.urgent_due(t0 + ms(10)), Some(t0 + ms(50)));
    assert_eq!(
        s.take_urgent(t0 + ms(20)).map(|u| u.shards),
        None,
        "within the spacing"
    );
    assert_eq!(
        s.take_urgent(t0 + ms(50)).map(|u| u.shards),
        Some(set(&[1]))
    );
    assert_eq!(s.urgent_due(t0 + ms(60)), None, "urgent no more");
    // The shard written urgently is not written again by the next write for that change.
    let p = s.take_write(&[0, 1, 2], t0 + SPACING, SPACING);
    assert!(!p.include.contains(&1), "{p:?}");
    // The file sink (no shards): its one document is urgent.
    let mut f = WriteSchedule::new(timing(), vec![0], SPACING);
    f.take_write(&[0], t0, SPACING);
    f.urgent(None);
    assert_eq!(f.due(), Some(t0 + ms(50)));
}

/// A failed write, and a final write before a hand-back, cover every shard; a final
/// write is due at once.
#[test]
fn failed_and_final_writes_cover_every_shard() {
    let t0 = Instant::now();
    let mut s = WriteSchedule::new(timing(), vec![0, 1], SPACING);
    s.take_write(&[0, 1], t0, SPACING);
    s.write_failed();
    assert_eq!(s.due(), Some(t0 + SPACING));
    assert!(s.take_write(&[0, 1], t0 + SPACING, SPACING).whole);
    s.final_write();
    assert_eq!(s.due(), None);
    assert!(s.take_write(&[0, 1], t0 + 2 * SPACING, SPACING).whole);
}

/// A shard taken is written at once by an urgent write of its own; with fair sharing it
/// is written only once seeded, and a shard no longer granted must be seeded afresh.
#[test]
fn a_shard_taken_is_written_at_once_once_seeded() {
    let t0 = Instant::now();
    let mut s = WriteSchedule::new(timing(), vec![0], SPACING);
    s.seed_before_writing();
    s.take_write(&[0], t0, SPACING);
    s.seeded_shard(1);
    s.held(vec![0, 1], Some(set(&[0, 1])));
    assert_eq!(s.seeded(), Some(&set(&[1])));
    assert_eq!(s.urgent_due(t0 + ms(1)), Some(t0 + ms(1)), "at once");
    // Its first write is its refresh too: no refresh of it follows at the next write.
    assert_eq!(
        s.take_urgent(t0 + ms(1)),
        Some(UrgentPlan {
            shards: set(&[1]),
            refresh: set(&[1])
        })
    );
    s.changed(Some(0));
    let p = s.take_write(&[0, 1], t0 + SPACING, SPACING);
    assert_eq!(p.include, set(&[0]), "{p:?}");
    // Released (no longer granted): seeded afresh when taken again.
    s.held(vec![0], Some(set(&[0])));
    assert_eq!(s.seeded(), Some(&BTreeSet::new()));
    // A hold that ran out on our clock and came back is no new take: still seeded.
    s.seeded_shard(1);
    s.held(vec![0, 1], Some(set(&[0, 1])));
    s.held(vec![0], Some(set(&[0, 1])));
    s.held(vec![0, 1], Some(set(&[0, 1])));
    assert_eq!(s.seeded(), Some(&set(&[1])));
}

/// A shard whose hold ran out for a moment between two looks (never seen missing) and
/// was renewed is written again at once: a write meanwhile skipped it. One not held now
/// waits for its return, which `held` sees as a take.
#[test]
fn a_shard_held_again_after_a_lapse_is_written_at_once() {
    let t0 = Instant::now();
    let mut s = WriteSchedule::new(timing(), vec![0, 1], SPACING);
    s.take_write(&[0, 1], t0, SPACING);
    assert_eq!(s.urgent_due(t0 + ms(100)), None);
    s.held(vec![0, 1], None);
    s.held_again(set(&[1, 2]));
    // Due the urgent spacing after the shard's last write (passed already).
    assert_eq!(s.urgent_due(t0 + ms(100)), Some(t0 + ms(50)));
    assert_eq!(
        s.take_urgent(t0 + ms(100)).map(|u| u.shards),
        Some(set(&[1])),
        "2 is not held"
    );
}

/// `--refresh` has one judge, this schedule: a shard whose nodes keep changing (written
/// for each change, and urgently) still comes due its refresh every `--refresh`, and
/// only a refresh is one (the sink rewrites the pages whose readings alone moved then,
/// and only then). Before, every write of a shard restarted its refresh, and the sink
/// judged each page on a clock of its own.
#[test]
fn a_shard_that_keeps_changing_still_gets_its_refresh() {
    let t0 = Instant::now();
    let refresh = timing().refresh;
    let mut s = WriteSchedule::new(timing(), vec![0, 1], SPACING);
    let p = s.take_write(&[0, 1], t0, SPACING);
    assert!(p.whole);
    assert_eq!(
        p.refresh,
        set(&[0, 1]),
        "a whole write refreshes every shard"
    );
    // Shard 1 changes every few seconds for two refresh periods.
    let mut refreshed = Vec::new();
    let mut at = t0;
    let mut n = 0;
    while at < t0 + refresh * 2 {
        at += Duration::from_secs(3);
        n += 1;
        if n % 4 == 0 {
            // A device failed: an urgent write carries the change.
            s.urgent(Some(1));
            assert_eq!(s.take_urgent(at).map(|u| u.shards), Some(set(&[1])));
        } else {
            s.changed(Some(1));
        }
        let p = s.take_write(&[0, 1], at + ms(10), SPACING);
        assert!(
            n % 4 == 0 || p.include.contains(&1),
            "each change is written"
        );
        if p.refresh.contains(&1) {
            refreshed.push(at);
        }
        assert!(
            p.refresh.is_subset(&p.include),
            "a refresh is part of the write"
        );
    }
    assert_eq!(
        refreshed.len(),
        2,
        "shard 1 refreshed once per period despite its changes: {refreshed:?}"
    );
    assert!(refreshed[1].duration_since(refreshed[0]) >= refresh - Duration::from_secs(3));
}
