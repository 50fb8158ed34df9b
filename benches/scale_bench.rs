//! Scale-out benchmark. Run through `benches/run-scale-bench.sh`.
//!
//! Everything on this machine, side by side in one run:
//!
//! 1. One replica following 5,000 nodes x 8 devices (every shard its own): RSS and CPU
//!    at steady state, CPU per received document.
//! 2. 20,000 nodes x 8 devices, 4 replicas, 32 shards of two ConfigMaps each
//!    (`BENCH_SCALE_NODES`, `BENCH_REPLICAS`, `BENCH_SHARDS`, `BENCH_PAGES`): per replica the shards held, the nodes
//!    followed, RSS, CPU and agent connections at steady state.
//! 3. Hard fault to its shard ConfigMap at that scale, 100 faults.
//! 4. SIGKILL of one replica: time until all its shards are held and rewritten by
//!    others, and the devices whose published status changed on the way (every entry
//!    of its shards is compared at each rewrite, and the whole fleet after).
//! 5. A fifth replica: time until every replica holds its fair share.
//!
//! The fleet (every node's document changing about every 5 s, as sensor readings do)
//! is served by child processes of this binary, 5,000 nodes each (`scale-bench --fleet
//! FIRST COUNT`, faults injected through their stdin): one process cannot hold 20,000
//! agent sockets plus its own under this machine's hard limit of 20,000 open files.
//! The Kubernetes API test server runs in this process; each replica is the release
//! `faultline-aggregator` in its own process.

#[path = "fleet.rs"]
mod fleet;

#[path = "scale_replicas.rs"]
mod scale_replicas;

#[path = "scale_shards.rs"]
mod scale_shards;

use scale_replicas::*;

use scale_shards::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, Write};
use std::process::{ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use faultline_common::fault::{page_name, page_of, shard_of, NodeFaults, ShardIndex};
use faultline_common::DeviceStatus;
use faultline_test_apiserver::ApiServer;
use fleet::*;
use rand::{Rng, SeedableRng};

/// Nodes per fleet process.
const CHUNK: usize = 5000;
/// The aggregator's default Lease duration, which the replicas run with.
const LEASE: Duration = Duration::from_secs(15);
const NS: &str = "faultline";

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fleet process's part: serve nodes `first..first + count` and apply `fail I D`
/// lines from stdin; exit when stdin closes (the benchmark is gone).
fn fleet_main(first: usize, count: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let fleet = Fleet::range(first, count);
        let addr = serve_fleet(fleet.clone()).await;
        // Each node's document changes about every 5 s (BENCH_NOISE_MS; 0: never).
        let period = env_or("BENCH_NOISE_MS", 5000) as u64;
        if period > 0 {
            noise(fleet.clone(), Duration::from_millis(period));
        }
        println!("{}", addr.port());
        std::io::stdout().flush()?;
        let f = fleet.clone();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                let w: Vec<usize> = line
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|v| v.parse().ok())
                    .collect();
                match (line.starts_with("fail "), w.as_slice()) {
                    (true, [i, d]) if (first..first + count).contains(i) && *d < 8 => {
                        f.change(i - first, |doc| hard_fault(doc, *d))
                    }
                    _ => eprintln!("fleet: bad command {line:?}"),
                }
            }
            std::process::exit(0);
        });
        std::future::pending::<()>().await;
        Ok(())
    })
}

/// A fleet process and where it listens.
struct FleetPart {
    _proc: Proc,
    stdin: ChildStdin,
    port: u16,
    first: usize,
}

fn spawn_fleet(first: usize, count: usize) -> Result<FleetPart> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--fleet", &first.to_string(), &count.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdin = child.stdin.take().context("fleet stdin")?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("fleet stdout")?).read_line(&mut line)?;
    let port = line.trim().parse().context("fleet port")?;
    Ok(FleetPart {
        _proc: Proc(child),
        stdin,
        port,
        first,
    })
}

/// The whole fleet, in parts of [`CHUNK`] nodes.
struct Fleets(Vec<FleetPart>);

impl Fleets {
    fn spawn(nodes: usize) -> Result<Self> {
        (0..nodes)
            .step_by(CHUNK)
            .map(|first| spawn_fleet(first, CHUNK.min(nodes - first)))
            .collect::<Result<_>>()
            .map(Fleets)
    }

    fn part(&self, i: usize) -> &FleetPart {
        &self.0[i / CHUNK]
    }

    /// `NODE=URL` lines for `--agents-file`, nodes `range`.
    fn agents_file(&self, range: std::ops::Range<usize>, tag: &str) -> Result<std::path::PathBuf> {
        let lines: Vec<String> = range
            .map(|i| {
                format!(
                    "{}=http://127.0.0.1:{}/n/{i}",
                    node_name(i),
                    self.part(i).port
                )
            })
            .collect();
        let path =
            std::env::temp_dir().join(format!("faultline-scale-{tag}-{}", std::process::id()));
        std::fs::write(&path, lines.join("\n"))?;
        Ok(path)
    }

    fn fail(&mut self, i: usize, device: usize) -> Result<()> {
        let part = &mut self.0[i / CHUNK];
        debug_assert!(i >= part.first);
        writeln!(part.stdin, "fail {i} {device}")?;
        part.stdin.flush()?;
        Ok(())
    }

    fn ports(&self) -> HashSet<u16> {
        self.0.iter().map(|p| p.port).collect()
    }
}

/// Wait until `check` holds, polling every `every`.
async fn until<F, Fut>(
    within: Duration,
    every: Duration,
    what: &str,
    mut check: F,
) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    loop {
        if check().await {
            return Ok(t.elapsed());
        }
        if t.elapsed() > within {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(every).await;
    }
}

/// Every replica in `rs` holds its fair share of `shards` and writes it, and together
/// they follow `nodes` nodes.
async fn fair(server: &ApiServer, base: &str, rs: &[&Replica], shards: u32, nodes: usize) -> bool {
    let (most, least) = (
        (shards as usize).div_ceil(rs.len()) as i64,
        (shards as usize / rs.len()) as i64,
    );
    let mut followed = 0;
    for r in rs {
        let held = r.held().await;
        if held < least || held > most {
            return false;
        }
        followed += r.followed().await;
    }
    let mut by: HashMap<String, i64> = HashMap::new();
    for s in 0..shards {
        match writer(server, base, s) {
            Some(w) => *by.entry(w).or_default() += 1,
            None => return false,
        }
    }
    followed == nodes as i64
        && rs
            .iter()
            .all(|r| by.get(&r.name).is_some_and(|n| (least..=most).contains(n)))
}

/// CPU share of one core, RSS in MiB and CPU per received document over `secs`.
async fn steady(r: &Replica, secs: u64) -> (f64, f64, f64) {
    let pid = r.pid();
    let (c0, d0, t0) = (cpu_secs(pid), r.docs().await, Instant::now());
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (c1, d1, dt) = (cpu_secs(pid), r.docs().await, t0.elapsed().as_secs_f64());
    let per_doc = if d1 > d0 {
        (c1 - c0) / (d1 - d0) * 1e6
    } else {
        f64::NAN
    };
    (
        (c1 - c0) / dt * 100.0,
        proc_kib(pid, "VmRSS:") as f64 / 1024.0,
        per_doc,
    )
}

/// Phase 1: one replica following 5,000 nodes.
async fn single(
    agg: &str,
    fleets: &Fleets,
    server: &ApiServer,
    kube: &str,
    shards: u32,
) -> Result<()> {
    let n = 5000.min(fleets.0.len() * CHUNK);
    let file = fleets.agents_file(0..n, "single")?;
    let r = replica(agg, kube, "solo", "solo", shards, &file)?;
    let ready = until(
        Duration::from_secs(300),
        Duration::from_secs(1),
        "one replica: every node published",
        || async {
            (0..shards)
                .map(|s| entries(server, "solo", s).len())
                .sum::<usize>()
                == n
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (cpu, rss, per_doc) = steady(&r, env_or("BENCH_STEADY_SECS", 30) as u64).await;
    println!(
        "| one replica, {n} nodes x 8 devices ({shards} shards, all its own) | RSS {rss:.0} MiB ({:.1} KiB per node); CPU {cpu:.1}% of one core; {per_doc:.0} µs of CPU per received document; all published {:.1} s after start |",
        rss * 1024.0 / n as f64,
        ready.as_secs_f64()
    );
    drop(r);
    Ok(())
}

struct Scale<'a> {
    agg: &'a str,
    kube: String,
    server: &'a ApiServer,
    shards: u32,
    nodes: usize,
    replicas: usize,
    file: std::path::PathBuf,
}

impl Scale<'_> {
    fn start(&self, name: &str) -> Result<Replica> {
        replica(
            self.agg,
            &self.kube,
            name,
            "faultline",
            self.shards,
            &self.file,
        )
    }

    /// Phase 2: the replicas at steady state.
    async fn steady_state(&self, rs: &[Replica], ports: &HashSet<u16>) -> Result<()> {
        let mut rows = Vec::new();
        // One at a time, so each replica's 30 s window sees the same load.
        for r in rs {
            let (cpu, rss, per_doc) = steady(r, 30).await;
            rows.push((
                r.held().await,
                r.followed().await,
                cpu,
                rss,
                per_doc,
                connections(r.pid(), ports),
            ));
        }
        for (r, (held, followed, cpu, rss, per_doc, conns)) in rs.iter().zip(rows) {
            println!(
                "| {}: {held} of {} shards | follows {followed} nodes ({:.1}% of the fleet), {conns} agent connections; RSS {rss:.0} MiB ({:.1} KiB per followed node); CPU {cpu:.1}% of one core, {per_doc:.0} µs per received document |",
                r.name,
                self.shards,
                followed as f64 * 100.0 / self.nodes as f64,
                rss * 1024.0 / followed.max(1) as f64,
            );
        }
        Ok(())
    }

    /// Phase 3: hard fault to its shard ConfigMap.
    async fn latency(&self, fleets: &mut Fleets, injections: usize) -> Result<Vec<usize>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut picked: Vec<usize> = (0..self.nodes).collect();
        let mut failed = Vec::new();
        let mut lat = Vec::new();
        for k in 0..injections {
            let i = picked.swap_remove(rng.random_range(0..picked.len()));
            let name = node_name(i);
            let dev = k % 8;
            let shard = shard_of(&name, self.shards);
            let page = page_of(&name, self.shards, pages());
            let pointer = format!("/data/{name}.json");
            let t0 = Instant::now();
            fleets.fail(i, dev)?;
            loop {
                let done = self
                    .server
                    .get_at(
                        "configmaps",
                        NS,
                        &page_name("faultline", shard, page),
                        &pointer,
                    )
                    .and_then(|v| serde_json::from_str::<NodeFaults>(v.as_str()?).ok())
                    .is_some_and(|e| {
                        e.npus.iter().any(|d| {
                            d.id == format!("gpu{dev}") && d.status == DeviceStatus::Failed
                        })
                    });
                if done {
                    lat.push(t0.elapsed());
                    break;
                }
                if t0.elapsed() > Duration::from_secs(10) {
                    bail!("fault on {name} not published within 10 s");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            failed.push(i);
            tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
        }
        lat.sort();
        println!(
            "| hard fault to its shard ConfigMap, {} nodes x 8 devices, {} replicas, {injections} faults | p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms, max {:.0} ms |",
            self.nodes,
            self.replicas,
            pct(&lat, 0.5),
            pct(&lat, 0.95),
            pct(&lat, 0.99),
            lat.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        );
        Ok(failed)
    }

    /// Phase 4: SIGKILL `victim`; its shards held and rewritten by the others, and no
    /// published status changed on the way.
    async fn kill(&self, victim: Replica, others: &[&Replica]) -> Result<()> {
        let before = statuses(self.server, "faultline", self.shards);
        let failed = before
            .values()
            .filter(|s| **s == DeviceStatus::Failed)
            .count();
        let mine: Vec<u32> = (0..self.shards)
            .filter(|s| writer(self.server, "faultline", *s).as_deref() == Some(&victim.name))
            .collect();
        let mut seen: HashMap<u32, BTreeMap<String, String>> = mine
            .iter()
            .map(|s| (*s, entries(self.server, "faultline", *s)))
            .collect();
        let mut changed: Statuses = HashMap::new();
        let name = victim.name.clone();
        drop(victim);
        let t = Instant::now();
        let mut took = None;
        // Watch its shards' entries until they are rewritten, and 5 s more.
        while took.is_none_or(|d: Duration| t.elapsed() < d + Duration::from_secs(5)) {
            for s in &mine {
                let now = entries(self.server, "faultline", *s);
                let last = seen.entry(*s).or_default();
                for (k, v) in &now {
                    if last.get(k) != Some(v) {
                        let mut st = HashMap::new();
                        statuses_of(v, &mut st);
                        for (key, status) in st {
                            if before.get(&key) != Some(&status) {
                                changed.insert(key, status);
                            }
                        }
                    }
                }
                *last = now;
            }
            if took.is_none()
                && mine
                    .iter()
                    .all(|s| writer(self.server, "faultline", *s).is_some_and(|w| w != name))
            {
                took = Some(t.elapsed());
            }
            if t.elapsed() > Duration::from_secs(120) {
                bail!("{name}'s shards not taken over within 120 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let took = took.expect("loop ends once taken");
        // And the whole fleet.
        for (k, v) in statuses(self.server, "faultline", self.shards) {
            if before.get(&k) != Some(&v) {
                changed.insert(k, v);
            }
        }
        let rest = others
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        until(
            Duration::from_secs(60),
            Duration::from_secs(1),
            "the others at their share",
            || fair(self.server, "faultline", others, self.shards, self.nodes),
        )
        .await?;
        println!(
            "| SIGKILL of {name} ({} of {} shards; lease {} s) | all its shards held and rewritten by {rest} {:.1} s after the kill; devices whose published status changed: {} (of {}, {failed} of them failed) |",
            mine.len(),
            self.shards,
            LEASE.as_secs(),
            took.as_secs_f64(),
            changed.len(),
            before.len(),
        );
        if !changed.is_empty() {
            let some: Vec<_> = changed.iter().take(5).collect();
            eprintln!("changed in the takeover, e.g.: {some:?}");
        }
        Ok(())
    }
}

async fn scale_out(agg: &str, fleets: &mut Fleets, server: &ApiServer, kube: &str) -> Result<()> {
    let nodes = env_or("BENCH_SCALE_NODES", 20_000);
    let replicas = env_or("BENCH_REPLICAS", 4);
    // A shard ConfigMap holds at most 1 MiB (the API's limit; faultline's guard is 900
    // KiB) and a node of 8 devices takes about 1.9 KiB (2.2 KiB with this fleet's
    // many-digit temperatures): 32 shards of 625 nodes are written over two pages each
    // (`--pages 2`, BENCH_PAGES).
    let shards = env_or("BENCH_SHARDS", 32) as u32;
    let sc = Scale {
        agg,
        kube: kube.to_string(),
        server,
        shards,
        nodes,
        replicas,
        file: fleets.agents_file(0..nodes, "fleet")?,
    };
    let mut rs: Vec<Replica> = (1..=replicas)
        .map(|i| sc.start(&format!("r{i}")))
        .collect::<Result<_>>()?;
    let settled = until(
        Duration::from_secs(600),
        Duration::from_secs(1),
        "every replica at its share, every node published",
        || async {
            let refs: Vec<&Replica> = rs.iter().collect();
            fair(server, "faultline", &refs, shards, nodes).await
                && (0..shards)
                    .map(|s| entries(server, "faultline", s).len())
                    .sum::<usize>()
                    == nodes
        },
    )
    .await?;
    println!(
        "| start, {nodes} nodes x 8 devices, {replicas} replicas started together, {shards} shards | every replica at its share and every node published {:.1} s after start |",
        settled.as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    sc.steady_state(&rs, &fleets.ports()).await?;
    sc.latency(fleets, 100.min(nodes)).await?;
    let victim = rs.remove(0);
    let others: Vec<&Replica> = rs.iter().collect();
    sc.kill(victim, &others).await?;
    let r5 = sc.start(&format!("r{}", replicas + 1))?;
    let mut all: Vec<&Replica> = rs.iter().collect();
    all.push(&r5);
    let spread = until(
        Duration::from_secs(300),
        Duration::from_millis(500),
        "the new replica at its share",
        || fair(server, "faultline", &all, shards, nodes),
    )
    .await?;
    let mut held = Vec::new();
    for r in &all {
        held.push(format!("{} {}", r.name, r.held().await));
    }
    println!(
        "| start of a fifth replica ({} live) | shares within one of the fair share ({}) {:.1} s after it started |",
        all.len(),
        held.join(", "),
        spread.as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some((first, count)) = fleet_args(&args, "scale-bench")? {
        return fleet_main(first, count);
    }
    let Some(agg) = args.get(1) else {
        bail!("usage: scale-bench PATH/TO/faultline-aggregator");
    };
    let nodes = env_or("BENCH_SCALE_NODES", 20_000);
    let mut fleets = Fleets::spawn(nodes)?;
    tokio::runtime::Runtime::new()?.block_on(async {
        let (server, kube) = api_server().await;
        println!("| measure | result |\n|---|---|");
        single(agg, &fleets, &server, &kube, 32).await?;
        if std::env::var("BENCH_ONLY").as_deref() == Ok("single") {
            return Ok(());
        }
        scale_out(agg, &mut fleets, &server, &kube).await
    })
}
