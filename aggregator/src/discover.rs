//! In-cluster discovery: the Nodes matching `--node-selector`, each followed at its
//! InternalIP and the agent port. The Node list is read again every `every`; a node that
//! left is forgotten, a changed address is followed anew.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::collect::{self, AgentClient, AgentEvent};
use crate::metrics::Metrics;

/// The agent URL of a node: its InternalIP at `port`.
pub fn agent_url(node: &Node, port: u16) -> Option<String> {
    let addrs = node.status.as_ref()?.addresses.as_ref()?;
    let ip = addrs
        .iter()
        .find(|a| a.type_ == "InternalIP")?
        .address
        .clone();
    Some(if ip.contains(':') {
        format!("http://[{ip}]:{port}")
    } else {
        format!("http://{ip}:{port}")
    })
}

/// Keep one follower per matching node until cancelled.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    api: Api<Node>,
    selector: String,
    port: u16,
    every: Duration,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut followers: BTreeMap<String, (String, CancellationToken)> = BTreeMap::new();
    loop {
        let lp = if selector.is_empty() {
            ListParams::default()
        } else {
            ListParams::default().labels(&selector)
        };
        match api.list(&lp).await {
            Ok(list) => {
                let mut seen = BTreeSet::new();
                for node in &list.items {
                    let Some(name) = node.metadata.name.clone() else {
                        continue;
                    };
                    let Some(url) = agent_url(node, port) else {
                        tracing::warn!(node = %name, "node has no InternalIP; not followed");
                        continue;
                    };
                    seen.insert(name.clone());
                    if followers.get(&name).is_some_and(|(u, _)| *u == url) {
                        continue;
                    }
                    if let Some((_, old)) = followers.remove(&name) {
                        old.cancel();
                    }
                    let token = cancel.child_token();
                    tokio::spawn(collect::follow(
                        url.clone(),
                        name.clone(),
                        client.clone(),
                        tx.clone(),
                        metrics.clone(),
                        token.clone(),
                    ));
                    tracing::info!(node = %name, %url, "following agent");
                    followers.insert(name, (url, token));
                }
                let gone: Vec<String> = followers
                    .keys()
                    .filter(|n| !seen.contains(*n))
                    .cloned()
                    .collect();
                for name in gone {
                    if let Some((_, t)) = followers.remove(&name) {
                        t.cancel();
                    }
                    tracing::info!(node = %name, "node left; forgetting it");
                    if tx.send(AgentEvent::Removed { node: name }).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                metrics.discovery_error();
                tracing::warn!(error = %e, "cannot list nodes; keeping the agents we follow");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
