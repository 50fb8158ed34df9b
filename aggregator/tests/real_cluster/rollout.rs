//! Discovery from real EndpointSlices through an agent DaemonSet rollout.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use faultline_controlplane::{Delays, Release};

use crate::support::real::RealCluster;
use crate::SHARDS;

/// What the published entries showed during a rollout, per node.
#[derive(Default, Debug)]
struct Seen {
    absent: usize,
    unreachable: usize,
    polls: usize,
}

/// An agent DaemonSet rollout (`kubectl rollout restart`): each agent pod is deleted
/// (its endpoint turns not ready, then goes), and a new one takes a few seconds to
/// start. Every node stays in the published shard throughout, its agent unreachable
/// while it is away (the node unknown, never absent), and is followed again at its new
/// pod's address. Before the fix, a node whose endpoint was not ready or gone was
/// forgotten: absent from its shard until the new agent was ready.
async fn an_agent_rollout_keeps_every_node_published(release: Release) {
    let test = format!("an_agent_rollout_keeps_every_node_published ({release:?})");
    // 3 s to stop and 3 s to start: the agent is away ~6 s per node.
    let delays = Delays {
        start: 3_000,
        stop: 3_000,
    };
    let Some(c) = RealCluster::start(&test, release, 2, delays).await else {
        return;
    };
    eprintln!(
        "{test}: control plane up in {:.1} s; {}",
        c.cp.started_in.as_secs_f64(),
        c.memory()
    );
    let (_agg, _url) = c.aggregator("faultline-aggregator-0", &[]).await;
    let nodes = ["n1", "n2"];
    let start = Instant::now();
    loop {
        let mut reachable = 0;
        for n in nodes {
            if c.node_entry(SHARDS, n)
                .await
                .is_some_and(|e| e.agent.reachable)
            {
                reachable += 1;
            }
        }
        if reachable == nodes.len() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "both nodes not published reachable within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before: BTreeSet<String> = c.agent_pods().await.into_iter().map(|p| p.1).collect();
    c.cp.kubectl(&[
        "-n",
        "faultline",
        "rollout",
        "restart",
        "daemonset/faultline-agent",
    ]);
    let mut seen: Vec<Seen> = nodes.iter().map(|_| Seen::default()).collect();
    let start = Instant::now();
    loop {
        for (i, n) in nodes.iter().enumerate() {
            seen[i].polls += 1;
            match c.node_entry(SHARDS, n).await {
                None => seen[i].absent += 1,
                Some(e) if !e.agent.reachable => seen[i].unreachable += 1,
                Some(_) => {}
            }
        }
        let pods = c.agent_pods().await;
        let replaced = pods.len() == nodes.len()
            && pods.iter().all(|p| !before.contains(&p.1) && !p.3)
            && c.ready_agent_endpoints().await.len() == nodes.len();
        let mut reachable = 0;
        for n in nodes {
            if c.node_entry(SHARDS, n)
                .await
                .is_some_and(|e| e.agent.reachable)
            {
                reachable += 1;
            }
        }
        if replaced && reachable == nodes.len() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the rollout did not end with both nodes reachable within 120 s: {seen:?}, pods {pods:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "{test}: rollout done in {:.1} s: {seen:?}",
        start.elapsed().as_secs_f64()
    );
    for (n, s) in nodes.iter().zip(&seen) {
        assert_eq!(
            s.absent, 0,
            "{n} was absent from its shard in {} of {} polls during the rollout (unreachable in {})",
            s.absent, s.polls, s.unreachable
        );
        assert!(s.unreachable > 0, "{n} was never seen unreachable: {s:?}");
    }
    c.assert_no_forbidden();
}

on_releases!(an_agent_rollout_keeps_every_node_published:
    an_agent_rollout_keeps_every_node_published_1_37 = V1_37,
    an_agent_rollout_keeps_every_node_published_1_36 = V1_36,
);
