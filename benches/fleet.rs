//! What the aggregator benchmarks share: a fleet of simulated agents (one long-poll
//! endpoint per node under `/n/<i>`, each node's document changing now and then as
//! real sensor readings do), the in-process Kubernetes API test server, and readings
//! of a process's CPU and memory from `/proc`.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use faultline_common::testing::{self, Device};
use faultline_common::{DeviceHealth, NodeHealth, Summary};
use faultline_test_apiserver::{ApiServer, Bootstrap};
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

pub struct SimNode {
    doc: Mutex<(NodeHealth, bytes::Bytes)>,
    generation: watch::Sender<u64>,
}

/// Nodes `first..first + nodes.len()`, served under `/n/<global index>`.
pub struct Fleet {
    pub first: usize,
    pub nodes: Vec<SimNode>,
}

/// Device `i` of a node: a healthy GPU as NVML reads it, at 50 C and 300 W.
pub fn device(i: u32) -> DeviceHealth {
    Device::nvml(i)
        .temperature(50.0)
        .power(300.0)
        .sample_age_ms(200)
        .build()
}

/// The UUID of GPU `d` of node `i`: its own, as a real fleet's (no two nodes report
/// one UUID; the aggregator flags and withholds a UUID that two nodes report).
pub fn gpu_uuid(i: usize, d: u32) -> String {
    format!("GPU-5157e000-0000-4000-8000-{i:08x}{d:04x}")
}

/// `BIN --fleet FIRST COUNT`: the part of the fleet a child process serves, when these
/// are its arguments.
pub fn fleet_args(args: &[String], bin: &str) -> anyhow::Result<Option<(usize, usize)>> {
    if args.get(1).map(String::as_str) != Some("--fleet") {
        return Ok(None);
    }
    let n = |i: usize| -> anyhow::Result<usize> {
        args.get(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("usage: {bin} --fleet FIRST COUNT"))
    };
    Ok(Some((n(2)?, n(3)?)))
}

/// Node `i`'s first document: 8 healthy devices.
pub fn node_health(i: usize) -> NodeHealth {
    testing::node(&node_name(i))
        .timestamp("")
        .agent_version("bench")
        .npus((0..8).map(|d| {
            let mut dev = device(d);
            dev.reading.uuid = Some(gpu_uuid(i, d));
            dev
        }))
        .build()
}

pub fn node_name(i: usize) -> String {
    format!("gpu-node-{i:05}")
}

impl Fleet {
    /// Nodes `0..n`.
    pub fn new(n: usize) -> Arc<Self> {
        Self::range(0, n)
    }

    /// Nodes `first..first + n`.
    pub fn range(first: usize, n: usize) -> Arc<Self> {
        Self::with_docs(first, n, node_health)
    }

    /// Nodes `first..first + n`, node `i`'s first document `doc(i)`.
    pub fn with_docs(first: usize, n: usize, first_doc: impl Fn(usize) -> NodeHealth) -> Arc<Self> {
        let nodes = (first..first + n)
            .map(|i| {
                let doc = first_doc(i);
                let bytes = bytes::Bytes::from(serde_json::to_vec(&doc).unwrap());
                SimNode {
                    doc: Mutex::new((doc, bytes)),
                    generation: watch::channel(1).0,
                }
            })
            .collect();
        Arc::new(Fleet { first, nodes })
    }

    /// The size of node `i`'s document (local index), in bytes.
    pub fn doc_len(&self, i: usize) -> usize {
        self.nodes[i].doc.lock().unwrap().1.len()
    }

    /// Change node `i` (local index) and wake its long-polls.
    pub fn change(&self, i: usize, f: impl FnOnce(&mut NodeHealth)) {
        let node = &self.nodes[i];
        let mut g = node.doc.lock().unwrap();
        f(&mut g.0);
        g.0.generation += 1;
        g.0.summary = Summary::of(&g.0.npus);
        g.1 = bytes::Bytes::from(serde_json::to_vec(&g.0).unwrap());
        node.generation.send_replace(g.0.generation);
    }
}

/// The query of `/v1/health`.
#[derive(serde::Deserialize)]
pub struct Q {
    wait_generation: Option<u64>,
    timeout_ms: Option<u64>,
    watch: Option<String>,
}

/// The agent's watch stream (`agent/src/api.rs`): each new document as a line, a
/// blank line at the heartbeat; it ends after `life` when given (a real agent ends a
/// stream after 5-10 minutes, `WATCH_MIN_LIFE`).
fn watch(
    f: Arc<Fleet>,
    i: usize,
    seen: Option<u64>,
    heartbeat: Duration,
    life: Option<Duration>,
) -> axum::response::Response {
    let rx = f.nodes[i].generation.subscribe();
    let end = life.map(|l| tokio::time::Instant::now() + l);
    let stream =
        futures_util::stream::unfold((f, rx, seen), move |(f, mut rx, mut seen)| async move {
            loop {
                if end.is_some_and(|e| tokio::time::Instant::now() >= e) {
                    return None;
                }
                let now = *rx.borrow_and_update();
                if seen != Some(now) {
                    let (generation, body) = {
                        let g = f.nodes[i].doc.lock().unwrap();
                        (g.0.generation, g.1.clone())
                    };
                    seen = Some(generation);
                    let mut line = Vec::with_capacity(body.len() + 1);
                    line.extend_from_slice(&body);
                    line.push(b'\n');
                    let item = Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line));
                    return Some((item, (f, rx, seen)));
                }
                let wait = end.map_or(heartbeat, |e| {
                    heartbeat.min(e.saturating_duration_since(tokio::time::Instant::now()))
                });
                match tokio::time::timeout(wait, rx.changed()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return None,
                    Err(_) if end.is_some_and(|e| tokio::time::Instant::now() >= e) => return None,
                    Err(_) => {
                        let item = Ok(bytes::Bytes::from_static(b"\n"));
                        return Some((item, (f, rx, seen)));
                    }
                }
            }
        });
    (
        [("content-type", "application/x-ndjson")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

async fn health(
    State(f): State<Arc<Fleet>>,
    Path(i): Path<usize>,
    Query(q): Query<Q>,
) -> axum::response::Response {
    let Some(local) = i.checked_sub(f.first).filter(|i| *i < f.nodes.len()) else {
        return axum::http::StatusCode::NOT_FOUND.into_response();
    };
    health_of(f, local, q, None).await
}

/// `/v1/health` of node `local` (an index into `f.nodes`): the document, a long-poll
/// (`wait_generation`) or a watch stream (`watch=true`) that ends after `life` if given.
pub async fn health_of(
    f: Arc<Fleet>,
    local: usize,
    q: Q,
    life: Option<Duration>,
) -> axum::response::Response {
    if matches!(q.watch.as_deref(), Some("true" | "1")) {
        let heartbeat = Duration::from_millis(q.timeout_ms.unwrap_or(10_000).clamp(1_000, 30_000));
        return watch(f.clone(), local, q.wait_generation, heartbeat, life);
    }
    let node = &f.nodes[local];
    if let Some(seen) = q.wait_generation {
        let mut rx = node.generation.subscribe();
        let wait = Duration::from_millis(q.timeout_ms.unwrap_or(10_000).min(60_000));
        let _ = tokio::time::timeout(wait, rx.wait_for(|g| *g != seen)).await;
    }
    let body = node.doc.lock().unwrap().1.clone();
    ([("content-type", "application/json")], body).into_response()
}

pub async fn serve_fleet(fleet: Arc<Fleet>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/n/{i}/v1/health", get(health))
        .with_state(fleet);
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Sensor noise: every node's document changes about once per `period`.
pub fn noise(fleet: Arc<Fleet>, period: Duration) {
    tokio::spawn(async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let tick = Duration::from_millis(100);
        let per_tick = (fleet.nodes.len() as f64 * tick.as_secs_f64() / period.as_secs_f64())
            .max(1.0) as usize;
        loop {
            tokio::time::sleep(tick).await;
            for _ in 0..per_tick {
                let i = rng.random_range(0..fleet.nodes.len());
                let d = rng.random_range(0..8);
                let t = rng.random_range(45.0..60.0);
                fleet.change(i, |doc| doc.npus[d].reading.temperature_c = Some(t));
            }
        }
    });
}

/// A child process, killed when dropped.
#[allow(unused_imports)]
pub use faultline_common::testing::ChildGuard as Proc;

/// A hard fault (Xid 79) on device `d` of a document.
pub fn hard_fault(doc: &mut NodeHealth, d: usize) {
    testing::mark_failed(&mut doc.npus[d], "xid-79");
}

pub fn proc_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

pub fn cpu_secs(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    (f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0))
        / 100.0
}

pub fn pct(v: &[Duration], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

/// The test API server with the `faultline` namespace; its URL.
pub async fn api_server() -> (ApiServer, String) {
    Bootstrap::new().namespace("faultline").spawn().await
}
