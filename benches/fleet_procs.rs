//! The simulated agents in child processes of a benchmark (`BIN --fleet FIRST COUNT`,
//! [`CHUNK`] nodes each), and the parent's handle on them: shared by cluster-bench and
//! real-cluster-bench.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::cluster_fleet::{self, node_ip, Agents, FleetStats};
use super::fleet::{node_name, Proc};

/// Nodes per fleet process (this machine's hard limit is 20,000 open files; each node
/// holds a watch and a delivery connection).
pub const CHUNK: usize = 5000;

/// `name` from the environment, parsed, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fleet process's part: serve nodes `first..first + count`; commands on stdin
/// (`fail I D`, `stats`, `arrivals`), answers on stdout; exit when stdin closes.
pub fn fleet_main(first: usize, count: usize) -> Result<()> {
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

pub fn control(a: &Agents) {
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

pub struct FleetPart {
    pub proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    port: u16,
}

/// The whole fleet, in parts of [`CHUNK`] nodes.
pub struct Fleets(pub Vec<FleetPart>);

impl Fleets {
    pub fn spawn(nodes: usize, token: &str, noise: f64) -> Result<Self> {
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

    pub fn port_of(&self, i: usize) -> u16 {
        self.0[i / CHUNK].port
    }

    pub fn fail(&mut self, i: usize, device: usize) -> Result<()> {
        let part = &mut self.0[i / CHUNK];
        writeln!(part.stdin, "fail {i} {device}")?;
        part.stdin.flush()?;
        Ok(())
    }

    /// `cmd` to every part; each part's one-line answer.
    pub fn ask(&mut self, cmd: &str) -> Result<Vec<String>> {
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

    pub fn stats(&mut self) -> Result<FleetStats> {
        let mut total = FleetStats::default();
        for line in self.ask("stats")? {
            total.add(&serde_json::from_str(&line).context("fleet stats")?);
        }
        Ok(total)
    }

    /// Node -> when its first delivered entry naming a failed device arrived (µs).
    pub fn arrivals(&mut self) -> Result<HashMap<usize, u64>> {
        let mut out = HashMap::new();
        for line in self.ask("arrivals")? {
            let v: Vec<(usize, u64)> = serde_json::from_str(&line).context("fleet arrivals")?;
            out.extend(v);
        }
        Ok(out)
    }
}

/// EndpointSlice `k` of the agents' Service `service` in `ns`: nodes `range`, all served
/// on `port`, labelled as the endpointslice controller labels a Service's slices (the
/// aggregator follows those only), each endpoint naming its node and an agent pod.
pub fn endpoint_slice(
    (ns, service): (&str, &str),
    k: usize,
    range: std::ops::Range<usize>,
    port: u16,
) -> Value {
    let endpoints: Vec<Value> = range
        .map(|i| {
            json!({
                "addresses": [node_ip(i).to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node_name(i),
                "targetRef": {"kind": "Pod", "namespace": ns,
                    "name": format!("faultline-agent-{i:05x}"),
                    "uid": format!("5157e000-0000-4000-8000-{i:012x}")},
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-{k:05x}"), "namespace": ns,
            "labels": {"kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    })
}
