//! Reading a shard's last published document back, to seed a takeover: the replica that
//! takes a shard continues from what the last holder published, so a change of holder
//! changes no published status. Publishing owns the pages' names and format,
//! so it owns reading them too; the Lease loop asks through [`SeedSource`].

use std::collections::BTreeMap;

use faultline_common::fault::{page_name, shard_of, NodeFaults};
use futures_util::future::BoxFuture;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;

use crate::shard::SeedSource;

/// The shard ConfigMaps of one aggregator (`<name>-shard-<i>` and its further pages) in
/// its own namespace.
pub struct ShardPages {
    /// The ConfigMaps in the aggregator's namespace.
    pub api: Api<ConfigMap>,
    /// The aggregator's `--name`.
    pub name: String,
    /// Number of shards (a node's shard is checked against it).
    pub shards: u32,
    /// ConfigMaps per shard (`--pages`).
    pub pages: u32,
}

impl SeedSource for ShardPages {
    fn read(&self, shard: u32) -> BoxFuture<'_, Vec<NodeFaults>> {
        Box::pin(async move {
            let mut nodes = Vec::new();
            // Each page read by name (RBAC can name them); a missing one is nothing to seed.
            for page in 0..self.pages.max(1) {
                let cm = page_name(&self.name, shard, page);
                match self.api.get_opt(&cm).await {
                    Ok(Some(c)) => {
                        entries(shard, self.shards, &c.data.unwrap_or_default(), &mut nodes)
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(shard, configmap = %cm, error = %e, "cannot read the shard's last document; its devices there start unknown")
                    }
                }
            }
            nodes
        })
    }
}

/// The node entries of one page of `shard` (the whole-shard `fault.json` key is not an
/// entry), into `out`; an entry of another shard or one that does not parse is skipped.
fn entries(shard: u32, shards: u32, data: &BTreeMap<String, String>, out: &mut Vec<NodeFaults>) {
    for (k, v) in data {
        if k == "fault.json" {
            continue;
        }
        match serde_json::from_str::<NodeFaults>(v) {
            Ok(n) if shard_of(&n.node, shards) == shard => out.push(n),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(shard, key = %k, error = %e, "unreadable entry in the shard's document; not seeded")
            }
        }
    }
}
