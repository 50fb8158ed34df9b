//! Aggregator benchmark. Run through `benches/run-aggregator-bench.sh`.
//!
//! A fleet of simulated agents is served from this process (one long-poll endpoint per
//! node under `/n/<i>`, each node's document changing now and then as real sensor
//! readings do), with the Kubernetes API test server in-process too; the release
//! `faultline-aggregator` runs as its own process against both.
//!
//! 1. Latency, 1,000 nodes x 8 devices: a hard fault is injected on a node's document;
//!    the time until the node's entry in its shard ConfigMap shows the device failed.
//! 2. Remediation, 1,000 nodes x 8 devices, each with a Node and a GPU pod: a hard
//!    fault is injected; the time until the Node carries the taint and until the pod on
//!    it is evicted (`--remediation enforce`, budgets wide open).
//! 3. Footprint, 5,000 nodes x 8 devices: the aggregator's CPU (share of one core) and
//!    resident memory at steady state, and ConfigMap writes per second.

#[path = "fleet.rs"]
mod fleet;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use faultline_common::fault::{shard_of, NodeFaults};
use faultline_common::DeviceStatus;
use faultline_test_apiserver::ApiServer;
use fleet::*;
use rand::{Rng, SeedableRng};

async fn start(
    agg: &str,
    nodes: usize,
    fleet: SocketAddr,
    kube: &str,
    shards: u32,
    extra: &[&str],
) -> Result<Proc> {
    // Each agent with its node (NODE=URL): --remediation enforce refuses bare URLs.
    let agents: Vec<String> = (0..nodes)
        .map(|i| format!("{}=http://{fleet}/n/{i}", node_name(i)))
        .collect();
    let list = std::env::temp_dir().join(format!("faultline-bench-agents-{}", std::process::id()));
    std::fs::write(&list, agents.join("\n"))?;
    let child = Command::new(agg)
        .args([
            "--sink",
            "configmap",
            "--kube-server",
            kube,
            "--namespace",
            "faultline",
            "--replica",
            "bench",
        ])
        .args([
            "--shards",
            &shards.to_string(),
            "--listen",
            "127.0.0.1:0",
            "--nudge-rate",
            "0",
        ])
        .arg("--agents-file")
        .arg(&list)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Proc(child))
}

fn entry(server: &ApiServer, node: &str, shards: u32) -> Option<NodeFaults> {
    let cm = server.get(
        "configmaps",
        "faultline",
        &format!("faultline-shard-{}", shard_of(node, shards)),
    )?;
    serde_json::from_str(cm["data"][format!("{node}.json")].as_str()?).ok()
}

async fn until_all_present(
    server: &ApiServer,
    nodes: usize,
    shards: u32,
    within: Duration,
) -> Result<Duration> {
    let t = Instant::now();
    loop {
        let present: usize = (0..shards)
            .filter_map(|s| server.get("configmaps", "faultline", &format!("faultline-shard-{s}")))
            .map(|cm| {
                cm["data"]
                    .as_object()
                    .map(|d| d.len().saturating_sub(1))
                    .unwrap_or(0)
            })
            .sum();
        if present == nodes {
            return Ok(t.elapsed());
        }
        if t.elapsed() > within {
            bail!("only {present} of {nodes} nodes published after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn latency(agg: &str, nodes: usize, injections: usize) -> Result<()> {
    let shards = 3;
    let fleet = Fleet::new(nodes);
    let addr = serve_fleet(fleet.clone()).await;
    noise(fleet.clone(), Duration::from_secs(5));
    let (server, kube) = api_server().await;
    let _p = start(agg, nodes, addr, &kube, shards, &[]).await?;
    let ready = until_all_present(&server, nodes, shards, Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut picked: Vec<usize> = (0..nodes).collect();
    let mut lat = Vec::new();
    for k in 0..injections {
        let i = picked.swap_remove(rng.random_range(0..picked.len()));
        let name = node_name(i);
        let t0 = Instant::now();
        fleet.change(i, |doc| hard_fault(doc, k % 8));
        let dev = format!("gpu{}", k % 8);
        loop {
            if entry(&server, &name, shards).is_some_and(|e| {
                e.npus
                    .iter()
                    .any(|d| d.id == dev && d.status == DeviceStatus::Failed)
            }) {
                lat.push(t0.elapsed());
                break;
            }
            if t0.elapsed() > Duration::from_secs(10) {
                bail!("fault on {name} not published within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
    }
    lat.sort();
    println!(
        "| fault to ConfigMap, {nodes} nodes x 8 devices, {injections} hard faults | p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms, max {:.0} ms (all published {:.1} s after start) |",
        pct(&lat, 0.5),
        pct(&lat, 0.95),
        pct(&lat, 0.99),
        lat.last().unwrap().as_secs_f64() * 1e3,
        ready.as_secs_f64()
    );
    Ok(())
}

async fn footprint(agg: &str, nodes: usize, shards: u32, secs: u64) -> Result<()> {
    let fleet = Fleet::new(nodes);
    let addr = serve_fleet(fleet.clone()).await;
    noise(fleet.clone(), Duration::from_secs(5));
    let (server, kube) = api_server().await;
    let p = start(agg, nodes, addr, &kube, shards, &[]).await?;
    let pid = p.0.id();
    let ready = until_all_present(&server, nodes, shards, Duration::from_secs(300)).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let writes = |s: &ApiServer| {
        s.calls()
            .iter()
            .filter(|c| {
                c.uri.contains("/configmaps") && matches!(c.method.as_str(), "PUT" | "POST")
            })
            .count()
    };
    let (c0, w0, t0) = (cpu_secs(pid), writes(&server), Instant::now());
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (c1, w1, dt) = (cpu_secs(pid), writes(&server), t0.elapsed().as_secs_f64());
    let mut shard_sizes = BTreeMap::new();
    for s in 0..shards {
        if let Some(cm) = server.get("configmaps", "faultline", &format!("faultline-shard-{s}")) {
            let bytes: usize = cm["data"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| k.len() + v.as_str().unwrap_or("").len())
                .sum();
            shard_sizes.insert(s, bytes);
        }
    }
    println!(
        "| steady state, {nodes} nodes x 8 devices ({shards} shards; each node's document changes every ~5 s) | CPU {:.1}% of one core; RSS {:.0} MiB (peak {:.0} MiB); {:.1} ConfigMap writes/s; largest ConfigMap {} KiB; all published {:.1} s after start |",
        (c1 - c0) / dt * 100.0,
        proc_kib(pid, "VmRSS:") as f64 / 1024.0,
        proc_kib(pid, "VmHWM:") as f64 / 1024.0,
        (w1 - w0) as f64 / dt,
        shard_sizes.values().max().copied().unwrap_or(0) / 1024,
        ready.as_secs_f64()
    );
    Ok(())
}

/// Fault to taint and fault to eviction, with every node a Node and one GPU pod each.
async fn remediation(agg: &str, nodes: usize, injections: usize) -> Result<()> {
    let shards = 3;
    let fleet = Fleet::new(nodes);
    let addr = serve_fleet(fleet.clone()).await;
    noise(fleet.clone(), Duration::from_secs(5));
    let (server, kube) = api_server().await;
    for i in 0..nodes {
        let name = node_name(i);
        server
            .create("nodes", "", serde_json::json!({"metadata": {"name": name}}))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        server
            .create(
                "pods",
                "default",
                serde_json::json!({"metadata": {"name": format!("train-{i}"), "namespace": "default"},
                    "spec": {"nodeName": name, "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}),
            )
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    let _p = start(
        agg,
        nodes,
        addr,
        &kube,
        shards,
        &[
            "--remediation",
            "enforce",
            "--max-quarantined",
            "100000",
            "--max-quarantined-percent",
            "100",
            "--breaker-nodes",
            "0",
            "--max-evictions-per-minute",
            "0",
            "--watch-pod-health",
            "false",
        ],
    )
    .await?;
    until_all_present(&server, nodes, shards, Duration::from_secs(120)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut picked: Vec<usize> = (0..nodes).collect();
    let (mut taint, mut evict) = (Vec::new(), Vec::new());
    for k in 0..injections {
        let i = picked.swap_remove(rng.random_range(0..picked.len()));
        let name = node_name(i);
        let t0 = Instant::now();
        fleet.change(i, |doc| hard_fault(doc, k % 8));
        let mut tainted = None;
        loop {
            if tainted.is_none()
                && server.get("nodes", "", &name).is_some_and(|n| {
                    n["spec"]["taints"]
                        .as_array()
                        .is_some_and(|t| !t.is_empty())
                })
            {
                tainted = Some(t0.elapsed());
            }
            // Evicted: Terminating (graceful deletion) or already gone.
            if server
                .get("pods", "default", &format!("train-{i}"))
                .is_none_or(|p| p.pointer("/metadata/deletionTimestamp").is_some())
            {
                taint.push(tainted.unwrap_or_else(|| t0.elapsed()));
                evict.push(t0.elapsed());
                break;
            }
            if t0.elapsed() > Duration::from_secs(15) {
                bail!("{name} not remediated within 15 s");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
    }
    taint.sort();
    evict.sort();
    for (what, v) in [("taint", &taint), ("eviction of the GPU pod", &evict)] {
        println!(
            "| fault to {what}, {nodes} nodes x 8 devices, {injections} hard faults (up to {injections} nodes quarantined) | p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms, max {:.0} ms |",
            pct(v, 0.5),
            pct(v, 0.95),
            pct(v, 0.99),
            v.last().unwrap().as_secs_f64() * 1e3,
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(agg) = args.get(1) else {
        bail!("usage: aggregator-bench PATH/TO/faultline-aggregator");
    };
    let n_lat: usize = std::env::var("BENCH_LATENCY_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let n_big: usize = std::env::var("BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    println!("| measure | result |\n|---|---|");
    let n_rem: usize = std::env::var("BENCH_REMEDIATION_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    if n_lat > 0 {
        latency(agg, n_lat, 100.min(n_lat)).await?;
    }
    if n_rem > 0 {
        remediation(agg, n_rem, 100.min(n_rem)).await?;
    }
    footprint(agg, n_big, 16, 30).await?;
    Ok(())
}
