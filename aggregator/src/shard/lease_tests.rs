//! The Lease loop's own calls against the test API server: the member Lease, the one
//! list, the look between passes, stale members, what a renewal or take came to, and a
//! pass that takes over up to its share.

use std::sync::Arc;
use std::time::Duration;

use faultline_common::fault::NodeFaults;
use faultline_test_apiserver::{ApiServer, Bootstrap, Faults};
use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::*;
use crate::shard::Held;

/// Seeds nothing: every shard taken starts from an empty document.
struct NoSeeds;

impl SeedSource for NoSeeds {
    fn read(&self, _shard: u32) -> BoxFuture<'_, Vec<NodeFaults>> {
        Box::pin(async { Vec::new() })
    }
}

/// Replica `me`'s Leases of 4 shards (15 s, retried every 2 s) on the test API server;
/// with fair sharing, the receiver of its events to the core loop. (The Lease writes'
/// tests use it too.)
pub(in crate::shard) async fn leases(
    me: &str,
    sharing: bool,
) -> (ApiServer, ShardLeases, Option<mpsc::Receiver<ShardEvent>>) {
    let (server, url) = Bootstrap::new().namespace("faultline").spawn().await;
    let mut kc = kube::Config::new(url.parse().unwrap());
    kc.default_retry = false;
    let client = kube::Client::try_from(kc).unwrap();
    let cfg = LeaseConfig::from_flags(Duration::from_secs(15), Duration::from_secs(2));
    let (tx, rx) = mpsc::channel(64);
    let leases = ShardLeases {
        api: Api::namespaced(client, "faultline"),
        name: "faultline".into(),
        me: me.into(),
        shards: 4,
        cfg,
        held: Held::default(),
        metrics: Arc::new(Metrics::new()),
        url: None,
        observer: ShardLeases::observer_for(me, &cfg),
        share: sharing.then(|| Sharing::new(Box::new(NoSeeds), tx)),
    };
    (server, leases, sharing.then_some(rx))
}

/// A Lease of this aggregator, as another replica or a person left it.
fn lease(server: &ApiServer, name: &str, labels: Value, holder: &str, duration: i32) {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    server
        .create(
            "leases",
            "faultline",
            json!({"metadata": {"name": name, "labels": labels},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                    "renewTime": now}}),
        )
        .unwrap();
}

fn member_labels() -> Value {
    json!({AGGREGATOR_LABEL: "faultline", MEMBER_LABEL: "faultline"})
}

/// The value of a counter in the replica's metrics.
fn counter(l: &ShardLeases, name: &str) -> u64 {
    counter_of(&l.metrics, name)
}

fn counter_of(metrics: &Metrics, name: &str) -> u64 {
    let text = metrics.encode();
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("faultline_aggregator_{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} in {text}"))
}

fn events(rx: &mut mpsc::Receiver<ShardEvent>) -> Vec<String> {
    let mut seen = Vec::new();
    while let Ok(e) = rx.try_recv() {
        seen.push(match e {
            ShardEvent::Taken(t) => format!("taken {}", t.shard),
            ShardEvent::Held => "held".into(),
            ShardEvent::FinalWrite(f) => format!("final {}", f.shard),
        });
    }
    seen
}

/// The member Lease says who this replica is, for how long and since when, labelled so
/// the others list it; renewed in place, other labels kept. Without fair sharing no
/// member Lease is written.
#[tokio::test]
async fn the_member_lease_names_the_replica_and_is_renewed_in_place() {
    let (server, l, _rx) = leases("r1", true).await;
    l.renew_member().await.unwrap();
    let v = server
        .get("leases", "faultline", "faultline-member-r1")
        .expect("the member Lease");
    assert_eq!(v["spec"]["holderIdentity"], "r1");
    assert_eq!(v["spec"]["leaseDurationSeconds"], 15);
    assert_eq!(v["metadata"]["labels"], member_labels());
    let first = v["spec"]["renewTime"].as_str().unwrap().to_string();
    assert!(
        faultline_common::time::parse_rfc3339_ms(&first)
            .is_some_and(|t| faultline_common::time::now_ms().abs_diff(t) < 10_000),
        "{v}"
    );

    let mut v = v;
    v["metadata"]["labels"]["team"] = json!("gpu");
    v["spec"]["holderIdentity"] = json!("someone");
    server
        .update("leases", "faultline", "faultline-member-r1", v, None)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    l.renew_member().await.unwrap();
    let v = server
        .get("leases", "faultline", "faultline-member-r1")
        .unwrap();
    assert_eq!(v["spec"]["holderIdentity"], "r1");
    assert_eq!(v["metadata"]["labels"]["team"], "gpu");
    assert_eq!(v["metadata"]["labels"][MEMBER_LABEL], "faultline");
    assert_ne!(v["spec"]["renewTime"], first.as_str(), "renewed: {v}");

    let (server, l, _) = leases("r1", false).await;
    l.renew_member().await.unwrap();
    assert!(server.list("leases", "faultline").is_empty());
}

/// One list gives the shards' records and Leases, and the members that name a holder;
/// without fair sharing, no members.
#[tokio::test]
async fn the_list_reads_shards_and_named_members() {
    let (server, l, _rx) = leases("r1", true).await;
    let shard = json!({AGGREGATOR_LABEL: "faultline"});
    lease(&server, "faultline-shard-2", shard.clone(), "r2", 15);
    lease(&server, "faultline-shard-9", shard.clone(), "r2", 15);
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    lease(&server, "faultline-member-r3", member_labels(), "", 15);
    lease(
        &server,
        "faultline-member-r4",
        json!({AGGREGATOR_LABEL: "faultline", MEMBER_LABEL: "other"}),
        "r4",
        15,
    );
    let (listing, by_shard) = l.list().await.unwrap();
    assert_eq!(listing.shards.keys().copied().collect::<Vec<_>>(), [2]);
    assert_eq!(listing.shards[&2].holder(), Some("r2"));
    assert_eq!(listing.shards[&2].duration_secs, Some(15));
    assert_eq!(by_shard.keys().copied().collect::<Vec<_>>(), [2]);
    assert_eq!(
        listing
            .members
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["r2"]
    );

    let (server, l, _) = leases("r1", false).await;
    lease(&server, "faultline-shard-1", shard, "r2", 15);
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    let (listing, _) = l.list().await.unwrap();
    assert_eq!(listing.shards.len(), 1);
    assert!(listing.members.is_empty(), "{:?}", listing.members);
}

/// A look between passes is news when a shard another replica held was released or a
/// member left; nothing changed is none. Without fair sharing no member's expiry
/// wakes the loop.
#[tokio::test]
async fn a_look_between_passes_finds_a_release_or_a_member_gone() {
    let (server, mut l, _rx) = leases("r1", true).await;
    let shard = json!({AGGREGATOR_LABEL: "faultline"});
    lease(&server, "faultline-shard-1", shard.clone(), "r2", 15);
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    assert!(!l.observe().await, "first sight is no news");
    assert!(!l.observe().await, "nothing changed");
    let mut v = server
        .get("leases", "faultline", "faultline-shard-1")
        .unwrap();
    v["spec"]["holderIdentity"] = json!("");
    server
        .update("leases", "faultline", "faultline-shard-1", v, None)
        .unwrap();
    assert!(l.observe().await, "released");
    assert!(!l.observe().await);
    server
        .delete("leases", "faultline", "faultline-member-r2")
        .unwrap();
    assert!(l.observe().await, "a member gone");

    server.set_faults(Faults {
        error_rate: 1.0,
        ..Default::default()
    });
    assert!(!l.observe().await, "a failed list is no news");
    assert_eq!(counter(&l, "lease_errors_total"), 1);

    let (server, mut l, _) = leases("r1", false).await;
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    assert!(!l.observe().await);
    assert_eq!(l.observer.next_expiry(Instant::now()), None);
}

/// A member Lease found stale is deleted and forgotten; one that cannot be deleted is
/// remembered, to be tried again.
#[tokio::test]
async fn a_stale_member_is_removed_and_forgotten() {
    let (server, mut l, _rx) = leases("r1", true).await;
    lease(
        &server,
        "faultline-member-gone",
        member_labels(),
        "gone",
        15,
    );
    let (listing, _) = l.list().await.unwrap();
    l.observer.pass(&listing, 4, Instant::now());
    let fresh = ShardLeases::observer_for("r1", &l.cfg);
    assert_ne!(l.observer, fresh, "noted");

    server.set_faults(Faults {
        write_error_rate: 1.0,
        ..Default::default()
    });
    l.remove_stale(&["gone".into()]).await;
    assert_ne!(l.observer, fresh, "kept while its Lease stays");
    server.set_faults(Faults::default());
    l.remove_stale(&["gone".into()]).await;
    assert!(server
        .get("leases", "faultline", "faultline-member-gone")
        .is_none());
    assert_eq!(l.observer, fresh);
}

/// What a renewal or take came to: a take is seeded before it counts as held, a
/// renewal of a shard still granted is not (even after its hold ran out on this
/// replica's clock, which is counted); a 409 lets the shard go at once, any other
/// error keeps the hold until it runs out.
#[tokio::test]
async fn a_take_is_seeded_a_renewal_is_not_and_only_a_conflict_lets_go() {
    let (_server, l, rx) = leases("r1", true).await;
    let mut rx = rx.unwrap();
    let now = Instant::now();
    l.outcome(1, Ok(true), now, Taken::Free).await;
    assert!(l.held.holds(1));
    assert_eq!(events(&mut rx), ["taken 1", "held"]);
    assert_eq!(counter(&l, "shard_hold_lapses_total"), 0);

    l.outcome(1, Ok(true), now, Taken::Renewed).await;
    assert!(events(&mut rx).is_empty(), "a renewal seeds nothing");
    assert_eq!(counter(&l, "shard_hold_lapses_total"), 0, "held throughout");

    // The hold ran out on this replica's clock (still granted): held again, unseeded.
    l.held.set(1, Some(now));
    assert!(!l.held.holds(1));
    l.outcome(1, Ok(true), Instant::now(), Taken::Renewed).await;
    assert!(l.held.holds(1));
    assert!(events(&mut rx).is_empty(), "{:?}", events(&mut rx));
    assert_eq!(counter(&l, "shard_hold_lapses_total"), 1);
    // Listed free and taken while still granted: a take, seeded.
    l.outcome(1, Ok(true), Instant::now(), Taken::Free).await;
    assert_eq!(events(&mut rx), ["taken 1"]);

    let refused = |code: u16| {
        Err(kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: "test".into(),
            ..Default::default()
        })))
    };
    l.outcome(1, refused(500), Instant::now(), Taken::Renewed)
        .await;
    assert!(l.held.holds(1), "kept until it runs out");
    assert_eq!(counter(&l, "lease_errors_total"), 1);
    l.outcome(1, refused(409), Instant::now(), Taken::Renewed)
        .await;
    assert!(!l.held.holds(1), "a conflict: another replica won");
    assert_eq!(events(&mut rx), ["held"]);
    assert_eq!(counter(&l, "lease_errors_total"), 1);
    l.outcome(2, Ok(true), Instant::now(), Taken::Free).await;
    l.outcome(2, Ok(false), Instant::now(), Taken::Renewed)
        .await;
    assert!(!l.held.holds(2), "another holder");
}

/// A pass takes free shards up to its share, and counts a shard whose holder's Lease
/// ran out as a takeover (its own, or one never held, as none).
#[tokio::test]
async fn a_pass_takes_up_to_its_share_and_counts_takeovers() {
    let (server, mut l, rx) = leases("r1", true).await;
    let mut rx = rx.unwrap();
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    let shard = json!({AGGREGATOR_LABEL: "faultline"});
    for s in 0..4 {
        lease(
            &server,
            &format!("faultline-shard-{s}"),
            shard.clone(),
            "r3",
            1,
        );
    }
    l.pass().await;
    assert!(l.held.shards().is_empty(), "joining: none taken");
    assert!(server
        .get("leases", "faultline", "faultline-member-r1")
        .is_some());
    // Past the joining hold-off and the gone holder's 1 s.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    l.pass().await;
    assert_eq!(l.held.shards().len(), 2, "a share of two replicas");
    let mine: Vec<_> = server
        .list("leases", "faultline")
        .into_iter()
        .filter(|v| v["spec"]["holderIdentity"] == "r1")
        .map(|v| v["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(mine.len(), 3, "two shards and the member: {mine:?}");
    assert_eq!(counter(&l, "shard_takeovers_total"), 2);
    let seeded = events(&mut rx);
    assert_eq!(
        seeded.iter().filter(|e| e.starts_with("taken")).count(),
        2,
        "{seeded:?}"
    );
}

/// The loop alone: it passes once a retry period and looks at the Leases about three
/// times between passes (never in a busy loop, never only at its passes); cancelled,
/// it releases every shard it holds the client-go way and deletes its member Lease.
#[tokio::test]
async fn the_loop_paces_its_passes_and_looks_then_releases_on_cancel() {
    let (server, mut l, rx) = leases("r1", true).await;
    let mut rx = rx.unwrap();
    let retry = Duration::from_millis(400);
    l.cfg = LeaseConfig::from_flags(Duration::from_secs(4), retry);
    let (metrics, held, margin) = (l.metrics.clone(), l.held.clone(), l.cfg.margin);
    let cancel = CancellationToken::new();
    let started = std::time::Instant::now();
    let task = tokio::spawn(l.run(cancel.clone()));
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let names = |v: &Value| {
        v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let holders: Vec<String> = server
        .list("leases", "faultline")
        .iter()
        .filter(|v| v["spec"]["holderIdentity"] == "r1")
        .map(names)
        .collect();
    assert_eq!(holders.len(), 5, "4 shards and the member: {holders:?}");
    // A write let through the fence just now: the release waits the margin out.
    assert!(held.admit(2).is_some());
    let admitted = std::time::Instant::now();
    cancel.cancel();
    task.await.unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    let waited = admitted.elapsed();
    assert!(waited >= margin, "released {waited:?} after a write");
    drain.abort();

    let lists = server
        .calls()
        .iter()
        .filter(|c| c.method == "GET" && c.uri.contains("/leases?"))
        .count() as f64;
    let passes = counter_of(&metrics, "lease_passes_total") as f64;
    let most = elapsed / retry.as_secs_f64() + 2.0;
    assert!(
        passes >= 2.0 && passes <= most,
        "{passes} passes in {elapsed} s"
    );
    // Looks between the passes (a stalled machine may skip some), never a busy loop.
    assert!(
        lists >= passes + 2.0 && lists <= 4.0 * passes + 4.0,
        "{lists} lists for {passes} passes in {elapsed} s"
    );

    let leases = server.list("leases", "faultline");
    assert_eq!(leases.len(), 4, "the member Lease deleted: {leases:?}");
    for v in &leases {
        assert_eq!(v["spec"]["holderIdentity"], "", "released: {v}");
        assert_eq!(v["spec"]["leaseDurationSeconds"], 1, "{v}");
    }
}

/// Another holder's shard is taken just past its Lease's expiry, as this replica
/// counts it (20 ms after), not at the next pass a retry period later; no pass runs in
/// a loop near the expiry.
#[tokio::test]
async fn a_lapsed_holders_shard_is_taken_just_past_its_expiry() {
    let (server, mut l, _) = leases("r1", false).await;
    // Passes every 3 s, looks every 0.75 s: the Lease runs out at 2 s, between two.
    l.cfg = LeaseConfig::from_flags(Duration::from_secs(15), Duration::from_secs(3));
    let shard = json!({AGGREGATOR_LABEL: "faultline"});
    lease(&server, "faultline-shard-1", shard, "r2", 2);
    let cancel = CancellationToken::new();
    let metrics = l.metrics.clone();
    let started = std::time::Instant::now();
    let task = tokio::spawn(l.run(cancel.clone()));
    let mut taken = None;
    while taken.is_none() && started.elapsed() < Duration::from_secs(6) {
        let holder = server.get_at(
            "leases",
            "faultline",
            "faultline-shard-1",
            "/spec/holderIdentity",
        );
        if holder == Some(json!("r1")) {
            taken = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    task.await.unwrap();
    let taken = taken.expect("taken");
    let ms = Duration::from_millis;
    assert!(
        taken >= ms(2_000) && taken < ms(2_900),
        "taken after {taken:?}"
    );
    let passes = counter_of(&metrics, "lease_passes_total");
    assert!(passes <= 3, "{passes} passes");
}

/// Above its share once another replica counts, a replica hands one shard back:
/// written once more first, then released the client-go way, counted.
#[tokio::test]
async fn a_replica_above_its_share_hands_one_shard_back_after_a_final_write() {
    let (server, mut l, rx) = leases("r1", true).await;
    let mut rx = rx.unwrap();
    let finals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = finals.clone();
    let answer = tokio::spawn(async move {
        while let Some(e) = rx.recv().await {
            if let ShardEvent::FinalWrite(f) = e {
                seen.lock().unwrap().push(f.shard);
                let _ = f.done.send(());
            }
        }
    });
    if let Some(sh) = l.share.as_mut() {
        sh.joined = true;
    }
    l.pass().await;
    assert_eq!(l.held.shards().len(), 4, "alone: every shard");
    lease(&server, "faultline-member-r2", member_labels(), "r2", 15);
    l.pass().await;
    let finals = finals.lock().unwrap().clone();
    assert_eq!(finals.len(), 1, "{finals:?}");
    let back = finals[0];
    assert!(!l.held.holds(back));
    assert_eq!(l.held.shards().len(), 3);
    let v = server
        .get("leases", "faultline", &lease_name("faultline", back))
        .unwrap();
    assert_eq!(v["spec"]["holderIdentity"], "", "{v}");
    assert_eq!(counter(&l, "shard_rebalances_total"), 1);
    answer.abort();
}
