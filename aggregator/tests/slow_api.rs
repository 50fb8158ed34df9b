//! The shard Leases under a slow API server. With 2 s added to every call no
//! Lease changes holder and a fault is still published within 10 s; one shard's Lease
//! calls hanging past `--kube-timeout` stop neither the replica's other shards' renewals
//! nor their writes. The slowness is injected (`Faults::latency_ms`, `latency_match`),
//! not kube-apiserver behaviour: an overloaded or partitioned control plane, as
//! `apiserver_request_duration_seconds`
//! (staging/src/k8s.io/apiserver/pkg/endpoints/metrics/metrics.go) shows it. Leases made
//! before they were labelled are labelled and taken as before.

mod support;

use std::time::{Duration, Instant};

use faultline_common::fault::shard_of;
use faultline_test_apiserver::{ApiServer, Faults};
use serde_json::json;
use support::*;

const NODES: [&str; 6] = ["n1", "n2", "n3", "n4", "n5", "n6"];
const SHARDS: u32 = 4;
const XID79: &str = r#"{"device":"gpu1","fault":"xid","xid":79}"#;

/// Who holds each shard's Lease.
fn holders(server: &ApiServer) -> Vec<Option<String>> {
    (0..SHARDS).map(|s| holder(server, s)).collect()
}

async fn world() -> World {
    let mut sc = Scenario::new();
    for n in NODES {
        sc = sc.agent(n);
    }
    sc.named().start().await
}

/// client-go's leader-election timing (15 s, renewed every 2 s), as deployed.
fn replica(w: &World, name: &str) -> Launch {
    w.configmap(name, SHARDS)
        .set("--lease-duration", "15s")
        .set("--lease-retry", "2s")
}

/// r1 holds every shard's Lease, and every node is published healthy.
async fn r1_holds_every_shard(server: &ApiServer) {
    until(Duration::from_secs(30), "r1 holds every shard", || {
        holders(server)
            .iter()
            .all(|h| h.as_deref() == Some("r1"))
            .then_some(())
    })
    .await;
    all_healthy(server).await;
}

async fn all_healthy(server: &ApiServer) {
    until(Duration::from_secs(40), "every node healthy", || {
        NODES
            .iter()
            .all(|n| node_entry(server, SHARDS, n).is_some_and(|e| e.summary.healthy == 4))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_seconds_on_every_call_move_no_lease_and_a_fault_is_still_published() {
    let w = world().await;
    let server = &w.server;
    let r1 = replica(&w, "r1").start().await;
    let r2 = replica(&w, "r2").start().await;
    until(Duration::from_secs(60), "two shards each", || {
        let h = holders(server);
        let of = |r: &str| h.iter().filter(|x| x.as_deref() == Some(r)).count();
        (of("r1") == 2 && of("r2") == 2).then_some(())
    })
    .await;
    all_healthy(server).await;
    let before = holders(server);
    server.set_faults(Faults {
        latency_ms: 2_000,
        ..Default::default()
    });
    let victim = NODES[0];
    let start = Instant::now();
    let mut injected: Option<Instant> = None;
    let mut took = None;
    while start.elapsed() < Duration::from_secs(30) {
        assert_eq!(
            holders(server),
            before,
            "a Lease changed holder {:?} into 2 s of latency on every call",
            start.elapsed()
        );
        if injected.is_none() && start.elapsed() >= Duration::from_secs(6) {
            inject(w.agent(victim), XID79).await;
            injected = Some(Instant::now());
        }
        if let (Some(at), None) = (injected, took) {
            if published_failed(server, SHARDS, victim, "gpu1") {
                took = Some(at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = took.expect("the fault was published under 2 s of latency");
    assert!(
        took <= Duration::from_secs(10),
        "published {took:?} after the fault"
    );
    server.set_faults(Faults::default());
    r1.cancel_token().cancel();
    r2.cancel_token().cancel();
}

/// One shard's Lease calls hang, at the default `--kube-timeout` (15 s, longer than a
/// hold of 15 s - 3 s): the other shards are held, renewed and written throughout. Each
/// Lease call is given up after half a hold; before, the hung renewal held up the whole
/// pass for the client's 15 s and every shard's hold ran out behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_lease_call_stops_neither_the_other_renewals_nor_their_writes() {
    let w = world().await;
    let server = &w.server;
    let r1 = replica(&w, "r1").start().await;
    r1_holds_every_shard(server).await;
    // Shard 1's Lease calls hang for 60 s (the client's own timeout is 15 s).
    server.set_faults(Faults {
        latency_ms: 60_000,
        latency_match: "/leases/faultline-shard-1".into(),
        ..Default::default()
    });
    let renewed = |s: u32| {
        server
            .get("leases", NS, &format!("faultline-shard-{s}"))
            .and_then(|l| l["spec"]["renewTime"].as_str().map(String::from))
    };
    let others: Vec<u32> = (0..SHARDS).filter(|s| *s != 1).collect();
    let first: Vec<_> = others.iter().map(|s| renewed(*s)).collect();
    // Past the hold of shard 1 on r1's clock and the client's timeout (15 s), the other
    // shards are held at every look.
    let start = Instant::now();
    let mut looks = 0;
    while start.elapsed() < Duration::from_secs(17) {
        let text = metrics(r1.addr).await;
        for s in &others {
            let held = format!("faultline_aggregator_lease_held{{shard=\"{s}\"}} 1");
            assert!(
                text.contains(&held),
                "shard {s} not held {:?} into shard 1's hung Lease calls",
                start.elapsed()
            );
        }
        looks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(looks > 50, "the metrics were read {looks} times");
    for (s, was) in others.iter().zip(&first) {
        assert_ne!(&renewed(*s), was, "shard {s}'s Lease renewed meanwhile");
        assert_eq!(holder(server, *s).as_deref(), Some("r1"));
    }
    let victim = *NODES
        .iter()
        .find(|n| shard_of(n, SHARDS) != 1)
        .expect("a node outside shard 1");
    let at = Instant::now();
    inject(w.agent(victim), XID79).await;
    until(
        Duration::from_secs(5),
        "the fault published beside the hung Lease",
        || published_failed(server, SHARDS, victim, "gpu1").then_some(()),
    )
    .await;
    eprintln!("published {:?} after the fault", at.elapsed());
    server.set_faults(Faults::default());
    r1.cancel_token().cancel();
}

/// A hold that ran out on the replica's clock (its Lease calls hung past the hold) is
/// held again by the next renewal, without a new seed: the Lease still names the
/// replica, so nobody else wrote the shard meanwhile. Each seed reads the shard's pages;
/// at 2 s a call, seeding every renewed shard again in sequence took longer than a hold
/// lasts, so the last shards' holds ran out before they were set, pass after pass, and
/// their faults were never published (found by the cluster benchmark).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_hold_is_held_again_at_the_next_renewal_under_a_slow_api() {
    let w = world().await;
    let server = &w.server;
    let r1 = replica(&w, "r1")
        .set("--pages", "2")
        .set("--kube-timeout", "4s")
        .start()
        .await;
    r1_holds_every_shard(server).await;
    // Every Lease call hangs (the client gives up after 4 s) past the hold (15 s - 3 s).
    server.set_faults(Faults {
        latency_ms: 60_000,
        latency_match: "/leases/".into(),
        ..Default::default()
    });
    // Until r1 says it holds no shard (its hold ran out; the Leases still name it).
    for shard in 0..SHARDS {
        let lapsed = format!("faultline_aggregator_lease_held{{shard=\"{shard}\"}} 0");
        metric_until(r1.addr, &lapsed, Duration::from_secs(30)).await;
    }
    server.set_faults(Faults {
        latency_ms: 2_000,
        ..Default::default()
    });
    // A node of the last shards to be renewed (in order, they were seeded last).
    let victim = *NODES
        .iter()
        .max_by_key(|n| shard_of(n, SHARDS))
        .expect("a node");
    assert!(shard_of(victim, SHARDS) >= 2, "a node in shard 2 or 3");
    let at = Instant::now();
    inject(w.agent(victim), XID79).await;
    until(
        Duration::from_secs(20),
        "the fault published after the hold was renewed",
        || published_failed(server, SHARDS, victim, "gpu1").then_some(()),
    )
    .await;
    eprintln!("published {:?} after the fault", at.elapsed());
    assert!(holders(server).iter().all(|h| h.as_deref() == Some("r1")));
    server.set_faults(Faults::default());
    r1.cancel_token().cancel();
}

/// A shard Lease made before the label (by an older version) is labelled, then judged
/// and taken like any other; a renewal carries the sequence the holder published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlabelled_lease_is_labelled_and_taken_and_renewals_carry_the_sequence() {
    let w = Scenario::new()
        .agent("n1")
        .named()
        .object(
            "leases",
            NS,
            json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": "faultline-shard-0", "namespace": NS},
                "spec": {"leaseDurationSeconds": 3, "leaseTransitions": 4}
            }),
        )
        .start()
        .await;
    let server = &w.server;
    let r1 = w.configmap("r1", 1).start().await;
    let lease = holds(server, "r1").await;
    assert_eq!(
        lease["metadata"]["labels"]["faultline.io/aggregator"],
        "faultline"
    );
    assert_eq!(lease["spec"]["leaseTransitions"], 5, "{lease}");
    let (seq, _) = until(Duration::from_secs(10), "the sequence on the Lease", || {
        let doc = shard_doc(server, 0)?;
        let l = server.get("leases", NS, "faultline-shard-0")?;
        let on_lease: u64 = l["metadata"]["annotations"]["faultline.io/sequence"]
            .as_str()?
            .parse()
            .ok()?;
        (on_lease == doc.sequence).then_some(on_lease)
    })
    .await;
    assert!(seq >= 1);
    r1.cancel_token().cancel();
}
