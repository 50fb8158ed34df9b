//! The documents published: a shard's (or the whole cluster's) fault.json from the
//! pipeline, and the files of the file sink.

use std::collections::BTreeMap;

use faultline_common::fault::{FaultDocument, FaultSummary, FAULT_VERSION};
use faultline_common::time::now_rfc3339;

use super::file::valid_key;
use crate::pipeline::Pipeline;

/// The document of the nodes of one shard (every node with `shards` = 1).
pub fn document(
    p: &Pipeline,
    sequence: u64,
    writer: &str,
    shard: u32,
    shards: u32,
) -> FaultDocument {
    let mut nodes = BTreeMap::new();
    let mut summary = FaultSummary::default();
    for (name, n) in p.shard_faults(shard, shards) {
        summary.add(&n.summary);
        nodes.insert(name.clone(), n);
    }
    FaultDocument {
        version: FAULT_VERSION.into(),
        timestamp: now_rfc3339(),
        sequence,
        shard,
        shards,
        writer: writer.to_string(),
        summary,
        nodes,
    }
}

/// The files of the file sink: `fault.json` (every node) and `<node>.json` (one node,
/// seed 003's shape).
pub fn files(doc: &FaultDocument) -> serde_json::Result<BTreeMap<String, Vec<u8>>> {
    let mut f = BTreeMap::new();
    f.insert("fault.json".to_string(), serde_json::to_vec_pretty(doc)?);
    for (name, n) in &doc.nodes {
        let key = format!("{name}.json");
        if valid_key(&key) {
            f.insert(key, serde_json::to_vec_pretty(n)?);
        }
    }
    Ok(f)
}
