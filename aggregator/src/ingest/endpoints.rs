//! Discovery from the EndpointSlices of the agents' headless Service (`--discovery
//! endpoints`), as Prometheus' endpoints discovery finds its targets: a slice
//! lists up to 100 endpoints, each a node name and an address, about 200 bytes, where a
//! real GPU Node is 15-40 KB (labels, images, managedFields) and changes with every
//! status update. A slice changes only when an agent pod does, so following them costs
//! next to nothing in steady state.
//!
//! Each endpoint with a `nodeName` is that node's agent, at its first address and the
//! slice's port named `http` (else `--agent-port`); the endpointslice controller
//! (pkg/controller/endpointslice) sets `nodeName` from the pod's `spec.nodeName`, so the
//! node it names is where the pod runs, and the agent's document must name the same node
//! (the identity check of every document). A node with several endpoints (an agent being
//! replaced) is followed at its best one: ready, else serving (terminating, still
//! answering), else any; then the lowest address, so every replica picks the same.
//!
//! An agent that goes away does not take its node with it: during every
//! DaemonSet rollout, and on a node that stops answering, the endpoint turns not ready
//! and then leaves the slice, while the node and its GPUs are still there. Such a node
//! stays followed at its last address, so it is published unreachable (its devices
//! unknown after the grace), never absent. It is forgotten only once its Node is gone or
//! no longer matches `--node-selector`, asked of the API ([`NodeCheck`]: a list of that
//! one name with the selector, metadata only) `--agent-gone-check` (default 30 s) after
//! the endpoint left, then every [`RECHECK`]; an error keeps the node.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::watched::{Seen, Watched};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::discover::Followers;

/// The label the endpointslice controller puts on a Service's slices.
pub const SERVICE_LABEL: &str = "kubernetes.io/service-name";

/// The label that names who manages a slice, and the endpointslice controller's value
/// (discovery/v1 `LabelManagedBy`). Only its slices are read: a slice anyone made by
/// hand in the namespace could otherwise point a node at another agent. A forged slice
/// that claims the controller's label is the controller's to reconcile (it deletes or
/// rewrites slices of its Service that do not match the Service's pods).
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
pub const CONTROLLER: &str = "endpointslice-controller.k8s.io";

/// How often a node without an endpoint is looked up again.
pub const RECHECK: Duration = Duration::from_secs(60);

/// One endpoint of a node's agent; the best of a node's sorts first.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    /// 0 ready, 1 serving (terminating), 2 neither.
    rank: u8,
    url: String,
}

/// The agents a slice names: node -> its best endpoint.
fn candidates(slice: &EndpointSlice, default_port: u16) -> BTreeMap<String, Candidate> {
    let port = slice
        .ports
        .as_ref()
        .and_then(|ps| {
            ps.iter()
                .find(|p| p.name.as_deref() == Some("http"))
                .or_else(|| ps.first())
        })
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(default_port);
    let v6 = slice.address_type == "IPv6";
    if slice.address_type != "IPv4" && !v6 {
        // FQDN slices name no address to connect to.
        return BTreeMap::new();
    }
    let mut out: BTreeMap<String, Candidate> = BTreeMap::new();
    for e in &slice.endpoints {
        let (Some(node), Some(addr)) = (e.node_name.as_ref(), e.addresses.first()) else {
            continue;
        };
        // The controller names the pod behind each endpoint; an agent is a pod.
        if e.target_ref.as_ref().and_then(|t| t.kind.as_deref()) != Some("Pod") {
            continue;
        }
        // `ready` and `serving` unset mean true (discovery/v1 types.go: "nil should be
        // interpreted as true"); `serving` is `ready` but for a terminating endpoint.
        let c = e.conditions.as_ref();
        let ready = c.and_then(|c| c.ready).unwrap_or(true);
        let serving = c.and_then(|c| c.serving.or(c.ready)).unwrap_or(true);
        let url = if v6 {
            format!("http://[{addr}]:{port}")
        } else {
            format!("http://{addr}:{port}")
        };
        let rank = if ready {
            0
        } else if serving {
            1
        } else {
            2
        };
        let c = Candidate { rank, url };
        match out.get_mut(node) {
            Some(best) if c < *best => *best = c,
            Some(_) => {}
            None => {
                out.insert(node.clone(), c);
            }
        }
    }
    out
}

/// The agents a slice names: node -> URL of its best endpoint.
pub fn agents(slice: &EndpointSlice, default_port: u16) -> BTreeMap<String, String> {
    candidates(slice, default_port)
        .into_iter()
        .map(|(n, c)| (n, c.url))
        .collect()
}

/// Every node's agent over all slices (the best endpoint where several name one node).
fn merged(slices: &BTreeMap<String, BTreeMap<String, Candidate>>) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, &Candidate> = BTreeMap::new();
    for agents in slices.values() {
        for (node, c) in agents {
            match out.get_mut(node) {
                Some(best) if c < *best => *best = c,
                Some(_) => {}
                None => {
                    out.insert(node.clone(), c);
                }
            }
        }
    }
    out.into_iter().map(|(n, c)| (n, c.url.clone())).collect()
}

/// Whether nodes that no endpoint names any more are still there: their Node exists
/// and matches `--node-selector`.
pub struct NodeCheck {
    /// Nodes, for lists of one name.
    pub api: Api<Node>,
    /// `--node-selector`.
    pub selector: String,
    /// How long after a node's last endpoint left its Node is first looked up
    /// (`--agent-gone-check`): an agent pod replaced by a rollout is usually back by
    /// then, and no call is made.
    pub first: Duration,
}

/// What a look-up found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The Node is there and selected: keep it.
    Present,
    /// No such Node, or not selected: forget it.
    Gone,
    /// The API did not answer: keep it, ask again later.
    Failed,
}

impl NodeCheck {
    async fn find(api: Api<Node>, selector: String, node: String) -> (String, Found) {
        let mut lp = ListParams::default().fields(&format!("metadata.name={node}"));
        if !selector.is_empty() {
            lp = lp.labels(&selector);
        }
        let found = match api.list_metadata(&lp).await {
            Ok(l) if l.items.is_empty() => Found::Gone,
            Ok(_) => Found::Present,
            Err(e) => {
                tracing::warn!(%node, error = %e, "could not look up a node whose agent left; keeping it");
                Found::Failed
            }
        };
        (node, found)
    }
}

/// Nodes known whose agent no slice names now: when each is looked up next.
struct Away {
    first: Duration,
    next: BTreeMap<String, Instant>,
    asking: BTreeSet<String>,
}

impl Away {
    fn new(first: Duration) -> Self {
        Away {
            first,
            next: BTreeMap::new(),
            asking: BTreeSet::new(),
        }
    }

    /// `known` nodes that `wanted` lacks are away (first looked up `first` from `now`);
    /// those it names are back.
    fn update<'a>(
        &mut self,
        known: impl Iterator<Item = &'a String>,
        wanted: &BTreeMap<String, String>,
        now: Instant,
    ) {
        self.next.retain(|n, _| !wanted.contains_key(n));
        for n in known {
            if !wanted.contains_key(n) && !self.next.contains_key(n) {
                tracing::info!(node = %n, "the node's agent left the agents' Service; keeping the node (unreachable) until its Node is gone");
                self.next.insert(n.clone(), now + self.first);
            }
        }
    }

    /// The nodes due for a look-up at `now`, marked as being asked.
    fn due(&mut self, now: Instant) -> Vec<String> {
        let due: Vec<String> = self
            .next
            .iter()
            .filter(|(n, at)| **at <= now && !self.asking.contains(*n))
            .map(|(n, _)| n.clone())
            .collect();
        self.asking.extend(due.iter().cloned());
        due
    }

    /// A look-up's answer: whether to forget the node.
    fn answered(&mut self, node: &str, found: Found, now: Instant) -> bool {
        self.asking.remove(node);
        let Some(at) = self.next.get_mut(node) else {
            // Back meanwhile.
            return false;
        };
        if found == Found::Gone {
            self.next.remove(node);
            return true;
        }
        *at = now + RECHECK;
        false
    }

    fn keep(&self) -> BTreeSet<String> {
        self.next.keys().cloned().collect()
    }
}

/// Follow the agents the slices of `service` name until cancelled, from a
/// `kube::runtime::watcher` (the watch cache: `resourceVersion=0`; relists after a 410,
/// backs off after errors). A node no slice names any more stays followed at its last
/// address until `check` finds its Node gone.
pub async fn run(
    api: Api<EndpointSlice>,
    service: String,
    port: u16,
    check: NodeCheck,
    mut f: Followers,
) {
    let (metrics, cancel) = (f.metrics(), f.cancel_token());
    let mut held = f.held();
    let selector = format!("{SERVICE_LABEL}={service},{MANAGED_BY_LABEL}={CONTROLLER}");
    let mut watch = Watched::new(api, &selector, metrics.clone(), "endpointslices");
    let mut slices: BTreeMap<String, BTreeMap<String, Candidate>> = BTreeMap::new();
    let mut away = Away::new(check.first);
    let (found_tx, mut found_rx) = mpsc::channel::<(String, Found)>(64);
    let mut tick = tokio::time::interval(check.first.min(Duration::from_secs(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
            _ = tick.tick() => {
                for node in away.due(Instant::now()) {
                    let tx = found_tx.clone();
                    let look = NodeCheck::find(check.api.clone(), check.selector.clone(), node);
                    let ask = async move {
                        let _ = tx.send(look.await).await;
                    };
                    faultline_common::supervise::spawn_contained("node lookup", ask, |_| {});
                }
                continue;
            }
            Some((node, found)) = found_rx.recv() => {
                if found == Found::Failed {
                    metrics.discovery_error();
                }
                if away.answered(&node, found, Instant::now()) {
                    tracing::info!(%node, "the node is gone (or no longer selected); forgetting it");
                    f.forget(&node).await;
                }
                continue;
            }
            seen = watch.next() => seen,
        };
        let name = |s: &EndpointSlice| s.metadata.name.clone().unwrap_or_default();
        match seen {
            Some(Seen::Applied(s)) => {
                slices.insert(name(&s), candidates(&s, port));
            }
            Some(Seen::Deleted(s)) => {
                slices.remove(&name(&s));
            }
            Some(Seen::Listing(s)) => {
                slices.insert(name(&s), candidates(&s, port));
                // Applied once the list is whole.
                continue;
            }
            Some(Seen::Listed(listed)) => {
                slices.retain(|k, _| listed.contains(k));
            }
            None => return,
        }
        let wanted = merged(&slices);
        away.update(f.known_nodes(), &wanted, Instant::now());
        f.follow_keeping(wanted, &away.keep()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn endpoint(node: &str, ip: &str, ready: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                ..Default::default()
            }),
            node_name: Some(node.into()),
            target_ref: Some(k8s_openapi::api::core::v1::ObjectReference {
                kind: Some("Pod".into()),
                name: Some(format!("faultline-agent-{node}")),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(ty: &str, port: Option<(&str, i32)>, endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: ty.into(),
            endpoints,
            ports: port.map(|(n, p)| {
                vec![EndpointPort {
                    name: Some(n.into()),
                    port: Some(p),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }
    }

    #[test]
    fn endpoints_with_a_node_are_agents() {
        let s = slice(
            "IPv4",
            Some(("http", 9000)),
            vec![
                endpoint("gpu-1", "10.0.0.1", Some(true)),
                endpoint("gpu-2", "10.0.0.2", None),
                endpoint("gpu-3", "10.0.0.3", Some(false)),
                // An agent being replaced: the lower address, whatever the order.
                endpoint("gpu-4", "10.0.0.9", Some(true)),
                endpoint("gpu-4", "10.0.0.10", Some(true)),
                Endpoint {
                    node_name: None,
                    ..endpoint("x", "10.0.0.5", Some(true))
                },
                // Not a pod behind it (by hand, or an external address): no agent, even
                // at a lower address than gpu-1's own.
                Endpoint {
                    target_ref: None,
                    ..endpoint("gpu-1", "10.0.0.0", Some(true))
                },
                Endpoint {
                    target_ref: Some(k8s_openapi::api::core::v1::ObjectReference {
                        kind: Some("Node".into()),
                        ..Default::default()
                    }),
                    ..endpoint("gpu-5", "10.0.0.6", Some(true))
                },
            ],
        );
        let a = agents(&s, 8081);
        assert_eq!(
            a.into_iter().collect::<Vec<_>>(),
            vec![
                ("gpu-1".into(), "http://10.0.0.1:9000".into()),
                ("gpu-2".into(), "http://10.0.0.2:9000".into()),
                // Not ready, and no other: still its node's agent.
                ("gpu-3".into(), "http://10.0.0.3:9000".into()),
                ("gpu-4".into(), "http://10.0.0.10:9000".into()),
            ]
        );
        let v6 = slice("IPv6", None, vec![endpoint("gpu-1", "fd00::1", None)]);
        assert_eq!(agents(&v6, 8081)["gpu-1"], "http://[fd00::1]:8081");
        let fqdn = slice("FQDN", None, vec![endpoint("gpu-1", "a.example", None)]);
        assert!(agents(&fqdn, 8081).is_empty());
        // Over slices: one URL per node.
        let mut all = BTreeMap::new();
        all.insert("a".to_string(), candidates(&s, 8081));
        all.insert(
            "b".to_string(),
            candidates(
                &slice("IPv4", None, vec![endpoint("gpu-1", "10.0.0.0", None)]),
                8081,
            ),
        );
        assert_eq!(merged(&all)["gpu-1"], "http://10.0.0.0:8081");
    }

    fn conditions(
        ready: Option<bool>,
        serving: Option<bool>,
        terminating: bool,
    ) -> EndpointConditions {
        EndpointConditions {
            ready,
            serving,
            terminating: Some(terminating),
        }
    }

    /// An agent pod being replaced: the old one terminating but serving, the
    /// new one starting (not ready), one already gone. A ready endpoint wins over a
    /// serving one, a serving one over one that is neither, whatever the addresses.
    #[test]
    fn a_ready_endpoint_wins_then_a_serving_one_then_any() {
        let e = |ip: &str, c| Endpoint {
            conditions: Some(c),
            ..endpoint("n1", ip, None)
        };
        let starting = e("10.0.0.1", conditions(Some(false), Some(false), false));
        let stopping = e("10.0.0.9", conditions(Some(false), Some(true), true));
        let fresh = e("10.0.0.8", conditions(Some(true), Some(true), false));
        let s = |eps| slice("IPv4", None, eps);
        assert_eq!(
            agents(&s(vec![starting.clone()]), 8081)["n1"],
            "http://10.0.0.1:8081"
        );
        assert_eq!(
            agents(&s(vec![starting.clone(), stopping.clone()]), 8081)["n1"],
            "http://10.0.0.9:8081"
        );
        assert_eq!(
            agents(
                &s(vec![stopping.clone(), fresh.clone(), starting.clone()]),
                8081
            )["n1"],
            "http://10.0.0.8:8081"
        );
        // Over two slices alike.
        let mut all = BTreeMap::new();
        all.insert("a".to_string(), candidates(&s(vec![starting]), 8081));
        all.insert("b".to_string(), candidates(&s(vec![stopping]), 8081));
        assert_eq!(merged(&all)["n1"], "http://10.0.0.9:8081");
    }

    /// A node whose agent left every slice is kept, looked up `first` later, then
    /// every RECHECK while present or unanswered, forgotten once gone; back in a slice,
    /// it is no longer looked up, and an answer that arrives after is ignored.
    #[test]
    fn a_node_whose_agent_left_is_kept_until_its_node_is_gone() {
        const FIRST_CHECK: Duration = Duration::from_secs(30);
        let t0 = Instant::now();
        let known: Vec<String> = vec!["n1".into(), "n2".into()];
        let only_n2: BTreeMap<String, String> = [("n2".to_string(), "u".to_string())].into();
        let mut away = Away::new(FIRST_CHECK);
        away.update(known.iter(), &only_n2, t0);
        assert_eq!(away.keep(), BTreeSet::from(["n1".to_string()]));
        assert!(away
            .due(t0 + FIRST_CHECK - Duration::from_millis(1))
            .is_empty());
        assert_eq!(away.due(t0 + FIRST_CHECK), vec!["n1".to_string()]);
        // Asked once at a time.
        assert!(away.due(t0 + FIRST_CHECK).is_empty());
        assert!(!away.answered("n1", Found::Present, t0 + FIRST_CHECK));
        assert!(away
            .due(t0 + FIRST_CHECK + RECHECK - Duration::from_millis(1))
            .is_empty());
        assert_eq!(away.due(t0 + FIRST_CHECK + RECHECK), vec!["n1".to_string()]);
        assert!(!away.answered("n1", Found::Failed, t0 + FIRST_CHECK + RECHECK));
        assert_eq!(away.keep().len(), 1, "an error keeps the node");
        let later = t0 + FIRST_CHECK + RECHECK * 2;
        assert_eq!(away.due(later), vec!["n1".to_string()]);
        assert!(away.answered("n1", Found::Gone, later));
        assert!(away.keep().is_empty());
        // Back before the answer: kept, the answer ignored.
        away.update(known.iter(), &only_n2, later);
        let due = away.due(later + FIRST_CHECK);
        assert_eq!(due, vec!["n1".to_string()]);
        let both: BTreeMap<String, String> = [
            ("n1".to_string(), "u".to_string()),
            ("n2".to_string(), "u".to_string()),
        ]
        .into();
        away.update(known.iter(), &both, later + FIRST_CHECK);
        assert!(!away.answered("n1", Found::Gone, later + FIRST_CHECK));
        assert!(away.keep().is_empty());
    }
}
