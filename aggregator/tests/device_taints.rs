//! The aggregator finds the newest `resource.k8s.io` version that
//! serves DeviceTaintRule, at each release the test API server plays, through the real
//! `kube` client; and finds none where none is served.

use faultline_aggregator::device_taint::discover;
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
    use faultline_aggregator::device_taint::{
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

    use faultline_test_apiserver::{fixtures, Release};
    use serde_json::json;

    use super::support::*;

    /// The whole path: an agent's GPU fails; the aggregator (deploy RBAC) quarantines
    /// that GPU alone by its rule, evicts only its pod, leaves the node untainted and
    /// marks the device in `fault.json` and the metrics.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_gpu_is_quarantined_alone_end_to_end() {
        let w = Scenario::ready_nodes(&["n1"]).start().await;
        w.server.set_release(Release::parse("1.37").unwrap());
        // The agent's GPUs, published by NVIDIA's DRA driver under their UUIDs; one
        // pod per GPU holding it through its claim.
        // Once the agent has sampled its GPUs (its first sample follows its start).
        let url = format!("http://{}/v1/health", w.agent("n1").addr);
        let mut uuids: Vec<String> = Vec::new();
        for _ in 0..1000 {
            let (_, health) = call("GET", &url, None, String::new()).await;
            uuids = health["npus"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|d| d["uuid"].as_str().map(String::from))
                .collect();
            if uuids.len() == 4 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(uuids.len(), 4, "the agent's 4 GPUs");
        let mut slice = fixtures::nvidia_slice("n1", uuids.len());
        for (i, u) in uuids.iter().enumerate() {
            slice["spec"]["devices"][i]["attributes"]["uuid"] = json!({"string": u});
        }
        w.server.create("resourceslices", "", slice).unwrap();
        for i in 0..uuids.len() {
            let p = w
                .server
                .create("pods", "default", fixtures::dra_pod(&format!("p{i}"), "n1"))
                .unwrap();
            w.server
                .create(
                    "resourceclaims",
                    "default",
                    fixtures::claim_for(&p, &format!("gpu-{i}"), json!([])),
                )
                .unwrap();
        }
        let agg = w.healing("r1").start().await;
        metric_until(
            agg.addr,
            "faultline_aggregator_lease_held{shard=\"0\"} 1",
            Duration::from_secs(10),
        )
        .await;
        fail(w.agent("n1"), "gpu1").await;
        let (rule, _) = until(Duration::from_secs(20), "gpu-1's rule enforced", || {
            w.server
                .list("devicetaintrules", "")
                .into_iter()
                .find(|r| r["spec"]["taint"]["effect"] == "NoSchedule")
        })
        .await;
        assert_eq!(rule["spec"]["deviceSelector"]["device"], "gpu-1");
        assert!(
            rule["metadata"]["annotations"]["faultline.io/sequence"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                > 0
        );
        until(Duration::from_secs(20), "p1 evicted", || {
            w.server
                .get("pods", "default", "p1")
                .is_none()
                .then_some(())
        })
        .await;
        let (entry, _) = until(Duration::from_secs(20), "gpu1 marked in fault.json", || {
            node_entry(&w.server, 1, "n1").filter(|e| {
                e.npus
                    .iter()
                    .any(|d| d.id == "gpu1" && d.quarantine.is_some())
            })
        })
        .await;
        let mark = entry
            .npus
            .iter()
            .find(|d| d.id == "gpu1")
            .unwrap()
            .quarantine
            .clone()
            .unwrap();
        assert_eq!(mark.by, "device-taint-rule");
        assert_eq!(mark.rule.as_deref(), rule["metadata"]["name"].as_str());
        assert!(entry
            .npus
            .iter()
            .filter(|d| d.id != "gpu1")
            .all(|d| d.quarantine.is_none()));
        metric_until(
            agg.addr,
            "faultline_aggregator_devices_isolated{node=\"n1\",driver=\"gpu.nvidia.com\",by=\"device-taint-rule\"} 1",
            Duration::from_secs(20),
        )
        .await;
        // The node stays schedulable; its other pods stay.
        assert_eq!(our_taints(&w.server, "n1"), 0);
        assert_eq!(w.server.allocatable_devices("n1"), uuids.len() - 1);
        for i in (0..uuids.len()).filter(|i| *i != 1) {
            assert!(
                w.server.get("pods", "default", &format!("p{i}")).is_some(),
                "p{i}"
            );
        }
        assert!(evicted_once(&w.server, "p1"));
        assert_eq!(events(&w.server, "FaultlineDeviceQuarantined"), 1);
        assert_no_forbidden(&w.server);
        agg.cancel_token().cancel();
    }

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

/// Through the remediation passes: the device path, the node path
/// where the fault is the node's, the device plugin's fallback, releases.
mod passes {
    use std::sync::Arc;

    use faultline_aggregator::device_taint::{
        discover, rule_name, Backend, DeviceQuarantine, DeviceRef,
    };
    use faultline_aggregator::model::RecordDevice;
    use faultline_aggregator::remediate::{
        record_of, DeviceIsolation, Mode, Outcome, ReleaseRequest, Remediator, DEVICES_LABEL,
    };
    use faultline_aggregator::shard::Fence;
    use faultline_common::rules::Rules;
    use faultline_test_apiserver::{fixtures, ApiServer, Bootstrap, Release};
    use serde_json::{json, Value};

    const TAINT: &str = "nvidia.com/gpu-fault";

    /// A cluster at `release` with node n1 (8 GPUs published by NVIDIA's DRA driver,
    /// allocatable as the device plugin would report `allocatable` of 8), one training
    /// pod per GPU holding it through its claim (p5's claim tolerating faultline's
    /// taint: the controller leaves it, and says so in its prediction).
    async fn cluster(
        release: Release,
        allocatable: u32,
        tolerant: bool,
    ) -> (ApiServer, Remediator) {
        cluster_in(Mode::Enforce, release, allocatable, tolerant).await
    }

    /// [`cluster`] with the remediator in `mode`.
    async fn cluster_in(
        mode: Mode,
        release: Release,
        allocatable: u32,
        tolerant: bool,
    ) -> (ApiServer, Remediator) {
        cluster_as(mode, release, allocatable, tolerant, |m| m).await
    }

    /// [`cluster_in`], the RBAC manifest passed through `rbac` first.
    async fn cluster_as(
        mode: Mode,
        release: Release,
        allocatable: u32,
        tolerant: bool,
        rbac: impl Fn(String) -> String,
    ) -> (ApiServer, Remediator) {
        let faults = faultline_test_apiserver::Faults::default();
        cluster_with(mode, release, (allocatable, tolerant), rbac, faults, |_| {}).await
    }

    /// [`cluster_as`] with `faults` injected and the device path's settings passed
    /// through `settings`.
    async fn cluster_with(
        mode: Mode,
        release: Release,
        (allocatable, tolerant): (u32, bool),
        rbac: impl Fn(String) -> String,
        faults: faultline_test_apiserver::Faults,
        settings: impl Fn(&mut DeviceQuarantine),
    ) -> (ApiServer, Remediator) {
        let mut node = fixtures::realistic_node("n1", "10.0.0.1");
        node["status"]["allocatable"]["nvidia.com/gpu"] = json!(allocatable.to_string());
        // Under the aggregator's RBAC of deploy/base/aggregator.yaml, enforced.
        let manifest = rbac(
            std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../deploy/base/aggregator.yaml"),
            )
            .unwrap(),
        );
        let (server, url) = Bootstrap::new()
            .release(release)
            .namespace("train")
            .namespace(super::support::NS)
            .manifests(manifest)
            .rbac(&super::support::USERS)
            .faults(faults)
            .object("nodes", "", node)
            .object("resourceslices", "", fixtures::nvidia_slice("n1", 8))
            .spawn()
            .await;
        for i in 0..8 {
            let p = server
                .create("pods", "train", fixtures::dra_pod(&format!("p{i}"), "n1"))
                .unwrap();
            let tol = if tolerant && i == 5 {
                json!([{"key": "faultline.io/unhealthy", "operator": "Exists", "effect": "NoExecute"}])
            } else {
                json!([])
            };
            server
                .create(
                    "resourceclaims",
                    "train",
                    fixtures::claim_for(&p, &format!("gpu-{i}"), tol),
                )
                .unwrap();
        }
        let client = super::support::kube_client(&url);
        let rules = tokio::sync::watch::channel(Arc::new(Rules::default())).1;
        let mut q = DeviceQuarantine::new(rules);
        *q.api.lock().unwrap() = discover(&client).await.unwrap();
        settings(&mut q);
        let r = Remediator::new(client, mode, TAINT, "default", "replica-0").with_devices(Some(q));
        (server, r)
    }

    /// [`cluster_with`] on 1.37, enforcing, every GPU allocatable, the RBAC as shipped.
    async fn enforcing(
        faults: faultline_test_apiserver::Faults,
        settings: impl Fn(&mut DeviceQuarantine),
    ) -> (ApiServer, Remediator) {
        let release = Release::parse("1.37").unwrap();
        cluster_with(Mode::Enforce, release, (8, false), |m| m, faults, settings).await
    }

    /// The rules file with `node_after_devices` at `n`: a node holds up to `n - 1`
    /// devices quarantined alone.
    fn node_after(q: &mut DeviceQuarantine, n: u32) {
        let rules = Rules {
            node_after_devices: n,
            ..Default::default()
        };
        q.rules = tokio::sync::watch::channel(Arc::new(rules)).1;
    }

    fn gpu(i: usize, reason: &str) -> RecordDevice {
        RecordDevice {
            uuid: Some(fixtures::gpu_uuid("n1", i)),
            ..RecordDevice::new(format!("gpu{i}"), reason)
        }
    }

    fn node_taints(server: &ApiServer) -> Vec<Value> {
        server.get("nodes", "", "n1").unwrap()["spec"]["taints"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t["key"] == TAINT)
            .collect()
    }

    /// gpu-3 fails: isolated by a rule of its own at NoSchedule.
    async fn gpu_3_quarantined_alone(server: &ApiServer, r: &Remediator) {
        let out = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        let rule = rule_of(server, 3).expect("gpu-3's rule");
        assert_eq!(rule["spec"]["taint"]["effect"], "NoSchedule");
        assert_eq!(
            rule["spec"]["taint"]["value"], "row-remap-failure",
            "its reason"
        );
    }

    /// A rule the API server could not write (a 500, not a 422 that refuses it) fails
    /// the pass for the next to try again: the node is not tainted for it.
    #[tokio::test]
    async fn a_rule_that_could_not_be_written_is_tried_again_not_the_node_tainted() {
        let faults = faultline_test_apiserver::Faults {
            write_error_rate: 1.0,
            write_error_match: "devicetaintrules".into(),
            ..Default::default()
        };
        let (server, r) = enforcing(faults, |_| {}).await;
        let out = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await;
        assert!(
            matches!(
                out,
                Err(faultline_aggregator::remediate::RemediateError::Api(_))
            ),
            "{out:?}"
        );
        assert!(node_taints(&server).is_empty());
        server.set_faults(Default::default());
        gpu_3_quarantined_alone(&server, &r).await;
    }

    fn rule_of(server: &ApiServer, i: usize) -> Option<Value> {
        let d = DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: format!("gpu-{i}"),
        };
        server.get("devicetaintrules", "", &rule_name(&d))
    }

    fn alive(server: &ApiServer) -> Vec<String> {
        (0..8)
            .map(|i| format!("p{i}"))
            .filter(|p| {
                server
                    .get("pods", "train", p)
                    .is_some_and(|o| o["metadata"]["deletionTimestamp"].is_null())
            })
            .collect()
    }

    /// One GPU of eight fails: its own rule (NoSchedule after the controller agreed),
    /// no node taint, 7 of 8 still allocatable, only its pod evicted (Eviction API);
    /// a release deletes the rule and the node's label.
    #[tokio::test]
    async fn one_gpu_of_eight_is_quarantined_alone_and_released() {
        for release in [
            Release::parse("1.37").unwrap(),
            Release::parse("1.36")
                .unwrap()
                .with_device_taint_rules(true),
        ] {
            let (server, r) = cluster(release, 8, false).await;
            let f = Fence::unfenced();
            let out = r
                .isolate("n1", vec![gpu(3, "row-remap-failure")], &f)
                .await
                .unwrap();
            assert_eq!(out, Outcome::Isolated);
            let rule = rule_of(&server, 3).expect("gpu-3's rule");
            assert_eq!(rule["spec"]["taint"]["effect"], "NoSchedule");
            assert_eq!(rule["spec"]["deviceSelector"]["device"], "gpu-3");
            // The prediction was waited for on a watch of the one rule, not polled: two
            // reads before proposing (the scope, the proposal) and one to enforce, none
            // while waiting (a GET every 10 ms before).
            let name = rule["metadata"]["name"].as_str().unwrap().to_string();
            let calls = server.calls();
            let reads = calls
                .iter()
                .filter(|c| {
                    c.method == "GET"
                        && c.uri
                            .split('?')
                            .next()
                            .unwrap()
                            .ends_with(&format!("/devicetaintrules/{name}"))
                })
                .count();
            let watches = calls
                .iter()
                .filter(|c| c.uri.contains("/devicetaintrules?") && c.uri.contains("watch=true"))
                .count();
            let trail: Vec<String> = calls
                .iter()
                .filter(|c| c.uri.contains("devicetaintrules"))
                .map(|c| format!("{} {} {}", c.method, c.uri, c.status))
                .collect();
            assert_eq!(
                (reads, watches),
                (3, 1),
                "{release:?}: rule reads and watches: {trail:#?}"
            );
            assert!(node_taints(&server).is_empty(), "no node taint");
            assert_eq!(server.allocatable_devices("n1"), 7);
            let node = server.get("nodes", "", "n1").unwrap();
            assert_eq!(node["metadata"]["labels"][DEVICES_LABEL], "gpu3");
            let n: k8s_openapi::api::core::v1::Node = serde_json::from_value(node).unwrap();
            let rec = record_of(&n).unwrap().unwrap();
            assert!(
                matches!(&rec.isolation, Some(DeviceIsolation::DeviceTaintRule { rules }) if rules.len() == 1 && rules[0].effect == "NoSchedule"),
                "{:?}",
                rec.isolation
            );
            // Again: nothing more.
            let again = r
                .isolate("n1", vec![gpu(3, "row-remap-failure")], &f)
                .await
                .unwrap();
            assert_eq!(again, Outcome::AlreadyDone);
            let e = r.evict("n1", &[], &f).await.unwrap();
            assert_eq!(e.evicted.len(), 1, "{e:?}");
            assert!(e.evicted[0].starts_with("train/p3/"), "{e:?}");
            assert_eq!(alive(&server).len(), 7);
            let evictions: usize = (0..8)
                .map(|i| super::support::eviction_calls(&server, &format!("p{i}"), 201))
                .sum();
            assert_eq!(evictions, 1, "through the Eviction API, once");
            assert!(super::support::evicted_once(&server, "p3"));

            let req = ReleaseRequest {
                devices: vec![],
                actor: "user:sre".into(),
                reason: "replaced".into(),
            };
            assert_eq!(r.release("n1", req, &f).await.unwrap(), Outcome::Released);
            assert!(
                rule_of(&server, 3).is_none(),
                "the rule goes with the release"
            );
            assert_eq!(server.allocatable_devices("n1"), 8);
            // Its driver does not taint it: nothing to warn of.
            let still = super::support::events(&server, "FaultlineDeviceStillTainted");
            assert_eq!(still, 0);
            let node = server.get("nodes", "", "n1").unwrap();
            assert!(node["metadata"]["labels"][DEVICES_LABEL].is_null());
            super::support::assert_no_forbidden(&server);
        }
    }

    /// Dry run: nothing is written (no rule, no taint, no record); what would be done
    /// is announced: the device's rule, and the eviction of the one pod holding it.
    #[tokio::test]
    async fn a_dry_run_announces_the_device_and_its_holder_and_writes_nothing() {
        let (server, r) = cluster_in(Mode::DryRun, Release::parse("1.37").unwrap(), 8, false).await;
        let f = Fence::unfenced();
        let bad = vec![gpu(2, "row-remap-failure")];
        assert_eq!(
            r.isolate("n1", bad.clone(), &f).await.unwrap(),
            Outcome::Announced
        );
        assert_eq!(r.would_evict("n1", &bad).await.unwrap(), 1);
        assert!(server.list("devicetaintrules", "").is_empty());
        assert!(node_taints(&server).is_empty());
        let node = server.get("nodes", "", "n1").unwrap();
        assert!(node["metadata"]["annotations"]["faultline.io/quarantine"].is_null());
        assert_eq!(
            super::support::events(&server, "FaultlineWouldQuarantineDevice"),
            1
        );
        let would: Vec<String> = server
            .list("events", "default")
            .iter()
            .filter(|e| e["reason"] == "FaultlineWouldEvict")
            .map(|e| e["message"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(would.len(), 1, "{would:?}");
        assert!(would[0].contains("train/p2"), "{would:?}");
        assert_eq!(alive(&server).len(), 8);
    }

    /// Rules of faultline's left at `None` (proposals whose prediction never came, on
    /// other nodes) keep nothing from new work: they do not count toward the device
    /// budget. 64 of them (the default budget) held every later device quarantine back.
    #[tokio::test]
    async fn rules_left_at_none_do_not_use_the_device_budget() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        for i in 0..64 {
            // As faultline proposes one (its label, effect None), for a device elsewhere.
            let orphan = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
                "metadata": {"name": format!("faultline-gpu-0-gone-{i}"),
                    "labels": {"app.kubernetes.io/managed-by": "faultline"}},
                "spec": {
                    "deviceSelector": {"driver": "gpu.nvidia.com", "pool": format!("gone-{i}"), "device": "gpu-0"},
                    "taint": {"key": "faultline.io/unhealthy", "value": "xid-79", "effect": "None"},
                },
            });
            server.create("devicetaintrules", "", orphan).unwrap();
        }
        gpu_3_quarantined_alone(&server, &r).await;
    }

    /// An install whose RBAC predates the watch of the rule: the watch is refused, the
    /// wait reads the rule twice a second instead, and the GPU is still quarantined
    /// alone (a refused watch failed the pass, and the device path with it).
    #[tokio::test]
    async fn without_the_watch_verb_the_prediction_is_read_instead() {
        let (server, r) = cluster_as(
            Mode::Enforce,
            Release::parse("1.37").unwrap(),
            8,
            false,
            |m| {
                m.replace(
                    "verbs: [get, list, watch, create, patch, delete]",
                    "verbs: [get, list, create, patch, delete]",
                )
            },
        )
        .await;
        gpu_3_quarantined_alone(&server, &r).await;
        let refused = server
            .calls()
            .iter()
            .filter(|c| c.uri.contains("/devicetaintrules?") && c.uri.contains("watch=true"))
            .filter(|c| c.status == 403)
            .count();
        assert!(refused >= 1, "the watch was refused and read around");
    }

    /// An install whose RBAC predates the device path (no `resource.k8s.io` rules):
    /// every DRA read is refused, and the node is quarantined as before, saying why.
    #[tokio::test]
    async fn without_the_dra_rbac_the_node_path_still_works() {
        let strip = |m: String| {
            let from = m
                .find("  # One failed device alone (--device-quarantine)")
                .unwrap();
            let to = m[from..]
                .find("verbs: [get, list, watch, create, patch, delete]")
                .unwrap()
                + from;
            let end = m[to..].find('\n').unwrap() + to + 1;
            format!("{}{}", &m[..from], &m[end..])
        };
        let (server, r) = cluster_as(
            Mode::Enforce,
            Release::parse("1.37").unwrap(),
            8,
            false,
            strip,
        )
        .await;
        let out = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        assert_eq!(node_taints(&server).len(), 1);
        let n: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(server.get("nodes", "", "n1").unwrap()).unwrap();
        let why = record_of(&n).unwrap().unwrap().node_why.unwrap();
        assert!(why.contains("could not be read"), "{why}");
        // The eviction pass goes on (no DRA holder can be found without the claims).
        r.evict("n1", &[], &Fence::unfenced()).await.unwrap();
        assert!(
            !super::support::refused(&server).is_empty(),
            "the DRA reads were refused"
        );
    }

    /// The node's own fault (the GPU fell off the bus: Xid 79), or two failed GPUs,
    /// taint the node as before, and the record says why.
    #[tokio::test]
    async fn a_node_fault_or_two_devices_taint_the_node() {
        for devices in [
            vec![gpu(2, "xid-79")],
            vec![gpu(1, "row-remap-failure"), gpu(6, "row-remap-failure")],
        ] {
            let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
            let out = r
                .isolate("n1", devices.clone(), &Fence::unfenced())
                .await
                .unwrap();
            assert_eq!(out, Outcome::Isolated);
            assert_eq!(node_taints(&server).len(), 1, "{devices:?}");
            assert!(server.list("devicetaintrules", "").is_empty());
            let n: k8s_openapi::api::core::v1::Node =
                serde_json::from_value(server.get("nodes", "", "n1").unwrap()).unwrap();
            let rec = record_of(&n).unwrap().unwrap();
            assert!(rec.isolation.is_none());
            let why = rec.node_why.unwrap();
            assert!(
                why.contains("whole node") || why.contains("2 devices"),
                "{why}"
            );
        }
    }

    /// A node whose kubelet keeps refusing pods for lack of devices (3 within the hour,
    /// the rules file's default) is the node's fault, even for one failed GPU.
    #[tokio::test]
    async fn a_node_that_keeps_refusing_allocations_is_tainted() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        for i in 0..3 {
            let mut p = fixtures::dra_pod(&format!("refused-{i}"), "n1");
            p["status"] = json!({"phase": "Failed", "reason": "UnexpectedAdmissionError",
                "message": "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. Requested: 1, Available: 0, which is unexpected"});
            server.create("pods", "train", p).unwrap();
        }
        let out = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        assert_eq!(node_taints(&server).len(), 1);
        assert!(server.list("devicetaintrules", "").is_empty());
        let n: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(server.get("nodes", "", "n1").unwrap()).unwrap();
        let why = record_of(&n).unwrap().unwrap().node_why.unwrap();
        assert!(why.contains("refused 3 pods"), "{why}");
    }

    /// No DeviceTaintRule (1.34): where the device plugin took the GPU out (8 -> 7) that
    /// stands and the node stays untainted; where it did not, the node is tainted.
    #[tokio::test]
    async fn without_dra_the_device_plugin_isolation_stands_or_the_node_is_tainted() {
        for (allocatable, tainted) in [(7, false), (8, true)] {
            let (server, r) = cluster(Release::parse("1.34").unwrap(), allocatable, false).await;
            let out = r
                .isolate("n1", vec![gpu(4, "row-remap-failure")], &Fence::unfenced())
                .await
                .unwrap();
            assert_eq!(out, Outcome::Isolated);
            assert_eq!(
                node_taints(&server).len(),
                usize::from(tainted),
                "{allocatable}"
            );
            let n: k8s_openapi::api::core::v1::Node =
                serde_json::from_value(server.get("nodes", "", "n1").unwrap()).unwrap();
            let rec = record_of(&n).unwrap().unwrap();
            if tainted {
                assert!(rec.node_why.unwrap().contains("device plugin took 0"));
            } else {
                assert!(matches!(
                    rec.isolation,
                    Some(DeviceIsolation::DevicePlugin { taken_out: 1, .. })
                ));
                // The same fault again: nothing to write.
                let version = |s: &ApiServer| {
                    s.get("nodes", "", "n1").unwrap()["metadata"]["resourceVersion"].clone()
                };
                let before = version(&server);
                let again = r
                    .isolate("n1", vec![gpu(4, "row-remap-failure")], &Fence::unfenced())
                    .await
                    .unwrap();
                assert_eq!(again, Outcome::AlreadyDone);
                assert_eq!(version(&server), before);
                // Its DRA pod is still found by its claim and evicted; only it.
                let e = r.evict("n1", &[], &Fence::unfenced()).await.unwrap();
                assert_eq!(e.evicted.len(), 1, "{e:?}");
                assert!(e.evicted[0].starts_with("train/p4/"));
            }
        }
    }

    /// `--device-quarantine` picks the backend. On a cluster that serves DeviceTaintRule
    /// and whose device plugin also took the failed GPU out (8 -> 7): `device-plugin`
    /// writes no rule and lets the plugin's isolation stand; where the plugin took
    /// nothing out it taints the node, still writing no rule. `dra` on a cluster without
    /// DeviceTaintRule (1.34) does not take the plugin's isolation: the node is tainted,
    /// saying there is no rule API.
    #[tokio::test]
    async fn the_backend_flag_picks_rules_or_the_plugins_isolation() {
        let no_faults = faultline_test_apiserver::Faults::default;
        for (release, backend, allocatable, tainted) in [
            ("1.37", Backend::DevicePlugin, 7, false),
            ("1.37", Backend::DevicePlugin, 8, true),
            ("1.34", Backend::Dra, 7, true),
            ("1.37", Backend::Dra, 7, false),
        ] {
            let case = format!("{release} {} allocatable {allocatable}", backend.as_str());
            let (server, r) = cluster_with(
                Mode::Enforce,
                Release::parse(release).unwrap(),
                (allocatable, false),
                |m| m,
                no_faults(),
                |q| q.backend = backend,
            )
            .await;
            let out = r
                .isolate("n1", vec![gpu(4, "row-remap-failure")], &Fence::unfenced())
                .await
                .unwrap();
            assert_eq!(out, Outcome::Isolated, "{case}");
            assert_eq!(node_taints(&server).len(), usize::from(tainted), "{case}");
            let rules_written = server
                .calls()
                .iter()
                .filter(|c| c.method == "POST" && c.uri.contains("/devicetaintrules"))
                .count();
            let n: k8s_openapi::api::core::v1::Node =
                serde_json::from_value(server.get("nodes", "", "n1").unwrap()).unwrap();
            let rec = record_of(&n).unwrap().unwrap();
            match (backend, tainted) {
                (Backend::DevicePlugin, false) => {
                    assert_eq!(rules_written, 0, "{case}");
                    assert!(
                        matches!(
                            rec.isolation,
                            Some(DeviceIsolation::DevicePlugin { taken_out: 1, .. })
                        ),
                        "{case}: {:?}",
                        rec.isolation
                    );
                }
                (Backend::DevicePlugin, true) => {
                    assert_eq!(rules_written, 0, "{case}");
                    let why = rec.node_why.unwrap();
                    assert!(why.contains("device plugin took 0"), "{case}: {why}");
                }
                (_, true) => {
                    let why = rec.node_why.unwrap();
                    assert!(why.contains("serves no DeviceTaintRule"), "{case}: {why}");
                }
                (_, false) => {
                    assert_eq!(rules_written, 1, "{case}");
                    assert!(
                        !matches!(rec.isolation, Some(DeviceIsolation::DevicePlugin { .. })),
                        "{case}: {:?}",
                        rec.isolation
                    );
                }
            }
        }
    }

    /// The controller's prediction is of the pods when the rule's generation was
    /// written. A holder gone while the proposal was in flight (its pod and claim
    /// deleted): faultline counted it, the controller did not; asked once more (a new
    /// `timeAdded`), both count none and the rule is enforced. A holder that came
    /// meanwhile (not in the pass's list) keeps the two apart: the pass asks once, then
    /// leaves the rule at `None` and ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stale_prediction_is_asked_again_once() {
        for gone in [true, false] {
            let faults = faultline_test_apiserver::Faults {
                latency_ms: 500,
                latency_method: "POST".into(),
                latency_match: "/devicetaintrules".into(),
                ..Default::default()
            };
            let (server, r) = enforcing(faults, |_| {}).await;
            let s = server.clone();
            let meanwhile = tokio::spawn(async move {
                super::support::until_received(&s, "POST", "/devicetaintrules").await;
                if gone {
                    s.delete("pods", "train", "p3").unwrap();
                    s.delete("resourceclaims", "train", "p3-gpu").unwrap();
                } else {
                    let p = s
                        .create("pods", "train", fixtures::dra_pod("p3b", "n1"))
                        .unwrap();
                    let claim = fixtures::claim_for(&p, "gpu-3", json!([]));
                    s.create("resourceclaims", "train", claim).unwrap();
                }
            });
            let fence = Fence::unfenced();
            let pass = r.isolate("n1", vec![gpu(3, "row-remap-failure")], &fence);
            let out = tokio::time::timeout(std::time::Duration::from_secs(20), pass)
                .await
                .expect("the pass ends")
                .unwrap();
            meanwhile.await.unwrap();
            let rule = rule_of(&server, 3).expect("gpu-3's rule");
            let effect = rule["spec"]["taint"]["effect"].clone();
            if gone {
                assert_eq!(out, Outcome::Isolated, "{rule}");
                assert_eq!(effect, "NoSchedule", "{rule}");
            } else {
                assert_ne!(out, Outcome::Isolated, "{rule}");
                assert_eq!(effect, "None", "{rule}");
            }
        }
    }

    /// The holder's claim tolerates the taint for ever (NoExecute): the controller
    /// leaves it out of its prediction and faultline counts it out alike
    /// (counted in, the two never agreed and the GPU stayed in service at effect None).
    /// The GPU is taken out of scheduling, and the tolerating pod is not evicted.
    #[tokio::test]
    async fn a_holder_that_tolerates_the_taint_is_left_and_the_gpu_taken_out() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, true).await;
        let out = r
            .isolate("n1", vec![gpu(5, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert!(!matches!(out, Outcome::Waiting(_)), "{out:?}");
        assert_eq!(
            rule_of(&server, 5).unwrap()["spec"]["taint"]["effect"],
            "NoSchedule"
        );
        assert_eq!(server.allocatable_devices("n1"), 7);
        assert!(node_taints(&server).is_empty());
        let e = r.evict("n1", &[], &Fence::unfenced()).await.unwrap();
        assert!(e.evicted.is_empty(), "{e:?}");
        assert_eq!(alive(&server).len(), 8);
        assert_eq!(
            super::support::events(&server, "FaultlineDevicePredictionDisagrees"),
            0
        );
    }

    /// Someone else's rule under faultline's name: never changed, never deleted; the
    /// device takes the node path instead, and says why.
    /// A pod on the node that names 2,000 claims that do not exist: the claims read
    /// per pass are bounded (they were all read at once, for every pass: 700-800 GETs a
    /// second), and the other pods' claims are still read, so the failed GPU's holder
    /// is found and the GPU quarantined alone.
    #[tokio::test]
    async fn a_pod_naming_thousands_of_claims_costs_a_bounded_number_of_reads() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let mut greedy = fixtures::dra_pod("a-greedy", "n1");
        greedy["spec"]["resourceClaims"] = (0..2000)
            .map(|i| json!({"name": format!("c{i}"), "resourceClaimName": format!("missing-{i}")}))
            .collect::<Vec<_>>()
            .into();
        // Pending: the kubelet runs no pod whose claims are not there.
        greedy["status"] = json!({"phase": "Pending"});
        server.create("pods", "train", greedy).unwrap();
        gpu_3_quarantined_alone(&server, &r).await;
        let reads = || {
            server
                .calls()
                .iter()
                .filter(|c| c.method == "GET" && c.uri.contains("/resourceclaims/"))
                .count()
        };
        // Two reads of the node's claims in the pass (to propose, to count the holders
        // against the prediction), 256 at most each.
        let first = reads();
        assert!(first <= 512, "{first} claim reads");
        // The claims found missing are not asked for again: each pass that reads the
        // claims (the holders to evict) reads the next ones, then only the holders'.
        let mut per_pass = Vec::new();
        for _ in 0..10 {
            let before = reads();
            r.evict("n1", &[], &Fence::unfenced()).await.unwrap();
            per_pass.push(reads() - before);
        }
        assert!(per_pass.iter().all(|n| *n <= 256 + 8), "{per_pass:?}");
        assert!(per_pass[9] <= 8, "only the 8 holders' claims: {per_pass:?}");
    }

    /// n1 with 8 GPUs on 1.37 whose device-taint controller does not run (no
    /// prediction comes unless the test writes one), waits of 200 ms for it, a 10 s
    /// deadline; gpu3 failed and its rule proposed (the first pass waits on it).
    async fn proposed_without_the_controller(
        clock: faultline_common::time::Clock,
    ) -> (ApiServer, Remediator) {
        let faults = faultline_test_apiserver::Faults {
            taint_eviction_paused: true,
            ..Default::default()
        };
        let (server, r) = enforcing(faults, |q| {
            q.prediction_wait = std::time::Duration::from_millis(200);
            q.prediction_deadline = std::time::Duration::from_secs(10);
        })
        .await;
        let r = r.with_clock(clock);
        let first = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert!(matches!(first, Outcome::Waiting(_)), "{first:?}");
        (server, r)
    }

    /// The next pass on gpu3 took the node path: no rule left, n1 tainted, and its
    /// record says why; the record.
    async fn node_path_taken(server: &ApiServer, r: &Remediator) -> String {
        let next = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(next, Outcome::Isolated);
        assert!(rule_of(server, 3).is_none(), "no rule left at None");
        assert_eq!(node_taints(server).len(), 1, "the node tainted");
        let node = server.get("nodes", "", "n1").unwrap();
        node["metadata"]["annotations"]["faultline.io/quarantine"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    /// The device-taint controller does not run (kube-controller-manager down): no
    /// prediction ever comes. Before, the rule waited at `None` for ever, unrecorded,
    /// and the failed GPU stayed in service; now, past `--device-prediction-deadline`
    /// after the proposal, the rule is deleted and the node tainted, saying why.
    #[tokio::test]
    async fn a_prediction_that_never_comes_takes_the_node_path_at_its_deadline() {
        // The remediator's clock moves; the rule's creationTimestamp is the server's.
        let clock = faultline_common::time::Clock::manual(faultline_common::time::now_ms());
        let (server, r) = proposed_without_the_controller(clock.clone()).await;
        let rule = rule_of(&server, 3).expect("proposed");
        assert_eq!(rule["spec"]["taint"]["effect"], "None");
        assert!(node_taints(&server).is_empty());
        // Past the deadline, short of twice it (when the budget count would sweep the
        // rule as an earlier fault's).
        clock.advance(std::time::Duration::from_secs(15));
        let record = node_path_taken(&server, &r).await;
        assert!(record.contains("no agreement"), "{record}");
    }

    /// The controller's report in words faultline cannot read (upstream: the message
    /// "may change"). Before, it read as "no prediction yet" and the rule waited at
    /// `None` until the deadline, the GPU in service meanwhile; now the pass that reads
    /// it deletes the rule and taints the node, saying why, with no clock moved.
    #[tokio::test]
    async fn a_prediction_that_cannot_be_read_takes_the_node_path_at_once() {
        let clock = faultline_common::time::Clock::default();
        let (server, r) = proposed_without_the_controller(clock).await;
        // The controller reports this generation, in words of a later release.
        let mut rule = rule_of(&server, 3).expect("proposed");
        let name = rule["metadata"]["name"].as_str().unwrap().to_string();
        rule["status"] = json!({"conditions": [{"type": "EvictionInProgress", "status": "False",
            "reason": "NoEffect", "message": "Simulated: 2 Pods (2 namespaces) to evict on NoExecute.",
            "lastTransitionTime": "2026-12-06T00:00:00Z",
            "observedGeneration": rule["metadata"]["generation"]}]});
        server
            .update("devicetaintrules", "", &name, rule, Some("status"))
            .unwrap();
        let record = node_path_taken(&server, &r).await;
        assert!(
            record.contains("cannot be read") && record.contains("2 Pods (2 namespaces)"),
            "{record}"
        );
    }

    /// A rule left at `None` by an earlier fault (its device recovered before any
    /// agreement, its replica went) carries a prediction of other pods, and stayed for
    /// ever. A later fault on the device reused it. Now a rule of faultline's at `None`
    /// for over twice the deadline is deleted when a device quarantine asks the budget:
    /// the failed device's is made again (a new uid: a fresh prediction, on 1.35 too),
    /// and the other device's is gone.
    #[tokio::test]
    async fn a_rule_left_at_none_by_an_earlier_fault_is_made_again() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let clock = faultline_common::time::Clock::manual(faultline_common::time::now_ms());
        let r = r.with_clock(clock.clone());
        let d = DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: "gpu-3".into(),
        };
        let orphan = rule_at_none(&rule_name(&d), "n1", "gpu-3");
        let old_uid =
            server.create("devicetaintrules", "", orphan).unwrap()["metadata"]["uid"].clone();
        // And one of a device that never failed again.
        let gone = rule_at_none("faultline-gpu-0-gone", "gone", "gpu-0");
        server.create("devicetaintrules", "", gone).unwrap();
        // Three deadlines (60 s by default) later, gpu-3 fails again.
        clock.advance(std::time::Duration::from_secs(180));
        gpu_3_quarantined_alone(&server, &r).await;
        let rule = rule_of(&server, 3).unwrap();
        assert_ne!(rule["metadata"]["uid"], old_uid, "made again, not reused");
        assert!(
            server
                .get("devicetaintrules", "", "faultline-gpu-0-gone")
                .is_none(),
            "no rule left at None"
        );
    }

    /// The device budget (`--max-quarantined-devices`) counts faultline's enforced
    /// rules cluster-wide: with 2 elsewhere and a budget of 3, gpu-3 is quarantined
    /// alone; with 3 elsewhere, it is held back, and no rule is written for it.
    #[tokio::test]
    async fn the_device_budget_holds_back_the_device_past_it() {
        for (elsewhere, isolated) in [(2, true), (3, false)] {
            let (server, r) = enforcing(Default::default(), |q| q.max_devices = 3).await;
            for i in 0..elsewhere {
                let mut rule =
                    rule_at_none(&format!("faultline-gpu-0-n{i}"), &format!("n{i}0"), "gpu-0");
                rule["spec"]["taint"]["effect"] = json!("NoSchedule");
                server.create("devicetaintrules", "", rule).unwrap();
            }
            if isolated {
                gpu_3_quarantined_alone(&server, &r).await;
                continue;
            }
            let out = r
                .isolate("n1", vec![gpu(3, "row-remap-failure")], &Fence::unfenced())
                .await
                .unwrap();
            assert_eq!(
                out,
                Outcome::HeldBack("device budget: 3 devices quarantined alone, at most 3".into())
            );
            assert!(rule_of(&server, 3).is_none());
            assert!(node_taints(&server).is_empty());
        }
    }

    /// Where the rules file quarantines a node from its third failed GPU on, a second
    /// GPU failing beside one quarantined alone gets a rule of its own (the first's,
    /// enforced, does not stand for it); the same two again change nothing.
    #[tokio::test]
    async fn a_second_gpu_beside_one_quarantined_alone_gets_its_own_rule() {
        let (server, r) = enforcing(Default::default(), |q| node_after(q, 3)).await;
        gpu_3_quarantined_alone(&server, &r).await;
        let both = vec![gpu(3, "row-remap-failure"), gpu(4, "row-remap-failure")];
        let out = r
            .isolate("n1", both.clone(), &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        let rule = rule_of(&server, 4).expect("gpu-4's own rule");
        assert_eq!(rule["spec"]["taint"]["effect"], "NoSchedule");
        assert!(node_taints(&server).is_empty());
        let again = r.isolate("n1", both, &Fence::unfenced()).await.unwrap();
        assert_eq!(again, Outcome::AlreadyDone);
    }

    /// The device budget counts a node's new device, not those its record holds: with
    /// two GPUs of n1 quarantined alone and a budget of 2, a third is held back.
    #[tokio::test]
    async fn a_nodes_next_device_asks_the_device_budget() {
        let settings = |q: &mut DeviceQuarantine| {
            node_after(q, 4);
            q.max_devices = 2;
        };
        let (server, r) = enforcing(Default::default(), settings).await;
        gpu_3_quarantined_alone(&server, &r).await;
        let mut failed = vec![gpu(3, "row-remap-failure"), gpu(5, "row-remap-failure")];
        let out = r
            .isolate("n1", failed.clone(), &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        assert!(rule_of(&server, 5).is_some());
        failed.push(gpu(4, "row-remap-failure"));
        let out = r.isolate("n1", failed, &Fence::unfenced()).await.unwrap();
        assert_eq!(
            out,
            Outcome::HeldBack("device budget: 2 devices quarantined alone, at most 2".into())
        );
        assert!(rule_of(&server, 4).is_none());
    }

    /// A second GPU's rule that gets no agreement by its deadline is deleted and the
    /// node tainted; the first GPU's rule, which its record holds, stays (it goes with
    /// the release).
    #[tokio::test]
    async fn a_second_rule_without_agreement_goes_and_the_recorded_one_stays() {
        let clock = faultline_common::time::Clock::manual(faultline_common::time::now_ms());
        let settings = |q: &mut DeviceQuarantine| {
            node_after(q, 3);
            q.prediction_wait = std::time::Duration::from_millis(200);
            q.prediction_deadline = std::time::Duration::from_secs(10);
        };
        let (server, r) = enforcing(Default::default(), settings).await;
        let r = r.with_clock(clock.clone());
        gpu_3_quarantined_alone(&server, &r).await;
        // The controller stops: gpu-4's rule waits at None, then past its deadline.
        server.set_faults(faultline_test_apiserver::Faults {
            taint_eviction_paused: true,
            ..Default::default()
        });
        let both = vec![gpu(3, "row-remap-failure"), gpu(4, "row-remap-failure")];
        // gpu-3's rule is written again; gpu-4's waits at None.
        r.isolate("n1", both.clone(), &Fence::unfenced())
            .await
            .unwrap();
        let waiting = rule_of(&server, 4).expect("gpu-4's rule proposed");
        assert_eq!(waiting["spec"]["taint"]["effect"], "None");
        assert!(node_taints(&server).is_empty());
        clock.advance(std::time::Duration::from_secs(15));
        let next = r.isolate("n1", both, &Fence::unfenced()).await.unwrap();
        assert_eq!(next, Outcome::Isolated);
        assert!(rule_of(&server, 4).is_none(), "the unrecorded rule deleted");
        assert!(rule_of(&server, 3).is_some(), "the recorded one kept");
        assert_eq!(node_taints(&server).len(), 1, "the node tainted");
    }

    /// A DeviceTaintRule of faultline's named `name` at effect `None` on `device` of
    /// NVIDIA's pool `pool`, as a pass proposes one.
    fn rule_at_none(name: &str, pool: &str, device: &str) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": name,
                "labels": {"app.kubernetes.io/managed-by": "faultline"}},
            "spec": {
                "deviceSelector": {"driver": "gpu.nvidia.com", "pool": pool, "device": device},
                "taint": {"key": "faultline.io/unhealthy", "value": "xid-79", "effect": "None"},
            },
        })
    }

    /// A rule at `None` younger than twice the deadline may still be a pass's own,
    /// waiting for its prediction: the sweep leaves it.
    #[tokio::test]
    async fn a_rule_at_none_younger_than_twice_the_deadline_is_kept() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let clock = faultline_common::time::Clock::manual(faultline_common::time::now_ms());
        let r = r.with_clock(clock.clone());
        let waiting = rule_at_none("faultline-gpu-0-waiting", "other", "gpu-0");
        server.create("devicetaintrules", "", waiting).unwrap();
        // One and a half deadlines (60 s by default) later, gpu-3 fails.
        clock.advance(std::time::Duration::from_secs(90));
        gpu_3_quarantined_alone(&server, &r).await;
        assert!(
            server
                .get("devicetaintrules", "", "faultline-gpu-0-waiting")
                .is_some(),
            "a rule younger than twice the deadline was swept"
        );
    }

    /// A pod that asked for `nvidia.com/gpu` on a DRA node (KEP-5004, GA in 1.37) names
    /// no claim in its spec: the scheduler made one, named only in the pod's
    /// `status.extendedResourceClaimStatus`. Its holder was missed: faultline counted
    /// nobody on gpu-3 while the controller counted the pod, so the prediction never
    /// agreed and the GPU stayed in service.
    #[tokio::test]
    async fn a_pod_holding_a_gpu_through_an_extended_resource_is_counted() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        server.delete("resourceclaims", "train", "p3-gpu").unwrap();
        server.delete("pods", "train", "p3").unwrap();
        let pod = server
            .create(
                "pods",
                "train",
                json!({"metadata": {"name": "ext", "labels": {"app": "train"}},
                    "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
                    "status": {"phase": "Running",
                        "extendedResourceClaimStatus": {
                            "resourceClaimName": "ext-extended-resources-x7k2p",
                            "requestMappings": [{"containerName": "c",
                                "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}]}}}),
            )
            .unwrap();
        let mut claim = fixtures::claim_for(&pod, "gpu-3", json!([]));
        claim["metadata"]["name"] = json!("ext-extended-resources-x7k2p");
        server.create("resourceclaims", "train", claim).unwrap();
        gpu_3_quarantined_alone(&server, &r).await;
    }

    /// Dynamic MIG: NVIDIA's driver publishes a GPU's partitions beside it, each a
    /// device of its own (`uuid`, and `parentUUID` the GPU's). When the GPU fails, its
    /// partitions fail with it: each gets a rule of its own, and a pod holding one is
    /// counted as a holder. Before, the partitions stayed allocatable.
    #[tokio::test]
    async fn a_failed_gpus_mig_partitions_are_quarantined_with_it() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let name = "n1-gpu.nvidia.com-0";
        let mut slice = server.get("resourceslices", "", name).unwrap();
        slice["spec"]["devices"]
            .as_array_mut()
            .unwrap()
            .push(json!({
            "name": "gpu-3-mig-1g18gb-0",
            "attributes": {"uuid": {"string": "MIG-3-0"}, "type": {"string": "mig"},
                "parentUUID": {"string": fixtures::gpu_uuid("n1", 3)}}}));
        server
            .update("resourceslices", "", name, slice, None)
            .unwrap();
        let pod = server
            .create("pods", "train", fixtures::dra_pod("m0", "n1"))
            .unwrap();
        let claim = fixtures::claim_for(&pod, "gpu-3-mig-1g18gb-0", json!([]));
        server.create("resourceclaims", "train", claim).unwrap();
        gpu_3_quarantined_alone(&server, &r).await;
        let part = DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: "gpu-3-mig-1g18gb-0".into(),
        };
        let rule = server
            .get("devicetaintrules", "", &rule_name(&part))
            .expect("the partition's own rule");
        assert_eq!(rule["spec"]["taint"]["effect"], "NoSchedule");
        assert_eq!(
            rule["spec"]["deviceSelector"]["device"],
            "gpu-3-mig-1g18gb-0"
        );
    }

    /// NVIDIA's driver republishes only healthy devices: once gpu-3 left the slice, no
    /// index names it, and its pods were never found, so never evicted. The kubelet's
    /// own DRA health report (KEP-4680: `claim:<claim>/<request>`, resource
    /// `<driver>/<pool>/<device>`, Unhealthy) names the pod and the device: it is
    /// taken as evidence, and the pod is evicted on the node path.
    #[tokio::test]
    async fn the_kubelets_dra_health_finds_the_holder_of_a_device_gone_from_its_slice() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let name = "n1-gpu.nvidia.com-0";
        let mut slice = server.get("resourceslices", "", name).unwrap();
        slice["spec"]["devices"]
            .as_array_mut()
            .unwrap()
            .retain(|d| d["name"] != "gpu-3");
        slice["spec"]["pool"]["generation"] = json!(2);
        server
            .update("resourceslices", "", name, slice, None)
            .unwrap();
        let mut p3 = server.get("pods", "train", "p3").unwrap();
        p3["status"]["containerStatuses"] = json!([{"name": "c", "ready": true, "restartCount": 0,
            "image": "x", "imageID": "",
            "allocatedResourcesStatus": [{"name": "claim:p3-gpu/gpu",
                "resources": [{"resourceID": "gpu.nvidia.com/n1/gpu-3", "health": "Unhealthy"}]}]}]);
        server
            .update("pods", "train", "p3", p3, Some("status"))
            .unwrap();
        let f = Fence::unfenced();
        let out = r
            .isolate("n1", vec![gpu(3, "row-remap-failure")], &f)
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        assert_eq!(
            node_taints(&server).len(),
            1,
            "not published: the node path"
        );
        let e = r.evict("n1", &[], &f).await.unwrap();
        assert!(
            e.evicted.iter().any(|p| p.starts_with("train/p3/")),
            "{e:?}"
        );
        assert_eq!(alive(&server).len(), 7, "p3 alone");
    }

    /// The node path keeps, for each failed GPU, the DRA device that published its UUID
    /// when it was recorded: after NVIDIA's driver took the failed GPUs out of the slice
    /// (it republishes only healthy ones), their holders are still found by their
    /// claims and evicted. Before, nothing named them any more.
    #[tokio::test]
    async fn the_record_keeps_each_devices_dra_name_for_its_holders() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let f = Fence::unfenced();
        let lists = || {
            server
                .calls()
                .iter()
                .filter(|c| c.method == "GET" && c.uri.contains("/resourceslices"))
                .count()
        };
        // One pass of the fault: its outcome and the slices' lists it made.
        let pass = || async {
            let start = lists();
            let devices = vec![gpu(3, "row-remap-failure"), gpu(4, "row-remap-failure")];
            let out = r.isolate("n1", devices, &f).await.unwrap();
            (out, lists() - start)
        };
        let (out, first) = pass().await;
        assert_eq!(out, Outcome::Isolated);
        assert_eq!(node_taints(&server).len(), 1, "two devices: the node path");
        // The slices are read for the holders once per new fault, not every pass.
        let (again, second) = pass().await;
        assert_eq!(again, Outcome::AlreadyDone);
        let (_, third) = pass().await;
        assert_eq!(third, second, "every pass of the same fault alike");
        assert!(
            second < first,
            "the same fault read the slices as often as the new one ({second}, {first})"
        );
        let node = server.get("nodes", "", "n1").unwrap();
        let record = node["metadata"]["annotations"]["faultline.io/quarantine"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(record.contains("gpu.nvidia.com/n1/gpu-3"), "{record}");
        // The driver republishes the healthy GPUs only.
        let name = "n1-gpu.nvidia.com-0";
        let mut slice = server.get("resourceslices", "", name).unwrap();
        slice["spec"]["devices"]
            .as_array_mut()
            .unwrap()
            .retain(|d| d["name"] != "gpu-3" && d["name"] != "gpu-4");
        slice["spec"]["pool"]["generation"] = json!(2);
        server
            .update("resourceslices", "", name, slice, None)
            .unwrap();
        let e = r.evict("n1", &[], &f).await.unwrap();
        let mut evicted: Vec<&str> = e
            .evicted
            .iter()
            .map(|p| p.split('/').nth(1).unwrap_or(""))
            .collect();
        evicted.sort();
        assert_eq!(evicted, ["p3", "p4"], "{e:?}");
    }

    /// 1.33 and 1.34 serve DeviceTaintRule (alpha, `v1alpha3`) without effect `None`:
    /// the proposal is refused (422). Every pass failed on it before and the node was
    /// never tainted; now the node path is taken, and the record says why.
    #[tokio::test]
    async fn a_cluster_without_effect_none_takes_the_node_path() {
        // 1.34 (1.33's ResourceSlices are beta, which the test server does not serve).
        let minor = "1.34";
        let release = Release::parse(minor).unwrap().with_device_taint_rules(true);
        let (server, r) = cluster(release, 8, false).await;
        let out = r
            .isolate("n1", vec![gpu(2, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated, "{minor}");
        assert_eq!(node_taints(&server).len(), 1, "{minor}: the node tainted");
        let node = server.get("nodes", "", "n1").unwrap();
        let record = node["metadata"]["annotations"]["faultline.io/quarantine"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(
            record.contains("refused the DeviceTaintRule"),
            "{minor}: {record}"
        );
        let refused = server
            .calls()
            .iter()
            .filter(|c| c.uri.contains("/devicetaintrules") && c.method == "POST")
            .map(|c| c.status)
            .collect::<Vec<_>>();
        assert_eq!(refused, [422], "{minor}");
    }

    #[tokio::test]
    async fn another_owners_rule_is_left_and_the_node_path_taken() {
        let (server, r) = cluster(Release::parse("1.37").unwrap(), 8, false).await;
        let d = DeviceRef {
            driver: "gpu.nvidia.com".into(),
            pool: "n1".into(),
            device: "gpu-1".into(),
        };
        server
            .create("devicetaintrules", "", json!({"metadata": {"name": rule_name(&d), "labels": {"app.kubernetes.io/managed-by": "nvsentinel"}},
                "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-1"},
                         "taint": {"key": "nvsentinel.io/quarantine", "effect": "NoSchedule"}}}))
            .unwrap();
        let out = r
            .isolate("n1", vec![gpu(1, "row-remap-failure")], &Fence::unfenced())
            .await
            .unwrap();
        assert_eq!(out, Outcome::Isolated);
        assert_eq!(node_taints(&server).len(), 1);
        let writes = server
            .calls()
            .iter()
            .filter(|c| c.uri.contains("/devicetaintrules") && c.method != "GET")
            .count();
        assert_eq!(writes, 0);
    }

    /// [`cluster`] on 1.37 with the canary's RBAC too (deploy/components/canary: its
    /// flags and their permission come together).
    async fn canary_cluster() -> (ApiServer, Remediator) {
        let canary = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/components/canary/rbac.yaml");
        let canary = std::fs::read_to_string(canary).unwrap();
        let release = Release::parse("1.37").unwrap();
        cluster_as(Mode::Enforce, release, 8, false, |m| {
            format!("{m}\n---\n{canary}")
        })
        .await
    }

    /// `r` releasing on its own after 3 clean samples and a canary Job.
    fn auto_release(r: Remediator) -> Remediator {
        use faultline_aggregator::remediate::{CanarySpec, ReleasePolicy};
        let template: k8s_openapi::api::batch::v1::Job = serde_json::from_value(json!({
            "metadata": {"name": "probe"},
            "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "probe"}]}}}
        }))
        .unwrap();
        r.with_release(ReleasePolicy {
            auto: true,
            healthy_samples: 3,
            cooldown: std::time::Duration::ZERO,
            canary: Some(CanarySpec {
                template,
                namespace: super::support::NS.into(),
                timeout: std::time::Duration::from_secs(600),
            }),
            ..ReleasePolicy::default()
        })
    }

    /// gpu3 of n1 quarantined alone, healthy since: the views of a release pass.
    async fn quarantined_then_healthy(
        r: &Remediator,
    ) -> [faultline_aggregator::model::DeviceView; 1] {
        let bad = gpu(3, "row-remap-failure");
        let f = Fence::unfenced();
        assert_eq!(
            r.isolate("n1", vec![bad.clone()], &f).await.unwrap(),
            Outcome::Isolated
        );
        [faultline_aggregator::model::DeviceView {
            device: bad,
            status: faultline_common::DeviceStatus::Healthy,
            clean_streak: 10,
            since_ms: 0,
        }]
    }

    /// The GPU in the quarantined slot was swapped (the driver publishes gpu-3 under a
    /// new UUID). The canary's claim selected the old UUID: nothing could be allocated
    /// to it, and the automatic release never came. It now asks for the device in the
    /// slot, the new GPU.
    #[tokio::test]
    async fn after_a_gpu_swap_the_canary_tests_the_new_gpu_in_the_slot() {
        let (server, r) = canary_cluster().await;
        let r = auto_release(r);
        let views = quarantined_then_healthy(&r).await;
        let mut slice = server.list("resourceslices", "").remove(0);
        let name = slice["metadata"]["name"].as_str().unwrap().to_string();
        slice["spec"]["devices"][3]["attributes"]["uuid"]["string"] = json!("GPU-swapped-in");
        server
            .update("resourceslices", "", &name, slice, None)
            .unwrap();
        let now = r.clock().now_ms();
        let out = r
            .release_pass("n1", &views, now, &Fence::unfenced())
            .await
            .unwrap();
        assert!(
            matches!(&out, Outcome::Waiting(w) if w.contains("started")),
            "{out:?}"
        );
        let claim = server.list("resourceclaims", super::support::NS).remove(0);
        let cel = claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
            ["expression"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(cel.contains("GPU-swapped-in"), "{cel}");
        assert!(!cel.contains(&fixtures::gpu_uuid("n1", 3)), "{cel}");
    }

    /// An auto release after positive evidence runs a canary whose own claim selects
    /// that very GPU (its UUID) and tolerates faultline's taint; the rule is deleted
    /// only once the canary succeeded.
    #[tokio::test]
    async fn a_release_deletes_the_rule_after_the_canary() {
        let (server, r) = canary_cluster().await;
        let r = auto_release(r);
        let views = quarantined_then_healthy(&r).await;
        let f = Fence::unfenced();
        let now = r.clock().now_ms();
        let out = r.release_pass("n1", &views, now, &f).await.unwrap();
        assert!(
            matches!(&out, Outcome::Waiting(w) if w.contains("started")),
            "{out:?}"
        );
        assert!(rule_of(&server, 3).is_some(), "kept while the canary runs");
        let jobs = server.list("jobs", super::support::NS);
        assert_eq!(jobs.len(), 1);
        let job = &jobs[0];
        let name = job["metadata"]["name"].as_str().unwrap().to_string();
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["resourceClaims"][0]["resourceClaimName"], name.as_str());
        assert_eq!(
            pod["containers"][0]["resources"]["claims"][0]["name"],
            "devices"
        );
        let claim = server
            .get("resourceclaims", super::support::NS, &name)
            .expect("the canary's claim");
        let req = &claim["spec"]["devices"]["requests"][0]["exactly"];
        let cel = req["selectors"][0]["cel"]["expression"].as_str().unwrap();
        assert!(cel.contains(&fixtures::gpu_uuid("n1", 3)), "{cel}");
        assert_eq!(req["tolerations"][0]["key"], "faultline.io/unhealthy");
        assert_eq!(
            claim["metadata"]["ownerReferences"][0]["uid"],
            job["metadata"]["uid"]
        );
        // Running: nothing released.
        let out = r.release_pass("n1", &views, now, &f).await.unwrap();
        assert!(matches!(out, Outcome::Waiting(_)), "{out:?}");
        assert!(rule_of(&server, 3).is_some());
        // It succeeds: the release deletes the rule.
        let mut done = server.get("jobs", super::support::NS, &name).unwrap();
        done["status"] = json!({"succeeded": 1});
        server
            .update("jobs", super::support::NS, &name, done, Some("status"))
            .unwrap();
        let out = r.release_pass("n1", &views, now, &f).await.unwrap();
        assert_eq!(out, Outcome::Released);
        assert!(rule_of(&server, 3).is_none());
        assert_eq!(server.allocatable_devices("n1"), 8);
        super::support::assert_no_forbidden(&server);
    }
}
