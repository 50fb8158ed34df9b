//! What faultline costs a real control plane. Run through
//! `benches/run-real-cluster-bench.sh`; docs/benchmarks.md, "On the real control plane",
//! has the figures and what they leave out.
//!
//! - kube-apiserver, etcd, kube-controller-manager and kube-scheduler of a pinned
//!   release (`tests/controlplane`, built from their Go modules), started here;
//! - `BENCH_NODES` realistic GPU Nodes (~26 KB each, `fixtures::realistic_node`), whose
//!   kubelets this process plays as far as the control plane sees them: each node's
//!   Lease in `kube-node-lease` renewed every 10 s (so the node lifecycle controller
//!   keeps them Ready);
//! - the agents: child processes of this binary (`real-cluster-bench --fleet FIRST
//!   COUNT`, `cluster_fleet.rs`), every node at an address of its own in 10.244.0.0/16
//!   (made local in the script's network namespace: kube-apiserver refuses loopback
//!   endpoints), listed in EndpointSlices of the selector-less Service `faultline-agent`;
//! - `BENCH_REPLICAS` release `faultline-aggregator` processes under the RBAC of
//!   deploy/base (a token of its ServiceAccount), `--sink configmap`.
//!
//! Two windows of `BENCH_STEADY_S` on the same fleet: the fleet alone, then with
//! faultline publishing it (after every node is published healthy). faultline's share
//! is the difference: kube-apiserver's and etcd's CPU and memory, requests and response
//! bytes by verb and resource, watch event bytes, etcd's revisions, WAL bytes and
//! database size. Then `BENCH_FAULTS` hard faults one at a time: to the node's shard
//! ConfigMap, and to the node's own delivered fault.json.

#[path = "cluster_fleet.rs"]
mod cluster_fleet;
#[path = "fleet.rs"]
mod fleet;
#[path = "fleet_procs.rs"]
mod fleet_procs;
#[path = "real_cluster_measure.rs"]
mod real_cluster_measure;
#[path = "real_cluster_setup.rs"]
mod real_cluster_setup;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use cluster_fleet::{node_ip, now_us};
use faultline_common::fault::{page_name, page_of, shard_of, NodeFaults};
use faultline_common::DeviceStatus;
use faultline_controlplane::{ControlPlane, Options, Release};
use faultline_test_apiserver::fixtures;
use fleet::{cpu_secs, node_name, proc_kib, Proc};
use fleet_procs::{endpoint_slice, env_or, fleet_main, Fleets, CHUNK};
use futures_util::{stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use real_cluster_measure::*;
use real_cluster_setup::*;
use serde_json::{json, Value};

const NS: &str = "faultline";
const BASE: &str = "faultline";
const SERVICE: &str = "faultline-agent";
/// Endpoints per EndpointSlice (the endpointslice controller's default maximum).
const PER_SLICE: usize = 100;
/// A kubelet renews its node's Lease every 10 s (a quarter of its 40 s duration).
const RENEW: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
struct Cfg {
    nodes: usize,
    replicas: usize,
    shards: u32,
    pages: u32,
    steady_s: u64,
    warm_s: u64,
    faults: usize,
    release: Release,
}

impl Cfg {
    fn from_env() -> Result<Self> {
        let release = std::env::var("BENCH_RELEASE").unwrap_or_else(|_| "1.37".into());
        Ok(Cfg {
            nodes: env_or("BENCH_NODES", 5000),
            replicas: env_or("BENCH_REPLICAS", 2),
            shards: env_or("BENCH_SHARDS", 32),
            pages: env_or("BENCH_PAGES", 2),
            steady_s: env_or("BENCH_STEADY_S", 300),
            warm_s: env_or("BENCH_WARM_S", 120),
            faults: env_or("BENCH_FAULTS", 100),
            release: Release::ALL
                .into_iter()
                .find(|r| r.minor() == release)
                .ok_or_else(|| anyhow!("BENCH_RELEASE={release}: 1.35, 1.36 or 1.37"))?,
        })
    }
}

// ---------------------------------------------------------------------------------

async fn run(cfg: Cfg, agg: String) -> Result<()> {
    let dir = std::env::temp_dir().join(format!(
        "faultline-real-cluster-bench-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir)?;
    let token = format!("{:032x}", rand::random::<u128>());
    std::fs::write(dir.join("delivery-token"), &token)?;
    let cp = ControlPlane::start("real-cluster-bench", Options::new(cfg.release))
        .await
        .ok_or_else(|| anyhow!("the control plane could not be built (see above)"))?;
    eprintln!("control plane up in {:.1} s", cp.started_in.as_secs_f64());
    let admin = cp.admin().await;
    apply_base(&cp)?;
    let t = Instant::now();
    let nodes: Vec<(&str, Value)> = (0..cfg.nodes)
        .map(|i| {
            (
                "nodes",
                fixtures::realistic_node(&node_name(i), &node_ip(i).to_string()),
            )
        })
        .collect();
    let seeded_bytes = create_all(&admin, nodes).await?;
    eprintln!("{} Nodes in {:.1} s", cfg.nodes, t.elapsed().as_secs_f64());
    let beats = heartbeats(admin.clone(), cfg.nodes);
    let settled = settle(&admin, Duration::from_secs(1200)).await;
    eprintln!(
        "the Nodes stopped changing {:.0} s after",
        settled.as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(cfg.warm_s)).await;
    eprintln!(
        "Leases renewed: {} ok, {} failed",
        beats.0.load(Relaxed),
        beats.1.load(Relaxed)
    );

    let w0 = window(
        "the fleet alone, before",
        cfg.steady_s,
        &cp,
        &admin,
        &[],
        None,
    )
    .await;

    // faultline: the agents, their Service and slices, the replicas.
    let mut fleets = Fleets::spawn(cfg.nodes, &token, 0.03)?;
    let service: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
        "metadata": {"name": SERVICE, "namespace": NS},
        "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 8081}]},
    }))?;
    Api::namespaced(admin.clone(), NS)
        .create(&PostParams::default(), &service)
        .await?;
    let slices: Vec<(&str, Value)> = (0..cfg.nodes)
        .step_by(PER_SLICE)
        .enumerate()
        .map(|(k, first)| {
            let range = first..(first + PER_SLICE).min(cfg.nodes);
            (
                "endpointslices",
                endpoint_slice((NS, SERVICE), k, range, fleets.port_of(first)),
            )
        })
        .collect();
    create_all(&admin, slices).await?;
    let kubeconfig = cp.service_account_kubeconfig(NS, "faultline-aggregator");
    let reps = (1..=cfg.replicas)
        .map(|i| start_replica(&agg, &kubeconfig, &format!("r{i}"), &cfg, &dir))
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    loop {
        let (all, healthy) = published(&admin).await?;
        if all == cfg.nodes && healthy == cfg.nodes {
            break;
        }
        let most = env_or("BENCH_START_S", 900);
        if t.elapsed() > Duration::from_secs(most) {
            bail!(
                "{all} nodes published, {healthy} healthy, after {most} s (logs: {})",
                dir.display()
            );
        }
        eprintln!(
            "{:.0} s: {all} nodes published, {healthy} healthy",
            t.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    eprintln!(
        "every node published healthy {:.1} s after the replicas started",
        t.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(cfg.warm_s)).await;
    let w1 = window(
        "with faultline",
        cfg.steady_s,
        &cp,
        &admin,
        &reps,
        Some(&fleets),
    )
    .await;

    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(7);
    let mut to_cm = Vec::new();
    let mut injected = HashMap::new();
    for k in 0..cfg.faults {
        let i = rand::Rng::random_range(&mut rng, 0..cfg.nodes);
        if injected.contains_key(&i) {
            continue;
        }
        let dev = k % cluster_fleet::DEVICES;
        let t0 = Instant::now();
        injected.insert(i, now_us());
        fleets.fail(i, dev)?;
        loop {
            if published_failed(&admin, &cfg, i, dev).await {
                to_cm.push(t0.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                eprintln!("fault {k} on {}: not published within 60 s", node_name(i));
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let arrivals = fleets.arrivals()?;
    let mut local: Vec<f64> = injected
        .iter()
        .filter_map(|(i, t)| Some((*arrivals.get(i)? as f64 - *t as f64) / 1e3))
        .collect();
    let delivered = fleets.stats()?;
    drop(reps);
    drop(fleets);
    tokio::time::sleep(Duration::from_secs(cfg.warm_s)).await;
    let w2 = window(
        "the fleet alone, after",
        cfg.steady_s,
        &cp,
        &admin,
        &[],
        None,
    )
    .await;
    let unreachable = cp.kubectl(&[
        "get",
        "nodes",
        "-o",
        "jsonpath={range .items[*]}{.spec.taints[*].key}{\"\\n\"}{end}",
    ]);
    let tainted = unreachable
        .lines()
        .filter(|l| l.contains("unreachable") || l.contains("not-ready"))
        .count();
    eprintln!("nodes tainted unreachable or not-ready by the node lifecycle controller: {tainted}");
    let windows = Windows {
        before: w0,
        with: w1,
        after: w2,
    };
    report(&cfg, &windows, &mut to_cm, &mut local, seeded_bytes);
    println!(
        "The Nodes stopped changing {:.0} s after they were made (kube-controller-manager's TTL controller rewrites each as the cluster grows).",
        settled.as_secs_f64()
    );
    println!(
        "The fleet took {} entries and {} confirmations, refused {}, over the whole run",
        delivered.entries, delivered.confirms, delivered.refused
    );
    println!("Leases renewed: {} ok, {} failed; nodes tainted unreachable/not-ready: {tainted}; fleet processes: {}", beats.0.load(Relaxed), beats.1.load(Relaxed), cfg.nodes.div_ceil(CHUNK));
    eprintln!("replica logs: {}", dir.display());
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some((first, count)) = fleet::fleet_args(&args, "real-cluster-bench")? {
        return fleet_main(first, count);
    }
    let Some(agg) = args.get(1).cloned() else {
        bail!("usage: real-cluster-bench PATH/TO/faultline-aggregator (benches/run-real-cluster-bench.sh)");
    };
    let cfg = Cfg::from_env()?;
    eprintln!("{cfg:?}");
    tokio::runtime::Runtime::new()?.block_on(run(cfg, agg))
}
