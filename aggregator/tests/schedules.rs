//! Randomized fault schedules (issue 10): a seeded simulation runs the real remediation
//! code (several `Remediator` replicas, each with its own credentials, fenced by its
//! own view of the shard Lease) against the Kubernetes API test server under the RBAC of
//! deploy/base/aggregator.yaml, through a random schedule of device failures and recoveries,
//! agents going dark, Lease takeovers while passes are in flight, replicas killed and
//! restarted, skewed replica clocks, and API latency, 5xx, 409s, API Priority and
//! Fairness 429s and Node churn. After every schedule it checks:
//!
//! 1. no pod is evicted twice (each pod lives through one fault at most);
//! 2. nothing is evicted for Unknown (nodes that never had a failed device keep their pods);
//! 3. quarantined nodes never exceed the budget plus (replicas − 1);
//! 4. no Node write or eviction lands from a replica while its Lease is elsewhere;
//! 5. every failed node ends quarantined, or announced as held back (or stopped by an
//!    open breaker, which announces itself);
//! 6. a node without a quarantine record carries no faultline taint (a release leaves none).
//!
//! The seed and the schedule are printed on failure. `FAULTLINE_SCHEDULES` (default
//! 200) sets how many run, from seed `FAULTLINE_SCHEDULE_FIRST` (default 1);
//! `FAULTLINE_SCHEDULE_SEED` runs one seed alone;
//! `benches/run-schedules.sh` runs 1,000.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use faultline_aggregator::model::{DeviceView, RecordDevice};
use faultline_aggregator::remediate::{
    record_of, Breaker, Budget, Mode, ReleasePolicy, Remediator, DEVICES_LABEL,
};
use faultline_aggregator::shard::{Fence, Held};
use faultline_common::DeviceStatus;
use faultline_test_apiserver::{ApiServer, Faults};
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use support::{NodeFixture, PodFixture, AGGREGATOR_USER};

const NODES: usize = 5;
const DEVICES: usize = 2;
const REPLICAS: usize = 3;
const STEPS: usize = 24;
const BUDGET: usize = 2;
const TAINT: &str = "nvidia.com/gpu-fault";
/// Between revoking a replica's Lease and granting it to another: longer than the
/// longest write can be in flight (injected latency ≤ 15 ms; local calls take less).
const GAP: Duration = Duration::from_millis(250);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dev {
    Healthy { since_ms: u64 },
    Failed,
}

struct NodeTruth {
    devices: [Dev; DEVICES],
    agent_down: bool,
    ever_failed: bool,
}

/// A node's pass as a replica sees it: failed devices, unknown devices, and the
/// views a release decision reads.
type NodeWork = (
    String,
    Vec<RecordDevice>,
    Vec<RecordDevice>,
    Vec<DeviceView>,
);

struct Replica {
    name: String,
    token_file: std::path::PathBuf,
    remediator: Arc<Remediator>,
    held: Held,
    /// This replica's clock, off by this much (ms).
    skew_ms: i64,
}

struct Sim {
    seed: u64,
    server: ApiServer,
    url: String,
    _dir: tempfile::TempDir,
    replicas: Vec<Replica>,
    truth: Vec<NodeTruth>,
    holder: Option<usize>,
    rng: StdRng,
    log: Vec<String>,
    /// Per replica: windows [from, until) in which it did not hold the Lease and no
    /// write of its may land (from: when another replica was granted it).
    not_holder: Vec<Vec<(u64, u64)>>,
    max_quarantined: usize,
    /// What the passes answered, per node (the last few), for a failure's report.
    outcomes: Arc<std::sync::Mutex<BTreeMap<String, Vec<String>>>>,
}

fn node(i: usize) -> String {
    format!("n{i}")
}

fn token(i: usize) -> String {
    format!("replica-{i}-token")
}

impl Sim {
    async fn new(seed: u64) -> Sim {
        let tokens: Vec<String> = (0..REPLICAS).map(token).collect();
        let users: Vec<(&str, &str)> = tokens
            .iter()
            .map(|t| (t.as_str(), AGGREGATOR_USER))
            .collect();
        let (server, url) = support::api_server_for(&users).await;
        for i in 0..NODES {
            NodeFixture::new(&node(i)).ready(true).create(&server);
            for p in 0..2 {
                let name = format!("job-{i}-{p}");
                PodFixture::new(&name, &node(i)).gpu().create(&server);
            }
        }
        // One job under a budget that allows one disruption of its two pods.
        for (name, i) in [("guarded-a", 0), ("guarded-b", 1)] {
            PodFixture::new(name, &node(i))
                .gpu()
                .label("app", "guarded")
                .create(&server);
        }
        server
            .create(
                "poddisruptionbudgets",
                "default",
                json!({"metadata": {"name": "guarded"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}}),
            )
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut sim = Sim {
            seed,
            server,
            url,
            replicas: Vec::new(),
            truth: (0..NODES)
                .map(|_| NodeTruth {
                    devices: [Dev::Healthy { since_ms: 0 }; DEVICES],
                    agent_down: false,
                    ever_failed: false,
                })
                .collect(),
            holder: None,
            log: Vec::new(),
            not_holder: vec![Vec::new(); REPLICAS],
            max_quarantined: 0,
            outcomes: Default::default(),
            _dir: dir,
            rng: StdRng::seed_from_u64(rng.random()),
        };
        for i in 0..REPLICAS {
            let token_file = sim._dir.path().join(format!("token-{i}"));
            std::fs::write(&token_file, token(i)).unwrap();
            let skew_ms = rng.random_range(-5_000..=5_000);
            let name = format!("replica-{i}");
            let remediator = sim.remediator(&name, &token_file);
            sim.replicas.push(Replica {
                name,
                token_file,
                remediator,
                held: Held::default(),
                skew_ms,
            });
        }
        sim.grant(0);
        sim
    }

    fn remediator(&self, name: &str, token_file: &std::path::Path) -> Arc<Remediator> {
        let mut kc = kube::Config::new(self.url.parse().unwrap());
        kc.auth_info.token_file = Some(token_file.display().to_string());
        kc.default_retry = false;
        kc.read_timeout = Some(Duration::from_secs(5));
        let client = kube::Client::try_from(kc).unwrap();
        let breaker = Breaker::new(
            kube::Api::namespaced(client.clone(), "faultline"),
            "faultline-breaker".into(),
            NODES,
            Duration::from_secs(300),
        );
        Arc::new(
            Remediator::new(client, Mode::Enforce, TAINT, "default", name)
                .with_budget(Budget {
                    max_nodes: BUDGET,
                    max_percent: 100.0,
                    max_unknown: 2,
                    ..Budget::default()
                })
                .with_breaker(Some(breaker), 0.0)
                .with_release(ReleasePolicy {
                    auto: true,
                    healthy_samples: 1,
                    cooldown: Duration::from_millis(1),
                    dedup_window: Duration::from_millis(1),
                    ..ReleasePolicy::default()
                }),
        )
    }

    fn grant(&mut self, r: usize) {
        self.replicas[r]
            .held
            .grant(0, Instant::now() + Duration::from_secs(3600));
        self.holder = Some(r);
        let t = now_ms();
        // The windows in which r did not hold end now.
        if let Some(w) = self.not_holder[r].last_mut() {
            if w.1 == u64::MAX {
                w.1 = t;
            }
        }
    }

    /// Revoke the holder's Lease; after the gap, grant it to `next`.
    async fn takeover(&mut self, next: usize, in_flight: bool) {
        let Some(old) = self.holder else {
            self.grant(next);
            return;
        };
        // Passes of the old holder still running while the Lease moves: slowed down
        // (every call 60 ms late) so that they straddle the move, yet any one write
        // sent before the revocation lands well within the gap.
        let before = self.server.faults();
        let passes = in_flight.then(|| {
            self.server.set_faults(Faults {
                latency_ms: 60,
                ..before.clone()
            });
            self.spawn_passes(old)
        });
        if in_flight {
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..200))).await;
        }
        self.replicas[old].held.grant(0, Instant::now());
        self.holder = None;
        tokio::time::sleep(GAP).await;
        if next != old {
            self.not_holder[old].push((now_ms(), u64::MAX));
        }
        self.grant(next);
        if let Some(p) = passes {
            let _ = p.await;
            self.server.set_faults(before);
        }
    }

    fn restart(&mut self, r: usize) {
        let name = self.replicas[r].name.clone();
        let file = self.replicas[r].token_file.clone();
        self.replicas[r].remediator = self.remediator(&name, &file);
        // A restarted replica holds nothing until it wins the Lease again.
        let held = Held::default();
        self.replicas[r].held = held;
        if self.holder == Some(r) {
            self.holder = None;
            self.not_holder[r].push((now_ms(), u64::MAX));
        }
    }

    /// One pass of replica `r` over every node, as its dispatcher would run them.
    fn spawn_passes(&self, r: usize) -> tokio::task::JoinHandle<()> {
        let rep = &self.replicas[r];
        let (rem, fence) = (rep.remediator.clone(), Fence::shard(rep.held.clone(), 0));
        let now = (now_ms() as i64 + rep.skew_ms) as u64;
        let work: Vec<NodeWork> = self
            .truth
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let failed: Vec<RecordDevice> = t
                    .devices
                    .iter()
                    .enumerate()
                    .filter(|(_, d)| **d == Dev::Failed)
                    .map(|(d, _)| RecordDevice::new(format!("gpu{d}"), "row-remap-failure"))
                    .collect();
                let unknown: Vec<RecordDevice> = if t.agent_down {
                    (0..DEVICES)
                        .map(|d| RecordDevice::new(format!("gpu{d}"), "no-fresh-data"))
                        .collect()
                } else {
                    Vec::new()
                };
                let views = t
                    .devices
                    .iter()
                    .enumerate()
                    .map(|(d, dev)| DeviceView {
                        device: RecordDevice::new(format!("gpu{d}"), ""),
                        status: match (t.agent_down, dev) {
                            (true, _) => DeviceStatus::Unknown,
                            (false, Dev::Failed) => DeviceStatus::Failed,
                            (false, Dev::Healthy { .. }) => DeviceStatus::Healthy,
                        },
                        clean_streak: match dev {
                            Dev::Healthy { .. } if !t.agent_down => 100,
                            _ => 0,
                        },
                        since_ms: match dev {
                            Dev::Healthy { since_ms } => *since_ms,
                            Dev::Failed => now,
                        },
                    })
                    .collect();
                (node(i), failed, unknown, views)
            })
            .collect();
        let outcomes = self.outcomes.clone();
        let who = rep.name.clone();
        tokio::spawn(async move {
            let passes = work.into_iter().map(|(n, failed, unknown, views)| {
                let (rem, fence, outcomes, who) =
                    (rem.clone(), fence.clone(), outcomes.clone(), who.clone());
                async move {
                    let mut said = vec![format!(
                        "{who} release: {:?}",
                        rem.release_pass(&n, &views, now, &fence).await
                    )];
                    if !failed.is_empty() {
                        let _ = rem.note_new_failure(&n).await;
                        let o = rem.isolate(&n, failed, &fence).await;
                        said.push(format!("{who} isolate: {o:?}"));
                        if o.is_ok() {
                            let _ = rem.evict(&n, &fence).await;
                        }
                    } else if !unknown.is_empty() {
                        let o = rem.guard_unknown(&n, unknown, &fence).await;
                        said.push(format!("{who} unknown guard: {o:?}"));
                    }
                    let mut g = outcomes.lock().unwrap();
                    let list = g.entry(n).or_default();
                    list.extend(said);
                    let drop = list.len().saturating_sub(6);
                    list.drain(..drop);
                }
            });
            futures_util::future::join_all(passes).await;
        })
    }

    async fn passes(&mut self) {
        if let Some(h) = self.holder {
            let _ = self.spawn_passes(h).await;
        }
        self.check_budget();
    }

    fn check_budget(&mut self) {
        let q = self
            .server
            .list("nodes", "")
            .iter()
            .filter(|n| {
                n.pointer("/metadata/labels")
                    .and_then(|l| l.get(DEVICES_LABEL))
                    .and_then(Value::as_str)
                    .is_some_and(|v| v != "unknown")
            })
            .count();
        self.max_quarantined = self.max_quarantined.max(q);
    }

    async fn step(&mut self) {
        let roll = self.rng.random_range(0..100);
        let n = self.rng.random_range(0..NODES);
        let d = self.rng.random_range(0..DEVICES);
        let what = match roll {
            0..=24 => {
                self.truth[n].devices[d] = Dev::Failed;
                self.truth[n].ever_failed = true;
                format!("fail n{n}/gpu{d}")
            }
            25..=39 => {
                if self.truth[n].devices[d] == Dev::Failed {
                    self.truth[n].devices[d] = Dev::Healthy { since_ms: now_ms() };
                }
                format!("recover n{n}/gpu{d}")
            }
            40..=47 => {
                self.truth[n].agent_down = !self.truth[n].agent_down;
                format!(
                    "agent of n{n} {}",
                    if self.truth[n].agent_down {
                        "down"
                    } else {
                        "up"
                    }
                )
            }
            48..=59 => {
                let next = self.rng.random_range(0..REPLICAS);
                let in_flight = self.rng.random_bool(0.7);
                self.takeover(next, in_flight).await;
                format!(
                    "takeover to replica-{next}{}",
                    if in_flight { " (passes in flight)" } else { "" }
                )
            }
            60..=65 => {
                let r = self.rng.random_range(0..REPLICAS);
                self.restart(r);
                if self.holder.is_none() {
                    let next = self.rng.random_range(0..REPLICAS);
                    tokio::time::sleep(GAP).await;
                    self.grant(next);
                }
                format!("restart replica-{r}")
            }
            66..=75 => {
                let f = Faults {
                    latency_ms: self.rng.random_range(0..=15),
                    error_rate: self.rng.random_range(0.0..0.08),
                    write_error_rate: self.rng.random_range(0.0..0.1),
                    conflict_rate: self.rng.random_range(0.0..0.2),
                    throttle_rate: self.rng.random_range(0.0..0.08),
                    node_churn: self.rng.random_bool(0.5),
                    seed: self.rng.random(),
                    ..Default::default()
                };
                let s = format!("{f:?}");
                self.server.set_faults(f);
                format!("faults {s}")
            }
            76..=79 => {
                self.server.set_faults(Faults::default());
                "faults cleared".into()
            }
            _ => "passes".into(),
        };
        self.log.push(what);
        self.passes().await;
    }

    /// Faults off, a holder, and passes until nothing changes.
    async fn settle(&mut self) {
        self.server.set_faults(Faults::default());
        if self.holder.is_none() {
            tokio::time::sleep(GAP).await;
            self.grant(0);
        }
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.passes().await;
        }
    }

    fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        let calls = self.server.calls();
        // 1 and 2: evictions.
        let mut evictions: BTreeMap<String, usize> = BTreeMap::new();
        for c in calls
            .iter()
            .filter(|c| c.method == "POST" && c.uri.ends_with("/eviction") && c.status == 201)
        {
            *evictions.entry(c.uri.clone()).or_default() += 1;
        }
        for (uri, n) in &evictions {
            if *n > 1 {
                out.push(format!("1: {uri} evicted {n} times"));
            }
            let pod = uri.split('/').rev().nth(1).unwrap_or("");
            let node_of = pod.split('-').nth(1).and_then(|i| i.parse::<usize>().ok());
            let node_of = match pod {
                "guarded-a" => Some(0),
                "guarded-b" => Some(1),
                _ => node_of,
            };
            if let Some(i) = node_of {
                if !self.truth[i].ever_failed {
                    out.push(format!(
                        "2: {pod} on n{i} evicted, a node that never failed"
                    ));
                }
            }
        }
        // 3: the budget.
        if self.max_quarantined > BUDGET + REPLICAS - 1 {
            out.push(format!(
                "3: {} nodes quarantined at once, budget {BUDGET} + {} replicas - 1",
                self.max_quarantined, REPLICAS
            ));
        }
        // 4: writes while the Lease was elsewhere.
        for (r, windows) in self.not_holder.iter().enumerate() {
            let t = token(r);
            for c in &calls {
                let acts = (c.method == "PATCH" || c.method == "PUT") && c.uri.contains("/nodes/")
                    || c.uri.ends_with("/eviction")
                    || (c.method == "DELETE" && c.uri.contains("/pods/"));
                if !acts || c.token.as_deref() != Some(t.as_str()) || c.status >= 400 {
                    continue;
                }
                if windows
                    .iter()
                    .any(|(from, until)| c.at_ms >= *from && c.at_ms < *until)
                {
                    out.push(format!(
                        "4: replica-{r} wrote {} {} at {} while another replica held the Lease",
                        c.method, c.uri, c.at_ms
                    ));
                }
            }
        }
        // 5 and 6: the end state.
        let held_back: BTreeSet<String> = self
            .server
            .list("events", "default")
            .iter()
            .filter(|e| e["reason"] == "FaultlineHeldBack")
            .filter_map(|e| {
                e.pointer("/involvedObject/name")
                    .and_then(Value::as_str)
                    .map(String::from)
            })
            .collect();
        let breaker_open = self
            .server
            .get("configmaps", "faultline", "faultline-breaker")
            .is_some_and(|c| c["data"]["state"] == "open");
        for (i, t) in self.truth.iter().enumerate() {
            let n = self.server.get("nodes", "", &node(i)).unwrap();
            let live: k8s_openapi::api::core::v1::Node = serde_json::from_value(n.clone()).unwrap();
            let record = record_of(&live).ok().flatten();
            let ours = n["spec"]["taints"]
                .as_array()
                .map_or(0, |ts| ts.iter().filter(|x| x["key"] == TAINT).count());
            let failed = t.devices.contains(&Dev::Failed);
            let quarantined = record.as_ref().is_some_and(|r| !r.unknown_only);
            if failed && !quarantined && !held_back.contains(&node(i)) && !breaker_open {
                out.push(format!(
                    "5: n{i} has a failed device, is not quarantined and was not announced as held back\n     node: {}\n     last passes: {:?}",
                    json!({"labels": n["metadata"]["labels"], "annotations": n["metadata"]["annotations"], "taints": n["spec"]["taints"]}),
                    self.outcomes.lock().unwrap().get(&node(i))
                ));
            }
            if record.is_none() && ours > 0 {
                out.push(format!(
                    "6: n{i} has no record but carries {ours} faultline taint(s)"
                ));
            }
            if ours > 1 {
                out.push(format!("6: n{i} carries {ours} faultline taints"));
            }
        }
        out
    }
}

async fn run(seed: u64) -> Result<(), String> {
    let mut sim = Sim::new(seed).await;
    for _ in 0..STEPS {
        sim.step().await;
    }
    sim.settle().await;
    let failures = sim.failures();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "schedule seed {} failed:\n  {}\nschedule:\n  {}",
            sim.seed,
            failures.join("\n  "),
            sim.log.join("\n  ")
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn randomized_fault_schedules_keep_the_invariants() {
    let seeds: Vec<u64> = match std::env::var("FAULTLINE_SCHEDULE_SEED") {
        Ok(s) => vec![s.parse().expect("FAULTLINE_SCHEDULE_SEED: a number")],
        Err(_) => {
            let var = |k: &str, d: u64| {
                std::env::var(k)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(d)
            };
            let (n, first) = (
                var("FAULTLINE_SCHEDULES", 200),
                var("FAULTLINE_SCHEDULE_FIRST", 1),
            );
            (first..first + n).collect()
        }
    };
    let total = seeds.len();
    let t = Instant::now();
    let results: Vec<Result<(), String>> = futures_util::stream::iter(seeds)
        .map(run)
        .buffer_unordered(8)
        .collect()
        .await;
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    println!(
        "schedules: {total} run, {} held every invariant, {} failed, in {:.1} s",
        total - failed.len(),
        failed.len(),
        t.elapsed().as_secs_f64()
    );
    assert!(
        failed.is_empty(),
        "{}",
        failed
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}
