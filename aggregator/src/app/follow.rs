//! The parts that follow what changes outside: the rules file, and the agents (the
//! `--agents` list, or the nodes discovery finds), each spawned supervised.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use faultline_common::rules::Rules;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::supervise::Supervisor;
use crate::agents::deliver::Deliveries;
use crate::agents::{collect, AgentEvent};
use crate::config::{Config, Discovery};
use crate::ingest::{discover, endpoints};
use crate::metrics::Metrics;
use crate::rules_file;

/// The rules in force, reloaded from `--rules` when it changes.
pub(super) fn rules(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    tasks: &Supervisor,
    cancel: &CancellationToken,
) -> anyhow::Result<watch::Receiver<Arc<Rules>>> {
    let rules = match &cfg.rules {
        Some(p) => rules_file::load(p).with_context(|| format!("rules file {}", p.display()))?,
        None => Rules::default(),
    };
    let (tx, rx) = watch::channel(Arc::new(rules));
    if let Some(p) = cfg.rules.clone() {
        tasks.spawn(
            "rules file watch",
            rules_file::watch_file(
                p,
                tx,
                metrics.clone(),
                Duration::from_secs(1),
                cancel.clone(),
            ),
        );
    }
    Ok(rx)
}

/// Follow the agents: the `--agents` list, or the Nodes found by discovery.
/// Follow the agents: discovered Nodes, or `--agents`. With `ownership` (the
/// ConfigMap sink), only the nodes of the shards this replica holds; an agent named by
/// URL alone is followed by every replica until its document names its node.
pub(super) fn follow_agents(
    cfg: &Config,
    watch: Option<&kube::Client>,
    metrics: &Arc<Metrics>,
    (tasks, cancel): (&Supervisor, &CancellationToken),
    ownership: Option<discover::Ownership>,
    deliveries: Option<Arc<Deliveries>>,
) -> anyhow::Result<mpsc::Receiver<AgentEvent>> {
    let (tx, rx) = mpsc::channel::<AgentEvent>(1024);
    // The delivery token as read at start: it reserves the agents' connections for
    // this collector (a rotation takes effect for deliveries at once, here at restart).
    let bearer = cfg.delivery.as_ref().map(|d| d.token.get().0);
    let client = collect::client().with_bearer(bearer.as_deref().map(String::as_str));
    let followers = discover::Followers::new(
        cfg.agent_port,
        client.clone(),
        tx.clone(),
        metrics.clone(),
        cancel.clone(),
        ownership,
    )
    .with_deliveries(deliveries.clone());
    if cfg.agents.is_empty() {
        let client = watch
            .cloned()
            .context("discovery needs the Kubernetes API")?;
        match cfg.discovery {
            Discovery::Endpoints => {
                let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &cfg.namespace);
                let check = endpoints::NodeCheck {
                    api: Api::all(client),
                    selector: cfg.node_selector.clone(),
                    first: cfg.agent_gone_check,
                };
                tasks.spawn(
                    "agent discovery (EndpointSlices)",
                    endpoints::run(
                        api,
                        cfg.agent_service.clone(),
                        cfg.agent_port,
                        check,
                        followers,
                    ),
                );
            }
            Discovery::Nodes => {
                let api: Api<Node> = Api::all(client);
                tasks.spawn(
                    "agent discovery (Nodes)",
                    discover::run(api, cfg.node_selector.clone(), followers),
                );
            }
        }
        return Ok(rx);
    }
    let mut followers = followers;
    // The nodes named with their address are theirs; a bare URL's agent may name only
    // another.
    let claims = collect::Claims::default();
    for a in &cfg.agents {
        if let Some(node) = &a.node {
            if let Err(by) = claims.claim(node, &a.url) {
                anyhow::bail!("--agents: node {node} is listed at {by} and at {}", a.url);
            }
        }
    }
    for a in &cfg.agents {
        match &a.node {
            Some(node) => followers.add_static(node.clone(), a.url.clone()),
            None => {
                if deliveries.is_some() {
                    tracing::warn!(url = %a.url, "an agent listed by URL alone gets no deliveries: name its node (NODE=URL)");
                }
                tasks.spawn(
                    "agent follower",
                    collect::follow_unnamed(
                        a.url.clone(),
                        claims.clone(),
                        client.clone(),
                        tx.clone(),
                        metrics.clone(),
                        cancel.clone(),
                    ),
                );
            }
        }
    }
    tasks.spawn("agent followers", followers.run_static());
    Ok(rx)
}
