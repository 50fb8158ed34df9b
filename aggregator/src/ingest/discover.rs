//! In-cluster discovery: the Nodes matching `--node-selector`, each followed at its
//! InternalIP and the agent port, from a `kube::runtime::watcher` (never a hand-rolled
//! watch loop). A node that leaves is forgotten; a changed address is followed anew.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
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

/// Keep one follower per matching node until cancelled, from `kube::runtime::watcher`:
/// it lists (from the API server's cache: `resourceVersion=0`), watches with bookmarks,
/// relists after a 410 Gone and backs off after errors. `api` must come from a client
/// without a read timeout: a quiet watch is silent for minutes, and a read timeout would
/// cut it and relist every Node each time. A relist forgets the nodes that left.
pub async fn run(
    api: Api<Node>,
    selector: String,
    port: u16,
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
    let mut cfg = watcher::Config::default().any_semantic();
    // Unpaginated: kube sends `resourceVersion=0` (the watch cache) only without a
    // limit, and Nodes are few enough for one answer.
    cfg.page_size = None;
    if !selector.is_empty() {
        cfg = cfg.labels(&selector);
    }
    let stream = watcher(api, cfg).default_backoff();
    let mut stream = std::pin::pin!(stream);
    // The names seen since the last (re)list began.
    let mut listing: Option<BTreeSet<String>> = None;
    loop {
        let ev = tokio::select! {
            _ = cancel.cancelled() => return,
            ev = stream.next() => ev,
        };
        match ev {
            Some(Ok(Event::Apply(n))) => f.upsert(&n),
            Some(Ok(Event::Delete(n))) => {
                if let Some(name) = n.metadata.name.as_deref() {
                    f.remove(name).await;
                }
            }
            Some(Ok(Event::Init)) => listing = Some(BTreeSet::new()),
            Some(Ok(Event::InitApply(n))) => {
                f.upsert(&n);
                if let (Some(seen), Some(name)) = (listing.as_mut(), n.metadata.name.clone()) {
                    seen.insert(name);
                }
            }
            Some(Ok(Event::InitDone)) => {
                let seen = listing.take().unwrap_or_default();
                let gone: Vec<String> = f
                    .by_node
                    .keys()
                    .filter(|n| !seen.contains(*n))
                    .cloned()
                    .collect();
                for name in gone {
                    f.remove(&name).await;
                }
            }
            Some(Err(e)) => {
                metrics.discovery_error();
                tracing::warn!(error = %e, "node watch failed; retrying with backoff, keeping the agents we follow");
            }
            None => return,
        }
    }
}
