//! Isolation against the Kubernetes API test server: one taint however often it runs,
//! others' taints kept, a record readable on the Node, a condition and one Event;
//! dry-run changes nothing; a refused write is an error, not a half-done job.

use faultline_aggregator::remediate::{
    Mode, Outcome, RecordDevice, Remediator, CONDITION, DEVICES_LABEL, RECORD_ANNOTATION,
};
use faultline_test_apiserver::{ApiServer, Faults};
use serde_json::{json, Value};

async fn setup() -> (ApiServer, kube::Client) {
    let server = ApiServer::new();
    server
        .create(
            "nodes",
            "",
            json!({"metadata": {"name": "gpu-1", "labels": {"team": "a"}},
                   "spec": {"taints": [{"key": "other.example/maintenance", "value": "x", "effect": "NoSchedule"}]}}),
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(faultline_test_apiserver::serve(
        listener,
        server.clone(),
        tokio_util::sync::CancellationToken::new(),
    ));
    let mut kc = kube::Config::new(url.parse().unwrap());
    kc.default_retry = false;
    (server, kube::Client::try_from(kc).unwrap())
}

fn failed(id: &str) -> Vec<RecordDevice> {
    vec![RecordDevice {
        id: id.into(),
        uuid: Some("GPU-1234".into()),
        pci_bus_id: Some("0000:3b:00.0".into()),
        reason: "xid-79".into(),
    }]
}

fn events(server: &ApiServer, reason: &str) -> usize {
    server
        .list("events", "default")
        .iter()
        .filter(|e| e["reason"] == reason)
        .count()
}

#[tokio::test]
async fn isolation_is_idempotent_and_keeps_other_taints() {
    let (server, client) = setup().await;
    let r = Remediator::new(
        client,
        Mode::Enforce,
        "nvidia.com/gpu-fault",
        "default",
        "replica-0",
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3")).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3")).await.unwrap(),
        Outcome::AlreadyDone
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3")).await.unwrap(),
        Outcome::AlreadyDone
    );

    let node: Value = server.get("nodes", "", "gpu-1").unwrap();
    let taints = node["spec"]["taints"].as_array().unwrap();
    let ours: Vec<&Value> = taints
        .iter()
        .filter(|t| t["key"] == "nvidia.com/gpu-fault")
        .collect();
    assert_eq!(ours.len(), 1, "exactly one taint: {taints:?}");
    assert_eq!(ours[0]["effect"], "NoSchedule");
    assert!(
        taints
            .iter()
            .any(|t| t["key"] == "other.example/maintenance"),
        "someone else's taint kept"
    );
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3");
    assert_eq!(node["metadata"]["labels"]["team"], "a");
    let record: Value = serde_json::from_str(
        node["metadata"]["annotations"][RECORD_ANNOTATION]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["owned_taint"], "nvidia.com/gpu-fault");
    assert_eq!(record["devices"][0]["uuid"], "GPU-1234");
    assert_eq!(record["actor"], "replica-0");
    assert_eq!(
        record["actions"].as_array().unwrap().len(),
        2,
        "taint and label, once each"
    );
    let cond = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == CONDITION)
        .cloned()
        .unwrap();
    assert_eq!(cond["status"], "False");
    assert_eq!(events(&server, "FaultlineQuarantined"), 1);

    // A second device fails: the record grows, still one taint, one more Event.
    let mut two = failed("gpu3");
    two.extend(failed("gpu5"));
    assert_eq!(r.isolate("gpu-1", two).await.unwrap(), Outcome::Isolated);
    let node: Value = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(
        node["spec"]["taints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["key"] == "nvidia.com/gpu-fault")
            .count(),
        1
    );
    assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3.gpu5");
    assert_eq!(events(&server, "FaultlineQuarantined"), 2);
}

#[tokio::test]
async fn dry_run_announces_and_changes_nothing() {
    let (server, client) = setup().await;
    let before = server.get("nodes", "", "gpu-1").unwrap();
    let r = Remediator::new(
        client,
        Mode::DryRun,
        "nvidia.com/gpu-fault",
        "default",
        "replica-0",
    );
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3")).await.unwrap(),
        Outcome::Announced
    );
    assert_eq!(server.get("nodes", "", "gpu-1").unwrap(), before);
    assert_eq!(events(&server, "FaultlineWouldQuarantine"), 1);
}

#[tokio::test]
async fn a_refused_write_changes_nothing_and_the_next_pass_completes() {
    let (server, client) = setup().await;
    let r = Remediator::new(
        client,
        Mode::Enforce,
        "nvidia.com/gpu-fault",
        "default",
        "replica-0",
    );
    server.set_faults(Faults {
        conflict_rate: 1.0,
        ..Default::default()
    });
    assert!(r.isolate("gpu-1", failed("gpu3")).await.is_err());
    let node = server.get("nodes", "", "gpu-1").unwrap();
    assert_eq!(
        node["spec"]["taints"].as_array().unwrap().len(),
        1,
        "nothing half done"
    );
    assert!(node["metadata"]["annotations"].is_null());
    server.set_faults(Faults::default());
    assert_eq!(
        r.isolate("gpu-1", failed("gpu3")).await.unwrap(),
        Outcome::Isolated
    );
    assert_eq!(events(&server, "FaultlineQuarantined"), 1);
}
