//! Table tests of the shard plan: fair share, hand-back, hold-off, a starving replica,
//! joining, and expiry as observed on this replica's own clock.

use super::*;

const RETRY: Duration = Duration::from_secs(2);
const DURATION: Duration = Duration::from_secs(15);

/// Shard views from a compact spec: `m` mine, `f` free, `F` free after holder `x`,
/// a lowercase letter other than m/f: that replica holds it (a -> "a").
fn views(spec: &str) -> BTreeMap<u32, ShardView> {
    spec.chars()
        .enumerate()
        .map(|(i, c)| {
            let v = match c {
                'm' => ShardView::Mine,
                'f' => ShardView::Free { previous: None },
                'F' => ShardView::Free {
                    previous: Some("x".into()),
                },
                other => ShardView::Other(other.to_string()),
            };
            (i as u32, v)
        })
        .collect()
}

struct Case {
    name: &'static str,
    shards: &'static str,
    /// Live replicas besides "me"; `None`: fair sharing off.
    live: Option<&'static [&'static str]>,
    joined: bool,
    /// Hold-off, in seconds from now (negative: already past).
    hold_off: Option<i64>,
    /// Expected: renewed count, a hand-back, room, others.
    renew: usize,
    hand_back: bool,
    room: usize,
    /// Expected hold-off after the plan, in retry periods from now (`None`: unchanged).
    new_hold_off: Option<u32>,
}

const CASES: &[Case] = &[
    Case {
        name: "alone: every free shard",
        shards: "ffff",
        live: None,
        joined: false,
        hold_off: None,
        renew: 0,
        hand_back: false,
        room: 4,
        new_hold_off: None,
    },
    Case {
        name: "joining: the first pass that counts members takes nothing",
        shards: "ffffffff",
        live: Some(&["a"]),
        joined: false,
        hold_off: None,
        renew: 0,
        hand_back: false,
        room: 0,
        new_hold_off: Some(1),
    },
    Case {
        name: "fair share: two replicas, eight free shards, four each",
        shards: "ffffffff",
        live: Some(&["a"]),
        joined: true,
        hold_off: None,
        renew: 0,
        hand_back: false,
        room: 4,
        new_hold_off: None,
    },
    Case {
        name: "fair share: at the share, the rest held by the other",
        shards: "mmmmaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: None,
        renew: 4,
        hand_back: false,
        room: 0,
        new_hold_off: None,
    },
    Case {
        name: "fair share: below the share, an expired shard is taken",
        shards: "mmmFaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: None,
        renew: 3,
        hand_back: false,
        room: 1,
        new_hold_off: None,
    },
    Case {
        name: "hand-back: above the share (a third replica came), one per pass",
        shards: "mmmmmaaa",
        live: Some(&["a", "b"]),
        joined: true,
        hold_off: None,
        renew: 4,
        hand_back: true,
        room: 0,
        new_hold_off: Some(2),
    },
    Case {
        name: "starving: at the ceiling while a live replica is below the floor",
        shards: "mmmaaab",
        live: Some(&["a", "b"]),
        joined: true,
        hold_off: None,
        renew: 2,
        hand_back: true,
        room: 0,
        new_hold_off: Some(2),
    },
    Case {
        name: "not starving: at the ceiling, everyone at least the floor",
        shards: "mmmaabb",
        live: Some(&["a", "b"]),
        joined: true,
        hold_off: None,
        renew: 3,
        hand_back: false,
        room: 0,
        new_hold_off: None,
    },
    Case {
        name: "a replica that is not live is not counted (its member Lease ran out)",
        shards: "mmmaaab",
        live: Some(&["a"]),
        joined: true,
        hold_off: None,
        renew: 3,
        hand_back: false,
        room: 1,
        new_hold_off: None,
    },
    Case {
        name: "hold-off: below the share but holding off, nothing taken",
        shards: "mmffaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: Some(1),
        renew: 2,
        hand_back: false,
        room: 0,
        new_hold_off: None,
    },
    Case {
        name: "hold-off past: takes up to the share",
        shards: "mmffaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: Some(-1),
        renew: 2,
        hand_back: false,
        room: 2,
        new_hold_off: None,
    },
    Case {
        name: "hold-off ends at its instant",
        shards: "mmffaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: Some(0),
        renew: 2,
        hand_back: false,
        room: 2,
        new_hold_off: None,
    },
    Case {
        name: "not starving: another above the floor is no reason to hand back",
        shards: "mmmaaabb",
        live: Some(&["a", "b"]),
        joined: true,
        hold_off: None,
        renew: 3,
        hand_back: false,
        room: 0,
        new_hold_off: None,
    },
    Case {
        name: "an even split: at the share, the one above it hands back, not this one",
        shards: "mmaaaa",
        live: Some(&["a", "b"]),
        joined: true,
        hold_off: None,
        renew: 2,
        hand_back: false,
        room: 0,
        new_hold_off: None,
    },
    Case {
        name: "uneven: nine shards, two replicas, the ceiling is five",
        shards: "mmmmfaaaa",
        live: Some(&["a"]),
        joined: true,
        hold_off: None,
        renew: 4,
        hand_back: false,
        room: 1,
        new_hold_off: None,
    },
];

#[test]
fn the_plan_of_a_pass() {
    let now = Instant::now();
    for c in CASES {
        let shards = views(c.shards);
        let live: Option<Vec<String>> = c.live.map(|l| {
            let mut v: Vec<String> = l.iter().map(|s| s.to_string()).collect();
            v.push("me".into());
            v.sort();
            v
        });
        let hold_off = c.hold_off.map(|s| {
            if s >= 0 {
                now + Duration::from_secs(s as u64)
            } else {
                now - Duration::from_secs((-s) as u64)
            }
        });
        let p = plan(&PlanInput {
            me: "me",
            shards: &shards,
            live: live.as_deref(),
            joined: c.joined,
            hold_off,
            retry: RETRY,
            now,
        });
        assert_eq!(p.renew.len(), c.renew, "{}: renew {:?}", c.name, p);
        assert_eq!(p.hand_back.is_some(), c.hand_back, "{}: {:?}", c.name, p);
        assert_eq!(p.room, c.room, "{}: room {:?}", c.name, p);
        let expected_hold = match c.new_hold_off {
            Some(n) => Some(now + n * RETRY),
            None => hold_off,
        };
        assert_eq!(p.hold_off, expected_hold, "{}: hold-off", c.name);
        assert!(p.joined || live.is_none(), "{}: joined", c.name);
        // Whatever else, the plan never renews or takes a shard another live replica holds,
        // and never takes a shard that would bring it above the ceiling (one above it
        // hands back one shard a pass).
        let held = intended(&p);
        assert_eq!(
            held.len(),
            c.renew + c.room.min(p.take.len()),
            "{}: intends {held:?}",
            c.name
        );
        assert!(p.renew.iter().all(|s| held.contains(s)), "{}", c.name);
        for s in &p.others {
            assert!(
                !held.contains(s),
                "{}: plans to write {s}, held by another",
                c.name
            );
        }
        let ceiling = live
            .as_ref()
            .map_or(shards.len(), |l| share(shards.len() as u32, l.len()).0);
        assert!(
            p.room == 0 || held.len() <= ceiling,
            "{}: {held:?} over {ceiling}",
            c.name
        );
        assert!(held.len() <= ceiling.max(p.renew.len()), "{}", c.name);
        if let Some(h) = p.hand_back {
            assert!(
                !held.contains(&h),
                "{}: hands back {h} and keeps it",
                c.name
            );
            assert_eq!(shards[&h], ShardView::Mine, "{}", c.name);
        }
    }
}

/// The shard handed back and the order of takes follow the rendezvous preference, so
/// replicas reaching at once mostly reach for different shards.
#[test]
fn takes_and_hand_backs_follow_the_preference() {
    let now = Instant::now();
    let free = views("ffffffffffffffff");
    let p = plan(&PlanInput {
        me: "r1",
        shards: &free,
        live: None,
        joined: false,
        hold_off: None,
        retry: RETRY,
        now,
    });
    let mut sorted = p.take.clone();
    sorted.sort_by_key(|s| preference("r1", *s));
    assert_eq!(p.take, sorted);
    let q = plan(&PlanInput {
        me: "r2",
        shards: &free,
        live: None,
        joined: false,
        hold_off: None,
        retry: RETRY,
        now,
    });
    assert_ne!(p.take, q.take, "two replicas prefer the same order");
    let mine = views("mmmmm");
    let live = vec!["a".to_string(), "b".into(), "r1".into()];
    let p = plan(&PlanInput {
        me: "r1",
        shards: &mine,
        live: Some(&live),
        joined: true,
        hold_off: None,
        retry: RETRY,
        now,
    });
    let last = (0..5).max_by_key(|s| preference("r1", *s));
    assert_eq!(p.hand_back, last);
}

fn record(holder: &str, renew: i128) -> Record {
    Record {
        holder: Some(holder.into()),
        renew: Some(renew),
        acquire: Some(0),
        transitions: Some(0),
        duration_secs: Some(15),
    }
}

/// Expiry is judged on this replica's clock from when it saw the record change, never
/// from the holder's timestamps.
#[test]
fn expiry_as_observed() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut o = Observer::new("me", DURATION);
    // A holder's renewal time far in the past (clock skew) is not expiry: we just saw it.
    assert_eq!(
        o.shard(0, Some(&record("a", -1_000_000_000_000)), t0),
        ShardView::Other("a".into())
    );
    // Unchanged for less than its duration: still held.
    assert_eq!(
        o.shard(0, Some(&record("a", -1_000_000_000_000)), t0 + s(15)),
        ShardView::Other("a".into())
    );
    // A renewal restarts the clock.
    assert_eq!(
        o.shard(0, Some(&record("a", 1)), t0 + s(16)),
        ShardView::Other("a".into())
    );
    assert_eq!(
        o.shard(0, Some(&record("a", 1)), t0 + s(31)),
        ShardView::Other("a".into())
    );
    // Unchanged past its duration since we saw it change: free, a takeover.
    assert_eq!(
        o.shard(0, Some(&record("a", 1)), t0 + s(32)),
        ShardView::Free {
            previous: Some("a".into())
        }
    );
    // The duration the record states counts.
    let mut short = record("b", 5);
    short.duration_secs = Some(5);
    assert_eq!(o.shard(1, Some(&short), t0), ShardView::Other("b".into()));
    assert_eq!(o.next_expiry(t0 + s(1)), Some(t0 + s(5)));
    assert_eq!(
        o.next_expiry(t0 + s(5)),
        Some(t0 + s(31)),
        "a lease out just now is not counted"
    );
    assert_eq!(
        o.shard(1, Some(&short), t0 + s(6)),
        ShardView::Free {
            previous: Some("b".into())
        }
    );
    // A shard forgotten (taken, or its take tried) is seen afresh.
    o.forget_shard(1);
    assert_eq!(
        o.shard(1, Some(&short), t0 + s(6)),
        ShardView::Other("b".into())
    );
    // Ours, released and absent.
    assert_eq!(o.shard(2, Some(&record("me", 1)), t0), ShardView::Mine);
    let mut released = record("a", 1);
    released.holder = Some(String::new());
    assert_eq!(
        o.shard(3, Some(&released), t0),
        ShardView::Free { previous: None }
    );
    assert_eq!(o.shard(4, None, t0), ShardView::Free { previous: None });
}

/// A replica is live while its member Lease changes within its duration; one unchanged
/// for ten durations is stale; news between passes is a release or a member gone.
#[test]
fn members_live_stale_and_news() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut o = Observer::new("me", DURATION);
    let mut listing = Listing::default();
    listing.members.insert("me".into(), record("me", 1));
    listing.members.insert("a".into(), record("a", 1));
    listing.members.insert("b".into(), record("b", 1));
    listing.shards.insert(0, record("a", 1));
    let seen = o.pass(&listing, 2, t0);
    assert_eq!(seen.live, vec!["a", "b", "me"]);
    assert_eq!(seen.shards[&0], ShardView::Other("a".into()));
    assert_eq!(seen.shards[&1], ShardView::Free { previous: None });
    // a renews, b does not: b is not live after its duration.
    listing.members.insert("a".into(), record("a", 2));
    let seen = o.pass(&listing, 2, t0 + s(16));
    assert_eq!(seen.live, vec!["a", "me"]);
    assert!(seen.stale.is_empty());
    // Ten durations unchanged: stale.
    let seen = o.pass(&listing, 2, t0 + s(151));
    assert_eq!(seen.stale, vec!["b"]);
    // Between passes: a renewal is no news; a release and a member gone are.
    listing.members.insert("a".into(), record("a", 3));
    assert!(!o.between(&listing, 2, t0 + s(152)));
    let mut released = record("a", 3);
    released.holder = None;
    listing.shards.insert(0, released);
    assert!(o.between(&listing, 2, t0 + s(153)));
    listing.members.remove("b");
    assert!(o.between(&listing, 2, t0 + s(154)));
    assert!(!o.between(&listing, 2, t0 + s(155)));
}

/// The observer's bookkeeping at its edges (cargo-mutants found these untested): stale
/// only past ten durations; a member Lease gone or removed is forgotten; a renewal
/// seen between passes counts from then; another's shard seen between passes makes its
/// release news, this replica's own does not.
#[test]
fn the_observer_forgets_and_notes_exactly() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut o = Observer::new("me", DURATION);
    let mut listing = Listing::default();
    listing.members.insert("a".into(), record("a", 1));
    listing.members.insert("b".into(), record("b", 1));
    o.pass(&listing, 0, t0);
    assert!(
        o.pass(&listing, 0, t0 + s(150)).stale.is_empty(),
        "ten durations"
    );
    assert_eq!(o.pass(&listing, 0, t0 + s(151)).stale, vec!["a", "b"]);
    listing.members.remove("b");
    assert_eq!(o.pass(&listing, 0, t0 + s(152)).stale, vec!["a"], "b gone");
    o.forget_member("a");
    let seen = o.pass(&listing, 0, t0 + s(152));
    assert!(seen.stale.is_empty(), "{seen:?}");
    assert_eq!(seen.live, vec!["a", "me"], "a seen afresh");
    // A renewal seen between passes counts from then: a duration later, not live.
    listing.members.insert("a".into(), record("a", 2));
    assert!(!o.between(&listing, 0, t0 + s(160)));
    assert_eq!(o.pass(&listing, 0, t0 + s(176)).live, vec!["me"]);

    let mut o = Observer::new("me", DURATION);
    let mut listing = Listing::default();
    listing.shards.insert(0, record("a", 1));
    listing.shards.insert(1, record("me", 1));
    assert!(!o.between(&listing, 2, t0));
    listing.shards.get_mut(&1).unwrap().holder = None;
    assert!(
        !o.between(&listing, 2, t0 + s(1)),
        "our own release is no news"
    );
    listing.shards.get_mut(&0).unwrap().holder = None;
    assert!(o.between(&listing, 2, t0 + s(2)), "another's release is");
}
