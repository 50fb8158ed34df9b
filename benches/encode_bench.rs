//! What a shard's heartbeat write costs before it leaves the replica (issue 11): the
//! shard's document built from the pipeline (`document`), and one ConfigMap's body
//! encoded from it (`page_body`, each node's entry written once, straight into its
//! escaped form), beside the encoding it replaced (each entry serialized to a string,
//! then the map of strings serialized again, escaping every byte once more).
//!
//! `cargo run --release -p faultline-benches --bin encode-bench` (`N`: rounds, 300):
//! 5,000 nodes x 8 devices in 32 shards, shard 3 (about 156 nodes) on one page.

use std::sync::Arc;
use std::time::Instant;

use faultline_aggregator::metrics::Metrics;
use faultline_aggregator::pipeline::Pipeline;
use faultline_aggregator::publish::configmap::{files, page_body};
use faultline_aggregator::publish::document;
use faultline_common::rules::Rules;
use faultline_common::{
    DeviceHealth, DeviceReading, DeviceStatus, NodeHealth, Summary, Vendor, SCHEMA_VERSION,
};

fn node(i: usize) -> NodeHealth {
    let npus: Vec<DeviceHealth> = (0..8u32)
        .map(|d| {
            let mut r = DeviceReading::new(format!("gpu{d}"), Vendor::Nvidia, "nvml");
            r.uuid = Some(format!("GPU-5157e000-0000-4000-8000-{d:012x}"));
            r.pci_bus_id = Some(format!("0000:{:02x}:00.0", 0x18 + d * 0x10));
            r.temperature_c = Some(51.25);
            r.power_w = Some(300.0);
            DeviceHealth {
                reading: r,
                status: DeviceStatus::Healthy,
                reason: None,
                findings: vec![],
                ecc_errors: Some(0),
                pcie_link_status: Some("up".into()),
                sampled_at: None,
                sample_age_ms: Some(200),
                recent_xids: vec![],
            }
        })
        .collect();
    NodeHealth {
        schema_version: SCHEMA_VERSION.into(),
        generation: 1,
        timestamp: String::new(),
        node: format!("gpu-node-{i:05}"),
        agent_version: "bench".into(),
        summary: Summary::of(&npus),
        npus,
        sources: vec![],
        unattributed_xids: vec![],
    }
}

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
        p.on_document(node(i), 1_000);
    }
    let (build, doc) = time(n, || document(&p, 1, "bench", 3, 32));
    let meta = kube_meta();
    let (one, (body, _, _)) = time(n, || page_body(&meta, &doc, 0, 1, doc.sequence).unwrap());
    let (two, old) = time(n, || {
        let (data, _) = files(&doc).unwrap();
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

fn kube_meta() -> faultline_aggregator::publish::configmap::ObjectMeta {
    faultline_aggregator::publish::configmap::ObjectMeta {
        name: Some("faultline-shard-3".into()),
        resource_version: Some("12345".into()),
        ..Default::default()
    }
}
