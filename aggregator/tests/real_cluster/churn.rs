//! Fifty GPU faults at once on a real 1.37 cluster, amid pod churn: every failed GPU
//! quarantined alone or its node tainted with the reason, no rule left at `None`, the
//! holders evicted and nobody else.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faultline_controlplane::Release;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams};

use crate::support::{self, real::RealCluster};
use crate::HEALING;

/// Nodes with one failed GPU each: the device path.
const ONE: usize = 26;
/// Nodes with three failed GPUs of four each: the node path (`node_after_devices`).
const THREE: usize = 8;
/// Pods holding a GPU on each node before the faults.
const HOLDERS: usize = 2;

/// Every pod that held a GPU, and which: (pod, pool, device), as the claims said.
type Held = Arc<Mutex<BTreeSet<(String, String, String)>>>;

fn claims(client: &kube::Client) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "resource.k8s.io".into(),
        version: "v1".into(),
        api_version: "resource.k8s.io/v1".into(),
        kind: "ResourceClaim".into(),
        plural: "resourceclaims".into(),
    };
    Api::namespaced_with(client.clone(), "default", &ar)
}

async fn create(client: &kube::Client, name: &str, node: &str) {
    let (claim, pod) = support::real::gpu_pod_objects(name, node, serde_json::json!([]));
    let (claim, pod): (DynamicObject, Pod) = (
        serde_json::from_value(claim).unwrap(),
        serde_json::from_value(pod).unwrap(),
    );
    let pp = PostParams::default();
    claims(client).create(&pp, &claim).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&pp, &pod).await.unwrap();
}

/// Record every allocation the claims show, every 100 ms, until `stop`.
async fn follow_claims(client: kube::Client, held: Held, stop: Arc<AtomicBool>) {
    let api = claims(&client);
    while !stop.load(Ordering::Relaxed) {
        if let Ok(list) = api.list(&ListParams::default()).await {
            let mut h = held.lock().unwrap();
            for c in list.items {
                let status = &c.data["status"];
                let results = status["allocation"]["devices"]["results"].as_array();
                let pods = status["reservedFor"].as_array();
                for (r, p) in results
                    .into_iter()
                    .flatten()
                    .flat_map(|r| pods.into_iter().flatten().map(move |p| (r, p)))
                {
                    if let (Some(pool), Some(dev), Some(pod)) =
                        (r["pool"].as_str(), r["device"].as_str(), p["name"].as_str())
                    {
                        h.insert((pod.into(), pool.into(), dev.into()));
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Pod churn on `nodes` until `stop`: every 300 ms a pod asking for a GPU is made on
/// the next node, and the one made four turns before is deleted, with its claim. The
/// names of the pods it deleted.
async fn churn(client: kube::Client, nodes: Vec<String>, stop: Arc<AtomicBool>) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut deleted = Vec::new();
    let mut k = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("churn-{k}");
        create(&client, &name, &nodes[k % nodes.len()]).await;
        if k >= 4 {
            let old = format!("churn-{}", k - 4);
            let _ = pods.delete(&old, &DeleteParams::default()).await;
            let _ = claims(&client)
                .delete(&format!("{old}-gpu"), &DeleteParams::default())
                .await;
            deleted.push(old);
        }
        k += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    deleted
}

/// The pods faultline evicted (each `create` of `pods/<name>/eviction` it sent), by the
/// audit log: name → the answers' codes.
fn evictions(c: &RealCluster) -> BTreeMap<String, Vec<u16>> {
    let mut out: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for e in c.cp.audit() {
        let pod = e
            .uri
            .strip_prefix("/api/v1/namespaces/default/pods/")
            .and_then(|rest| rest.split('?').next())
            .and_then(|rest| rest.strip_suffix("/eviction"));
        if let (Some(pod), "create") = (pod, e.verb.as_str()) {
            out.entry(pod.to_string()).or_default().push(e.code);
        }
    }
    out
}

/// How the failed GPUs stand now, or what is not yet as the end requires.
fn settled(
    c: &RealCluster,
    failed: &BTreeSet<(String, String)>,
    holders: &BTreeSet<String>,
    churned: &BTreeSet<String>,
) -> Result<(usize, usize), String> {
    let rules = c.rules();
    let at_none: Vec<String> = rules
        .iter()
        .filter(|r| r["spec"]["taint"]["effect"] == "None")
        .map(|r| r["metadata"]["name"].to_string())
        .collect();
    if !at_none.is_empty() {
        return Err(format!("{} rules at None: {at_none:?}", at_none.len()));
    }
    let nodes = c.items(&["nodes"]);
    let node = |name: &str| nodes.iter().find(|n| n["metadata"]["name"] == name);
    let (mut alone, mut by_node) = (0, 0);
    for (pool, device) in failed {
        let rule = rules.iter().find(|r| {
            r["spec"]["deviceSelector"]["pool"] == pool.as_str()
                && r["spec"]["deviceSelector"]["device"] == device.as_str()
        });
        let n = node(pool).ok_or(format!("no node {pool}"))?;
        let tainted = n["spec"]["taints"]
            .as_array()
            .is_some_and(|t| RealCluster::ours(t) > 0);
        let why = n["metadata"]["annotations"]["faultline.io/quarantine"]
            .as_str()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
            .and_then(|r| r["node_why"].as_str().map(String::from));
        match (rule, tainted, why) {
            (_, true, Some(_)) => by_node += 1,
            (Some(r), false, _) if r["spec"]["taint"]["effect"] == "NoSchedule" => alone += 1,
            (r, t, w) => {
                return Err(format!(
                    "{pool}/{device}: rule {:?}, node tainted {t}, why {w:?}",
                    r.map(|r| &r["spec"]["taint"])
                ))
            }
        }
    }
    let pods = c.items(&["-n", "default", "pods"]);
    for h in holders.iter().filter(|h| !churned.contains(*h)) {
        if let Some(p) = pods.iter().find(|p| p["metadata"]["name"] == h.as_str()) {
            if p["metadata"]["deletionTimestamp"].is_null() {
                return Err(format!("holder {h} still runs"));
            }
        }
    }
    Ok((alone, by_node))
}

/// The issue's done-when, on 1.37: 50 GPU faults at once on 34 nodes, 26 with one
/// failed GPU (the device path: a DeviceTaintRule each) and 8 with three (the node
/// path), while pods asking for GPUs are made and deleted on the one-GPU nodes every
/// 300 ms, so some land on a failed GPU while its rule waits at `None` for the
/// controller's prediction. It ends with every failed GPU behind a `NoSchedule` rule of
/// its own or its node's taint with the reason in the record, no rule at `None`, every
/// pod that held a failed GPU evicted (or deleted by the churn), and no eviction of any
/// other pod (the apiserver's audit log of faultline's requests).
async fn fifty_faults_amid_pod_churn(release: Release) {
    let test = format!("fifty_faults_amid_pod_churn ({release:?})");
    let Some(c) = RealCluster::enforcing(&test, release, ONE + THREE).await else {
        return;
    };
    let nodes: Vec<String> = (1..=ONE + THREE).map(|i| format!("n{i}")).collect();
    let mut ids = BTreeMap::new();
    for n in &nodes {
        for (device, id) in c.publish_gpus(n).await {
            ids.insert((n.clone(), device), id);
        }
    }
    let held: Held = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let follow = tokio::spawn(follow_claims(c.client.clone(), held.clone(), stop.clone()));
    for n in &nodes {
        for h in 0..HOLDERS {
            create(&c.client, &format!("h-{n}-{h}"), n).await;
        }
    }
    // Every holder runs on its GPU.
    let start = Instant::now();
    let placed: BTreeMap<String, (String, String)> = loop {
        let running: BTreeSet<String> = c
            .items(&[
                "-n",
                "default",
                "pods",
                "--field-selector=status.phase=Running",
            ])
            .iter()
            .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
            .collect();
        let placed: BTreeMap<_, _> = held
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| running.contains(p))
            .map(|(p, pool, d)| (p.clone(), (pool.clone(), d.clone())))
            .collect();
        if placed.len() == nodes.len() * HOLDERS {
            break placed;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{} of {} holders running on a GPU",
            placed.len(),
            nodes.len() * HOLDERS
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "{test}: {} holders placed in {:?}",
        placed.len(),
        start.elapsed()
    );
    // The GPUs to fail: on a one-GPU node the first holder's, or every fourth a free
    // one (the churn may put a pod on it while its rule waits); on a three-GPU node the
    // first holder's and both free ones, the second holder's GPU left healthy.
    let mut failed: BTreeSet<(String, String)> = BTreeSet::new();
    for (i, n) in nodes.iter().enumerate() {
        let used: Vec<String> = (0..HOLDERS)
            .map(|h| placed[&format!("h-{n}-{h}")].1.clone())
            .collect();
        let free: Vec<String> = (0..4)
            .map(|g| format!("gpu-{g}"))
            .filter(|d| !used.contains(d))
            .collect();
        let pick: Vec<&String> = match (i < ONE, i % 4) {
            (true, 0) => vec![&free[0]],
            (true, _) => vec![&used[0]],
            (false, _) => vec![&used[0], &free[0], &free[1]],
        };
        failed.extend(pick.into_iter().map(|d| (n.clone(), d.clone())));
    }
    assert_eq!(failed.len(), 50);

    let extra = [
        HEALING[0],
        HEALING[1],
        "--max-quarantined=34",
        // 34 nodes failing at once is this drill, not a monitoring fault.
        "--breaker-nodes=0",
        "--max-evictions-per-minute=0",
    ];
    let (_agg, url) = c.aggregator("faultline-aggregator-0", &extra).await;
    let churning = tokio::spawn(churn(c.client.clone(), nodes[..ONE].to_vec(), stop.clone()));
    let t0 = Instant::now();
    for (n, d) in &failed {
        let fault = format!(
            r#"{{"device":"{}","fault":"row-remap-failure"}}"#,
            ids[&(n.clone(), d.clone())]
        );
        assert_eq!(
            support::post(c.agent_addr(n), "/v1/sim/faults", &fault).await,
            201
        );
    }
    // The end, reached while the churn goes on.
    let holders_now = |held: &Held| -> BTreeSet<String> {
        held.lock()
            .unwrap()
            .iter()
            .filter(|(_, pool, d)| failed.contains(&(pool.clone(), d.clone())))
            .map(|(p, _, _)| p.clone())
            .collect()
    };
    let mut last;
    let (alone, by_node) = loop {
        // The churn's pods are judged once it stopped; the placed holders now.
        let holders: BTreeSet<String> = holders_now(&held)
            .into_iter()
            .filter(|p| !p.starts_with("churn-"))
            .collect();
        match settled(&c, &failed, &holders, &BTreeSet::new()) {
            Ok(done) => break done,
            Err(e) => last = e,
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "not settled within 240 s: {last}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let settled_in = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let churned: BTreeSet<String> = churning.await.unwrap().into_iter().collect();
    follow.await.unwrap();
    let holders = holders_now(&held);
    // The churn's holders too: each evicted, or deleted by the churn itself.
    let start = Instant::now();
    while let Err(e) = settled(&c, &failed, &holders, &churned) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "after the churn: {e}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let evicted = evictions(&c);
    let others: Vec<&String> = evicted.keys().filter(|p| !holders.contains(*p)).collect();
    assert!(
        others.is_empty(),
        "evicted though they held no failed GPU: {others:?}"
    );
    let missed: Vec<&String> = holders
        .iter()
        .filter(|h| !churned.contains(*h))
        .filter(|h| !evicted.get(*h).is_some_and(|codes| codes.contains(&201)))
        .collect();
    assert!(missed.is_empty(), "holders never evicted: {missed:?}");
    let churn_held = holders.iter().filter(|h| h.starts_with("churn-")).count();
    let asked_again = c
        .rules()
        .iter()
        .filter(|r| r["metadata"]["generation"].as_i64() > Some(2))
        .count();
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let metrics = support::metrics(addr).await;
    let given_up = metrics
        .lines()
        .find(|l| l.contains(r#"action="quarantine-device",result="given-up""#))
        .unwrap_or("none given up");
    eprintln!(
        "{test}: settled in {settled_in:?}: {alone} GPUs quarantined alone, {by_node} by \
         their node; {} pods held a failed GPU ({churn_held} of them churn pods), {} evicted; \
         {} churn pods made and deleted; {asked_again} rules asked again; {given_up}; {}",
        holders.len(),
        evicted.len(),
        churned.len(),
        c.memory()
    );
    c.assert_no_forbidden();
}

on_releases!(fifty_faults_amid_pod_churn:
    fifty_faults_amid_pod_churn_1_37 = V1_37,
    fifty_faults_amid_pod_churn_1_36 = V1_36,
    fifty_faults_amid_pod_churn_1_35 = V1_35,
);
