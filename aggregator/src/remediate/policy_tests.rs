//! Table tests of the remediation decisions: no API server, no clock.

use super::*;
use crate::remediate::record::{Released, CANARY_LABEL};
use faultline_common::time::rfc3339_ms;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

const NOW: u64 = 1_800_000_000_000;

fn secs_ago(s: u64) -> String {
    rfc3339_ms(NOW - s * 1000)
}

fn pod(v: serde_json::Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

fn gpu_pod(extra: serde_json::Value) -> Pod {
    let mut p = json!({
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running"}
    });
    json_merge(&mut p, extra);
    pod(p)
}

fn json_merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                json_merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn holding(id: &str) -> serde_json::Value {
    json!({"status": {"containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
        "allocatedResourcesStatus": [{"name": "nvidia.com/gpu", "resources": [{"resourceID": id, "health": "Unhealthy"}]}]}]}})
}

fn failed_gpu3() -> Vec<RecordDevice> {
    vec![RecordDevice {
        uuid: Some("GPU-3".into()),
        pci_bus_id: Some("0000:3b:00.0".into()),
        ..RecordDevice::new("gpu3", "xid-79")
    }]
}

#[test]
fn which_pods_are_evicted() {
    let res = vec!["nvidia.com/gpu".to_string()];
    let cases: Vec<(&str, Pod, bool)> = vec![
        (
            "a running GPU pod the kubelet says nothing about",
            gpu_pod(json!({})),
            true,
        ),
        (
            "holds the failed device by UUID",
            gpu_pod(holding("GPU-3")),
            true,
        ),
        (
            "holds the failed device by id",
            gpu_pod(holding("gpu3")),
            true,
        ),
        (
            "holds the failed device by bus id",
            gpu_pod(holding("0000:3b:00.0")),
            true,
        ),
        ("holds a healthy device", gpu_pod(holding("GPU-9")), false),
        (
            "finished",
            gpu_pod(json!({"status": {"phase": "Succeeded"}})),
            false,
        ),
        (
            "failed",
            gpu_pod(json!({"status": {"phase": "Failed"}})),
            false,
        ),
        (
            "terminating",
            gpu_pod(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}})),
            false,
        ),
        (
            "a mirror pod",
            gpu_pod(json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}})),
            false,
        ),
        (
            "a DaemonSet's",
            gpu_pod(
                json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u"}]}}),
            ),
            false,
        ),
        (
            "faultline's canary",
            gpu_pod(json!({"metadata": {"labels": {CANARY_LABEL: "true"}}})),
            false,
        ),
        (
            "no accelerator",
            pod(
                json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Running"}}),
            ),
            false,
        ),
        (
            "an accelerator in an init container",
            pod(
                json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}],
            "initContainers": [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}, "status": {"phase": "Running"}}),
            ),
            true,
        ),
    ];
    for (what, p, want) in cases {
        assert_eq!(
            wants_eviction(&PodView::of(&p, &res), &failed_gpu3()),
            want,
            "{what}"
        );
    }
    assert!(
        !wants_eviction(
            &PodView::of(&gpu_pod(json!({})), &["huawei.com/Ascend910".into()]),
            &failed_gpu3()
        ),
        "another vendor's resource is not ours"
    );
}

/// A pod whose claim holds a failed device goes (unless it is one never
/// evicted); on a device quarantine only a pod known to hold a failed device goes.
#[test]
fn a_device_quarantine_evicts_only_the_known_holders() {
    let res = ["nvidia.com/gpu".to_string()];
    let dra = pod(
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Running"}}),
    );
    let unknown = gpu_pod(json!({}));
    let holds = |id: &str| {
        gpu_pod(
            json!({"status": {"phase": "Running", "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
            "allocatedResourcesStatus": [{"name": "nvidia.com/gpu", "resources": [{"resourceID": id, "health": "Healthy"}]}]}]}}),
        )
    };
    let daemon = pod(
        json!({"metadata": {"name": "p", "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u"}]},
        "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Running"}}),
    );
    let dra_with = |extra: serde_json::Value| {
        let mut p = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}, "status": {"phase": "Running"}});
        json_patch::merge(&mut p, &extra);
        pod(p)
    };
    let terminating = dra_with(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
    let finished = dra_with(json!({"status": {"phase": "Succeeded"}}));
    let mirror =
        dra_with(json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}}));
    let canary = dra_with(json!({"metadata": {"labels": {CANARY_LABEL: "true"}}}));
    let failed = failed_gpu3();
    let cases = [
        // (what, pod, its claim holds a failed device, device-scoped, evicted)
        ("a DRA holder, device scope", &dra, true, true, true),
        ("a DRA holder, node scope", &dra, true, false, true),
        ("a DRA pod holding nothing failed", &dra, false, true, false),
        ("a DRA pod on the node path", &dra, false, false, false),
        (
            "a GPU pod whose devices are unknown, device scope",
            &unknown,
            false,
            true,
            false,
        ),
        (
            "a GPU pod whose devices are unknown, node scope",
            &unknown,
            false,
            false,
            true,
        ),
        (
            "the kubelet says it holds gpu3",
            &holds("GPU-3"),
            false,
            true,
            true,
        ),
        (
            "the kubelet says it holds another",
            &holds("GPU-9"),
            false,
            true,
            false,
        ),
        ("a DaemonSet's, holding it", &daemon, true, true, false),
        ("terminating, holding it", &terminating, true, true, false),
        ("finished, holding it", &finished, true, true, false),
        ("a mirror pod, holding it", &mirror, true, true, false),
        ("faultline's canary, holding it", &canary, true, true, false),
    ];
    for (what, p, claim, scoped, want) in cases {
        assert_eq!(
            wants_device_eviction(&PodView::of(p, &res), &failed, claim, scoped),
            want,
            "{what}"
        );
    }
}

/// An Ascend pod holds its chips by the device plugin's names (`Ascend910-3`,
/// a virtual NPU `Ascend910-2c-100-3`), the agent names them by physical id (`npu3`).
#[test]
fn an_ascend_pod_is_evicted_only_for_the_chip_it_holds() {
    let pod = |id: &str| {
        let mut p = json!({"metadata": {"name": "p", "namespace": "d"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"huawei.com/Ascend910": "1"}}}]},
            "status": {"phase": "Running", "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
                "allocatedResourcesStatus": [{"name": "huawei.com/Ascend910", "resources": [{"resourceID": id, "health": "Unhealthy"}]}]}]}});
        serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(p.take()).unwrap()
    };
    let res = ["huawei.com/Ascend910".to_string()];
    let failed = [RecordDevice::new("npu3", "ascend-separate-npu")];
    for (held, want) in [
        ("Ascend910-3", true),
        ("Ascend910-2c-100-3", true),
        ("Ascend910-13", false),
        ("Ascend910-4", false),
    ] {
        assert_eq!(
            wants_eviction(&PodView::of(&pod(held), &res), &failed),
            want,
            "{held}"
        );
    }
    // Under Volcano the kubelet's id is an alias; the plugin's annotation names the
    // chips the pod really holds.
    let mut aliased = pod("Ascend910-3");
    aliased.metadata.annotations = Some(
        [(
            "huawei.com/AscendReal".to_string(),
            "Ascend910-5,Ascend910-6".to_string(),
        )]
        .into(),
    );
    assert!(!wants_eviction(&PodView::of(&aliased, &res), &failed));
    let on5 = [RecordDevice::new("npu5", "ascend-separate-npu")];
    assert!(wants_eviction(&PodView::of(&aliased, &res), &on5));
}

fn record(unknown_only: bool) -> QuarantineRecord {
    let mut r = QuarantineRecord::new("n1", failed_gpu3(), &secs_ago(3600), "r", secs_ago(0));
    r.unknown_only = unknown_only;
    r
}

fn view(id: &str, status: DeviceStatus, clean: u32, since_s: u64) -> DeviceView {
    DeviceView {
        device: RecordDevice {
            uuid: Some("GPU-3".into()),
            ..RecordDevice::new(id, "")
        },
        status,
        clean_streak: clean,
        since_ms: NOW - since_s * 1000,
    }
}

#[test]
fn when_a_record_may_be_released() {
    let auto = ReleasePolicy {
        auto: true,
        healthy_samples: 30,
        cooldown: Duration::from_secs(600),
        ..ReleasePolicy::default()
    };
    let manual = ReleasePolicy {
        auto: false,
        ..auto.clone()
    };
    let healthy = [view("gpu3", DeviceStatus::Healthy, 40, 700)];
    let waiting = |r: Readiness, has: &str| match r {
        Readiness::Waiting(why) => assert!(why.contains(has), "{why} lacks {has}"),
        other => panic!("{other:?}, wanted waiting on {has}"),
    };
    waiting(
        release_readiness(&record(false), &healthy, &manual, NOW),
        "manual release",
    );
    waiting(
        release_readiness(&record(false), &[], &auto, NOW),
        "not reported",
    );
    waiting(
        release_readiness(
            &record(false),
            &[view("gpu3", DeviceStatus::Failed, 40, 700)],
            &auto,
            NOW,
        ),
        "failed with 40",
    );
    waiting(
        release_readiness(
            &record(false),
            &[view("gpu3", DeviceStatus::Healthy, 29, 700)],
            &auto,
            NOW,
        ),
        "29 clean samples of 30",
    );
    waiting(
        release_readiness(
            &record(false),
            &[view("gpu3", DeviceStatus::Healthy, 40, 599)],
            &auto,
            NOW,
        ),
        "healthy for 599s of the 600s cool-down",
    );
    assert_eq!(
        release_readiness(&record(false), &healthy, &auto, NOW),
        Readiness::Ready("30 clean samples and 600s cool-down".into())
    );
    // Exactly the cool-down (and exactly the samples) is enough.
    assert!(matches!(
        release_readiness(
            &record(false),
            &[view("gpu3", DeviceStatus::Healthy, 30, 600)],
            &auto,
            NOW
        ),
        Readiness::Ready(_)
    ));
    // Found by UUID when the agent names it otherwise.
    assert!(matches!(
        release_readiness(
            &record(false),
            &[view("renamed", DeviceStatus::Healthy, 40, 700)],
            &auto,
            NOW
        ),
        Readiness::Ready(_)
    ));
    // An unknown-only guard lifts in manual mode too, with no cool-down.
    assert_eq!(
        release_readiness(
            &record(true),
            &[view("gpu3", DeviceStatus::Healthy, 30, 1)],
            &manual,
            NOW
        ),
        Readiness::Ready("devices seen healthy again".into())
    );
    waiting(
        release_readiness(
            &record(true),
            &[view("gpu3", DeviceStatus::Unknown, 0, 1)],
            &manual,
            NOW,
        ),
        "unknown",
    );
}

#[test]
fn budget_arithmetic() {
    let b = Budget {
        max_nodes: 3,
        max_percent: 10.0,
        per_domain: Some(("rack".into(), 1)),
        node_selector: String::new(),
        max_unknown: 2,
    };
    let q = |n: usize| -> Vec<Option<String>> { (0..n).map(|i| Some(format!("r{i}"))).collect() };
    // The first quarantine is always allowed, whatever the share.
    assert_eq!(b.refusal(Some("x"), &[], || 2), None);
    // The second: 2 of 30 is 6.7%, allowed; 2 of 10 is 20%, refused.
    assert_eq!(b.refusal(Some("x"), &q(1), || 30), None);
    // Exactly the budget is within it: 2 of 20 is 10%.
    assert_eq!(b.refusal(Some("x"), &q(1), || 20), None);
    let why = b.refusal(Some("x"), &q(1), || 10).unwrap();
    assert!(
        why.contains("2 of 10 nodes would be quarantined (20%)"),
        "{why}"
    );
    // The node count first: the total is not even asked.
    let why = b.refusal(Some("x"), &q(3), || panic!("not asked")).unwrap();
    assert_eq!(why, "3 nodes quarantined, budget 3");
    // One per rack.
    let why = b.refusal(Some("r0"), &q(1), || 100).unwrap();
    assert_eq!(why, "1 nodes of rack=r0 quarantined, budget 1");
    assert_eq!(
        b.refusal(None, &q(1), || 100),
        None,
        "no domain label: no domain budget"
    );
}

/// The ledger's count: the Nodes quarantined and the places not yet landed, each once;
/// a place whose taint never landed is dropped once it is `PLACE_TTL` old, never before.
#[test]
fn a_place_in_the_ledger_counts_until_it_lands_or_expires() {
    use std::collections::BTreeMap;
    let b = Budget {
        max_nodes: 2,
        max_percent: 100.0,
        per_domain: Some(("rack".into(), 2)),
        ..Budget::default()
    };
    let ttl = super::PLACE_TTL.as_secs();
    let place = |at: u64, rack: &str| super::Place {
        at: at.to_string(),
        by: "replica-0".into(),
        domain: Some(rack.into()),
    };
    // Ages are seconds since `at`, now being 1000.
    let age = |at: &str| at.parse::<u64>().ok().map(|t| 1000.0 - t as f64);
    let take = |ledger: &mut BTreeMap<String, super::Place>,
                quarantined: &BTreeMap<String, Option<String>>,
                node: &str,
                rack: &str| {
        super::take_place(
            &b,
            ledger,
            quarantined,
            (node, Some(rack)),
            place(1000, rack),
            age,
            || 100,
        )
    };
    let mut ledger = BTreeMap::new();
    let none = BTreeMap::new();
    // Two places taken, their taints not landed: a third is refused.
    assert_eq!(take(&mut ledger, &none, "a", "r0"), None);
    assert_eq!(take(&mut ledger, &none, "b", "r1"), None);
    let why = take(&mut ledger, &none, "c", "r2").unwrap();
    assert_eq!(why, "2 nodes quarantined, budget 2");
    assert_eq!(ledger.len(), 2, "a refusal takes no place");
    // A node that landed counts once, as a Node and as a place.
    let landed: BTreeMap<String, Option<String>> = [("a".to_string(), Some("r0".into()))].into();
    assert!(take(&mut ledger, &landed, "c", "r2").is_some());
    // Taking one's own place again is stamped anew, and counts the others only.
    ledger.insert("a".into(), place(1000 - ttl - 1, "r0"));
    assert_eq!(take(&mut ledger, &none, "a", "r0"), None);
    assert_eq!(ledger["a"].at, "1000");
    // A place not landed, just under the TTL old, still counts...
    ledger.insert("b".into(), place(1000 - ttl + 1, "r1"));
    assert!(take(&mut ledger, &none, "c", "r2").is_some());
    assert!(ledger.contains_key("b"));
    // ...and at the TTL it is dropped: its taint can no longer land.
    ledger.insert("b".into(), place(1000 - ttl, "r1"));
    assert_eq!(take(&mut ledger, &none, "c", "r2"), None);
    assert_eq!(ledger.keys().collect::<Vec<_>>(), ["a", "c"]);
    // An old place whose node is quarantined stays (and counts once).
    let mut ledger: BTreeMap<String, super::Place> = [("a".to_string(), place(0, "r0"))].into();
    assert_eq!(take(&mut ledger, &landed, "b", "r0"), None);
    assert!(ledger.contains_key("a"));
    // A landed node and a place: the budget of two is spent.
    let why = take(&mut ledger, &landed, "c", "r0").unwrap();
    assert!(why.contains("2 nodes quarantined"), "{why}");
    // A domain's count includes the places: the rack of two is full.
    let b1 = Budget {
        max_nodes: 5,
        ..b.clone()
    };
    let mut ledger: BTreeMap<String, super::Place> = [
        ("a".to_string(), place(1000, "r0")),
        ("b".to_string(), place(1000, "r0")),
    ]
    .into();
    let why = super::take_place(
        &b1,
        &mut ledger,
        &none,
        ("c", Some("r0")),
        place(1000, "r0"),
        age,
        || 100,
    )
    .unwrap();
    assert_eq!(why, "2 nodes of rack=r0 quarantined, budget 2");
}

fn run(state: CanaryState, started_s: u64, finished_s: Option<u64>) -> CanaryRun {
    CanaryRun {
        job: "faultline/c1".into(),
        started: secs_ago(started_s),
        state,
        finished: finished_s.map(secs_ago),
    }
}

fn job(succeeded: i32, failed: i32) -> JobView {
    JobView {
        succeeded: succeeded > 0,
        failed: failed > 0,
    }
}

#[test]
fn how_a_canary_stands() {
    let t = Duration::from_secs(600);
    let r = run(CanaryState::Running, 60, None);
    assert_eq!(
        canary_verdict(&r, Some(job(1, 0)), t, NOW),
        CanaryState::Succeeded
    );
    assert_eq!(
        canary_verdict(&r, Some(job(0, 1)), t, NOW),
        CanaryState::Failed
    );
    assert_eq!(
        canary_verdict(&r, None, t, NOW),
        CanaryState::Failed,
        "gone is failed"
    );
    assert_eq!(
        canary_verdict(&r, Some(job(0, 0)), t, NOW),
        CanaryState::Running
    );
    let late = run(CanaryState::Running, 601, None);
    assert_eq!(
        canary_verdict(&late, Some(job(0, 0)), t, NOW),
        CanaryState::Failed,
        "timed out"
    );
    assert_eq!(
        canary_verdict(&late, Some(job(1, 0)), t, NOW),
        CanaryState::Succeeded,
        "success wins"
    );
    assert_eq!(
        canary_verdict(
            &run(CanaryState::Running, 600, None),
            Some(job(0, 0)),
            t,
            NOW
        ),
        CanaryState::Running,
        "at the timeout exactly: not yet"
    );

    let cool = Duration::from_secs(600);
    let why =
        canary_retry_wait(Some(&run(CanaryState::Failed, 900, Some(300))), cool, NOW).unwrap();
    assert!(why.contains("failed 300s ago; cool-down 600s"), "{why}");
    assert_eq!(
        canary_retry_wait(Some(&run(CanaryState::Failed, 900, Some(601))), cool, NOW),
        None
    );
    assert_eq!(
        canary_retry_wait(Some(&run(CanaryState::Failed, 900, Some(600))), cool, NOW),
        None,
        "the cool-down over exactly"
    );
    assert_eq!(
        canary_retry_wait(Some(&run(CanaryState::Succeeded, 900, Some(1))), cool, NOW),
        None
    );
    assert_eq!(canary_retry_wait(None, cool, NOW), None);
}

#[test]
fn expiry_and_the_announcement_window() {
    let mut r = record(false);
    r.expiry = Some(secs_ago(1));
    assert!(expired(&r, NOW));
    r.expiry = Some(rfc3339_ms(NOW + 1000));
    assert!(!expired(&r, NOW));
    r.expiry = None;
    assert!(!expired(&r, NOW), "no expiry never expires");
    assert!(young(&record(false), NOW, 3601.0));
    assert!(!young(&record(false), NOW, 1800.0));
    assert!(!young(&record(false), NOW, 3600.0), "as old as the window");
}

#[test]
fn a_persons_release_holds_within_the_window() {
    let window = Duration::from_secs(900);
    let mut released = record(false);
    released.released = Some(Released {
        at: secs_ago(60),
        actor: "user:alice".into(),
        reason: "swapped".into(),
        manual: true,
    });
    let history = vec![released.clone()];
    let gpu3 = failed_gpu3();
    assert!(not_suppressed(&history, None, gpu3.clone(), window, NOW).is_empty());
    // Another reason is another fault.
    let other = vec![RecordDevice {
        reason: "xid-48".into(),
        ..gpu3[0].clone()
    }];
    assert_eq!(
        not_suppressed(&history, None, other.clone(), window, NOW),
        other
    );
    // Past the window, or released automatically: acted on again.
    let mut old = released.clone();
    old.released.as_mut().unwrap().at = secs_ago(901);
    assert_eq!(
        not_suppressed(&[old.clone()], None, gpu3.clone(), window, NOW),
        gpu3
    );
    old.released.as_mut().unwrap().at = secs_ago(900);
    assert_eq!(
        not_suppressed(&[old], None, gpu3.clone(), window, NOW),
        gpu3,
        "as old as the window exactly"
    );
    // The device released is matched by its name or by its UUID (its index may change).
    for (id, uuid) in [("gpu3", None), ("gpu1", Some("GPU-3"))] {
        let mut by = released.clone();
        by.devices = vec![RecordDevice {
            uuid: uuid.map(str::to_string),
            ..RecordDevice::new(id, "xid-79")
        }];
        assert!(
            not_suppressed(&[by], None, gpu3.clone(), window, NOW).is_empty(),
            "released as {id}, {uuid:?}"
        );
    }
    let mut auto = released.clone();
    auto.released.as_mut().unwrap().manual = false;
    assert_eq!(
        not_suppressed(&[auto], None, gpu3.clone(), window, NOW),
        gpu3
    );
    // Released from the current record on its own.
    let mut current = record(false);
    current.released_devices.insert("gpu3".into(), secs_ago(10));
    assert!(not_suppressed(&[], Some(&current), gpu3.clone(), window, NOW).is_empty());
    current
        .released_devices
        .insert("gpu3".into(), secs_ago(1000));
    assert_eq!(
        not_suppressed(&[], Some(&current), gpu3.clone(), window, NOW),
        gpu3
    );
}

#[test]
fn the_eviction_deadline() {
    let d = Duration::from_secs(600);
    assert_eq!(blocked(Duration::from_secs(599), d, true), Blocked::Retry);
    assert_eq!(blocked(Duration::from_secs(600), d, false), Blocked::GiveUp);
    assert_eq!(blocked(Duration::from_secs(600), d, true), Blocked::Delete);
}

/// The guards' two small decisions: an open breaker stops isolation and eviction, never
/// a release; an unknown-only quarantine never evicts.
#[test]
fn what_the_breaker_stops_and_what_evicts() {
    assert!(breaker_stops(Step::Isolate));
    assert!(breaker_stops(Step::Evict));
    assert!(!breaker_stops(Step::Release));
    assert!(record_evicts(false));
    assert!(!record_evicts(true));
}

/// The breaker's shared count: a node counted once within the window, the window
/// inclusive, the threshold trips it, an open breaker counts nothing, and a count left
/// full by a person's close starts afresh.
#[test]
fn the_breaker_count() {
    use std::collections::BTreeMap;
    let now = rfc3339_ms(NOW);
    let age =
        |at: &str| faultline_common::time::parse_rfc3339_ms(at).map(|t| (NOW - t) as f64 / 1000.0);
    let keys = |f: &BTreeMap<String, String>| f.keys().cloned().collect::<Vec<_>>();
    let mut f: BTreeMap<String, String> = BTreeMap::new();
    let note = |f: &mut BTreeMap<String, String>, open: bool, node: &str| {
        note_failure(open, f, node, &now, age, 4, 600.0)
    };
    assert_eq!(note(&mut f, true, "a"), Noted::Open);
    assert!(f.is_empty());
    assert_eq!(note(&mut f, false, "a"), Noted::Counted);
    assert_eq!(note(&mut f, false, "a"), Noted::Unchanged);
    // Counted 600 s ago (the window exactly) still counts; 601 s ago does not.
    f.insert("old".into(), secs_ago(600));
    f.insert("older".into(), secs_ago(601));
    assert_eq!(note(&mut f, false, "b"), Noted::Counted);
    assert_eq!(keys(&f), ["a", "b", "old"]);
    assert_eq!(note(&mut f, false, "c"), Noted::Tripped);
    // Closed by a person with the count full: it starts afresh.
    assert_eq!(note(&mut f, false, "d"), Noted::Counted);
    assert_eq!(keys(&f), ["d"]);
}
