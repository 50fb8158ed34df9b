//! What the CLI reads from the cluster: the published shard documents (each node's
//! entry `<node>.json` and each shard's index `fault.json`), the quarantine record and
//! history on the Node, and the breaker's ConfigMap. Reading only: nothing here writes.

use std::collections::BTreeMap;

use anyhow::Context;
use faultline_common::fault::{shard_of, NodeFaults, ShardIndex};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::{Api, ListParams};
use serde::Serialize;

use crate::remediate::{history_of, record_of, QuarantineRecord};

/// The breaker as its ConfigMap says (closed when there is none).
#[derive(Debug, Clone, Serialize)]
pub struct BreakerView {
    /// `closed` or `open`.
    pub state: String,
    /// Why, as written by the replica or the person who set it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Since when (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

/// `faultline status`.
#[derive(Debug, Clone, Serialize)]
pub struct StatusView {
    /// The breaker.
    pub breaker: BreakerView,
    /// Every quarantined node's record.
    pub quarantined: Vec<QuarantineRecord>,
}

/// `faultline describe NODE`.
#[derive(Debug, Clone, Serialize)]
pub struct DescribeView {
    /// The node.
    pub node: String,
    /// The shard its entry is published in, when one was found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardIndexView>,
    /// Its published entry: each device's status, reason, since and last readings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub published: Option<NodeFaults>,
    /// The node's taints (`key=value:effect`), faultline's marked `(faultline)`.
    pub taints: Vec<String>,
    /// The quarantine record, while quarantined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<QuarantineRecord>,
    /// Earlier quarantines, oldest first.
    pub history: Vec<QuarantineRecord>,
}

/// Where a node's entry came from.
#[derive(Debug, Clone, Serialize)]
pub struct ShardIndexView {
    /// The ConfigMap (`namespace/name`).
    pub configmap: String,
    /// Which shard, of how many.
    pub shard: u32,
    /// Number of shards.
    pub shards: u32,
    /// The replica that wrote it.
    pub writer: String,
    /// Its write sequence.
    pub sequence: u64,
    /// When it was written.
    pub timestamp: String,
}

/// One row of `faultline agents`.
#[derive(Debug, Clone, Serialize)]
pub struct AgentView {
    /// The node.
    pub node: String,
    /// The shard that publishes it.
    pub shard: u32,
    /// Reachability, last contact, error and sources, as the aggregator saw them.
    pub agent: faultline_common::fault::AgentReach,
    /// The node's devices by status.
    pub summary: faultline_common::fault::FaultSummary,
}

/// Where faultline publishes and keeps its state.
pub struct Scope {
    /// The aggregator's namespace.
    pub namespace: String,
    /// The aggregator's `--name`.
    pub name: String,
}

impl Scope {
    fn shard_cm(&self, shard: u32) -> String {
        crate::publish::configmap::configmap_name(&self.name, shard)
    }
}

/// The breaker.
pub async fn breaker(client: &kube::Client, scope: &Scope) -> anyhow::Result<BreakerView> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &scope.namespace);
    let data = cms
        .get_opt(&format!("{}-breaker", scope.name))
        .await
        .with_context(|| format!("breaker ConfigMap in {}", scope.namespace))?
        .and_then(|c| c.data)
        .unwrap_or_default();
    Ok(BreakerView {
        state: data
            .get("state")
            .cloned()
            .unwrap_or_else(|| "closed".into()),
        reason: data.get("reason").cloned(),
        since: data.get("since").cloned(),
    })
}

/// The breaker and every quarantined node.
pub async fn status(client: &kube::Client, scope: &Scope) -> anyhow::Result<StatusView> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels(crate::remediate::DEVICES_LABEL))
        .await
        .context("list quarantined Nodes")?;
    let mut quarantined = Vec::new();
    for n in &list.items {
        if let Some(r) = record_of(n)? {
            quarantined.push(r);
        }
    }
    quarantined.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(StatusView {
        breaker: breaker(client, scope).await?,
        quarantined,
    })
}

/// A shard ConfigMap's index and data, if it exists and parses.
async fn shard(
    cms: &Api<ConfigMap>,
    name: &str,
) -> anyhow::Result<Option<(ShardIndex, BTreeMap<String, String>)>> {
    let Some(cm) = cms
        .get_opt(name)
        .await
        .with_context(|| format!("ConfigMap {name}"))?
    else {
        return Ok(None);
    };
    let data = cm.data.unwrap_or_default();
    let index: ShardIndex = serde_json::from_str(
        data.get("fault.json")
            .with_context(|| format!("ConfigMap {name} has no fault.json"))?,
    )
    .with_context(|| format!("ConfigMap {name}: fault.json"))?;
    Ok(Some((index, data)))
}

/// One node: its published entry, faultline's taints, record and history.
pub async fn describe(
    client: &kube::Client,
    scope: &Scope,
    node: &str,
) -> anyhow::Result<DescribeView> {
    let nodes: Api<Node> = Api::all(client.clone());
    let live = nodes
        .get_opt(node)
        .await
        .with_context(|| format!("node {node}"))?
        .with_context(|| format!("node {node:?} not found"))?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &scope.namespace);
    // Shard 0 says how many shards there are; the node's shard follows from its name.
    let mut found = None;
    if let Some((first, data)) = shard(&cms, &scope.shard_cm(0)).await? {
        let s = shard_of(node, first.shards);
        found = if s == 0 {
            Some((first, data))
        } else {
            shard(&cms, &scope.shard_cm(s)).await?
        };
    }
    let (shard, published) = match found {
        Some((index, mut data)) => {
            let key = format!("{node}.json");
            let mut cm_name = scope.shard_cm(index.shard);
            if !data.contains_key(&key) {
                // A shard spread over pages (`--pages`): the entry is on one of its
                // other ConfigMaps, all labelled with the shard.
                let lp =
                    ListParams::default().labels(&format!("faultline.io/shard={}", index.shard));
                let pages = cms
                    .list(&lp)
                    .await
                    .with_context(|| format!("list the ConfigMaps of shard {}", index.shard))?;
                for cm in pages.items {
                    let name = cm.metadata.name.clone().unwrap_or_default();
                    let ours = crate::publish::configmap::parse_page_name(&scope.name, &name)
                        .is_some_and(|(s, _)| s == index.shard);
                    if let Some(d) = cm.data.filter(|d| ours && d.contains_key(&key)) {
                        data = d;
                        cm_name = name;
                        break;
                    }
                }
            }
            let entry = data
                .get(&key)
                .map(|t| serde_json::from_str::<NodeFaults>(t))
                .transpose()
                .with_context(|| format!("{key} in {cm_name}"))?;
            let view = ShardIndexView {
                configmap: format!("{}/{}", scope.namespace, cm_name),
                shard: index.shard,
                shards: index.shards,
                writer: index.writer,
                sequence: index.sequence,
                timestamp: index.timestamp,
            };
            (Some(view), entry)
        }
        None => (None, None),
    };
    let quarantine = record_of(&live)?;
    // Every taint on the node; the one faultline owns (named in the record) is marked.
    let owned = quarantine.as_ref().and_then(|r| r.owned_taint.clone());
    let taints = live
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| {
            ts.iter()
                .map(|t| {
                    format!(
                        "{}={}:{}{}",
                        t.key,
                        t.value.as_deref().unwrap_or_default(),
                        t.effect,
                        if owned.as_deref() == Some(t.key.as_str()) {
                            " (faultline)"
                        } else {
                            ""
                        }
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(DescribeView {
        node: node.to_string(),
        shard,
        published,
        taints,
        quarantine,
        history: history_of(&live),
    })
}

/// Every agent published by any shard.
pub async fn agents(client: &kube::Client, scope: &Scope) -> anyhow::Result<Vec<AgentView>> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &scope.namespace);
    let list = cms
        .list(&ListParams::default().labels("faultline.io/shard"))
        .await
        .with_context(|| format!("list shard ConfigMaps in {}", scope.namespace))?;
    let mut out = Vec::new();
    for cm in list.items {
        let name = cm.metadata.name.unwrap_or_default();
        let Some((shard, _page)) = crate::publish::configmap::parse_page_name(&scope.name, &name)
        else {
            continue;
        };
        for (key, text) in cm.data.unwrap_or_default() {
            if key == "fault.json" || !key.ends_with(".json") {
                continue;
            }
            match serde_json::from_str::<NodeFaults>(&text) {
                Ok(n) => out.push(AgentView {
                    node: n.node,
                    shard,
                    agent: n.agent,
                    summary: n.summary,
                }),
                Err(e) => eprintln!("warning: {name}/{key}: {e}"),
            }
        }
    }
    out.sort_by(|a, b| a.node.cmp(&b.node));
    Ok(out)
}
