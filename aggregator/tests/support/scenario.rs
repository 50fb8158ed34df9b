//! A scenario in a few lines: the cluster's Nodes, Pods and other objects, the
//! simulated agents, and the aggregator's `--agents` for them; [`Scenario::start`]
//! seeds the Kubernetes API test server ([`super::api_server`]: the namespace, the
//! aggregator's RBAC enforced), starts the agents and gives a [`World`] that launches
//! aggregators against it.
//!
//! ```ignore
//! let w = Scenario::new()
//!     .node(NodeFixture::shared("n1").ready(true))
//!     .pod(PodFixture::new("train", "n1").gpu())
//!     .agents()
//!     .start()
//!     .await;
//! let agg = w.healing("r1").start().await;
//! fail(w.agent("n1"), "gpu1").await;
//! ```

use faultline_agent::Agent;
use faultline_test_apiserver::ApiServer;
use serde_json::Value;

use super::{NodeFixture, PodFixture};

/// An agent address where nothing answers: `--agents` for an aggregator that must not
/// hear from any agent (alerts and the kubelet only).
pub const NO_AGENT: &str = "http://127.0.0.1:9";

/// How `--agents` is made.
enum Listed {
    /// `http://ADDR,...`: each agent names its node in its documents.
    Bare,
    /// `NODE=http://ADDR,...`: each agent pinned to its node.
    Named,
    /// As given.
    Given(String),
    /// Not at all (discovery finds the agents, or the test lists them itself).
    No,
}

/// What a test's cluster holds; [`Scenario::start`] makes it.
pub struct Scenario {
    nodes: Vec<NodeFixture>,
    objects: Vec<(String, String, Value)>,
    agents: Vec<String>,
    every_node: bool,
    listed: Listed,
    components: Vec<&'static str>,
}

impl Default for Scenario {
    fn default() -> Self {
        Self::new()
    }
}

impl Scenario {
    /// No Nodes, no Pods, no agents.
    pub fn new() -> Self {
        Scenario {
            nodes: Vec::new(),
            objects: Vec::new(),
            agents: Vec::new(),
            every_node: false,
            listed: Listed::Named,
            components: Vec::new(),
        }
    }

    /// The RBAC of the kustomize component `c` too (`deploy/components/<c>`), for a
    /// test that turns its feature on.
    pub fn component(mut self, c: &'static str) -> Self {
        self.components.push(c);
        self
    }

    /// Ready GPU Nodes of these names, of a real one's size and shape
    /// ([`NodeFixture::realistic`]), each with a simulated agent that `--agents` names
    /// (`n1=http://ADDR`): the cluster most tests start from.
    pub fn ready_nodes(names: &[&str]) -> Self {
        Self::new()
            .nodes(names.iter().map(|n| NodeFixture::realistic(n).ready(true)))
            .agents()
            .named()
    }

    /// A Node.
    pub fn node(mut self, node: NodeFixture) -> Self {
        self.nodes.push(node);
        self
    }

    /// Nodes.
    pub fn nodes(mut self, nodes: impl IntoIterator<Item = NodeFixture>) -> Self {
        self.nodes.extend(nodes);
        self
    }

    /// A Pod in `default`, created after the Nodes.
    pub fn pod(self, pod: PodFixture) -> Self {
        self.object("pods", "default", pod.build())
    }

    /// Pods in `default`.
    pub fn pods(self, pods: impl IntoIterator<Item = PodFixture>) -> Self {
        pods.into_iter().fold(self, Self::pod)
    }

    /// Any other object, created after the Nodes, in order.
    pub fn object(mut self, plural: &str, ns: &str, obj: Value) -> Self {
        self.objects.push((plural.into(), ns.into(), obj));
        self
    }

    /// A simulated agent (4 GPUs, sampling every 100 ms: [`super::agent`]) serving
    /// `node`, whether or not a Node of that name exists.
    pub fn agent(mut self, node: &str) -> Self {
        self.agents.push(node.into());
        self
    }

    /// A simulated agent for every Node (after those named by [`Scenario::agent`]).
    pub fn agents(mut self) -> Self {
        self.every_node = true;
        self
    }

    /// `--agents` names each agent's node: `n1=http://ADDR` (the default: an
    /// agent that acts must be told whom it follows).
    pub fn named(mut self) -> Self {
        self.listed = Listed::Named;
        self
    }

    /// `--agents` lists the bare URLs: each agent names its node by its first answer
    /// (refused with `--remediation enforce`).
    pub fn bare(mut self) -> Self {
        self.listed = Listed::Bare;
        self
    }

    /// `--agents` as given (e.g. [`NO_AGENT`]) instead of the agents' URLs.
    pub fn agents_flag(mut self, agents: &str) -> Self {
        self.listed = Listed::Given(agents.into());
        self
    }

    /// No `--agents` from [`World::healing`] and [`World::configmap`]: discovery finds
    /// the agents, or the test lists them itself.
    pub fn unlisted(mut self) -> Self {
        self.listed = Listed::No;
        self
    }

    /// Seed the API server, start the agents.
    pub async fn start(self) -> World {
        let (server, kube) = super::api_server_with(&super::USERS, &self.components).await;
        let mut names = self.agents;
        if self.every_node {
            for n in &self.nodes {
                if !names.iter().any(|a| a == n.name()) {
                    names.push(n.name().to_string());
                }
            }
        }
        for n in self.nodes {
            n.create(&server);
        }
        for (plural, ns, obj) in self.objects {
            server.create(&plural, &ns, obj).unwrap();
        }
        let mut agents = Vec::new();
        for n in &names {
            agents.push(super::agent(n).await);
        }
        let url = |a: &Agent| format!("http://{}", a.addr);
        let flag = match self.listed {
            Listed::Bare => Some(agents.iter().map(url).collect::<Vec<_>>().join(",")),
            Listed::Named => Some(
                names
                    .iter()
                    .zip(&agents)
                    .map(|(n, a)| format!("{n}={}", url(a)))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            Listed::Given(s) => Some(s),
            Listed::No => None,
        }
        .filter(|f| !f.is_empty());
        World {
            server,
            kube,
            agents: Agents {
                nodes: names,
                agents,
            },
            flag,
        }
    }
}

/// A started [`Scenario`].
pub struct World {
    /// The Kubernetes API test server.
    pub server: ApiServer,
    /// Its URL.
    pub kube: String,
    /// The simulated agents: those of [`Scenario::agent`] in order, then one per Node.
    pub agents: Agents,
    flag: Option<String>,
}

impl World {
    /// The agent serving `node`.
    pub fn agent(&self, node: &str) -> &Agent {
        self.agents.get(node)
    }

    /// The aggregator's `--agents`, if the scenario gives one.
    pub fn agents_flag(&self) -> Option<&str> {
        self.flag.as_deref()
    }

    /// [`super::Launch::healing`] against this cluster, following the agents.
    pub fn healing(&self, replica: &str) -> super::Launch {
        self.follow(super::Launch::healing(&self.kube, replica))
    }

    /// [`super::Launch::configmap`] against this cluster, following the agents.
    pub fn configmap(&self, replica: &str, shards: u32) -> super::Launch {
        self.follow(super::Launch::configmap(&self.kube, replica, shards))
    }

    fn follow(&self, launch: super::Launch) -> super::Launch {
        match &self.flag {
            Some(f) => launch.args(&["--agents", f]),
            None => launch,
        }
    }
}

/// A scenario's simulated agents, by the node each serves.
pub struct Agents {
    nodes: Vec<String>,
    agents: Vec<Agent>,
}

impl Agents {
    fn position(&self, node: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n == node)
            .unwrap_or_else(|| panic!("no agent for {node}"))
    }

    /// The agent serving `node`.
    pub fn get(&self, node: &str) -> &Agent {
        &self.agents[self.position(node)]
    }

    /// The agent serving `node`, taken out (to shut it down: a node gone dark).
    pub fn take(&mut self, node: &str) -> Agent {
        let i = self.position(node);
        self.nodes.remove(i);
        self.agents.remove(i)
    }

    /// The agents, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Agent> {
        self.agents.iter()
    }
}

impl std::ops::Index<usize> for Agents {
    type Output = Agent;
    fn index(&self, i: usize) -> &Agent {
        &self.agents[i]
    }
}

impl<'a> IntoIterator for &'a Agents {
    type Item = &'a Agent;
    type IntoIter = std::slice::Iter<'a, Agent>;
    fn into_iter(self) -> Self::IntoIter {
        self.agents.iter()
    }
}
