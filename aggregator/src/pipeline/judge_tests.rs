//! The pipeline's unit tests.

use super::*;
use faultline_common::testing::{self, device};
use faultline_common::time::rfc3339_ms as rfc3339;
use faultline_common::{DeviceHealth, NodeHealth};

fn doc(node: &str, devs: Vec<DeviceHealth>) -> NodeHealth {
    testing::node(node).npus(devs).build()
}

/// Device `id` at `temp` C, failed for a code or healthy.
fn dev(id: &str, temp: f64, failed: Option<&str>) -> DeviceHealth {
    let d = device(id)
        .temperature(temp)
        .ecc_errors(0)
        .pcie("up")
        .sample_age_ms(1);
    match failed {
        Some(code) => d.failed(code),
        None => d,
    }
    .build()
}

fn pipeline() -> Pipeline {
    Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()))
}

#[test]
fn a_hard_fault_fails_at_once_even_between_ticks() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 1_000);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
    // 100 ms later, a hard fault: evaluated at once and marked urgent.
    let c = p.on_document(doc("n1", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 1_100);
    assert!(c.urgent);
    assert_eq!(c.nodes, vec!["n1".to_string()]);
    let s = p.device_state("n1", "gpu0").unwrap();
    assert_eq!(
        (s.status, s.reason.as_deref()),
        (DeviceStatus::Failed, Some("gpu-lost"))
    );
    let f = p.node_faults("n1").unwrap();
    assert_eq!(f.summary.failed, 1);
    assert_eq!(f.npus[0].since, rfc3339(1_100));
}

#[test]
fn documents_faster_than_once_a_second_count_once() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 0);
    // Ten clean documents within one second are one sample, not ten.
    for i in 1..=10 {
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), i * 50);
    }
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Failed
    );
    for t in 1..=5 {
        p.tick(t * 1_000);
    }
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
}

#[test]
fn an_unreachable_agent_turns_devices_unknown_after_the_grace_never_failed() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    p.on_unreachable("n1", "connection refused", 500);
    for t in 1..=29 {
        p.tick(t * 1_000);
    }
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
    p.tick(30_000);
    let f = p.node_faults("n1").unwrap();
    assert_eq!(f.npus[0].status, DeviceStatus::Unknown);
    assert!(!f.agent.reachable);
    assert_eq!(f.agent.error.as_deref(), Some("connection refused"));
    for t in 31..=400 {
        p.tick(t * 1_000);
    }
    assert_eq!(p.summary().failed, 0);
}

/// A reachable agent whose every device is unknown (its source hung) leaves
/// them healthy for the grace, then unknown, never failed; the ticks do not skip the
/// node as quiet meanwhile (they did: it stayed healthy as long as the agent said
/// unknown, and every skipped tick counted as a clean sample).
#[test]
fn devices_their_agent_reports_unknown_turn_unknown_after_the_grace() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    p.tick(1_000);
    let unknown = device("gpu0").status(DeviceStatus::Unknown).build();
    p.on_document(doc("n1", vec![unknown]), 1_100);
    for t in 2..=30 {
        p.tick(t * 1_000);
    }
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
    p.tick(31_100);
    let s = p.device_state("n1", "gpu0").unwrap();
    assert_eq!(
        (s.status, s.reason.as_deref()),
        (DeviceStatus::Unknown, Some("no-fresh-data"))
    );
    assert_eq!(
        p.node_faults("n1").unwrap().npus[0].status,
        DeviceStatus::Unknown
    );
    for t in 32..=400 {
        p.tick(t * 1_000);
    }
    assert_eq!(p.summary().failed, 0);
}

/// A node that was never reached publishes why as soon as it is known, and again
/// when the reason changes; the same failure again is no change (no write per
/// retry). CI caught the first: an agent refused before its node was known was
/// published only at the next heartbeat.
#[test]
fn a_new_reason_for_an_unreachable_agent_is_a_change_the_same_one_is_not() {
    let mut p = pipeline();
    assert_eq!(
        p.on_unreachable("n1", "identity mismatch", 500).nodes,
        ["n1"]
    );
    assert_eq!(
        p.node_faults("n1").unwrap().agent.error.as_deref(),
        Some("identity mismatch")
    );
    assert!(p
        .on_unreachable("n1", "identity mismatch", 700)
        .nodes
        .is_empty());
    assert_eq!(
        p.on_unreachable("n1", "connection refused", 900).nodes,
        ["n1"]
    );
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 1_000);
    assert_eq!(
        p.on_unreachable("n1", "connection refused", 1_500).nodes,
        ["n1"]
    );
}

/// A quiet node's document is dropped once judged; its ticks are still
/// clean samples (never missing ones), and what is published keeps its readings.
/// A node with a device not healthy keeps its document for the next ticks.
#[test]
fn a_quiet_nodes_document_is_dropped_and_its_readings_kept() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 41.5, None)]), 0);
    assert!(p.nodes["n1"].pending.is_none(), "judged quiet: dropped");
    for t in 1..=120 {
        p.tick(t * 1_000);
    }
    let s = p.device_state("n1", "gpu0").unwrap();
    assert_eq!(s.status, DeviceStatus::Healthy);
    assert!(s.clean_streak >= 120, "{}", s.clean_streak);
    let f = p.node_faults("n1").unwrap();
    assert_eq!(f.npus[0].temperature_c, Some(41.5));
    assert_eq!(f.npus[0].pcie_link_status.as_deref(), Some("up"));
    // The same devices again: readings updated in place, a changed text too.
    let mut d = dev("gpu0", 47.0, None);
    d.pcie_link_status = Some("down".into());
    p.on_document(doc("n1", vec![d]), 121_500);
    let f = p.node_faults("n1").unwrap();
    assert_eq!(f.npus[0].temperature_c, Some(47.0));
    assert_eq!(f.npus[0].pcie_link_status.as_deref(), Some("down"));
    // A document within a second of the last evaluation waits for the tick, bytes
    // and all; judged quiet there, both are dropped.
    p.on_document(doc("n1", vec![dev("gpu0", 46.0, None)]), 122_000);
    assert!(p.nodes["n1"].pending.is_some() && p.nodes["n1"].raw.is_some());
    p.tick(122_600);
    assert!(p.nodes["n1"].pending.is_none(), "judged quiet: dropped");
    assert!(p.nodes["n1"].raw.is_none(), "its bytes too");
    p.on_document(doc("n2", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 0);
    assert!(p.nodes["n2"].pending.is_some(), "not quiet: kept");
    assert!(p.nodes["n2"].raw.is_some(), "its bytes too, for new rules");
    // Unreachable: nothing to judge; the readings stay.
    p.on_unreachable("n2", "down", 500);
    assert!(p.nodes["n2"].pending.is_none());
    assert_eq!(
        p.node_faults("n2").unwrap().npus[0].temperature_c,
        Some(40.0)
    );
}

/// A shard's entries are those of the nodes [`shard_of`] puts in it, each as
/// [`Pipeline::node_faults`] has it (the kept hash decides as the name would).
#[test]
fn a_shards_entries_are_its_nodes() {
    use faultline_common::fault::shard_of;
    let mut p = pipeline();
    let names: Vec<String> = (0..200)
        .map(|i| format!("node-{i}.rack-{}", i % 7))
        .collect();
    for n in &names {
        p.on_document(doc(n, vec![dev("gpu0", 40.0, None)]), 1_000);
    }
    for shards in [1, 2, 7, 32] {
        let mut all = Vec::new();
        for shard in 0..shards {
            let mut got: Vec<String> = p
                .shard_faults(shard, shards)
                .map(|(name, f)| {
                    assert_eq!(f, p.node_faults(name).unwrap());
                    name.clone()
                })
                .collect();
            got.sort();
            let mut want: Vec<String> = names
                .iter()
                .filter(|n| shard_of(n, shards) == shard)
                .cloned()
                .collect();
            want.sort();
            assert_eq!(got, want, "shard {shard} of {shards}");
            all.extend(got);
        }
        assert_eq!(all.len(), names.len());
    }
}

/// The nodes followed are capped; past the cap a new node's
/// documents change nothing, and known nodes go on.
#[test]
fn nodes_past_the_cap_are_refused() {
    let mut p = pipeline().with_max_nodes(2);
    for n in ["a", "b", "c"] {
        p.on_document(doc(n, vec![dev("gpu0", 40.0, None)]), 1_000);
    }
    assert_eq!(p.node_names().cloned().collect::<Vec<_>>(), ["a", "b"]);
    assert!(p.on_unreachable("d", "down", 2_000).nodes.is_empty());
    assert!(!p
        .on_document(
            doc("a", vec![dev("gpu0", 40.0, Some("row-remap-failure"))]),
            3_000
        )
        .nodes
        .is_empty());
}

/// A device its reachable agent stops reporting is forgotten
/// after the forget time (never unknown for ever); while the agent is unreachable
/// nothing is forgotten.
#[test]
fn devices_no_longer_reported_are_forgotten() {
    let mut p = pipeline().with_device_forget(std::time::Duration::from_secs(60));
    p.on_document(
        doc("n1", vec![dev("gpu0", 40.0, None), dev("gpu1", 40.0, None)]),
        1_000,
    );
    // gpu1 disappears; the agent keeps answering.
    let mut t = 2_000;
    while t < 60_000 {
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), t);
        t += 1_000;
    }
    assert!(
        p.device_state("n1", "gpu1").is_some(),
        "kept within the forget time"
    );
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 61_500);
    assert!(p.device_state("n1", "gpu1").is_none(), "forgotten");
    assert!(p.unknown_devices("n1", 0, 61_500).is_empty());
    // An unreachable agent's devices stay, however long.
    p.on_unreachable("n1", "down", 62_000);
    p.tick(62_000 + 3_600_000);
    assert!(p.device_state("n1", "gpu0").is_some());
}

/// Ids an agent churned through before it went away are forgotten
/// after the forget time while it stays unreachable; the devices of its last document
/// stay (unknown, for the unknown guard), however long.
#[test]
fn churned_ids_of_an_unreachable_agent_are_forgotten_its_last_devices_stay() {
    let mut p = pipeline().with_device_forget(std::time::Duration::from_secs(60));
    // Each document names two devices under ids never seen before, then the last
    // document names gpu0 and gpu1.
    for i in 0..4 {
        let (a, b) = (format!("churn{i}a"), format!("churn{i}b"));
        p.on_document(
            doc("n1", vec![dev(&a, 40.0, None), dev(&b, 40.0, None)]),
            1_000 + i * 1_000,
        );
    }
    p.on_document(
        doc("n1", vec![dev("gpu0", 40.0, None), dev("gpu1", 40.0, None)]),
        10_000,
    );
    p.on_unreachable("n1", "down", 11_000);
    p.tick(12_000);
    assert!(
        p.device_state("n1", "churn0a").is_some(),
        "kept within the forget time"
    );
    p.tick(66_000);
    for i in 0..4 {
        assert!(
            p.device_state("n1", &format!("churn{i}a")).is_none(),
            "churn{i}a forgotten"
        );
        assert!(
            p.device_state("n1", &format!("churn{i}b")).is_none(),
            "churn{i}b forgotten"
        );
    }
    p.tick(66_000 + 3_600_000);
    for id in ["gpu0", "gpu1"] {
        assert_eq!(
            p.device_state("n1", id).map(|s| s.status),
            Some(DeviceStatus::Unknown),
            "{id} of the last document stays, unknown"
        );
    }
}

#[test]
fn a_device_missing_from_the_document_is_not_a_fault() {
    let mut p = pipeline();
    p.on_document(
        doc("n1", vec![dev("gpu0", 40.0, None), dev("gpu1", 40.0, None)]),
        0,
    );
    for t in 1..=60 {
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), t * 1_000);
    }
    assert_eq!(
        p.device_state("n1", "gpu1").unwrap().status,
        DeviceStatus::Unknown
    );
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
}

#[test]
fn skipping_quiet_nodes_changes_no_outcome() {
    // The same history through the pipeline, with documents now and then: the
    // states must match what evaluating every tick in full gives (the state
    // machine run by hand below).
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    for t in 1..=10 {
        p.tick(t * 1_000);
    }
    let s = p.device_state("n1", "gpu0").unwrap();
    assert_eq!(s.status, DeviceStatus::Healthy);
    assert_eq!(
        s.last_fresh_ms,
        Some(10_000),
        "quiet ticks still count as fresh samples"
    );
    assert_eq!(s.clean_streak, 11);
    // Unreachable after that: unknown 30 s after the last fresh sample, not earlier.
    p.on_unreachable("n1", "gone", 10_500);
    for t in 11..=39 {
        p.tick(t * 1_000);
    }
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Healthy
    );
    p.tick(40_000);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().status,
        DeviceStatus::Unknown
    );
}

/// A quiet node is skipped by the ticks and its samples recorded when it
/// is next read or touched; the streak and freshness are what recording every due
/// tick gives, also when ticks come closer together than the spacing (a tick within
/// 900 ms of a node's last sample is no sample for it).
#[test]
fn skipped_ticks_count_as_recorded_ones() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    // Due ticks at 1 s, 2 s, 3 s; 3.5 s is within 900 ms of the last recorded
    // sample, 4.4 s is not; 4.5 s is again within, 5.5 s is due.
    let streak = |p: &Pipeline| p.device_state("n1", "gpu0").unwrap().clean_streak;
    for (t, want) in [
        (1_000, 2),
        (2_000, 3),
        (3_000, 4),
        (3_500, 4),
        (4_400, 5),
        (4_500, 5),
        (5_500, 6),
    ] {
        p.tick(t);
        assert_eq!(streak(&p), want, "at {t} ms");
    }
    let s = p.device_state("n1", "gpu0").unwrap();
    assert_eq!(s.last_fresh_ms, Some(5_500));
    assert!(
        p.nodes["n1"].lazy_since_tick.is_some(),
        "skipped while quiet"
    );
    // A document between ticks brings it up to date before it is judged; judged
    // quiet 1.1 s after the last tick, it is skipped at once (the next tick, at 7 s
    // here, is within 900 ms of it): not put back on the ticks' list.
    p.on_document(doc("n1", vec![dev("gpu0", 41.0, None)]), 6_600);
    assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
    assert_eq!(streak(&p), 7);
    assert_eq!(
        p.device_views("n1")[0].clean_streak,
        7,
        "release decisions see the same streak"
    );
    // 7 s is within 900 ms of the document: no sample, and skipped from there on
    // (not looked at again by the next tick); 8 s to 20 s are 13 samples.
    p.tick(7_000);
    assert_eq!(streak(&p), 7);
    assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
    for t in 8..=20 {
        p.tick(t * 1_000);
    }
    assert_eq!(streak(&p), 20);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
        Some(20_000)
    );
    // The same with a tick that comes too soon after the one that skipped it.
    p.on_document(doc("n1", vec![dev("gpu0", 42.0, None)]), 20_950);
    assert_eq!(streak(&p), 21);
    p.tick(21_000);
    assert!(p.nodes["n1"].lazy_since_tick.is_some());
    p.tick(21_300);
    assert_eq!(streak(&p), 21, "21.3 s is within 900 ms of the document");
    p.tick(22_000);
    assert_eq!(streak(&p), 22);
    // Unreachable: the skipped samples are kept, and no fresh one is added after.
    p.on_unreachable("n1", "gone", 22_500);
    assert_eq!(streak(&p), 22);
    p.tick(23_000);
    p.tick(24_000);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
        Some(22_000)
    );
}

/// A quiet node judged at its document is skipped at once when the next
/// tick is within the spacing of the document; a document just after a tick is
/// left to the next tick, which is a sample for it.
#[test]
fn a_document_just_after_a_tick_is_left_to_the_next() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    let streak = |p: &Pipeline| p.device_state("n1", "gpu0").unwrap().clean_streak;
    for t in 1..=3 {
        p.tick(t * 1_000);
    }
    assert_eq!(streak(&p), 4);
    // 50 ms after the tick at 3 s, its last sample: not judged yet, left to the
    // next tick (on its list), which is a sample.
    p.on_document(doc("n1", vec![dev("gpu0", 41.0, None)]), 3_050);
    assert!(p.nodes["n1"].lazy_since_tick.is_none() && p.active.len() == 1);
    assert_eq!(streak(&p), 4);
    p.tick(4_000);
    assert_eq!(streak(&p), 5, "judged at the tick");
    p.tick(5_000);
    p.tick(6_000);
    assert_eq!(streak(&p), 7);
    assert!(p.nodes["n1"].lazy_since_tick.is_some());
    // 950 ms after the tick at 6 s: judged now, and the tick at 7 s is within
    // 900 ms of it, so no sample: skipped at once, off the list, and the ticks
    // after it count.
    p.on_document(doc("n1", vec![dev("gpu0", 42.0, None)]), 6_950);
    assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
    assert_eq!(streak(&p), 8);
    p.tick(7_000);
    assert_eq!(streak(&p), 8, "7 s is 50 ms after the document");
    for t in 8..=10 {
        p.tick(t * 1_000);
    }
    assert_eq!(streak(&p), 11);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
        Some(10_000)
    );
}

#[test]
fn sustained_heat_degrades_after_the_window_and_the_hold() {
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
    let mut t = 0;
    while p.device_state("n1", "gpu0").unwrap().status == DeviceStatus::Healthy {
        t += 1_000;
        assert!(t < 120_000, "never degraded");
        p.on_document(doc("n1", vec![dev("gpu0", 95.0, None)]), t);
    }
    // 3 of 5 samples over 85 C from the third hot sample, then held 60 s.
    assert_eq!(t, 63_000);
    assert_eq!(
        p.device_state("n1", "gpu0").unwrap().reason.as_deref(),
        Some("high-temp")
    );
}

/// An agent that names new device ids in every document is refused once past
/// the per-window budget (and past the per-node cap at once); the node keeps what it
/// had, another node is judged as ever, and memory does not grow with the churn.
#[test]
fn device_id_churn_is_refused_and_other_nodes_go_on() {
    let mut p = pipeline();
    let eight = |prefix: &str, n: usize| -> Vec<DeviceHealth> {
        (0..n)
            .map(|i| dev(&format!("{prefix}{i}"), 40.0, None))
            .collect()
    };
    p.on_document(doc("evil", eight("gpu", 8)), 1_000);
    p.on_document(doc("good", eight("gpu", 8)), 1_000);
    assert_eq!(p.node_faults("evil").unwrap().npus.len(), 8);
    // A first document past the cap is refused whole.
    p.on_document(doc("huge", eight("npu", 65)), 1_000);
    assert!(p.node_faults("huge").is_none_or(|f| f.npus.is_empty()));
    // 512 new ids a document, one a second for a minute.
    for s in 1..=60u64 {
        let ids: Vec<DeviceHealth> = (0..512)
            .map(|i| dev(&format!("x{s}-{i}"), 40.0, None))
            .collect();
        let c = p.on_document(doc("evil", ids), 1_000 + s * 1_000);
        assert!(c.nodes.is_empty(), "second {s}: {:?}", c.nodes);
    }
    assert_eq!(
        p.node_faults("evil").unwrap().npus.len(),
        8,
        "nothing taken"
    );
    // Within the budget, a few new ids are taken (a device replaced).
    let mut replaced = eight("gpu", 8);
    replaced.push(dev("gpu8", 40.0, None));
    p.on_document(doc("evil", replaced), 70_000);
    assert_eq!(p.node_faults("evil").unwrap().npus.len(), 9);
    // The other node's fault is judged as ever.
    let c = p.on_document(
        doc("good", vec![dev("gpu0", 40.0, Some("gpu-lost"))]),
        71_000,
    );
    assert!(c.urgent);
    assert_eq!(
        p.device_state("good", "gpu0").unwrap().status,
        DeviceStatus::Failed
    );
}

/// A GPU UUID is one physical device. A second node reporting a
/// UUID another node reported first is flagged (counted) and the UUID is withheld from
/// its entry and its quarantine records, so nothing acts on it through that node; the
/// first node keeps it. Once the first node is gone, the UUID is free again.
#[test]
fn a_uuid_another_node_reported_first_is_flagged_and_withheld() {
    let metrics = Arc::new(Metrics::new());
    let mut p = Pipeline::new(Arc::new(Rules::default()), metrics.clone());
    let with_uuid = |uuid: &str, failed: Option<&str>| {
        let d = device("gpu0")
            .temperature(40.0)
            .ecc_errors(0)
            .pcie("up")
            .sample_age_ms(1)
            .uuid(uuid);
        match failed {
            Some(code) => d.failed(code),
            None => d,
        }
        .build()
    };
    let victim = "GPU-6f1a9c2e-0000-4000-8000-000000000001";
    p.on_document(doc("victim", vec![with_uuid(victim, None)]), 1_000);
    p.on_document(doc("liar", vec![with_uuid(victim, Some("xid-79"))]), 1_100);
    let uuid_of = |p: &Pipeline, n: &str| p.node_faults(n).unwrap().npus[0].uuid.clone();
    assert_eq!(uuid_of(&p, "victim").as_deref(), Some(victim));
    assert_eq!(uuid_of(&p, "liar"), None, "withheld from the second node");
    let records = p.failed_devices("liar");
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].uuid, None,
        "a record never names the claimed UUID"
    );
    assert!(metrics
        .encode()
        .contains("faultline_aggregator_duplicate_uuids_total 1"));
    // The same document again changes nothing and counts nothing more.
    p.on_document(doc("liar", vec![with_uuid(victim, Some("xid-79"))]), 2_100);
    assert!(metrics
        .encode()
        .contains("faultline_aggregator_duplicate_uuids_total 1"));
    // The first node gone, a new claim by another node holds.
    p.remove_node("victim");
    p.on_document(doc("moved", vec![with_uuid(victim, None)]), 3_000);
    assert_eq!(uuid_of(&p, "moved").as_deref(), Some(victim));
}

/// NVML's recovery action, as the agent reports it per device, is in the
/// node's published entry and names the repair in a quarantine record; a name this
/// build does not know reads as none, and the document is not refused for it.
#[test]
fn the_recovery_action_of_each_nvml_value_is_published_and_recorded() {
    let mut p = pipeline();
    let mut now = 0;
    for action in faultline_common::RecoveryAction::ALL {
        let mut d = dev("gpu0", 40.0, Some("xid-79"));
        d.reading.recovery_action = Some(action);
        now += 1_000;
        p.on_document(doc("n1", vec![d]), now);
        let f = p.node_faults("n1").unwrap();
        assert_eq!(f.npus[0].recovery_action, Some(action), "{action:?}");
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(v["npus"][0]["recovery_action"], action.as_str());
        assert_eq!(p.failed_devices("n1")[0].recovery_action, Some(action));
    }
    // A newer agent's name.
    let mut raw = serde_json::to_value(doc("n1", vec![dev("gpu0", 40.0, None)])).unwrap();
    raw["npus"][0]["recovery_action"] = serde_json::json!("melt-down");
    raw["generation"] = serde_json::json!(99);
    let bytes = serde_json::to_vec(&raw).unwrap();
    let view = DocView::parse(&bytes).expect("not refused for an unknown action");
    p.on_view(&view, &bytes, now + 1_000);
    assert_eq!(p.node_faults("n1").unwrap().npus[0].recovery_action, None);
    // A driver without the field: none in the entry.
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), now + 2_000);
    let v = serde_json::to_value(p.node_faults("n1").unwrap()).unwrap();
    assert!(v["npus"][0].get("recovery_action").is_none(), "{v}");
}

/// Only a new acknowledgement of an intent published for the node, not yet
/// acknowledged, makes its pass run (an agent naming ever new UIDs makes none); a shard
/// taken over keeps its intents published.
#[test]
fn only_an_acknowledgement_of_a_published_intent_wakes_the_node() {
    use faultline_common::document::DrainAck;
    use faultline_common::fault::DrainNotice;
    let mut p = pipeline();
    p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 1_000);
    let intent = DrainNotice {
        namespace: "ml".into(),
        pod: "p".into(),
        uid: "u-1".into(),
        pod_ips: vec![],
        devices: vec!["gpu0".into()],
        reasons: vec!["xid-79".into()],
        requested: rfc3339(1_000),
        evict_after: rfc3339(301_000),
        acknowledged: None,
    };
    assert!(p.set_drain("n1", vec![intent.clone()], 1_100));
    assert!(!p.set_drain("n1", vec![intent.clone()], 1_200), "unchanged");
    assert_eq!(p.node_faults("n1").unwrap().drain, vec![intent.clone()]);
    let with_acks = |acks: &[(&str, u64)], g: u64| {
        let mut d = doc("n1", vec![dev("gpu0", 40.0, None)]);
        d.generation = g;
        d.drain_acks = acks
            .iter()
            .map(|(uid, at)| DrainAck {
                uid: uid.to_string(),
                requested: rfc3339(*at),
                at: rfc3339(2_000),
            })
            .collect();
        d
    };
    let c = p.on_document(with_acks(&[("u-9", 1_000), ("u-1", 500)], 2), 2_000);
    assert!(
        c.drain_acked.is_empty(),
        "no such intent, or an earlier one"
    );
    let c = p.on_document(with_acks(&[("u-1", 1_000)], 3), 3_000);
    assert_eq!(c.drain_acked, ["n1"]);
    assert_eq!(p.drain_acks("n1"), [("u-1".to_string(), rfc3339(1_000))]);
    let c = p.on_document(with_acks(&[("u-1", 1_000)], 4), 4_000);
    assert!(c.drain_acked.is_empty(), "the same one again");
    // Another replica takes the shard over: the intents stay published.
    let mut q = pipeline();
    q.seed(&p.node_faults("n1").unwrap(), 5_000);
    assert_eq!(q.node_faults("n1").unwrap().drain, vec![intent]);
}
