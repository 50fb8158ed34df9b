//! In-cluster discovery: the Nodes matching `--node-selector`, each followed at its
//! InternalIP and the agent port, by list and watch. A node that leaves is forgotten; a
//! changed address is followed anew.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::collect::{self, AgentClient, AgentEvent};
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

/// The followers of the nodes we know.
struct Followers {
    port: u16,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    by_node: BTreeMap<String, (String, CancellationToken)>,
}

impl Followers {
    /// Follow `node` (again, if its address changed).
    fn upsert(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        let Some(url) = agent_url(node, self.port) else {
            tracing::warn!(node = %name, "node has no InternalIP; not followed");
            return;
        };
        if self.by_node.get(&name).is_some_and(|(u, _)| *u == url) {
            return;
        }
        if let Some((_, old)) = self.by_node.remove(&name) {
            old.cancel();
        }
        let token = self.cancel.child_token();
        tokio::spawn(collect::follow(
            url.clone(),
            Some(name.clone()),
            self.client.clone(),
            self.tx.clone(),
            self.metrics.clone(),
            token.clone(),
        ));
        tracing::info!(node = %name, %url, "following agent");
        self.by_node.insert(name, (url, token));
    }

    /// Stop following `name` and tell the pipeline it left.
    async fn remove(&mut self, name: &str) {
        if let Some((_, t)) = self.by_node.remove(name) {
            t.cancel();
            tracing::info!(node = %name, "node left; forgetting it");
            let _ = self
                .tx
                .send(AgentEvent::Removed {
                    node: name.to_string(),
                })
                .await;
        }
    }
}

/// Keep one follower per matching node until cancelled: list the Nodes, then watch
/// them from the list's resourceVersion; list again when the watch ends or fails.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    api: Api<Node>,
    selector: String,
    port: u16,
    retry: Duration,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut f = Followers {
        port,
        client,
        tx,
        metrics: metrics.clone(),
        cancel: cancel.clone(),
        by_node: BTreeMap::new(),
    };
    while !cancel.is_cancelled() {
        let lp = if selector.is_empty() {
            ListParams::default()
        } else {
            ListParams::default().labels(&selector)
        };
        let list = match api.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                metrics.discovery_error();
                tracing::warn!(error = %e, "cannot list nodes; keeping the agents we follow");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(retry) => continue,
                }
            }
        };
        let mut seen = BTreeSet::new();
        for node in &list.items {
            f.upsert(node);
            if let Some(n) = &node.metadata.name {
                seen.insert(n.clone());
            }
        }
        let gone: Vec<String> = f
            .by_node
            .keys()
            .filter(|n| !seen.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            f.remove(&name).await;
        }
        let rv = list.metadata.resource_version.unwrap_or_default();
        let mut wp = WatchParams::default().timeout(290);
        if !selector.is_empty() {
            wp = wp.labels(&selector);
        }
        let stream = match api.watch(&wp, &rv).await {
            Ok(s) => s,
            Err(e) => {
                metrics.discovery_error();
                tracing::warn!(error = %e, "cannot watch nodes; listing again");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(retry) => continue,
                }
            }
        };
        let mut stream = std::pin::pin!(stream);
        loop {
            let ev = tokio::select! {
                _ = cancel.cancelled() => return,
                ev = stream.next() => ev,
            };
            match ev {
                Some(Ok(WatchEvent::Added(n) | WatchEvent::Modified(n))) => f.upsert(&n),
                Some(Ok(WatchEvent::Deleted(n))) => {
                    if let Some(name) = n.metadata.name.as_deref() {
                        f.remove(name).await;
                    }
                }
                Some(Ok(WatchEvent::Bookmark(_))) => {}
                // Expired resourceVersion, a dropped watch, its timeout: list again.
                Some(Ok(WatchEvent::Error(e))) => {
                    tracing::debug!(code = e.code, "node watch ended: {}", e.message);
                    break;
                }
                Some(Err(e)) => {
                    metrics.discovery_error();
                    tracing::debug!(error = %e, "node watch failed");
                    break;
                }
                None => break,
            }
        }
    }
}
