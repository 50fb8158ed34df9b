//! Two replicas on real Leases (`coordination.k8s.io/v1`, compare-and-swap on the
//! resourceVersion by the real apiserver): fair shares, and a killed holder's shards
//! taken over by the other replica, which then heals on them, once.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use faultline_common::fault::shard_of;
use faultline_controlplane::Release;

use crate::support::{self, real::RealCluster};
use crate::{until, HEALING, SHARDS};

/// The shard Leases' holders, by shard (`faultline-shard-<i>`).
fn holders(c: &RealCluster) -> BTreeMap<u32, (String, i64)> {
    c.items(&["-n", support::real::NS, "leases"])
        .iter()
        .filter_map(|l| {
            let i = l["metadata"]["name"]
                .as_str()?
                .strip_prefix("faultline-shard-")?
                .parse()
                .ok()?;
            let who = l["spec"]["holderIdentity"].as_str()?.to_string();
            Some((
                i,
                (who, l["spec"]["leaseTransitions"].as_i64().unwrap_or(0)),
            ))
        })
        .filter(|(_, (who, _))| !who.is_empty())
        .collect()
}

/// Replicas a and b share the four shards; the holder of n1's shard is killed
/// (SIGKILL: no Lease released); once its Lease expires the other takes it over (the
/// real apiserver's compare-and-swap), publishes n1 again, and heals a fault there:
/// n1 tainted once, as the record's actor says, by the survivor.
async fn a_killed_holders_shards_are_taken_over(release: Release) {
    let test = format!("a_killed_holders_shards_are_taken_over ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, 2).await else {
        return;
    };
    let mut args = HEALING.to_vec();
    args.extend(["--lease-duration=4s", "--lease-retry=500ms"]);
    let a = c.aggregator("faultline-aggregator-a", &args).await;
    let b = c.aggregator("faultline-aggregator-b", &args).await;
    let mut replicas =
        BTreeMap::from([("faultline-aggregator-a", a), ("faultline-aggregator-b", b)]);
    let shard = shard_of("n1", SHARDS);
    let shared = until(Duration::from_secs(60), "the shards shared", || {
        let h = holders(&c);
        let a = h.values().filter(|(w, _)| w.ends_with("-a")).count();
        let b = h.values().filter(|(w, _)| w.ends_with("-b")).count();
        (h.len() == SHARDS as usize && a == 2 && b == 2)
            .then(|| h.clone())
            .ok_or(format!("{h:?}"))
    })
    .await;
    let (holder, transitions) = shared[&shard].clone();
    let survivor = if holder.ends_with("-a") {
        "faultline-aggregator-b"
    } else {
        "faultline-aggregator-a"
    };
    until(Duration::from_secs(30), "n1 published", || {
        c.published(SHARDS, "n1")
            .filter(|e| e.agent.reachable)
            .map(|_| ())
            .ok_or("not yet".to_string())
    })
    .await;

    let (proc, _) = replicas.remove(holder.as_str()).unwrap();
    let killed = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &proc.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let taken = until(Duration::from_secs(30), "n1's shard taken over", || {
        let h = holders(&c);
        match h.get(&shard) {
            Some((who, t)) if who == survivor => Ok(*t),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let took = killed.elapsed();
    eprintln!("{test}: {holder} killed; {survivor} holds shard {shard} after {took:?}");
    assert!(
        taken > transitions,
        "leaseTransitions {transitions} -> {taken}"
    );
    assert!(
        took >= Duration::from_secs(3),
        "taken over {took:?} after the kill: before the 4 s Lease could expire"
    );
    until(
        Duration::from_secs(30),
        "every shard held by the survivor",
        || {
            let h = holders(&c);
            (h.len() == SHARDS as usize && h.values().all(|(w, _)| w == survivor))
                .then_some(())
                .ok_or(format!("{h:?}"))
        },
    )
    .await;

    let fault = r#"{"device":"gpu1","fault":"row-remap-failure"}"#;
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", fault).await,
        201
    );
    until(
        Duration::from_secs(30),
        "n1 quarantined by the survivor",
        || {
            let tainted = RealCluster::ours(&c.taints("n1"));
            assert!(tainted <= 1, "n1 tainted {tainted} times");
            let node = c.items(&["nodes", "--field-selector", "metadata.name=n1"]);
            let record = node
                .first()
                .and_then(|n| n["metadata"]["annotations"]["faultline.io/quarantine"].as_str())
                .unwrap_or("")
                .to_string();
            (tainted == 1 && record.contains(survivor))
                .then_some(())
                .ok_or(format!("tainted {tainted}, record {record}"))
        },
    )
    .await;
    let entry = c.published(SHARDS, "n1").unwrap();
    assert_eq!(entry.summary.failed, 1, "{:?}", entry.summary);
    // A stop as Kubernetes asks it: exit 0, every Lease released the way client-go's
    // leader election releases one, which kube-apiserver takes.
    let (proc, _) = replicas.remove(survivor).unwrap();
    let status = proc.stop(Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
    let leases = c.items(&["-n", support::real::NS, "leases"]);
    let shards: Vec<&serde_json::Value> = leases
        .iter()
        .filter(|l| {
            l["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("faultline-shard-"))
        })
        .collect();
    assert_eq!(shards.len(), SHARDS as usize);
    for l in shards {
        assert!(support::released_as_client_go_does(l), "{l}");
    }
    drop(replicas);
    c.assert_no_forbidden();
}

on_releases!(a_killed_holders_shards_are_taken_over:
    a_killed_holders_shards_are_taken_over_1_37 = V1_37,
    a_killed_holders_shards_are_taken_over_1_36 = V1_36,
);
