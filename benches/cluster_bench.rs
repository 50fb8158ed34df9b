//! What faultline costs a real cluster (issue 25). Run through
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

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use cluster_fleet::{node_ip, now_us, Agents, FleetStats};
use faultline_common::fault::{page_name, page_of, shard_of, NodeFaults};
use faultline_common::DeviceStatus;
use faultline_test_apiserver::{fixtures, rbac, ApiServer, Bootstrap, Costs, Faults};
use fleet::{cpu_secs, node_name, proc_kib, Proc};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Nodes per fleet process (this machine's hard limit is 20,000 open files; each node
/// holds a watch and a delivery connection).
const CHUNK: usize = 5000;
/// Endpoints per EndpointSlice (the endpointslice controller's default maximum).
const PER_SLICE: usize = 100;
const NS: &str = "faultline";
const BASE: &str = "faultline";
const SERVICE: &str = "faultline-agent";
const AGG_TOKEN: &str = "aggregator-token";
const AGG_USER: &str = "system:serviceaccount:faultline:faultline-aggregator";
/// Targets (issue 25).
const MB: f64 = 1e6;
const KB: f64 = 1e3;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The run's settings (environment variables).
#[derive(Clone, Debug)]
struct Cfg {
    nodes: usize,
    replicas: usize,
    shards: u32,
    pages: u32,
    steady_s: u64,
    /// The steady phase at 2 s of latency or more (the issue: 5 minutes).
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

// ---------------------------------------------------------------------------------
// The fleet processes.

/// A fleet process's part: serve nodes `first..first + count`; commands on stdin
/// (`fail I D`, `stats`, `arrivals`), answers on stdout; exit when stdin closes.
fn fleet_main(first: usize, count: usize) -> Result<()> {
    let token = std::env::var("BENCH_DELIVERY_TOKEN").context("BENCH_DELIVERY_TOKEN")?;
    let noise: f64 = env_or("BENCH_POWER_NOISE", 0.03);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let agents = Agents::new(first, count, &token);
        let port = cluster_fleet::serve(agents.clone()).await?;
        cluster_fleet::noise(agents.clone(), noise);
        println!("{port}");
        std::io::stdout().flush()?;
        std::thread::spawn(move || control(&agents));
        std::future::pending::<()>().await;
        Ok(())
    })
}

fn control(a: &Agents) {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let mut out = std::io::stdout().lock();
        let _ = match w.as_slice() {
            ["fail", i, d] => match (i.parse(), d.parse()) {
                (Ok(i), Ok(d)) if d < cluster_fleet::DEVICES && a.fail(i, d) => Ok(()),
                _ => writeln!(std::io::stderr(), "fleet: bad command {line:?}"),
            },
            ["stats"] => writeln!(out, "{}", json!(a.stats())),
            ["arrivals"] => writeln!(out, "{}", json!(a.arrivals())),
            _ => writeln!(std::io::stderr(), "fleet: bad command {line:?}"),
        };
        let _ = out.flush();
    }
    std::process::exit(0);
}

struct FleetPart {
    proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    port: u16,
}

/// The whole fleet, in parts of [`CHUNK`] nodes.
struct Fleets(Vec<FleetPart>);

impl Fleets {
    fn spawn(nodes: usize, token: &str, noise: f64) -> Result<Self> {
        let mut parts = Vec::new();
        for first in (0..nodes).step_by(CHUNK) {
            let count = CHUNK.min(nodes - first);
            let mut child = Command::new(std::env::current_exe()?)
                .args(["--fleet", &first.to_string(), &count.to_string()])
                .env("BENCH_DELIVERY_TOKEN", token)
                .env("BENCH_POWER_NOISE", noise.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()?;
            let stdin = child.stdin.take().context("fleet stdin")?;
            let mut stdout = BufReader::new(child.stdout.take().context("fleet stdout")?);
            let mut line = String::new();
            stdout.read_line(&mut line)?;
            let port = line.trim().parse().context("fleet port")?;
            parts.push(FleetPart {
                proc: Proc(child),
                stdin,
                stdout,
                port,
            });
        }
        Ok(Fleets(parts))
    }

    fn port_of(&self, i: usize) -> u16 {
        self.0[i / CHUNK].port
    }

    fn fail(&mut self, i: usize, device: usize) -> Result<()> {
        let part = &mut self.0[i / CHUNK];
        writeln!(part.stdin, "fail {i} {device}")?;
        part.stdin.flush()?;
        Ok(())
    }

    /// `cmd` to every part; each part's one-line answer.
    fn ask(&mut self, cmd: &str) -> Result<Vec<String>> {
        tokio::task::block_in_place(|| {
            let mut out = Vec::new();
            for p in &mut self.0 {
                writeln!(p.stdin, "{cmd}")?;
                p.stdin.flush()?;
            }
            for p in &mut self.0 {
                let mut line = String::new();
                p.stdout.read_line(&mut line)?;
                out.push(line);
            }
            Ok(out)
        })
    }

    fn stats(&mut self) -> Result<FleetStats> {
        let mut total = FleetStats::default();
        for line in self.ask("stats")? {
            total.add(&serde_json::from_str(&line).context("fleet stats")?);
        }
        Ok(total)
    }

    /// Node -> when its first delivered entry naming a failed device arrived (µs).
    fn arrivals(&mut self) -> Result<HashMap<usize, u64>> {
        let mut out = HashMap::new();
        for line in self.ask("arrivals")? {
            let v: Vec<(usize, u64)> = serde_json::from_str(&line).context("fleet arrivals")?;
            out.extend(v);
        }
        Ok(out)
    }
}

/// Whether a connection to node `n - 1`'s loopback address reaches a listener on
/// `0.0.0.0` that sees that address as its local one.
fn check_loopback(n: usize) -> Result<()> {
    let l = std::net::TcpListener::bind("0.0.0.0:0")?;
    let ip = node_ip(n.saturating_sub(1));
    let _c = std::net::TcpStream::connect((ip, l.local_addr()?.port()))
        .with_context(|| format!("connect to {ip}: 127.0.0.0/8 is not routed to lo here"))?;
    let (s, _) = l.accept()?;
    let local = s.local_addr()?;
    if local.ip() != ip {
        bail!("a connection to {ip} arrived at {local}: loopback aliases do not work here");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// The cluster.

/// A workload pod on node `i` reading its node's own fault.json from the agent's
/// directory, mounted read-only (deploy/workload-example.yaml, pod 1).
fn workload_pod(i: usize) -> Value {
    let node = node_name(i);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("trainer-{node}"), "namespace": "default",
            "labels": {"app": "trainer"}},
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "trainer", "image": "python:3.12-slim",
                "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}},
                "volumeMounts": [{"name": "faultline", "mountPath": "/config", "readOnly": true}],
            }],
            "volumes": [{"name": "faultline", "hostPath": {"path": "/run/faultline/node", "type": "Directory"}}],
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    })
}

/// EndpointSlice `k` of the agents' Service: nodes `range`, all served on `port`.
fn endpoint_slice(k: usize, range: std::ops::Range<usize>, port: u16) -> Value {
    let endpoints: Vec<Value> = range
        .map(|i| {
            json!({
                "addresses": [node_ip(i).to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node_name(i),
                "targetRef": {"kind": "Pod", "namespace": NS,
                    "name": format!("faultline-agent-{i:05x}"),
                    "uid": format!("5157e000-0000-4000-8000-{i:012x}")},
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{SERVICE}-{k:05x}"), "namespace": NS,
            "labels": {"kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    })
}

/// The Role that `scripts/gen-rbac.py` would generate for `--publish-namespaces ns`
/// with these shards and pages (the base's names only its 4 shards of one page).
fn publisher_rbac(ns: &str, shards: u32, pages: u32) -> [Value; 2] {
    let names: Vec<String> = (0..shards)
        .flat_map(|s| (0..pages).map(move |p| page_name(BASE, s, p)))
        .collect();
    [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "faultline-publisher-bench", "namespace": ns},
        "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": names, "verbs": ["get", "update"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        ]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "faultline-publisher-bench", "namespace": ns},
            "subjects": [{"kind": "ServiceAccount", "name": "faultline-aggregator", "namespace": NS}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "faultline-publisher-bench"}}),
    ]
}

/// The test server's faults: `latency_ms` on every call, and the simulated disruption
/// controller paused. It looks at every pod of a namespace after each pod write
/// (tests/apiserver/src/lifecycle.rs `sync_budgets`), 20,000 of them here, under the
/// server's lock; there is no PodDisruptionBudget for it to keep.
fn api_faults(latency_ms: u64) -> Faults {
    Faults {
        latency_ms,
        disruption_controller_paused: true,
        ..Default::default()
    }
}

/// What the cluster holds.
struct Seeded {
    node_bytes: u64,
    pod_bytes: u64,
    slice_bytes: u64,
    slices: usize,
    took: Duration,
}

/// The API server with the cluster in it; its URL.
async fn cluster(cfg: &Cfg, fleets: &Fleets) -> Result<(ApiServer, String, Seeded)> {
    let t = Instant::now();
    let manifest = faultline_common::testing::repo_root().join("deploy/base/aggregator.yaml");
    let running = Bootstrap::new()
        .namespace(NS)
        .manifests(std::fs::read_to_string(&manifest)?)
        .rbac(&[(AGG_TOKEN, AGG_USER), ("admin-token", rbac::ADMIN)])
        .start()
        .await?;
    let s = running.server.clone();
    let create = |plural: &str, ns: &str, v: Value| -> Result<u64> {
        let n = serde_json::to_vec(&v)?.len() as u64;
        s.create(plural, ns, v)
            .map_err(|e| anyhow!("{plural} in {ns:?}: {e:?}"))?;
        Ok(n)
    };
    let mut seeded = Seeded {
        node_bytes: 0,
        pod_bytes: 0,
        slice_bytes: 0,
        slices: 0,
        took: Duration::ZERO,
    };
    s.set_faults(api_faults(0));
    for i in 0..cfg.nodes {
        let ip = format!("10.{}.{}.{}", 1 + i / 65536, i / 256 % 256, i % 256);
        seeded.node_bytes += create("nodes", "", fixtures::realistic_node(&node_name(i), &ip))?;
    }
    eprintln!("{} Nodes in {:.1} s", cfg.nodes, t.elapsed().as_secs_f64());
    for i in 0..cfg.nodes {
        seeded.pod_bytes += create("pods", "default", workload_pod(i))?;
    }
    eprintln!("and their pods after {:.1} s", t.elapsed().as_secs_f64());
    for (k, first) in (0..cfg.nodes).step_by(PER_SLICE).enumerate() {
        let range = first..(first + PER_SLICE).min(cfg.nodes);
        seeded.slice_bytes += create(
            "endpointslices",
            NS,
            endpoint_slice(k, range, fleets.port_of(first)),
        )?;
        seeded.slices += 1;
    }
    for ns in cfg.publish.split(',').filter(|n| !n.is_empty() && *n != NS) {
        let [role, binding] = publisher_rbac(ns, cfg.shards, cfg.pages);
        create("roles", ns, role)?;
        create("rolebindings", ns, binding)?;
    }
    // The watch history of the seeding is not needed (every watch starts from a list
    // at the current revision) and would hold a second copy of every Node.
    s.compact();
    seeded.took = t.elapsed();
    // It serves in its own task until the process ends.
    Ok((s, running.url.clone(), seeded))
}

// ---------------------------------------------------------------------------------
// The replicas.

/// A replica: the release binary, killed (SIGKILL) when dropped.
struct Replica {
    proc: Proc,
    name: String,
    port: u16,
    log: PathBuf,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Replica {
    fn start(agg: &str, kube: &str, name: &str, cfg: &Cfg, dir: &Path) -> Result<Self> {
        let port = free_port()?;
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::new(agg);
        cmd.args(["--sink", "configmap", "--kube-server", kube])
            .arg("--kube-token-file")
            .arg(dir.join("kube-token"))
            .args(["--namespace", NS, "--name", BASE, "--replica", name])
            .args(["--shards", &cfg.shards.to_string()])
            .args(["--pages", &cfg.pages.to_string()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--delivery-token-file")
            .arg(dir.join("delivery-token"));
        if !cfg.publish.is_empty() {
            cmd.args(["--publish-namespaces", &cfg.publish]);
        }
        let child = cmd
            .env(
                "RUST_LOG",
                std::env::var("BENCH_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Replica {
            proc: Proc(child),
            name: name.into(),
            port,
            log,
        })
    }

    fn pid(&self) -> u32 {
        self.proc.0.id()
    }

    /// Every sample of its metrics, by name with labels.
    async fn metrics(&self) -> HashMap<String, f64> {
        let client: hyper_util::client::legacy::Client<
            _,
            http_body_util::Empty<hyper::body::Bytes>,
        > = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
        let Ok(url) = format!("http://127.0.0.1:{}/metrics", self.port).parse() else {
            return HashMap::new();
        };
        let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(10), client.get(url)).await
        else {
            return HashMap::new();
        };
        let Ok(body) = http_body_util::BodyExt::collect(resp.into_body()).await else {
            return HashMap::new();
        };
        String::from_utf8_lossy(&body.to_bytes())
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((
                    k.strip_prefix("faultline_aggregator_")?.to_string(),
                    v.parse().ok()?,
                ))
            })
            .collect()
    }

    /// Warnings and errors it logged.
    fn log_lines(&self) -> (usize, usize) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        (
            text.lines().filter(|l| l.contains("WARN")).count(),
            text.lines().filter(|l| l.contains("ERROR")).count(),
        )
    }
}

/// The sum of the samples whose name (with labels) starts with `prefix`.
fn sum(m: &HashMap<String, f64>, prefix: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// What a replica counted at one moment.
#[derive(Clone, Copy, Debug, Default)]
struct RepSample {
    cpu_s: f64,
    docs: f64,
    entries_ok: f64,
    confirms_ok: f64,
    deliveries: f64,
    transitions: f64,
    writes: f64,
    write_s: f64,
    held: f64,
    followed: f64,
}

async fn sample(r: &Replica) -> RepSample {
    let m = r.metrics().await;
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
    RepSample {
        cpu_s: cpu_secs(r.pid()),
        docs: get("agent_polls_total{result=\"ok\"}"),
        entries_ok: get("deliveries_total{kind=\"entry\",result=\"ok\"}"),
        confirms_ok: get("deliveries_total{kind=\"confirm\",result=\"ok\"}"),
        deliveries: sum(&m, "deliveries_total{"),
        transitions: sum(&m, "transitions_total{"),
        writes: sum(&m, "write_duration_seconds_count{"),
        write_s: sum(&m, "write_duration_seconds_sum{"),
        held: get("shards_held"),
        followed: get("nodes_followed"),
    }
}

async fn samples(rs: &[Replica]) -> Vec<RepSample> {
    let mut out = Vec::new();
    for r in rs {
        out.push(sample(r).await);
    }
    out
}

// ---------------------------------------------------------------------------------
// Reading the cluster back.

/// Each node entry of a shard, as written, over its pages.
fn entries(server: &ApiServer, cfg: &Cfg, s: u32) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in 0..cfg.pages {
        if let Some(Value::Object(o)) =
            server.get_at("configmaps", NS, &page_name(BASE, s, p), "/data")
        {
            out.extend(
                o.into_iter()
                    .filter(|(k, _)| k != "fault.json")
                    .filter_map(|(k, v)| Some((k, v.as_str()?.to_string()))),
            );
        }
    }
    out
}

/// Every node published, each with 8 healthy devices.
fn all_published_healthy(server: &ApiServer, cfg: &Cfg) -> bool {
    let mut count = 0;
    for s in 0..cfg.shards {
        let es = entries(server, cfg, s);
        count += es.len();
        let healthy = es.values().all(|e| {
            serde_json::from_str::<NodeFaults>(e).is_ok_and(|n| {
                n.npus.len() == cluster_fleet::DEVICES
                    && n.npus.iter().all(|d| d.status == DeviceStatus::Healthy)
            })
        });
        if !healthy {
            return false;
        }
    }
    count == cfg.nodes
}

/// Whether node `i`'s published entry shows device `dev` failed.
fn published_failed(server: &ApiServer, cfg: &Cfg, i: usize, dev: usize) -> bool {
    let name = node_name(i);
    let cm = page_name(
        BASE,
        shard_of(&name, cfg.shards),
        page_of(&name, cfg.shards, cfg.pages),
    );
    let id = format!("gpu{dev}");
    server
        .get_at("configmaps", NS, &cm, &format!("/data/{name}.json"))
        .and_then(|v| serde_json::from_str::<NodeFaults>(v.as_str()?).ok())
        .is_some_and(|e| {
            e.npus
                .iter()
                .any(|d| d.id == id && d.status == DeviceStatus::Failed)
        })
}

/// Every shard Lease's holder, polled every second; changes counted.
#[derive(Default)]
struct LeaseWatch {
    last: Vec<Option<String>>,
    changes: u64,
}

fn watch_leases(server: ApiServer, shards: u32) -> Arc<Mutex<LeaseWatch>> {
    let w = Arc::new(Mutex::new(LeaseWatch::default()));
    let out = w.clone();
    tokio::spawn(async move {
        loop {
            let now: Vec<Option<String>> = (0..shards)
                .map(|s| {
                    server
                        .get_at(
                            "leases",
                            NS,
                            &format!("{BASE}-shard-{s}"),
                            "/spec/holderIdentity",
                        )
                        .and_then(|v| v.as_str().map(String::from))
                })
                .collect();
            {
                let mut g = w.lock().unwrap();
                if !g.last.is_empty() {
                    let changed = g.last.iter().zip(&now).filter(|(a, b)| a != b).count();
                    g.changes += changed as u64;
                }
                g.last = now;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    out
}

fn lease_changes(w: &Arc<Mutex<LeaseWatch>>) -> u64 {
    w.lock().unwrap().changes
}

// ---------------------------------------------------------------------------------
// The reference: serde_json reading the fleet's document, timed on this thread's CPU
// clock, so that CPU per document compares across machines as a ratio.

fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// µs of CPU per `serde_json::from_slice::<Value>` of `doc`: the median of 5 batches
/// of `n` reads.
async fn reference_us(doc: Arc<Vec<u8>>, n: usize) -> f64 {
    tokio::task::spawn_blocking(move || {
        let batches: Vec<f64> = (0..5)
            .map(|_| {
                let t = thread_cpu_s();
                for _ in 0..n {
                    let v: Value = serde_json::from_slice(std::hint::black_box(&doc)).unwrap();
                    std::hint::black_box(v);
                }
                (thread_cpu_s() - t) / n as f64 * 1e6
            })
            .collect();
        pctl(&batches, 0.5)
    })
    .await
    .unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------------------------
// Measuring.

fn bytes_out(c: &Costs) -> u64 {
    c.total.response_bytes + c.kubelet_fanout_bytes
}

/// One steady-state window.
struct Window {
    label: String,
    latency_ms: u64,
    secs: f64,
    costs: Costs,
    reps: Vec<RepSample>,
    fleet: FleetStats,
    lease_changes: u64,
    reference_us: f64,
    /// CPU seconds of this process (the API server, the benchmark) and of the fleet.
    load: (f64, f64),
}

impl Window {
    fn per_s(&self, v: f64) -> f64 {
        v / self.secs
    }
}

fn delta(a: &[RepSample], b: &[RepSample]) -> Vec<RepSample> {
    a.iter()
        .zip(b)
        .map(|(a, b)| RepSample {
            cpu_s: b.cpu_s - a.cpu_s,
            docs: b.docs - a.docs,
            entries_ok: b.entries_ok - a.entries_ok,
            confirms_ok: b.confirms_ok - a.confirms_ok,
            deliveries: b.deliveries - a.deliveries,
            transitions: b.transitions - a.transitions,
            writes: b.writes - a.writes,
            write_s: b.write_s - a.write_s,
            held: b.held,
            followed: b.followed,
        })
        .collect()
}

/// What the run shares.
struct Run<'a> {
    cfg: &'a Cfg,
    server: ApiServer,
    reps: Vec<Replica>,
    fleets: Fleets,
    leases: Arc<Mutex<LeaseWatch>>,
    doc: Arc<Vec<u8>>,
    rng: rand::rngs::StdRng,
    /// When the injected latency changed (ms since the epoch, latency in ms), to tell a
    /// slow answer from the latency in force.
    latencies: Mutex<Vec<(u64, u64)>>,
    /// Nodes not faulted yet.
    fresh: Vec<usize>,
    fleet_started: Instant,
}

impl Run<'_> {
    fn latency(&self, ms: u64) {
        self.server.set_faults(api_faults(ms));
        self.latencies.lock().unwrap().push((now_us() / 1000, ms));
    }

    async fn window(&mut self, label: String, latency_ms: u64) -> Result<Window> {
        self.latency(latency_ms);
        tokio::time::sleep(Duration::from_secs(self.cfg.settle_s)).await;
        // The fleet's rate of documents settles about 70 s after it starts (each
        // device's last announced reading becomes a sample like any other).
        let warm = Duration::from_secs(90).saturating_sub(self.fleet_started.elapsed());
        tokio::time::sleep(warm).await;
        let (r0, f0, l0, c0) = (
            samples(&self.reps).await,
            self.fleets.stats()?,
            lease_changes(&self.leases),
            self.load(),
        );
        self.server.reset_costs();
        let t = Instant::now();
        let steady_s = if latency_ms >= 2000 {
            self.cfg.slow_steady_s
        } else {
            self.cfg.steady_s
        };
        tokio::time::sleep(Duration::from_secs(steady_s)).await;
        let costs = self.server.reset_costs();
        let secs = t.elapsed().as_secs_f64();
        let (r1, f1, l1, c1) = (
            samples(&self.reps).await,
            self.fleets.stats()?,
            lease_changes(&self.leases),
            self.load(),
        );
        let reference_us = reference_us(self.doc.clone(), 4_000).await;
        let w = Window {
            label,
            latency_ms,
            secs,
            costs,
            reps: delta(&r0, &r1),
            fleet: f1.minus(&f0),
            lease_changes: l1 - l0,
            reference_us,
            load: (c1.0 - c0.0, c1.1 - c0.1),
        };
        eprintln!(
            "steady{} at {latency_ms} ms: {:.0} B/s out, {:.0} B/s written, {} Lease changes",
            if w.label.is_empty() {
                String::new()
            } else {
                format!(" {}", w.label)
            },
            w.per_s(bytes_out(&w.costs) as f64),
            w.per_s(w.costs.total.written_bytes as f64),
            w.lease_changes
        );
        Ok(w)
    }

    /// CPU seconds of this process and of the fleet processes.
    fn load(&self) -> (f64, f64) {
        (
            cpu_secs(std::process::id()),
            self.fleets.0.iter().map(|p| cpu_secs(p.proc.0.id())).sum(),
        )
    }

    fn names(&self) -> Vec<String> {
        self.reps.iter().map(|r| r.name.clone()).collect()
    }

    fn pick(&mut self) -> usize {
        let k = self.rng.random_range(0..self.fresh.len());
        self.fresh.swap_remove(k)
    }

    /// A hard fault on a fresh node: (node, injected at µs, to its ConfigMap).
    async fn fault(&mut self, dev: usize, within: Duration) -> Result<(usize, u64, Option<f64>)> {
        let i = self.pick();
        let r0 = samples(&self.reps).await;
        let (t0_us, t0) = (now_us(), Instant::now());
        self.fleets.fail(i, dev)?;
        loop {
            if published_failed(&self.server, self.cfg, i, dev) {
                return Ok((i, t0_us, Some(t0.elapsed().as_secs_f64() * 1e3)));
            }
            if t0.elapsed() > within {
                let d = delta(&r0, &samples(&self.reps).await);
                let shard = shard_of(&node_name(i), self.cfg.shards);
                let holder = self.server.get_at(
                    "leases",
                    NS,
                    &format!("{BASE}-shard-{shard}"),
                    "/spec/holderIdentity",
                );
                eprintln!(
                    "fault on {} (shard {shard}, held by {holder:?}) not published within {within:?}; documents received meanwhile: {}; shard writes {}",
                    node_name(i),
                    self.names()
                        .iter()
                        .zip(&d)
                        .map(|(n, r)| format!("{n} {:.0}/s", r.docs / within.as_secs_f64()))
                        .collect::<Vec<_>>()
                        .join(", "),
                    d.iter().map(|r| format!("{:.0}", r.writes)).collect::<Vec<_>>().join(", "),
                );
                let now = samples(&self.reps).await;
                eprintln!(
                    "  then: shards held {}; nodes followed {}; confirmations meanwhile {}",
                    now.iter()
                        .map(|r| format!("{:.0}", r.held))
                        .collect::<Vec<_>>()
                        .join(", "),
                    now.iter()
                        .map(|r| format!("{:.0}", r.followed))
                        .collect::<Vec<_>>()
                        .join(", "),
                    d.iter()
                        .map(|r| format!("{:.0}", r.confirms_ok))
                        .collect::<Vec<_>>()
                        .join(", "),
                );
                return Ok((i, t0_us, None));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// `n` faults spaced 200-600 ms apart: to the ConfigMap (ms), and the nodes with
    /// their injection time for the deliveries.
    async fn faults(&mut self, n: usize, within: Duration) -> Result<FaultRun> {
        let mut out = FaultRun::default();
        let r0 = samples(&self.reps).await;
        let (since, t, l0) = (now_us() / 1000, Instant::now(), lease_changes(&self.leases));
        for k in 0..n {
            let (i, t0_us, cm) = self.fault(k % cluster_fleet::DEVICES, within).await?;
            out.injected.push((i, t0_us));
            match cm {
                Some(ms) => {
                    out.to_configmap.push(ms);
                    if ms > 100.0 {
                        out.slow.push((i, t0_us / 1000, ms));
                    }
                }
                None => out.missed_configmap += 1,
            }
            let pause = self.rng.random_range(200..600);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        let calls = self.server.calls();
        for (i, t0, ms) in &out.slow {
            eprintln!("{}", slow_fault(&calls, self.cfg, *i, *t0, *ms));
        }
        out.server_ms = calls
            .iter()
            .filter(|c| {
                c.method == "PUT" && c.uri.contains("/configmaps/") && c.received_ms >= since
            })
            .map(|c| c.at_ms.saturating_sub(c.received_ms) as f64)
            .collect();
        let d = delta(&r0, &samples(&self.reps).await);
        out.writes = d.iter().map(|r| r.writes).sum();
        out.write_s = d.iter().map(|r| r.write_s).sum();
        out.lease_changes = lease_changes(&self.leases) - l0;
        let secs = t.elapsed().as_secs_f64();
        out.replicas = self
            .names()
            .iter()
            .zip(&d)
            .map(|(n, r)| {
                format!(
                    "{n} {:.0} documents/s, {:.1}% of a core",
                    r.docs / secs,
                    r.cpu_s / secs * 100.0
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let arrivals = self.fleets.arrivals()?;
        for (i, t0) in &out.injected {
            match arrivals.get(i) {
                Some(t) => out.to_node.push(t.saturating_sub(*t0) as f64 / 1e3),
                None => out.missed_node += 1,
            }
        }
        eprintln!(
            "faults (node: to its fault.json ms): {}",
            out.injected
                .iter()
                .map(|(i, t0)| {
                    let node = arrivals.get(i).map_or("-".into(), |t| {
                        format!("{:.0}", t.saturating_sub(*t0) as f64 / 1e3)
                    });
                    format!("{i}: {node}")
                })
                .collect::<Vec<_>>()
                .join(", ")
        );
        eprintln!(
            "to the ConfigMap, in order: {:?}",
            out.to_configmap
                .iter()
                .map(|v| v.round())
                .collect::<Vec<_>>()
        );
        Ok(out)
    }

    /// One fault alone: API bytes in the window after it minus the window before, and
    /// the device status changes the replicas counted in it.
    async fn single_cost(&mut self) -> Result<Single> {
        let w = Duration::from_secs(self.cfg.single_window_s);
        self.server.reset_costs();
        tokio::time::sleep(w).await;
        let before = self.server.reset_costs();
        let r0 = samples(&self.reps).await;
        let t = Instant::now();
        let (_, _, cm) = self.fault(0, w).await?;
        tokio::time::sleep(w.saturating_sub(t.elapsed())).await;
        let after = self.server.reset_costs();
        let r1 = samples(&self.reps).await;
        let changes: f64 = delta(&r0, &r1).iter().map(|r| r.transitions).sum();
        Ok(Single {
            before,
            after,
            changes,
            to_configmap: cm,
        })
    }
}

#[derive(Default)]
struct FaultRun {
    injected: Vec<(usize, u64)>,
    to_configmap: Vec<f64>,
    to_node: Vec<f64>,
    missed_configmap: usize,
    missed_node: usize,
    /// The API server's time for each ConfigMap update meanwhile (ms, from its arrival
    /// to its answer, injected latency included).
    server_ms: Vec<f64>,
    /// Shard writes the replicas made meanwhile, and the seconds they took.
    writes: f64,
    write_s: f64,
    /// Lease holder changes meanwhile.
    lease_changes: u64,
    /// Each replica's documents and CPU meanwhile.
    replicas: String,
    /// Faults that took over 100 ms to their ConfigMap: (node, injected at ms, ms).
    slow: Vec<(usize, u64, f64)>,
}

/// What the API server was doing while a slow fault (node `i`, injected at `t0` ms,
/// in its ConfigMap after `ms`) waited: its page's updates, and the calls that took
/// 30 ms or more and overlapped the wait.
fn slow_fault(
    calls: &[faultline_test_apiserver::Call],
    cfg: &Cfg,
    i: usize,
    t0: u64,
    ms: f64,
) -> String {
    let name = node_name(i);
    let shard = shard_of(&name, cfg.shards);
    let page = page_name(BASE, shard, page_of(&name, cfg.shards, cfg.pages));
    let end = t0 + ms as u64;
    let during: Vec<&faultline_test_apiserver::Call> = calls
        .iter()
        .filter(|c| c.received_ms <= end && c.at_ms >= t0)
        .collect();
    let path = |c: &faultline_test_apiserver::Call| {
        let p = c.uri.split('?').next().unwrap_or("");
        format!(
            "{} {}",
            c.method,
            p.rsplit_once("/namespaces/faultline/").map_or(p, |x| x.1)
        )
    };
    let writes: Vec<String> = during
        .iter()
        .filter(|c| c.method == "PUT" && c.uri.contains(&format!("/configmaps/{page}")))
        .map(|c| {
            format!(
                "+{} ms..+{} ms",
                c.received_ms as i64 - t0 as i64,
                c.at_ms as i64 - t0 as i64
            )
        })
        .collect();
    let slow: Vec<String> = during
        .iter()
        .filter(|c| c.at_ms.saturating_sub(c.received_ms) >= 30)
        .map(|c| {
            format!(
                "{} +{}..+{} ms",
                path(c),
                c.received_ms as i64 - t0 as i64,
                c.at_ms as i64 - t0 as i64
            )
        })
        .collect();
    format!(
        "slow fault: {name} (shard {shard}, {page}) {ms:.0} ms; its page updated {writes:?}; {} calls overlapped, {} of 30 ms or more: {}",
        during.len(),
        slow.len(),
        slow.join(", ")
    )
}

struct Single {
    before: Costs,
    after: Costs,
    changes: f64,
    to_configmap: Option<f64>,
}

impl Single {
    fn extra_bytes(&self) -> f64 {
        bytes_out(&self.after) as f64 - bytes_out(&self.before) as f64
    }
}

fn pctl(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}

// ---------------------------------------------------------------------------------
// The summary.

fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

fn human(b: f64) -> String {
    if b.abs() >= MB {
        format!("{:.2} MB", b / MB)
    } else if b.abs() >= KB {
        format!("{:.1} KB", b / KB)
    } else {
        format!("{b:.0} B")
    }
}

fn sh(args: &[&str]) -> String {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem = proc_meminfo_gib();
    format!(
        "{cpu}, {} cores, {mem:.0} GiB",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
}

fn proc_meminfo_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("MemTotal:")?
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0)
        / 1024.0
        / 1024.0
}

fn commit() -> String {
    let head = sh(&["git", "rev-parse", "--short", "HEAD"]);
    let dirty = sh(&[
        "git",
        "status",
        "--porcelain",
        "--",
        "aggregator",
        "agent",
        "common",
    ]);
    if dirty.is_empty() {
        head
    } else {
        format!("{head} (with uncommitted changes in aggregator/agent/common)")
    }
}

/// The requests of a window by verb and resource, busiest first.
fn requests_line(w: &Window) -> String {
    let mut rows: Vec<(String, f64, f64, u64)> = w
        .costs
        .by_verb
        .iter()
        .flat_map(|(verb, rs)| {
            rs.iter().map(move |(res, t)| {
                let res = if res.is_empty() { "(discovery)" } else { res };
                (
                    format!("{verb} {res}"),
                    t.requests as f64,
                    t.response_bytes as f64,
                    t.errors,
                )
            })
        })
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.1.total_cmp(&a.1)));
    rows.iter()
        .map(|(k, n, b, e)| {
            let errors = if *e > 0 {
                format!(", {e} errors")
            } else {
                String::new()
            };
            format!(
                "{k} {:.2}/s ({}/s{errors})",
                w.per_s(*n),
                human(w.per_s(*b))
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

struct Report {
    cfg: Cfg,
    machine: String,
    commit: String,
    date: String,
    command: String,
    seeded: Seeded,
    start_s: f64,
    start_costs: Costs,
    hwm_start: Vec<(String, f64)>,
    hwm_steady: Vec<(String, f64)>,
    hwm_end: Vec<(String, f64)>,
    windows: Vec<Window>,
    singles: Vec<Single>,
    fast: FaultRun,
    slow: Option<FaultRun>,
    logs: Vec<(String, usize, usize)>,
    names: Vec<String>,
    /// Shard ConfigMap updates in each minute since the replicas started.
    cm_updates_by_minute: Vec<usize>,
    /// API calls answered a second or more past the latency in force, and the calls.
    slow_calls: (usize, usize, Vec<String>),
    /// When the latency changed: seconds since the replicas started, latency in ms.
    latency_changes: Vec<(f64, u64)>,
}

/// The API calls the test server answered a second or more later than the latency
/// injected when they arrived (its own time, or a wait for its lock): how many, of how
/// many, and the slowest ten (seconds since the replicas started, method, path, ms).
fn slow_calls(
    calls: &[faultline_test_apiserver::Call],
    latencies: &[(u64, u64)],
    started_ms: u64,
) -> (usize, usize, Vec<String>) {
    let in_force = |at: u64| {
        latencies
            .iter()
            .rev()
            .find(|(t, _)| *t <= at)
            .map_or(0, |(_, l)| *l)
    };
    let mut slow: Vec<(u64, &faultline_test_apiserver::Call)> = calls
        .iter()
        .filter(|c| c.received_ms >= started_ms && !c.uri.contains("watch=true"))
        .filter_map(|c| {
            let took = c.at_ms.saturating_sub(c.received_ms);
            let over = took.saturating_sub(in_force(c.received_ms));
            (over >= 1000).then_some((took, c))
        })
        .collect();
    let total = calls.iter().filter(|c| c.received_ms >= started_ms).count();
    let n = slow.len();
    slow.sort_by_key(|s| std::cmp::Reverse(s.0));
    let top = slow
        .iter()
        .take(10)
        .map(|(took, c)| {
            let path = c.uri.split('?').next().unwrap_or(&c.uri);
            format!(
                "+{:.1} s {} {path} {took} ms",
                c.received_ms.saturating_sub(started_ms) as f64 / 1e3,
                c.method
            )
        })
        .collect();
    (n, total, top)
}

fn print_window(r: &Report, w: &Window, out: &mut Vec<String>) {
    let c = &w.costs;
    let out_bps = w.per_s(bytes_out(c) as f64);
    let written = w.per_s(c.total.written_bytes as f64);
    out.push(format!(
        "steady state{}, API latency {} ms, {:.0} s:",
        if w.label.is_empty() {
            String::new()
        } else {
            format!(" {}", w.label)
        },
        w.latency_ms,
        w.secs
    ));
    out.push(format!(
        "  API bytes out: {}/s = responses {}/s + watch events {}/s + kubelet fan-out {}/s   [target <= 1 MB/s: {}]",
        human(out_bps),
        human(w.per_s((c.total.response_bytes - c.total.watch_event_bytes) as f64)),
        human(w.per_s(c.total.watch_event_bytes as f64)),
        human(w.per_s(c.kubelet_fanout_bytes as f64)),
        verdict(out_bps <= MB),
    ));
    out.push(format!(
        "  object bytes written: {}/s ({:.2} objects/s)   [target <= 100 KB/s: {}]",
        human(written),
        w.per_s(c.total.written_objects as f64),
        verdict(written <= 100.0 * KB),
    ));
    out.push(format!(
        "  requests: {:.2}/s, {} errors; {}",
        w.per_s(c.total.requests as f64),
        c.total.errors,
        requests_line(w)
    ));
    let docs: f64 = w.reps.iter().map(|x| x.docs).sum();
    out.push(format!(
        "  documents: the fleet announced {:.1}/s ({} each on average); received {:.1}/s: {}",
        w.per_s(w.fleet.docs as f64),
        human(w.fleet.doc_bytes as f64 / w.fleet.docs.max(1) as f64),
        w.per_s(docs),
        r.names
            .iter()
            .zip(&w.reps)
            .map(|(n, x)| format!("{n} {:.1}/s", w.per_s(x.docs)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    out.push(format!(
        "  CPU per received document: {} (reference: serde_json reads the {} document into a Value in {:.2} µs of CPU here)",
        r.names
            .iter()
            .zip(&w.reps)
            .map(|(n, x)| {
                let us = x.cpu_s / x.docs.max(1.0) * 1e6;
                format!(
                    "{n} {us:.0} µs = {:.1}x ref ({:.1}% of a core)",
                    us / w.reference_us,
                    w.per_s(x.cpu_s) * 100.0
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        human(r.seeded_doc_len() as f64),
        w.reference_us
    ));
    out.push(format!(
        "  Lease holder changes: {}{}",
        w.lease_changes,
        if w.latency_ms >= 2000 {
            format!("   [target 0 at 2 s: {}]", verdict(w.lease_changes == 0))
        } else {
            String::new()
        }
    ));
    let f = &w.fleet;
    out.push(format!(
        "  node-local deliveries (pod network, not API server traffic): {:.1} entries/s + {:.1} confirmations/s ({} answered 409, {} refused); {}/s sent to agents (bodies {}/s), {}/s answered",
        w.per_s(f.entries as f64),
        w.per_s(f.confirms as f64),
        f.conflicts,
        f.refused,
        human(w.per_s(f.req_bytes as f64)),
        human(w.per_s(f.req_body_bytes as f64)),
        human(w.per_s(f.resp_bytes as f64)),
    ));
    out.push(format!(
        "  agent documents to the replicas (pod network): about {}/s (documents received x their mean size)",
        human(w.per_s(docs) * f.doc_bytes as f64 / f.docs.max(1) as f64)
    ));
    out.push(format!(
        "  beside the replicas on the same cores: the API server and this benchmark {:.1}% of a core, the fleet {:.1}%",
        w.per_s(w.load.0) * 100.0,
        w.per_s(w.load.1) * 100.0
    ));
}

impl Report {
    fn seeded_doc_len(&self) -> usize {
        serde_json::to_vec(&cluster_fleet::first_doc(0)).map_or(0, |v| v.len())
    }

    fn print(&self) {
        let mut o = Vec::new();
        let cfg = &self.cfg;
        o.push(
            "==================== faultline cluster costs (issue 25) ====================".into(),
        );
        o.push(format!("date: {}   commit: {}", self.date, self.commit));
        o.push(format!("machine: {}", self.machine));
        o.push(format!("command: {}", self.command));
        o.push(format!(
            "cluster: {} Nodes ({} each), {} workload Pods ({} each; hostPath /run/faultline/node at /config, no ConfigMap), {} EndpointSlices of {SERVICE} ({} in all); RBAC of deploy/base/aggregator.yaml enforced; seeded in {:.0} s",
            cfg.nodes,
            human(self.seeded.node_bytes as f64 / cfg.nodes as f64),
            cfg.nodes,
            human(self.seeded.pod_bytes as f64 / cfg.nodes as f64),
            self.seeded.slices,
            human(self.seeded.slice_bytes as f64),
            self.seeded.took.as_secs_f64(),
        ));
        o.push(format!(
            "replicas: {} x release faultline-aggregator, --shards {} --pages {}, --discovery endpoints (default), --delivery-token-file with --delivery-confirm 10s (default), --remediation dry-run (default), nudges at the default rate, {}",
            cfg.replicas,
            cfg.shards,
            cfg.pages,
            if cfg.publish.is_empty() {
                "no --publish-namespaces (shards in faultline only)".to_string()
            } else {
                format!("--publish-namespaces {}", cfg.publish)
            }
        ));
        o.push(format!(
            "fleet: {} nodes x 8 GPUs in {} processes, sampled every 1 s, power noise {:.0}% (1 sigma), the agent's default deadband (2 C, 10% power, drift every 60 s)",
            cfg.nodes,
            cfg.nodes.div_ceil(CHUNK),
            cfg.power_noise * 100.0
        ));
        let sc = &self.start_costs;
        o.push(format!(
            "start: every node published healthy {:.1} s after the replicas started; the start cost {} out of the API server ({} requests, {} written)",
            self.start_s,
            human(bytes_out(sc) as f64),
            sc.total.requests,
            human(sc.total.written_bytes as f64),
        ));
        let peak = self.hwm_end.iter().map(|(_, m)| *m).fold(0.0, f64::max);
        o.push(format!(
            "peak RSS per replica (VmHWM): after the start {}; after the steady phases {}; at the end {}   [target <= 128 MiB: {}]",
            self.hwm_start
                .iter()
                .map(|(n, m)| format!("{n} {m:.0} MiB"))
                .collect::<Vec<_>>()
                .join(", "),
            self.hwm_steady
                .iter()
                .map(|(n, m)| format!("{n} {m:.0} MiB"))
                .collect::<Vec<_>>()
                .join(", "),
            self.hwm_end
                .iter()
                .map(|(n, m)| format!("{n} {m:.0} MiB"))
                .collect::<Vec<_>>()
                .join(", "),
            verdict(peak <= 128.0),
        ));
        for w in &self.windows {
            print_window(self, w, &mut o);
        }
        self.print_faults(&mut o);
        o.push(format!(
            "shard ConfigMap updates in each minute since the replicas started: {:?}",
            self.cm_updates_by_minute
        ));
        let (n, total, top) = &self.slow_calls;
        o.push(format!(
            "API calls answered 1 s or more past the latency in force: {n} of {total} (latency set at {}){}",
            self.latency_changes
                .iter()
                .map(|(t, l)| format!("+{t:.0} s: {l} ms"))
                .collect::<Vec<_>>()
                .join(", "),
            if top.is_empty() {
                String::new()
            } else {
                format!("; slowest: {}", top.join(", "))
            }
        ));
        o.push(format!(
            "replica logs: {}",
            self.logs
                .iter()
                .map(|(n, w, e)| format!("{n} {w} warnings, {e} errors"))
                .collect::<Vec<_>>()
                .join("; ")
        ));
        o.push("skipped: TLS and a real network (everything is loopback on one machine, which every process shares); etcd and kube-apiserver's own CPU (the test server keeps objects in memory); the kubelet model's first list of each watch and Node status updates (no kubelet heartbeats: Nodes do not change); the agent's rename of fault.json after a delivery (the fleet records when the delivery arrives); HTTP headers of API calls (bodies only)".into());
        o.push(
            "============================================================================".into(),
        );
        println!("{}", o.join("\n"));
    }

    fn print_faults(&self, o: &mut Vec<String>) {
        let f = &self.fast;
        o.push(format!(
            "faults at API latency 0 ({} hard faults, 200-600 ms apart):",
            f.injected.len()
        ));
        o.push(format!(
            "  fault -> the node's fault.json (delivery at its agent): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms{}   [target p99 <= 100 ms: {}]",
            pctl(&f.to_node, 0.5),
            pctl(&f.to_node, 0.99),
            pctl(&f.to_node, 1.0),
            if f.missed_node > 0 { format!(", {} never delivered", f.missed_node) } else { String::new() },
            verdict(f.missed_node == 0 && pctl(&f.to_node, 0.99) <= 100.0),
        ));
        o.push(format!(
            "  fault -> its shard ConfigMap: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms{}   [target p99 <= 100 ms: {}]",
            pctl(&f.to_configmap, 0.5),
            pctl(&f.to_configmap, 0.99),
            pctl(&f.to_configmap, 1.0),
            if f.missed_configmap > 0 { format!(", {} not within the deadline", f.missed_configmap) } else { String::new() },
            verdict(f.missed_configmap == 0 && pctl(&f.to_configmap, 0.99) <= 100.0),
        ));
        o.push(format!(
            "  the replicas' shard writes meanwhile: {:.0}, {:.0} ms each on average (write_duration_seconds); of which the API server's time per ConfigMap update ({}): p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            f.writes,
            f.write_s / f.writes.max(1.0) * 1e3,
            f.server_ms.len(),
            pctl(&f.server_ms, 0.5),
            pctl(&f.server_ms, 0.99),
            pctl(&f.server_ms, 1.0),
        ));
        o.push(format!(
            "  meanwhile: Lease holder changes {}; {}",
            f.lease_changes, f.replicas
        ));
        if let Some(s) = &self.slow {
            o.push(format!(
                "faults at API latency 2 s ({} faults, 200-600 ms after the last one's ConfigMap or its 60 s): to the node's fault.json p50 {:.1} ms, max {:.1} ms{}; to the shard ConfigMap p50 {:.0} ms, max {:.0} ms{}; Lease holder changes {}",
                s.injected.len(),
                pctl(&s.to_node, 0.5),
                pctl(&s.to_node, 1.0),
                if s.missed_node > 0 { format!(" ({} never delivered)", s.missed_node) } else { String::new() },
                pctl(&s.to_configmap, 0.5),
                pctl(&s.to_configmap, 1.0),
                if s.missed_configmap > 0 { format!(" ({} not within 60 s)", s.missed_configmap) } else { String::new() },
                s.lease_changes,
            ));
        }
        let per_change: Vec<f64> = self
            .singles
            .iter()
            .map(|s| s.extra_bytes() / s.changes.max(1.0))
            .collect();
        let med = pctl(&per_change, 0.5);
        o.push(format!(
            "API bytes out per device status change: {} (median of {} faults alone, each the {} s after it minus the {} s before: {}; status changes counted {}; to the ConfigMap in {})   [target <= 1 MB: {}]",
            human(med),
            self.singles.len(),
            self.cfg.single_window_s,
            self.cfg.single_window_s,
            per_change.iter().map(|b| human(*b)).collect::<Vec<_>>().join(", "),
            self.singles.iter().map(|s| format!("{:.0}", s.changes)).collect::<Vec<_>>().join(", "),
            self.singles
                .iter()
                .map(|s| s.to_configmap.map_or("-".into(), |ms| format!("{ms:.0} ms")))
                .collect::<Vec<_>>()
                .join(", "),
            verdict(med <= MB),
        ));
        if let Some(s) = self.singles.first() {
            o.push(format!(
                "  where the first one's bytes went (after minus before): {}",
                fault_breakdown(s)
            ));
        }
    }
}

/// A fault window's bytes out minus the window before it, by verb and resource.
fn fault_breakdown(s: &Single) -> String {
    let mut rows: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for (c, sign) in [(&s.after, 1i64), (&s.before, -1)] {
        for (verb, rs) in &c.by_verb {
            for (res, t) in rs {
                let e = rows.entry(format!("{verb} {res}")).or_default();
                e.0 += sign * t.requests as i64;
                e.1 += sign * t.response_bytes as i64;
            }
        }
        let e = rows.entry("kubelet fan-out".into()).or_default();
        e.1 += sign * c.kubelet_fanout_bytes as i64;
    }
    let mut v: Vec<_> = rows
        .into_iter()
        .filter(|(_, (n, b))| *n != 0 || *b != 0)
        .collect();
    v.sort_by_key(|(_, (_, b))| -b.abs());
    v.iter()
        .map(|(k, (n, b))| format!("{k} {n:+} requests {}", human(*b as f64)))
        .collect::<Vec<_>>()
        .join("; ")
}

// ---------------------------------------------------------------------------------

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
