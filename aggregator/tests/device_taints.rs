//! Issue 28, point 1: the aggregator finds the newest `resource.k8s.io` version that
//! serves DeviceTaintRule, at each release the test API server plays, through the real
//! `kube` client; and finds none where none is served.

use faultline_aggregator::quarantine::discover;
use faultline_test_apiserver::{Bootstrap, Release};

#[tokio::test]
async fn the_taint_api_is_the_newest_the_cluster_serves() {
    let r = |s: &str| Release::parse(s).unwrap();
    let cases = [
        (r("1.34"), None),
        (r("1.35"), None),
        (r("1.35").with_device_taint_rules(true), Some("v1alpha3")),
        (r("1.36"), None),
        (r("1.36").with_device_taint_rules(true), Some("v1beta2")),
        (r("1.37"), Some("v1")),
        (r("1.37").with_device_taint_rules(false), None),
    ];
    for (release, want) in cases {
        let (_server, url) = Bootstrap::new().release(release).spawn().await;
        let client = faultline_aggregator::connect(Some(&url), None, None)
            .await
            .unwrap();
        let got = discover(&client).await.unwrap();
        assert_eq!(
            got.as_ref().map(|t| t.version.as_str()),
            want,
            "{release:?}"
        );
        if let Some(t) = got {
            assert_eq!(t.api_version(), format!("resource.k8s.io/{}", t.version));
        }
    }
}

#[tokio::test]
async fn an_unreachable_api_is_an_error_not_none() {
    // Nothing listens here: "none served" must never be concluded from a failed call.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let client = faultline_aggregator::connect(Some(&url), None, None)
        .await
        .unwrap();
    assert!(discover(&client).await.is_err());
}

mod quarantine {
    use faultline_aggregator::quarantine::{
        discover, rule_name, Dra, Effect, Prediction, QuarantineError,
    };
    use faultline_test_apiserver::{fixtures, ApiServer, Bootstrap, Release};
    use serde_json::json;

    /// A 1.37 cluster with node n1 (8 GPUs under NVIDIA's DRA driver), one training pod
    /// per GPU holding it through its claim.
    async fn cluster() -> (ApiServer, Dra) {
        let (server, url) = Bootstrap::new()
            .release(Release::parse("1.37").unwrap())
            .namespace("train")
            .object("resourceslices", "", fixtures::nvidia_slice("n1", 8))
            .spawn()
            .await;
        for i in 0..8 {
            let p = server
                .create("pods", "train", fixtures::dra_pod(&format!("p{i}"), "n1"))
                .unwrap();
            server
                .create(
                    "resourceclaims",
                    "train",
                    fixtures::claim_for(&p, &format!("gpu-{i}"), json!([])),
                )
                .unwrap();
        }
        let client = faultline_aggregator::connect(Some(&url), None, None)
            .await
            .unwrap();
        let api = discover(&client)
            .await
            .unwrap()
            .expect("1.37 serves DeviceTaintRule");
        (server, Dra::new(client, api, vec!["gpu.nvidia.com".into()]))
    }

    #[tokio::test]
    async fn one_gpu_is_quarantined_once_the_controller_agrees_and_released() {
        let (server, dra) = cluster().await;
        let ix = dra.index().await.unwrap();
        assert_eq!(ix.len(), 8);
        let dev = ix
            .by_uuid(&fixtures::gpu_uuid("n1", 3))
            .unwrap()
            .device
            .clone();
        assert_eq!(dev.device, "gpu-3");
        let holders = dra.holders(&dev).await.unwrap();
        assert_eq!(
            holders.iter().map(|h| h.pod.as_str()).collect::<Vec<_>>(),
            ["p3"]
        );
        let uuid = fixtures::gpu_uuid("n1", 3);
        let rule = dra.propose(&dev, &uuid, "Xid 79", 7, 2).await.unwrap();
        assert_eq!(rule["spec"]["taint"]["effect"], "None");
        assert_eq!(
            rule["metadata"]["annotations"]["faultline.io/sequence"],
            "7"
        );
        // Proposing again keeps the one rule.
        dra.propose(&dev, &uuid, "Xid 79", 8, 2).await.unwrap();
        assert_eq!(server.list("devicetaintrules", "").len(), 1);
        // None takes nothing out of the scheduler's hands.
        assert_eq!(server.allocatable_devices("n1"), 8);
        // The controller's prediction, polled until it reports for this generation.
        let mut p = Prediction::Pending;
        for _ in 0..500 {
            p = dra.prediction(&dev, &holders).await.unwrap();
            if p != Prediction::Pending {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(p, Prediction::Agrees(1));
        let enforced = dra.enforce(&dev, Effect::NoSchedule).await.unwrap();
        assert_eq!(enforced["spec"]["taint"]["effect"], "NoSchedule");
        // 7 of 8 GPUs stay schedulable; NoSchedule deletes nobody.
        assert_eq!(server.allocatable_devices("n1"), 7);
        assert!(
            server.get("pods", "train", "p3").unwrap()["metadata"]["deletionTimestamp"].is_null()
        );
        assert!(dra.release(&dev).await.unwrap());
        assert_eq!(server.allocatable_devices("n1"), 8);
        assert!(!dra.release(&dev).await.unwrap(), "nothing left to release");
    }

    #[tokio::test]
    async fn a_rule_made_by_someone_else_is_never_touched() {
        let (server, dra) = cluster().await;
        let ix = dra.index().await.unwrap();
        let dev = ix
            .by_uuid(&fixtures::gpu_uuid("n1", 5))
            .unwrap()
            .device
            .clone();
        // Another tool's rule, under the very name faultline would use.
        server
            .create("devicetaintrules", "", json!({"metadata": {"name": rule_name(&dev), "labels": {"app.kubernetes.io/managed-by": "nvsentinel"}},
                "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-5"},
                         "taint": {"key": "nvsentinel.io/quarantine", "effect": "NoSchedule"}}}))
            .unwrap();
        let before = server
            .get("devicetaintrules", "", &rule_name(&dev))
            .unwrap();
        let uuid = fixtures::gpu_uuid("n1", 5);
        assert!(matches!(
            dra.propose(&dev, &uuid, "Xid 79", 1, 0).await,
            Err(QuarantineError::NotOurs(_))
        ));
        assert!(matches!(
            dra.enforce(&dev, Effect::NoExecute).await,
            Err(QuarantineError::NotOurs(_))
        ));
        assert!(matches!(
            dra.release(&dev).await,
            Err(QuarantineError::NotOurs(_))
        ));
        let after = server
            .get("devicetaintrules", "", &rule_name(&dev))
            .unwrap();
        // Its spec, labels and generation as they were (its status is the eviction
        // controller's to write, and it does).
        assert_eq!(after["spec"], before["spec"]);
        assert_eq!(after["metadata"]["labels"], before["metadata"]["labels"]);
        assert_eq!(
            after["metadata"]["generation"],
            before["metadata"]["generation"]
        );
        // No write reached the rule: only reads.
        let writes = server
            .calls()
            .iter()
            .filter(|c| c.uri.contains("/devicetaintrules") && c.method != "GET")
            .count();
        assert_eq!(writes, 0);
    }
}

mod support;

mod wiring {
    use std::time::Duration;

    use faultline_test_apiserver::Release;

    use super::support::*;

    /// The aggregator looks for the API at start and shows what it found.
    #[tokio::test]
    async fn the_aggregator_shows_where_device_taints_are_served() {
        for (release, version) in [("1.37", "v1"), ("1.34", "none")] {
            let w = Scenario::ready_nodes(&["n1"]).start().await;
            w.server.set_release(Release::parse(release).unwrap());
            let agg = w.configmap("r1", 1).start().await;
            let needle =
                format!("faultline_aggregator_device_taint_api{{version=\"{version}\"}} 1");
            let text = metric_until(agg.addr, &needle, Duration::from_secs(10)).await;
            assert_eq!(
                text.matches("faultline_aggregator_device_taint_api{")
                    .count(),
                1,
                "{release}"
            );
            assert_no_forbidden(&w.server);
            agg.cancel_token().cancel();
        }
    }
}
