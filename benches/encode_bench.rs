//! What a shard's heartbeat write costs before it leaves the replica: the
//! shard's document built from the pipeline (`document`), and one ConfigMap's body
//! encoded from it (`page_body`, each node's entry written once, straight into its
//! escaped form), beside the encoding it replaced (each entry serialized to a string,
//! then the map of strings serialized again, escaping every byte once more).
//!
//! `cargo run --release -p faultline-benches --bin encode-bench` (`N`: rounds, 300):
//! 5,000 nodes x 8 devices (the scale benchmark's fleet) in 32 shards, shard 3 (about
//! 156 nodes) on one page.

#[path = "fleet.rs"]
mod fleet;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use faultline_aggregator::agents::collect::admit_raw;
use faultline_aggregator::metrics::Metrics;
use faultline_aggregator::pipeline::Pipeline;
use faultline_aggregator::publish::configmap::{page_body, ObjectMeta};
use faultline_aggregator::publish::document;
use faultline_common::fault::ShardIndex;
use faultline_common::rules::Rules;

/// Mean µs of `f` over `n` rounds.
fn time<T>(n: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut last = f();
    let t = Instant::now();
    for _ in 0..n {
        last = f();
    }
    (t.elapsed().as_secs_f64() / n as f64 * 1e6, last)
}

fn main() {
    let n = std::env::var("N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut p = Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()));
    for i in 0..5000 {
        let doc = fleet::node_health(i);
        let raw = serde_json::to_vec(&doc).unwrap();
        let view = admit_raw(&doc.node, &raw).expect("the fleet's documents pass the gate");
        p.on_view(&view, &raw, 1_000);
    }
    let (build, doc) = time(n, || document(&p, 1, "bench", 3, 32));
    let meta = ObjectMeta {
        name: Some("faultline-shard-3".into()),
        resource_version: Some("12345".into()),
        ..Default::default()
    };
    let (one, body) = time(n, || {
        page_body(&meta, &doc, 0, 1, doc.sequence).unwrap().body
    });
    // Before: every value a string in a map, and the map serialized again.
    let (two, old) = time(n, || {
        let mut data = BTreeMap::new();
        let index = serde_json::to_string(&ShardIndex::of(&doc)).unwrap();
        data.insert("fault.json".to_string(), index);
        for (name, entry) in &doc.nodes {
            data.insert(
                format!("{name}.json"),
                serde_json::to_string(entry).unwrap(),
            );
        }
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": &meta, "data": data,
        }))
        .unwrap()
    });
    assert!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()
            == serde_json::from_slice::<serde_json::Value>(&old).unwrap(),
        "not the same ConfigMap"
    );
    let nodes = doc.nodes.len();
    println!("| step | µs per shard of {nodes} nodes x 8 devices | µs per node |");
    println!("|---|---|---|");
    for (what, us) in [
        ("document (from the pipeline)", build),
        ("page_body (one pass)", one),
        ("entries to strings, then the map (two passes, before)", two),
    ] {
        println!("| {what} | {us:.0} | {:.1} |", us / nodes as f64);
    }
    println!("body: {} bytes", body.len());
}
