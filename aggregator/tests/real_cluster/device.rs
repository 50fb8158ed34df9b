//! DRA per-device quarantine, answered by the real device-taint eviction controller.

use std::time::{Duration, Instant};

use faultline_controlplane::Release;

use crate::support::{self, real::RealCluster};
use crate::HEALING;

/// The rule faultline made for `device` of n1's pool, if any.
fn rule_for(c: &RealCluster, device: &str) -> Option<serde_json::Value> {
    c.rules()
        .into_iter()
        .find(|r| r["spec"]["deviceSelector"]["device"] == device)
}

/// Wait (60 s at most) until `device`'s rule has `effect`; the rule.
async fn until_effect(c: &RealCluster, device: &str, effect: &str) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let rule = rule_for(c, device);
        if let Some(r) = rule
            .as_ref()
            .filter(|r| r["spec"]["taint"]["effect"] == effect)
        {
            return r.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{device}'s DeviceTaintRule not at {effect} within 60 s: {rule:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A holder that tolerates the taint: its claim tolerates
/// faultline's taint with `NoExecute` for ever, so the real device-taint eviction
/// controller leaves it out of its prediction ("0 pods would be evicted"). Before the
/// fix faultline counted it in, the two never agreed, and the failed GPU stayed
/// allocatable at effect None for ever. Now faultline counts as the controller does:
/// the rule goes to NoSchedule and the tolerating pod is left running.
async fn a_tolerating_holder_does_not_keep_a_failed_gpu_in_service(release: Release) {
    let test = format!("a_tolerating_holder_does_not_keep_a_failed_gpu_in_service ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, 1).await else {
        return;
    };
    let gpus = c.publish_gpus("n1").await;
    let tolerates = serde_json::json!([
        {"key": "faultline.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}
    ]);
    let device = c.gpu_pod("tolerant", "n1", tolerates).await;
    let other = c.gpu_pod("plain", "n1", serde_json::json!([])).await;
    assert_ne!(device, other);
    let id = &gpus.iter().find(|(d, _)| *d == device).unwrap().1;
    let (_agg, url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let agent = c.agent_addr("n1");
    let fault = format!(r#"{{"device":"{id}","fault":"row-remap-failure"}}"#);
    assert_eq!(support::post(agent, "/v1/sim/faults", &fault).await, 201);
    let rule = until_effect(&c, &device, "NoSchedule").await;
    eprintln!(
        "{test}: {device} ({id}) at NoSchedule; the controller said: {}",
        rule["status"]["conditions"][0]["message"]
    );
    // Two more remediation passes: the eviction pass has run and left both pods.
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    support::grows(
        addr,
        &[("faultline_aggregator_remediation_passes_total", 2)],
    )
    .await;
    let pods = c.items(&["-n", "default", "pods"]);
    for name in ["tolerant", "plain"] {
        let p = pods.iter().find(|p| p["metadata"]["name"] == name);
        assert!(
            p.is_some_and(|p| p["metadata"]["deletionTimestamp"].is_null()),
            "{name} was evicted: {p:?}"
        );
    }
    c.assert_no_forbidden();
}

/// Pod churn: a rule of faultline's left at `None` by an earlier
/// replica, whose prediction (written once, when the rule was made) counts a pod that
/// has since gone. Before the fix the stale "1 pod would be evicted" never agreed with
/// faultline's count of 0, and the failed GPU stayed allocatable for ever. Now a
/// disagreement asks the controller again (a spec change, `timeAdded`), and the fresh
/// prediction agrees.
async fn a_stale_prediction_is_asked_again(release: Release) {
    let test = format!("a_stale_prediction_is_asked_again ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, 1).await else {
        return;
    };
    let gpus = c.publish_gpus("n1").await;
    let device = c.gpu_pod("gone", "n1", serde_json::json!([])).await;
    let id = &gpus.iter().find(|(d, _)| *d == device).unwrap().1;
    // The rule an earlier replica made, as faultline names and labels it.
    let dev = faultline_aggregator::device_taint::DeviceRef {
        driver: "gpu.nvidia.com".into(),
        pool: "n1".into(),
        device: device.clone(),
    };
    let version = match release {
        Release::V1_37 => "v1",
        Release::V1_36 => "v1beta2",
        Release::V1_35 => "v1alpha3",
    };
    c.apply(&serde_json::json!({
        "apiVersion": format!("resource.k8s.io/{version}"), "kind": "DeviceTaintRule",
        "metadata": {"name": faultline_aggregator::device_taint::rule_name(&dev),
                     "labels": {"app.kubernetes.io/managed-by": "faultline"}},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": device},
                 "taint": {"key": "faultline.io/unhealthy", "value": "row-remap-failure", "effect": "None"}},
    }));
    let start = Instant::now();
    loop {
        let msg = rule_for(&c, &device).and_then(|r| {
            r["status"]["conditions"][0]["message"]
                .as_str()
                .map(String::from)
        });
        if msg
            .as_deref()
            .is_some_and(|m| m.contains("1 pod would be evicted"))
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no prediction: {msg:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.cp.kubectl(&["-n", "default", "delete", "pod", "gone", "--wait=true"]);
    let (_agg, _url) = c.aggregator("faultline-aggregator-0", &HEALING).await;
    let fault = format!(r#"{{"device":"{id}","fault":"row-remap-failure"}}"#);
    assert_eq!(
        support::post(c.agent_addr("n1"), "/v1/sim/faults", &fault).await,
        201
    );
    let rule = until_effect(&c, &device, "NoSchedule").await;
    eprintln!(
        "{test}: {device} at NoSchedule, generation {}; the controller said: {}",
        rule["metadata"]["generation"], rule["status"]["conditions"][0]["message"]
    );
    c.assert_no_forbidden();
}

on_releases!(a_tolerating_holder_does_not_keep_a_failed_gpu_in_service:
    a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_37 = V1_37,
    a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_36 = V1_36,
    a_tolerating_holder_does_not_keep_a_failed_gpu_in_service_1_35 = V1_35,
);
on_releases!(a_stale_prediction_is_asked_again:
    a_stale_prediction_is_asked_again_1_37 = V1_37,
    a_stale_prediction_is_asked_again_1_36 = V1_36,
    a_stale_prediction_is_asked_again_1_35 = V1_35,
);
