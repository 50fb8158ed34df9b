//! In-cluster discovery: the Nodes matching `--node-selector`, each followed at its
//! InternalIP and the agent port, from a `kube::runtime::watcher` (never a hand-rolled
//! watch loop). A node that leaves is forgotten; a changed address is followed anew.
//!
//! With shard ownership a replica follows only the nodes of the shards it
//! holds: every node is known, only those are followed, and the set moves with the
//! Leases (a node whose shard is handed back is forgotten here, seeded by its next
//! holder).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use faultline_common::fault::shard_of;
use faultline_common::supervise::spawn_contained;
use tokio::sync::watch;

use super::watched::{Seen, Watched};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::agents::collect::{self, AgentClient, AgentEvent};
use crate::agents::deliver::Deliveries;
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

/// Which nodes this replica follows: those of the shards it holds.
#[derive(Clone)]
pub struct Ownership {
    /// The shards held, as the Lease loop changes them.
    pub held: watch::Receiver<BTreeSet<u32>>,
    /// Number of shards.
    pub shards: u32,
}

impl Ownership {
    fn owns(&self, node: &str) -> bool {
        self.held.borrow().contains(&shard_of(node, self.shards))
    }
}

/// The followers of the nodes we know.
pub struct Followers {
    port: u16,
    client: AgentClient,
    tx: mpsc::Sender<AgentEvent>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    /// Followed: node -> (url, its follower's token).
    by_node: BTreeMap<String, (String, CancellationToken)>,
    /// Every node known and its agent's URL, followed or not.
    known: BTreeMap<String, String>,
    ownership: Option<Ownership>,
    /// Node-local delivery to each followed agent, when on.
    deliveries: Option<Arc<Deliveries>>,
}

impl Followers {
    /// Followers sending to `tx`, of the nodes `ownership` says (all without it).
    pub fn new(
        port: u16,
        client: AgentClient,
        tx: mpsc::Sender<AgentEvent>,
        metrics: Arc<Metrics>,
        cancel: CancellationToken,
        ownership: Option<Ownership>,
    ) -> Self {
        Followers {
            port,
            client,
            tx,
            metrics,
            cancel,
            by_node: BTreeMap::new(),
            known: BTreeMap::new(),
            ownership,
            deliveries: None,
        }
    }

    /// Deliver each followed node's entry to its agent too.
    pub fn with_deliveries(mut self, deliveries: Option<Arc<Deliveries>>) -> Self {
        self.deliveries = deliveries;
        self
    }

    /// Follow `node` (again, if its address changed).
    fn upsert(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        let Some(url) = agent_url(node, self.port) else {
            tracing::warn!(node = %name, "node has no InternalIP; not followed");
            return;
        };
        self.known.insert(name.clone(), url.clone());
        self.follow(name, url);
    }

    /// Follow the agent of `name` at `url` if this replica owns the node.
    pub fn follow(&mut self, name: String, url: String) {
        if !self.ownership.as_ref().is_none_or(|o| o.owns(&name)) {
            return;
        }
        if self.by_node.get(&name).is_some_and(|(u, _)| *u == url) {
            return;
        }
        if let Some((_, old)) = self.by_node.remove(&name) {
            old.cancel();
        }
        let token = self.cancel.child_token();
        let follower = collect::follow(
            url.clone(),
            Some(name.clone()),
            self.client.clone(),
            self.tx.clone(),
            self.metrics.clone(),
            token.clone(),
        );
        // A follower's panic (a bug an agent's answer found) stays with its node: it
        // is logged and counted, and the node's readings go stale (unknown), never
        // the replica's other nodes.
        let metrics = self.metrics.clone();
        spawn_contained("agent follower", follower, move |panicked| {
            if panicked {
                metrics.agent_poll_error("panic");
            }
        });
        if let Some(d) = &self.deliveries {
            d.open(&name, &url, token.clone());
        }
        tracing::debug!(node = %name, %url, "following agent");
        self.by_node.insert(name, (url, token));
        self.metrics.set_nodes_followed(self.by_node.len());
    }

    /// Stop following `name` and tell the pipeline it left.
    async fn remove(&mut self, name: &str) {
        self.known.remove(name);
        self.unfollow(name, "node left; forgetting it").await;
    }

    async fn unfollow(&mut self, name: &str, why: &str) {
        if let Some((_, t)) = self.by_node.remove(name) {
            t.cancel();
            if let Some(d) = &self.deliveries {
                d.close(name);
            }
            tracing::debug!(node = %name, "{why}");
            self.metrics.set_nodes_followed(self.by_node.len());
            let _ = self
                .tx
                .send(AgentEvent::Removed {
                    node: name.to_string(),
                })
                .await;
        }
    }

    /// The shards held changed: follow the nodes of the new ones, forget the others'.
    pub async fn reconcile(&mut self) {
        let owned: Vec<(String, String)> = self
            .known
            .iter()
            .map(|(n, u)| (n.clone(), u.clone()))
            .collect();
        for (name, url) in owned {
            self.follow(name, url);
        }
        let gone: Vec<String> = self
            .by_node
            .keys()
            .filter(|n| !self.ownership.as_ref().is_none_or(|o| o.owns(n)))
            .cloned()
            .collect();
        for name in gone {
            self.unfollow(&name, "its shard is held elsewhere now; forgetting it")
                .await;
        }
        tracing::info!(
            followed = self.by_node.len(),
            known = self.known.len(),
            "agents followed for the shards held"
        );
    }

    /// Follow exactly these nodes' agents (node -> URL): the others known are forgotten,
    /// a changed URL followed anew.
    pub async fn follow_exactly(&mut self, wanted: BTreeMap<String, String>) {
        self.follow_keeping(wanted, &BTreeSet::new()).await;
    }

    /// [`Followers::follow_exactly`], but the nodes of `keep` that `wanted` lacks stay
    /// followed at their last URL (EndpointSlice discovery: an agent away is its node
    /// unreachable, not gone).
    pub async fn follow_keeping(
        &mut self,
        wanted: BTreeMap<String, String>,
        keep: &BTreeSet<String>,
    ) {
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|n| !wanted.contains_key(*n) && !keep.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            self.remove(&name).await;
        }
        for (name, url) in wanted {
            if self.known.get(&name) != Some(&url) {
                self.known.insert(name.clone(), url.clone());
                self.follow(name, url);
            }
        }
    }

    /// The nodes known, followed or not.
    pub fn known_nodes(&self) -> impl Iterator<Item = &String> {
        self.known.keys()
    }

    /// Stop following `name` and tell the pipeline it left.
    pub async fn forget(&mut self, name: &str) {
        self.remove(name).await;
    }

    /// The metrics the followers count in.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The token that stops every follower.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// The shards held as they change, with shard ownership.
    pub fn held(&self) -> Option<watch::Receiver<BTreeSet<u32>>> {
        self.ownership.as_ref().map(|o| o.held.clone())
    }

    /// A node named on the command line (`--agents NODE=URL`).
    pub fn add_static(&mut self, name: String, url: String) {
        self.known.insert(name.clone(), url.clone());
        self.follow(name, url);
    }

    /// Run until cancelled, following the nodes of the shards held as they change.
    pub async fn run_static(mut self) {
        let Some(mut held) = self.ownership.as_ref().map(|o| o.held.clone()) else {
            return self.cancel.cancelled().await;
        };
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                r = held.changed() => {
                    if r.is_err() {
                        return self.cancel.cancelled().await;
                    }
                    self.reconcile().await;
                }
            }
        }
    }
}

/// Keep one follower per matching node until cancelled, from the one watch loop
/// ([`Watched`]): it lists from the API server's cache, watches with bookmarks, relists
/// after a 410 Gone and backs off after errors. `api` must come from a client without a
/// read timeout. A relist forgets the nodes that left.
pub async fn run(api: Api<Node>, selector: String, mut f: Followers) {
    let cancel = f.cancel.clone();
    let mut held = f.ownership.as_ref().map(|o| o.held.clone());
    let mut watch = Watched::new(api, &selector, f.metrics.clone(), "nodes");
    loop {
        let seen = tokio::select! {
            _ = cancel.cancelled() => return,
            r = async {
                match held.as_mut() {
                    Some(h) => h.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                if r.is_ok() {
                    f.reconcile().await;
                } else {
                    held = None;
                }
                continue;
            }
            seen = watch.next() => seen,
        };
        match seen {
            Some(Seen::Applied(n) | Seen::Listing(n)) => f.upsert(&n),
            Some(Seen::Deleted(n)) => {
                if let Some(name) = n.metadata.name.as_deref() {
                    f.remove(name).await;
                }
            }
            Some(Seen::Listed(listed)) => {
                let gone: Vec<String> = f
                    .known
                    .keys()
                    .filter(|n| !listed.contains(*n))
                    .cloned()
                    .collect();
                for name in gone {
                    f.remove(&name).await;
                }
            }
            None => return,
        }
    }
}
