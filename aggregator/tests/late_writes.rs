//! A write that would land after the writer's hold ended. A replica's fence admits a
//! write while its hold stands; the API server is slow, and the write is still in
//! flight when the hold ends, the Lease runs out and another replica takes the shard.
//! Every write that acts is sent under `Fence::write`, which gives it up when the hold
//! ends, so it is never carried out: the new holder's count of the budget is the
//! truth, and nothing is done twice. The slowness is injected on the one call
//! (`Faults::latency_method`, `latency_match`); the API server drops a call whose
//! client went away, as kube-apiserver does (`ApiServer::abandoned`). And writes that
//! race: two replicas of different shards isolating at once against one budget.

mod support;

use std::time::Duration;

use faultline_aggregator::model::RecordDevice;
use faultline_aggregator::remediate::{Budget, Ledger, Mode, Outcome, RemediateError, Remediator};
use faultline_aggregator::shard::{Fence, Held};
use faultline_test_apiserver::{ApiServer, Faults};
use support::{kube_client, until, NodeFixture, Scenario};
use tokio::time::Instant;

const TAINT: &str = "nvidia.com/gpu-fault";

fn failed() -> Vec<RecordDevice> {
    vec![RecordDevice::new("gpu0", "xid-79")]
}

/// A replica named `actor` with a budget of `max_nodes`, its places in the ledger.
fn replica(client: &kube::Client, actor: &str, max_nodes: usize) -> Remediator {
    Remediator::new(client.clone(), Mode::Enforce, TAINT, "default", actor)
        .with_budget(Budget {
            max_nodes,
            max_percent: 100.0,
            ..Budget::default()
        })
        .with_budget_ledger(Some(Ledger::new(
            kube::Api::namespaced(client.clone(), support::NS),
            "faultline-budget".into(),
        )))
}

/// An aggregator's API server holding `nodes`, whose Node PATCHes on paths containing
/// `path` take `ms`, and a client of it.
async fn slow_patches(nodes: &[&str], path: &str, ms: u64) -> (support::World, kube::Client) {
    let w = Scenario::new().start().await;
    for n in nodes {
        NodeFixture::new(n).create(&w.server);
    }
    w.server.set_faults(Faults {
        latency_ms: ms,
        latency_match: path.into(),
        latency_method: "PATCH".into(),
        ..Default::default()
    });
    let client = kube_client(&w.kube);
    (w, client)
}

fn tainted(server: &ApiServer) -> Vec<String> {
    server
        .list("nodes", "")
        .iter()
        .filter(|n| {
            n["spec"]["taints"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["key"] == TAINT))
        })
        .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
        .collect()
}

/// The fate of the first `method` call on a path ending in `path`: carried out
/// (`Some(true)`), abandoned by its client (`Some(false)`), or still in the server.
fn fate(server: &ApiServer, method: &str, path: &str) -> Option<bool> {
    let ours =
        |m: &str, u: &str| m == method && u.split('?').next().is_some_and(|p| p.ends_with(path));
    if server.calls().iter().any(|c| ours(&c.method, &c.uri)) {
        return Some(true);
    }
    server
        .abandoned()
        .iter()
        .any(|c| ours(&c.method, &c.uri))
        .then_some(false)
}

/// Replica 0 taints n1 with 1 s of its hold left; the taint takes 6 s in the server,
/// so it would land 5 s after the hold ended. Meanwhile replica 1, the new holder,
/// holds n2 back: n1's place in the budget's ledger counts (the budget is one node),
/// for all replica 1 can know the taint may still land. The late taint is given up and
/// never carried out; replica 1 then quarantines n1 itself: one node tainted, the
/// budget kept. Without the bound the late taint lands, 5 s after the hold ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taint_due_to_land_after_the_hold_ended_changes_nothing() {
    let (w, client) = slow_patches(&["n1", "n2"], "/nodes/n1", 6_000).await;
    let server = w.server.clone();
    let held = Held::default();
    held.grant(0, Instant::now() + Duration::from_secs(1));
    let old = Fence::shard(held.clone(), 0);
    let r0 = replica(&client, "replica-0", 1);
    let late = tokio::spawn(async move { r0.isolate("n1", failed(), &old).await });
    until(
        Duration::from_secs(10),
        "replica 0's taint in the server",
        || {
            server
                .received()
                .iter()
                .any(|c| c.method == "PATCH" && c.uri.contains("/nodes/n1"))
                .then_some(())
        },
    )
    .await;
    // The hold ends; the Lease runs out a margin later, and replica 1 takes the shard.
    until(Duration::from_secs(10), "replica 0's hold ended", || {
        (!held.holds(0)).then_some(())
    })
    .await;
    server.set_faults(Faults::default());
    let r1 = replica(&client, "replica-1", 1);
    let fence = Fence::unfenced();
    let n2 = r1.isolate("n2", failed(), &fence).await.unwrap();
    assert!(
        matches!(&n2, Outcome::HeldBack(why) if why.contains("1 nodes quarantined, budget 1")),
        "n2: {n2:?}"
    );
    let r = late.await.unwrap();
    assert!(
        matches!(r, Err(RemediateError::HoldEnded(_))),
        "replica 0's pass: {r:?}"
    );
    let (carried_out, _) = until(Duration::from_secs(30), "the late taint's fate", || {
        fate(&server, "PATCH", "/nodes/n1")
    })
    .await;
    assert!(!carried_out, "the late taint was carried out");
    assert_eq!(tainted(&server), Vec::<String>::new());
    // n1's place is replica 1's now: its own, not one more.
    assert_eq!(
        r1.isolate("n1", failed(), &fence).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(tainted(&server), ["n1"], "one node, as the budget allows");
}

/// Two replicas holding different shards isolate failed nodes at once, each under its
/// own fence, against one budget of two nodes. Replica 0 quarantines n1; replica 1's
/// taint of n4 is slow (2 s in the server), and while it is in flight replica 0 decides
/// on n2. Counting the Nodes alone it sees one quarantine (n1) and takes n2 too: three
/// tainted, the old bound B + R − 1. With each place taken in the budget's ledger (a
/// ConfigMap written by compare-and-swap) before the taint, it counts n4's place:
/// exactly 2 tainted, the 4 others held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_isolating_at_once_keep_the_budget_exactly() {
    let nodes = ["n1", "n2", "n3", "n4", "n5", "n6"];
    let (w, client) = slow_patches(&nodes, "/nodes/n4", 2_000).await;
    let server = w.server.clone();
    let replica_of = |actor: &str, shard: u32| {
        let held = Held::default();
        held.grant(shard, Instant::now() + Duration::from_secs(600));
        (replica(&client, actor, 2), Fence::shard(held, shard))
    };
    let (r0, f0) = replica_of("replica-0", 0);
    let (r1, f1) = replica_of("replica-1", 1);
    let mut outcomes = vec![("n1", r0.isolate("n1", failed(), &f0).await.unwrap())];
    let slow = tokio::spawn(async move {
        let first = r1.isolate("n4", failed(), &f1).await.unwrap();
        let mut rest = vec![("n4", first)];
        for n in ["n5", "n6"] {
            rest.push((n, r1.isolate(n, failed(), &f1).await.unwrap()));
        }
        rest
    });
    until(
        Duration::from_secs(10),
        "replica 1's taint in the server",
        || {
            server
                .received()
                .iter()
                .any(|c| c.method == "PATCH" && c.uri.contains("/nodes/n4"))
                .then_some(())
        },
    )
    .await;
    assert!(
        !tainted(&server).contains(&"n4".to_string()),
        "n4's taint is still in flight"
    );
    for n in ["n2", "n3"] {
        outcomes.push((n, r0.isolate(n, failed(), &f0).await.unwrap()));
    }
    outcomes.extend(slow.await.unwrap());
    let quarantined = tainted(&server);
    println!("isolated at once: {outcomes:?}; tainted {quarantined:?}");
    assert_eq!(
        quarantined,
        ["n1", "n4"],
        "{} nodes tainted against a budget of 2",
        quarantined.len()
    );
    let held_back: Vec<&str> = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::HeldBack(_)))
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(held_back, ["n2", "n3", "n5", "n6"], "{outcomes:?}");
}
