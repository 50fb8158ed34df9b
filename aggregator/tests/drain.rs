//! Issue 29: warn before evicting. A pod on a failed device that asks for time to
//! checkpoint (`faultline.io/checkpoint-grace`) gets a drain intent first: in its node's
//! `fault.json` (the ConfigMap entry and the node's own, served by its agent), on the
//! Node's record and as an Event on the pod. It is evicted at once when it acknowledges
//! through its node's agent, from its own address, and at its deadline otherwise,
//! never before; a pod that asks for nothing is evicted at once, as before.

mod support;

use std::time::{Duration, Instant};

use faultline_common::time::{now_ms, parse_rfc3339_ms};
use serde_json::{json, Value};
use support::*;

const TOKEN: &str = "delivery-token-0123456789";

/// A GPU pod on `n1` with `grace` (if any) and its address `ip`.
fn pod(name: &str, grace: Option<&str>, ip: &str) -> Value {
    let mut p = PodFixture::new(name, "n1").gpu().build();
    if let Some(g) = grace {
        p["metadata"]["annotations"] = json!({"faultline.io/checkpoint-grace": g});
    }
    p["status"]["podIP"] = json!(ip);
    p["status"]["podIPs"] = json!([{"ip": ip}]);
    p
}

/// When the first eviction of `pod` was answered 201 (ms), if it was.
fn evicted_at(server: &faultline_test_apiserver::ApiServer, pod: &str) -> Option<u64> {
    server
        .calls()
        .iter()
        .find(|c| {
            c.method == "POST"
                && c.uri.contains(&format!("/pods/{pod}/eviction"))
                && c.status == 201
        })
        .map(|c| c.at_ms)
}

fn uid(server: &faultline_test_apiserver::ApiServer, pod: &str) -> String {
    server.get("pods", "default", pod).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warned_pod_is_evicted_at_its_acknowledgement_or_its_deadline_never_before() {
    let tmp = tempfile::tempdir().unwrap();
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let agent = agent_with(
        "n1",
        &[
            "--fault-listen",
            "127.0.0.1:0",
            "--delivery-token-file",
            token.to_str().unwrap(),
        ],
    )
    .await;
    let pod_port = agent.fault_addr.expect("--fault-listen bound");
    let w = Scenario::new()
        .node(NodeFixture::shared("n1").ready(true))
        // Checkpoints when warned, and says so from its own address (this test's).
        .object("pods", "default", pod("ckpt", Some("300s"), "127.0.0.1"))
        // Never acknowledges: evicted at its deadline.
        .object("pods", "default", pod("slow", Some("4s"), "10.1.2.3"))
        // Asks for nothing: evicted at once, as before.
        .object("pods", "default", pod("plain", None, "10.1.2.4"))
        .agents_flag(&format!("n1=http://{}", agent.addr))
        .start()
        .await;
    let server = &w.server;
    let agg = w
        .healing("r1")
        .args(&["--delivery-token-file", token.to_str().unwrap()])
        .start()
        .await;
    holds(server, "r1").await;
    let (ckpt, slow) = (uid(server, "ckpt"), uid(server, "slow"));

    fail(&agent, "gpu1").await;
    let failed_at = now_ms();
    until(Duration::from_secs(15), "the plain pod evicted", || {
        evicted_at(server, "plain")
    })
    .await;

    // Both warned pods have an intent: on the record, in the ConfigMap entry, in the
    // node's own fault.json, and as an Event on each pod.
    let (entry, _) = until(Duration::from_secs(10), "both intents published", || {
        node_entry(server, 1, "n1").filter(|e| e.drain.len() == 2)
    })
    .await;
    let intent = |uid: &str| entry.drain.iter().find(|d| d.uid == uid).unwrap().clone();
    let (i_ckpt, i_slow) = (intent(&ckpt), intent(&slow));
    assert_eq!(
        (i_ckpt.pod.as_str(), i_ckpt.namespace.as_str()),
        ("ckpt", "default")
    );
    assert_eq!(i_ckpt.devices, ["gpu1"]);
    assert_eq!(i_ckpt.pod_ips, ["127.0.0.1"]);
    assert!(i_ckpt.acknowledged.is_none());
    let deadline = |i: &faultline_common::fault::DrainNotice| {
        parse_rfc3339_ms(&i.evict_after).unwrap() - parse_rfc3339_ms(&i.requested).unwrap()
    };
    assert_eq!(deadline(&i_ckpt), 300_000);
    assert_eq!(deadline(&i_slow), 4_000);
    let on_node = record(server, "n1").unwrap();
    assert_eq!(on_node["drains"].as_object().unwrap().len(), 2, "{on_node}");
    assert_eq!(events_on(server, "ckpt", "FaultlineDrainRequested"), 1);
    assert_eq!(events_on(server, "slow", "FaultlineDrainRequested"), 1);
    let pod_fault = format!("http://{pod_port}/v1/fault");
    until(
        Duration::from_secs(10),
        "the node's own fault.json lists them",
        || {
            let (s, body) = futures_block(call("GET", &pod_fault, None, String::new()));
            (s == 200 && body["drain"].as_array().is_some_and(|d| d.len() == 2)).then_some(())
        },
    )
    .await;
    assert_eq!(evicted_at(server, "ckpt"), None, "warned, not evicted");

    // Acknowledgements are checked: the pod's own address, a listed intent, a body.
    let ack = format!("http://{pod_port}/v1/drain/ack");
    let (s, body) = call("POST", &ack, None, json!({"uid": slow}).to_string()).await;
    assert_eq!(s, 403, "not slow's address: {body}");
    let (s, _) = call("POST", &ack, None, json!({"uid": "no-such"}).to_string()).await;
    assert_eq!(s, 404);
    let (s, _) = call("POST", &ack, None, "garbage".into()).await;
    assert_eq!(s, 400);
    assert_eq!(evicted_at(server, "slow"), None);

    // ckpt checkpointed and says so: evicted now, not in 300 s.
    let acked = Instant::now();
    let (s, body) = call("POST", &ack, None, json!({"uid": ckpt}).to_string()).await;
    assert_eq!(s, 202, "{body}");
    let (s, _) = call("POST", &ack, None, json!({"uid": ckpt}).to_string()).await;
    assert_eq!(s, 200, "once");
    until(Duration::from_secs(10), "ckpt evicted on its word", || {
        evicted_at(server, "ckpt")
    })
    .await;
    let took = acked.elapsed();
    eprintln!("acknowledgement -> eviction: {took:?}");

    // slow never acknowledged: evicted at its deadline, not before.
    let (at, _) = until(
        Duration::from_secs(15),
        "slow evicted at its deadline",
        || evicted_at(server, "slow"),
    )
    .await;
    let due = parse_rfc3339_ms(&i_slow.evict_after).unwrap();
    assert!(at >= due, "evicted {} ms before its deadline", due - at);
    eprintln!(
        "slow: evicted {} ms after its deadline ({} ms after the fault)",
        at - due,
        at - failed_at
    );
    for p in ["ckpt", "slow", "plain"] {
        assert!(evicted_once(server, p), "{p}");
    }
    let m = metric_until(
        agg.addr,
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"timed-out\"} 1",
        Duration::from_secs(5),
    )
    .await;
    for line in [
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"ok\"} 2",
        "faultline_aggregator_remediation_actions_total{action=\"drain\",result=\"acknowledged\"} 1",
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
    // The intents are gone with their pods, from the record and from fault.json.
    until(Duration::from_secs(10), "no intent left", || {
        node_entry(server, 1, "n1").filter(|e| e.drain.is_empty())
    })
    .await;
    let actions = record(server, "n1").unwrap()["actions"].to_string();
    assert!(
        actions.contains("evict default/ckpt (drain intent acknowledged)")
            && actions.contains("evict default/slow (drain intent timed-out)"),
        "{actions}"
    );
    assert_no_forbidden(server);
    agg.cancel_token().cancel();
    agg.wait().await;
}

/// `call` from a synchronous closure (`until` polls a closure).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}
