//! Ownership follows the shard Leases, end to end with real aggregator
//! processes: 3 replicas, 6 shards, 300 nodes of 8 devices (a fake fleet in this
//! process answering each node's long-poll). Each replica follows only the nodes of
//! the shards it holds (its fair share, counted from the member Leases); a replica
//! killed with SIGKILL has its shards taken over and rewritten with no device's
//! published status changing, and written alone (the takers' own shards are not
//! rewritten with them); a new replica gets its share as the others hand shards
//! back. Each shard is written over two pages (`--pages 2`), so a takeover is seeded
//! from both of its ConfigMaps.

mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::routing::get;
use faultline_common::fault::{page_name, NodeFaults, ShardIndex};
use faultline_test_apiserver::ApiServer;
use serde_json::{json, Value};
use support::*;

const NODES: usize = 300;
const SHARDS: u32 = 6;
/// ConfigMaps per shard: `faultline-shard-<i>` and `faultline-shard-<i>-page-1`.
const PAGES: u32 = 2;

/// Shares and writers as last seen, and since when.
type Settled = (Vec<(i64, i64)>, BTreeMap<u32, String>, Instant);

/// Per node: its document's generation and its failed devices.
type FleetState = HashMap<String, (u64, BTreeSet<usize>)>;

/// The fleet: per node a generation and its failed devices; a change wakes the polls.
#[derive(Clone)]
struct Fleet {
    nodes: Arc<Mutex<FleetState>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Fleet {
    fn doc(&self, node: &str) -> Option<Value> {
        let g = self.nodes.lock().unwrap();
        let (gen, failed) = g.get(node)?;
        let now = faultline_common::time::now_rfc3339();
        let npus: Vec<Value> = (0..8)
            .map(|i| {
                let bad = failed.contains(&i);
                json!({
                    "id": format!("gpu{i}"), "vendor": "nvidia", "source": "sim", "index": i,
                    "uuid": format!("GPU-{node}-{i}"), "temperature_c": 40.0,
                    "status": if bad { "failed" } else { "healthy" },
                    "reason": if bad { Some("pcie-link-down") } else { None },
                    "findings": if bad {
                        json!([{"code": "pcie-link-down", "status": "failed", "detail": "PCIe link is down"}])
                    } else {
                        json!([])
                    },
                    "pcie": {"up": !bad}, "sampled_at": now, "sample_age_ms": 0
                })
            })
            .collect();
        let f = failed.len();
        Some(json!({
            "schema_version": "faultline.node-health/v1", "generation": gen,
            "timestamp": now, "node": node, "agent_version": "0.1.0", "npus": npus,
            "summary": {"total": 8, "healthy": 8 - f, "degraded": 0, "failed": f, "unknown": 0},
            "sources": [{"name": "sim", "up": true, "consecutive_failures": 0, "abandoned_calls": 0}]
        }))
    }

    fn fail(&self, node: &str, device: usize) {
        let mut g = self.nodes.lock().unwrap();
        let e = g.get_mut(node).unwrap();
        e.0 += 1;
        e.1.insert(device);
        drop(g);
        self.changed.send_modify(|c| *c += 1);
    }
}

async fn health(
    State(fleet): State<Fleet>,
    Path(node): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let want: Option<u64> = q.get("wait_generation").and_then(|g| g.parse().ok());
    let wait = Duration::from_millis(
        q.get("timeout_ms")
            .and_then(|t| t.parse().ok())
            .unwrap_or(0u64)
            .min(30_000),
    );
    let mut rx = fleet.changed.subscribe();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let Some(doc) = fleet.doc(&node) else {
            return axum::http::StatusCode::NOT_FOUND.into_response();
        };
        if want != doc["generation"].as_u64() {
            return axum::Json(doc).into_response();
        }
        tokio::select! {
            _ = rx.changed() => {}
            _ = tokio::time::sleep_until(deadline) => return axum::Json(doc).into_response(),
        }
    }
}

async fn fleet() -> (Fleet, SocketAddr) {
    let fleet = Fleet {
        nodes: Arc::new(Mutex::new(
            (0..NODES)
                .map(|i| (format!("n{i}"), (1, BTreeSet::new())))
                .collect(),
        )),
        changed: Arc::new(tokio::sync::watch::channel(0).0),
    };
    let app = axum::Router::new()
        .route("/{node}/v1/health", get(health))
        .with_state(fleet.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (fleet, addr)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A replica: the real binary, killed (SIGKILL) when dropped.
struct Replica {
    child: Child,
    port: u16,
    name: String,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replica(kube: &str, name: &str, agents: &str) -> Replica {
    let port = free_port();
    let mut args = Launch::configmap(kube, name, SHARDS)
        .args(&["--agents", agents, "--remediation", "off"])
        .args(&["--pages", &PAGES.to_string()])
        // No refresh within the test: every write is one the test can account for.
        .args(&["--refresh", "300s"])
        .into_args();
    let at = args.iter().position(|a| a == "--listen").unwrap() + 1;
    args[at] = format!("127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_faultline-aggregator"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    Replica {
        child,
        port,
        name: name.to_string(),
    }
}

/// A gauge of a replica's metrics, if it answers.
async fn gauge(r: &Replica, name: &str) -> Option<i64> {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<hyper::body::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let url = format!("http://127.0.0.1:{}/metrics", r.port);
    let resp = tokio::time::timeout(Duration::from_secs(2), client.get(url.parse().ok()?))
        .await
        .ok()?
        .ok()?;
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .ok()?
        .to_bytes();
    let text = String::from_utf8_lossy(&body);
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("faultline_aggregator_{name} ")))?;
    line.rsplit(' ').next()?.parse().ok()
}

/// Every shard's writer and each device's published status.
fn published(server: &ApiServer) -> (BTreeMap<u32, String>, BTreeMap<(String, String), String>) {
    let mut writers = BTreeMap::new();
    let mut status = BTreeMap::new();
    for (s, p) in (0..SHARDS).flat_map(|s| (0..PAGES).map(move |p| (s, p))) {
        let Some(cm) = server.get("configmaps", NS, &page_name("faultline", s, p)) else {
            continue;
        };
        let data = cm["data"].as_object().cloned().unwrap_or_default();
        if let Some(i) = data
            .get("fault.json")
            .and_then(|v| serde_json::from_str::<ShardIndex>(v.as_str()?).ok())
        {
            writers.insert(s, i.writer);
        }
        for (k, v) in data {
            if k == "fault.json" {
                continue;
            }
            let n: NodeFaults = serde_json::from_str(v.as_str().unwrap()).unwrap();
            for d in n.npus {
                status.insert((n.node.clone(), d.id), d.status.as_str().to_string());
            }
        }
    }
    (writers, status)
}

async fn shares(rs: &[&Replica]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for r in rs {
        out.push((
            gauge(r, "shards_held").await.unwrap_or(-1),
            gauge(r, "nodes_followed").await.unwrap_or(-1),
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_shards_and_take_over_without_a_status_change() {
    let (server, kube) = api_server().await;
    let (fleet, addr) = fleet().await;
    // The fake documents are what an agent serves.
    let bytes = serde_json::to_vec(&fleet.doc("n0").unwrap()).unwrap();
    faultline_aggregator::agents::collect::admit_raw("n0", &bytes).expect("a node document");
    fleet.fail("n5", 3);
    fleet.fail("n17", 1);
    let agents: Vec<String> = (0..NODES)
        .map(|i| format!("n{i}=http://{addr}/n{i}"))
        .collect();
    let agents = agents.join(",");
    let r1 = replica(&kube, "r1", &agents);
    let r2 = replica(&kube, "r2", &agents);
    let r3 = replica(&kube, "r3", &agents);

    // Each holds its share (2 of 6), writes it, and follows only those shards' nodes;
    // settled: the same holders and writers for 2 s (four Lease passes).
    let steady: Mutex<Option<Settled>> = Mutex::new(None);
    let (s, _) = until_async(
        Duration::from_secs(60),
        "every replica at its share",
        || async {
            let s = shares(&[&r1, &r2, &r3]).await;
            let (writers, status) = published(&server);
            let by_writer = |w: &str| writers.values().filter(|x| *x == w).count();
            let ok = s.iter().all(|(h, _)| *h == 2)
                && ["r1", "r2", "r3"].iter().all(|w| by_writer(w) == 2)
                && s.iter().map(|(_, n)| *n).sum::<i64>() == NODES as i64
                && status.len() == NODES * 8;
            let mut g = steady.lock().unwrap();
            match g.as_ref() {
                _ if !ok => {
                    *g = None;
                    None
                }
                Some((s0, w0, t)) if *s0 == s && *w0 == writers => {
                    (t.elapsed() >= Duration::from_secs(2)).then_some(s)
                }
                _ => {
                    *g = Some((s, writers, Instant::now()));
                    None
                }
            }
        },
    )
    .await;
    // Both pages of every shard carry nodes (about half each), and only page 0 an index.
    for sh in 0..SHARDS {
        let page = server
            .get("configmaps", NS, &page_name("faultline", sh, 1))
            .unwrap_or_else(|| panic!("shard {sh} has its page 1"));
        let keys = page["data"].as_object().cloned().unwrap_or_default();
        assert!(
            !keys.contains_key("fault.json"),
            "shard {sh}: index on page 1"
        );
        assert!(
            keys.len() >= 10,
            "shard {sh}: page 1 holds {} nodes",
            keys.len()
        );
    }
    for (held, followed) in &s {
        assert!(
            (*followed as usize) < NODES / 2,
            "a replica follows only its shards' nodes: {s:?}"
        );
        assert_eq!(*held, 2);
    }
    let (_, before) = published(&server);
    assert_eq!(before[&("n5".to_string(), "gpu3".to_string())], "failed");
    assert_eq!(before.values().filter(|s| *s == "failed").count(), 2);

    // SIGKILL r1: no release, no final write. Its shards are taken over and rewritten by
    // the others, and no device's published status changes on the way.
    let (writers, _) = published(&server);
    let of_r1: Vec<u32> = writers
        .iter()
        .filter(|(_, w)| *w == "r1")
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(of_r1.len(), 2, "{writers:?}");
    let of_others: Vec<u32> = writers
        .iter()
        .filter(|(_, w)| *w != "r1")
        .map(|(s, _)| *s)
        .collect();
    drop(r1);
    let killed = Instant::now();
    let killed_ms = faultline_common::time::now_ms();
    let mut changed = BTreeSet::new();
    loop {
        let (writers, now) = published(&server);
        for (k, v) in &now {
            if before.get(k) != Some(v) {
                changed.insert((k.clone(), v.clone()));
            }
        }
        if of_r1
            .iter()
            .all(|s| writers.get(s).is_some_and(|w| w != "r1"))
        {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "r1's shards not taken over: {writers:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = killed.elapsed();
    assert!(
        changed.is_empty(),
        "statuses changed in the takeover: {changed:?}"
    );
    // A shard taken is written alone: the takers' own shards, unchanged, are not
    // rewritten with it (they were, every one of them, for every shard taken).
    // Two more Lease passes of each taker after the takeover.
    for r in [&r2, &r3] {
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], r.port).into();
        grows(addr, &[("faultline_aggregator_lease_passes_total", 2)]).await;
    }
    let own: Vec<String> = server
        .received()
        .into_iter()
        .filter(|c| c.method == "PUT" && c.at_ms >= killed_ms && c.uri.contains("/configmaps/"))
        .filter(|c| {
            of_others.iter().any(|sh| {
                let path = c.uri.split('?').next().unwrap_or_default();
                (0..PAGES).any(|p| path.ends_with(&format!("/{}", page_name("faultline", *sh, p))))
            })
        })
        .map(|c| c.uri)
        .collect();
    assert!(
        own.is_empty(),
        "the takers' own shards were rewritten with the taken ones: {own:?}"
    );
    eprintln!("r1's shards taken over and rewritten {took:?} after SIGKILL (lease 3 s)");
    until_async(
        Duration::from_secs(30),
        "r2 and r3 at 3 shards each",
        || async {
            let s = shares(&[&r2, &r3]).await;
            (s.iter().all(|(h, _)| *h == 3)
                && s.iter().map(|(_, n)| *n).sum::<i64>() == NODES as i64)
                .then_some(())
        },
    )
    .await;

    // A new replica gets its share (2 of 6): r2 and r3 hand one shard back each.
    let handed_before = gauge(&r2, "shard_rebalances_total").await.unwrap_or(0)
        + gauge(&r3, "shard_rebalances_total").await.unwrap_or(0);
    let r4 = replica(&kube, "r4", &agents);
    let started = Instant::now();
    until_async(Duration::from_secs(60), "r4 at its share", || async {
        let s = shares(&[&r2, &r3, &r4]).await;
        let (writers, _) = published(&server);
        let by_writer = |w: &str| writers.values().filter(|x| *x == w).count();
        (s.iter().all(|(h, _)| *h == 2)
            && ["r2", "r3", "r4"].iter().all(|w| by_writer(w) == 2)
            && s.iter().map(|(_, n)| *n).sum::<i64>() == NODES as i64)
            .then_some(())
    })
    .await;
    eprintln!(
        "shares even (2, 2, 2) {:?} after r4 started",
        started.elapsed()
    );
    let (_, after) = published(&server);
    assert_eq!(
        after, before,
        "no published status changed through the hand-backs"
    );
    let handed_back = gauge(&r2, "shard_rebalances_total").await.unwrap_or(0)
        + gauge(&r3, "shard_rebalances_total").await.unwrap_or(0);
    assert_eq!(
        handed_back - handed_before,
        2,
        "r2 and r3 handed one shard back each"
    );
    assert!(gauge(&r4, "seeded_devices_total").await.unwrap_or(0) >= 8);
    let taken = gauge(&r2, "shard_takeovers_total").await.unwrap_or(0)
        + gauge(&r3, "shard_takeovers_total").await.unwrap_or(0);
    assert!(taken >= 2, "r1's two shards were taken over");
    let names: Vec<&str> = [&r2, &r3, &r4].iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["r2", "r3", "r4"]);
    assert_no_forbidden(&server);
}

/// Poll an async check until it gives a value or `within` passes.
async fn until_async<T, F, Fut>(within: Duration, what: &str, mut f: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
