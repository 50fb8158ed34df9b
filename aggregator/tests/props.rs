//! Property tests for what the aggregator reads: the rules file and agents'
//! documents into the pipeline. Nothing panics; what is kept is bounded.

use std::path::Path;
use std::sync::Arc;

use faultline_aggregator::agents::collect::admit_raw;
use faultline_aggregator::metrics::Metrics;
use faultline_aggregator::pipeline::Pipeline;
use faultline_aggregator::rules_file;
use faultline_common::document::limits;
use faultline_common::reading::DeviceStatus;
use faultline_common::rules::Rules;
use faultline_common::testing::{device, node};
use faultline_common::{DeviceHealth, NodeHealth};
use proptest::prelude::*;

fn status() -> impl Strategy<Value = DeviceStatus> {
    prop::sample::select(vec![
        DeviceStatus::Healthy,
        DeviceStatus::Degraded,
        DeviceStatus::Failed,
        DeviceStatus::Unknown,
    ])
}

fn any_device() -> impl Strategy<Value = DeviceHealth> {
    (
        prop::sample::select(vec!["gpu0", "gpu1", "gpu2", "npu0", "", "x"]).prop_map(String::from),
        ".{0,140}",
        status(),
        prop::option::of(".{0,140}"),
        prop::option::of(any::<f64>()),
    )
        .prop_map(|(id, odd_id, status, reason, temp)| {
            let id = if odd_id.len() % 3 == 0 { odd_id } else { id };
            device(id)
                .source("prop")
                .temperature(temp)
                .status(status)
                .reason(reason)
                .build()
        })
}

fn doc() -> impl Strategy<Value = NodeHealth> {
    (
        prop::sample::select(vec!["n1", "n2", "n3"]).prop_map(String::from),
        any::<u64>(),
        prop::collection::vec(any_device(), 0..12),
    )
        .prop_map(|(name, generation, npus)| {
            node(&name)
                .generation(generation)
                .agent_version("prop")
                .npus(npus)
                .build()
        })
}

proptest! {
    /// The rules file: any text is rules or a clear error, never a panic.
    #[test]
    fn rules_never_panic(raw in ".{0,400}", yaml in "(state_machine|windows|thresholds):\n  [a-z_]{1,12}: [-0-9.a-z]{0,8}\n") {
        let _ = rules_file::parse(Path::new("rules.yaml"), &raw);
        let _ = rules_file::parse(Path::new("rules.yaml"), &yaml);
        let _ = rules_file::parse(Path::new("rules.json"), &raw);
    }

    /// Documents as the collector admits them (within the limits) into the pipeline,
    /// at any times: no panic, nodes only those the documents named, devices per node
    /// within the limit, and every published entry consistent with its summary.
    #[test]
    fn documents_into_the_pipeline(docs in prop::collection::vec((doc(), 0u64..5_000), 1..30)) {
        let mut p = Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()));
        let mut now = 1_000_000u64;
        for (d, step) in docs {
            now += step;
            // Through the collector's one gate, as the core loop takes a document.
            let raw = serde_json::to_vec(&d).unwrap();
            let Ok(view) = admit_raw(&d.node, &raw) else {
                continue;
            };
            let _ = p.on_view(&view, &raw, now);
            let _ = p.tick(now);
        }
        let _ = p.tick(now + 3_600_000);
        prop_assert!(p.node_names().count() <= 3);
        for n in p.node_names().cloned().collect::<Vec<_>>() {
            let f = p.node_faults(&n).expect("a known node has an entry");
            prop_assert!(f.npus.len() <= limits::DEVICES);
        }
        let s = p.summary();
        prop_assert_eq!(s.total, s.healthy + s.degraded + s.failed + s.unknown);
    }
}
