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
use faultline_aggregator::remediate::{Budget, Mode, Outcome, RemediateError, Remediator};
use faultline_aggregator::shard::{Fence, Held};
use faultline_test_apiserver::{ApiServer, Faults};
use support::{kube_client, until, NodeFixture, Scenario};
use tokio::time::Instant;

const TAINT: &str = "nvidia.com/gpu-fault";

fn failed() -> Vec<RecordDevice> {
    vec![RecordDevice::new("gpu0", "xid-79")]
}

/// A replica named `actor` with a budget of `max_nodes`.
fn replica(client: &kube::Client, actor: &str, max_nodes: usize) -> Remediator {
    Remediator::new(client.clone(), Mode::Enforce, TAINT, "default", actor).with_budget(Budget {
        max_nodes,
        max_percent: 100.0,
        ..Budget::default()
    })
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
/// quarantines n2 (the budget is one node, and n1 is not tainted) and holds n1 back.
/// The late taint is given up and never carried out: one node tainted, the budget
/// kept. Without the bound it lands, and two nodes are quarantined against a budget
/// of one.
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
    assert_eq!(
        r1.isolate("n2", failed(), &fence).await.unwrap(),
        Outcome::Isolated
    );
    assert!(matches!(
        r1.isolate("n1", failed(), &fence).await.unwrap(),
        Outcome::HeldBack(_)
    ));
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
    assert_eq!(tainted(&server), ["n2"], "one node, as the budget allows");
}

/// Two replicas holding different shards isolate failed nodes at once, each under its
/// own fence, against one budget of two nodes: each counts the quarantined nodes
/// before its taint goes, and the taints are slow (400 ms), so both may count before
/// either lands. The bound the design gives, B + R − 1 = 3 (docs/remediation.md), holds
/// with six nodes failing; the budget is reached, and the nodes beyond it are held
/// back. Without the budget's check, all six are tainted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_isolating_at_once_keep_the_budget_bound() {
    let nodes = ["n1", "n2", "n3", "n4", "n5", "n6"];
    let (w, client) = slow_patches(&nodes, "/nodes/", 400).await;
    let server = w.server.clone();
    let replica_of = |actor: &str, shard: u32| {
        let held = Held::default();
        held.grant(shard, Instant::now() + Duration::from_secs(600));
        (replica(&client, actor, 2), Fence::shard(held, shard))
    };
    let pass = |(r, fence): (Remediator, Fence), mine: [&'static str; 3]| async move {
        let mut outcomes = Vec::new();
        for n in mine {
            outcomes.push((n, r.isolate(n, failed(), &fence).await.unwrap()));
        }
        outcomes
    };
    let (a, b) = tokio::join!(
        pass(replica_of("replica-0", 0), ["n1", "n2", "n3"]),
        pass(replica_of("replica-1", 1), ["n4", "n5", "n6"]),
    );
    let quarantined = tainted(&server);
    println!("isolated at once: {a:?} {b:?}; tainted {quarantined:?}");
    assert!(
        (2..=3).contains(&quarantined.len()),
        "{} nodes tainted: the budget is 2, the bound with two replicas 3 ({quarantined:?})",
        quarantined.len()
    );
    let held_back = a
        .iter()
        .chain(&b)
        .filter(|(_, o)| matches!(o, Outcome::HeldBack(_)))
        .count();
    assert_eq!(held_back, nodes.len() - quarantined.len(), "{a:?} {b:?}");
}
