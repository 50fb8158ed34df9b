//! What faultline costs a real cluster. Run through
//! `benches/run-cluster-bench.sh`; docs/benchmarks.md, "Cluster costs", has the figures
//! and what they leave out.
//!
//! Everything is the real path, on this machine:
//!
//! - the Kubernetes API test server (in this process) with `BENCH_NODES` realistic GPU
//!   Nodes (~26 KB each, `fixtures::realistic_node`), one workload Pod per node that
//!   reads its node's own fault.json from a read-only hostPath (deploy/workload-example.yaml:
//!   no ConfigMap, so no kubelet watch), the RBAC of deploy/base/aggregator.yaml enforced,
//!   and the EndpointSlices of the agents' headless Service `faultline-agent` (100
//!   endpoints each), from which the replicas discover the agents (`--discovery
//!   endpoints`, the default; no `--agents`);
//! - the agents: child processes of this binary (`cluster-bench --fleet FIRST COUNT`),
//!   5,000 nodes each, every node at a loopback address of its own, sending what a real
//!   agent with the default deadband sends and taking node-local deliveries
//!   (`cluster_fleet.rs`);
//! - `BENCH_REPLICAS` release `faultline-aggregator` processes, `--sink configmap`,
//!   `--shards 32 --pages 2`, `--delivery-token-file`, everything else at its default
//!   (remediation dry-run, pod nudges on).
//!
//! Phases: (1) start until every node is published healthy, peak RSS per replica; (2)
//! steady state with 0, 1 and 2 s of API latency on every call: API bytes out, object
//! bytes written, requests by verb and resource, documents and CPU per replica against
//! a reference measured here, Lease holder changes, deliveries; (3) hard faults: the
//! API bytes of one device status change (faults alone), then 100 faults at latency 0
//! and a few at 2 s: to the node's delivered fault.json and to its shard ConfigMap; (4)
//! steady state again, with those nodes failed. One summary block at the end.

#[path = "cluster_fleet.rs"]
mod cluster_fleet;
#[path = "fleet.rs"]
mod fleet;
#[path = "fleet_procs.rs"]
mod fleet_procs;

#[path = "cluster_report.rs"]
mod cluster_report;
#[path = "cluster_run.rs"]
mod cluster_run;
#[path = "cluster_setup.rs"]
mod cluster_setup;

use cluster_report::*;
use cluster_run::*;
use cluster_setup::*;
use fleet_procs::{endpoint_slice, env_or, fleet_main, Fleets, CHUNK};
use std::collections::{BTreeMap, HashMap};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use cluster_fleet::{node_ip, now_us, FleetStats};
use faultline_common::fault::{page_name, page_of, shard_of, NodeFaults};
use faultline_common::DeviceStatus;
use faultline_test_apiserver::{fixtures, rbac, ApiServer, Bootstrap, Costs, Faults};
use fleet::{cpu_secs, node_name, proc_kib, Proc};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Endpoints per EndpointSlice (the endpointslice controller's default maximum).
const PER_SLICE: usize = 100;
const NS: &str = "faultline";
const BASE: &str = "faultline";
const SERVICE: &str = "faultline-agent";
const AGG_TOKEN: &str = "aggregator-token";
const AGG_USER: &str = "system:serviceaccount:faultline:faultline-aggregator";
/// Targets.
const MB: f64 = 1e6;
const KB: f64 = 1e3;

/// The run's settings (environment variables).
#[derive(Clone, Debug)]
struct Cfg {
    nodes: usize,
    replicas: usize,
    shards: u32,
    pages: u32,
    steady_s: u64,
    /// The steady phase at 2 s of latency or more (the target: 5 minutes).
    slow_steady_s: u64,
    settle_s: u64,
    latencies: Vec<u64>,
    faults: usize,
    slow_faults: usize,
    single_faults: usize,
    single_window_s: u64,
    publish: String,
    power_noise: f64,
    after_faults: bool,
}

impl Cfg {
    fn from_env() -> Self {
        Cfg {
            nodes: env_or("BENCH_NODES", 20_000),
            replicas: env_or("BENCH_REPLICAS", 4),
            shards: env_or("BENCH_SHARDS", 32),
            // 625 nodes a shard in 8 pages of ~210 KB: a status change rewrites its page
            // and page 0 (docs/aggregator.md, Sizing).
            pages: env_or("BENCH_PAGES", 8),
            steady_s: env_or("BENCH_STEADY_S", 120),
            slow_steady_s: env_or("BENCH_SLOW_STEADY_S", 300),
            settle_s: env_or("BENCH_SETTLE_S", 15),
            latencies: std::env::var("BENCH_LATENCIES_MS")
                .unwrap_or_else(|_| "0,1000,2000".into())
                .split(',')
                .filter_map(|v| v.trim().parse().ok())
                .collect(),
            faults: env_or("BENCH_FAULTS", 100),
            slow_faults: env_or("BENCH_SLOW_FAULTS", 5),
            single_faults: env_or("BENCH_SINGLE_FAULTS", 3),
            single_window_s: env_or("BENCH_SINGLE_WINDOW_S", 10),
            publish: env_or("BENCH_PUBLISH_NAMESPACES", String::new()),
            power_noise: env_or("BENCH_POWER_NOISE", 0.03),
            after_faults: env_or("BENCH_AFTER_FAULTS", 1) != 0,
        }
    }
}

async fn wait_started(server: &ApiServer, cfg: &Cfg, reps: &[Replica]) -> Result<Duration> {
    let t = Instant::now();
    let (most, least) = (
        (cfg.shards as usize).div_ceil(reps.len()) as f64,
        (cfg.shards as usize / reps.len()) as f64,
    );
    loop {
        let s = samples(reps).await;
        let fair = s.iter().all(|x| x.held >= least && x.held <= most)
            && s.iter().map(|x| x.followed).sum::<f64>() == cfg.nodes as f64;
        if fair && all_published_healthy(server, cfg) {
            return Ok(t.elapsed());
        }
        if t.elapsed() > Duration::from_secs(900) {
            bail!("not every node published healthy within 900 s");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn hwm(reps: &[Replica]) -> Vec<(String, f64)> {
    reps.iter()
        .map(|r| (r.name.clone(), proc_kib(r.pid(), "VmHWM:") as f64 / 1024.0))
        .collect()
}

async fn run(cfg: Cfg, agg: String) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("faultline-cluster-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let token = format!("{:032x}", rand::random::<u128>());
    std::fs::write(dir.join("kube-token"), AGG_TOKEN)?;
    std::fs::write(dir.join("delivery-token"), &token)?;
    let fleets = Fleets::spawn(cfg.nodes, &token, cfg.power_noise)?;
    let fleet_started = Instant::now();
    eprintln!("fleet: {} processes up", fleets.0.len());
    let (server, kube, seeded) = cluster(&cfg, &fleets).await?;
    eprintln!(
        "cluster seeded in {:.0} s ({} of Nodes)",
        seeded.took.as_secs_f64(),
        human(seeded.node_bytes as f64)
    );
    server.reset_costs();
    let started_ms = now_us() / 1000;
    let names: Vec<String> = (1..=cfg.replicas).map(|i| format!("r{i}")).collect();
    let reps = names
        .iter()
        .map(|n| Replica::start(&agg, &kube, n, &cfg, &dir))
        .collect::<Result<Vec<_>>>()?;
    let start = wait_started(&server, &cfg, &reps).await?;
    let start_costs = server.reset_costs();
    let hwm_start = hwm(&reps);
    eprintln!(
        "started: every node published healthy after {:.1} s",
        start.as_secs_f64()
    );
    let leases = watch_leases(server.clone(), cfg.shards);
    let mut run = Run {
        cfg: &cfg,
        server: server.clone(),
        reps,
        fleets,
        leases,
        doc: Arc::new(serde_json::to_vec(&cluster_fleet::first_doc(0))?),
        rng: rand::rngs::StdRng::seed_from_u64(7),
        latencies: Mutex::new(vec![(0, 0)]),
        fresh: (0..cfg.nodes).collect(),
        fleet_started,
    };
    let mut windows = Vec::new();
    for ms in cfg.latencies.clone() {
        windows.push(run.window(String::new(), ms).await?);
    }
    let hwm_steady = hwm(&run.reps);
    run.latency(0);
    tokio::time::sleep(Duration::from_secs(cfg.settle_s)).await;
    let mut singles = Vec::new();
    for _ in 0..cfg.single_faults {
        singles.push(run.single_cost().await?);
    }
    eprintln!("single faults measured");
    let fast = run.faults(cfg.faults, Duration::from_secs(10)).await?;
    eprintln!("{} faults at latency 0 done", cfg.faults);
    let slow = if cfg.slow_faults > 0 {
        run.latency(2000);
        tokio::time::sleep(Duration::from_secs(cfg.settle_s)).await;
        Some(run.faults(cfg.slow_faults, Duration::from_secs(60)).await?)
    } else {
        None
    };
    if cfg.after_faults {
        let failed = cfg.nodes - run.fresh.len();
        let label = format!("after the faults ({failed} nodes with a failed device)");
        windows.push(run.window(label, 0).await?);
    }
    run.latency(0);
    let mut by_minute = vec![0usize; ((now_us() / 1000 - started_ms) / 60_000 + 1) as usize];
    for c in server.calls() {
        if c.method == "PUT" && c.uri.contains("/configmaps/") && c.received_ms >= started_ms {
            by_minute[((c.received_ms - started_ms) / 60_000) as usize] += 1;
        }
    }
    let slow_calls = slow_calls(&server.calls(), &run.latencies.lock().unwrap(), started_ms);
    let latency_changes = run
        .latencies
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t >= started_ms)
        .map(|(t, l)| ((t - started_ms) as f64 / 1e3, *l))
        .collect();
    let report = Report {
        slow_calls,
        latency_changes,
        cm_updates_by_minute: by_minute,
        machine: machine(),
        commit: commit(),
        date: sh(&["date", "-u", "+%Y-%m-%d %H:%M UTC"]),
        command: std::env::var("BENCH_COMMAND")
            .unwrap_or_else(|_| std::env::args().collect::<Vec<_>>().join(" ")),
        seeded,
        start_s: start.as_secs_f64(),
        start_costs,
        hwm_start,
        hwm_steady,
        hwm_end: hwm(&run.reps),
        windows,
        singles,
        fast,
        slow,
        logs: run
            .reps
            .iter()
            .map(|r| {
                let (w, e) = r.log_lines();
                (r.name.clone(), w, e)
            })
            .collect(),
        names,
        cfg: cfg.clone(),
    };
    report.print();
    eprintln!("replica logs: {}", dir.display());
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some((first, count)) = fleet::fleet_args(&args, "cluster-bench")? {
        return fleet_main(first, count);
    }
    let Some(agg) = args.get(1).cloned() else {
        bail!("usage: cluster-bench PATH/TO/faultline-aggregator");
    };
    let cfg = Cfg::from_env();
    check_loopback(cfg.nodes)?;
    eprintln!("{cfg:?}");
    tokio::runtime::Runtime::new()?.block_on(run(cfg, agg))
}
