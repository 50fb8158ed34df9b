//! The bench's cluster: the agents' loopback addresses, the workload pods, the agents' EndpointSlices, RBAC, API faults; the aggregator replicas, their samples, the Leases watched.

use super::*;

/// Whether a connection to node `n - 1`'s loopback address reaches a listener on
/// `0.0.0.0` that sees that address as its local one.
pub(crate) fn check_loopback(n: usize) -> Result<()> {
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
pub(crate) fn workload_pod(i: usize) -> Value {
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

/// The Role that `scripts/gen-rbac.py` would generate for `--publish-namespaces ns`
/// with these shards and pages (the base's names only its 4 shards of one page).
pub(crate) fn publisher_rbac(ns: &str, shards: u32, pages: u32) -> [Value; 2] {
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
pub(crate) fn api_faults(latency_ms: u64) -> Faults {
    Faults {
        latency_ms,
        disruption_controller_paused: true,
        ..Default::default()
    }
}

/// What the cluster holds.
pub(crate) struct Seeded {
    pub(crate) node_bytes: u64,
    pub(crate) pod_bytes: u64,
    pub(crate) slice_bytes: u64,
    pub(crate) slices: usize,
    pub(crate) took: Duration,
}

/// The API server with the cluster in it; its URL.
pub(crate) async fn cluster(cfg: &Cfg, fleets: &Fleets) -> Result<(ApiServer, String, Seeded)> {
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
            endpoint_slice((NS, SERVICE), k, range, fleets.port_of(first)),
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
pub(crate) struct Replica {
    pub(crate) proc: Proc,
    pub(crate) name: String,
    pub(crate) port: u16,
    pub(crate) log: PathBuf,
}

pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Replica {
    pub(crate) fn start(agg: &str, kube: &str, name: &str, cfg: &Cfg, dir: &Path) -> Result<Self> {
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

    pub(crate) fn pid(&self) -> u32 {
        self.proc.0.id()
    }

    /// Every sample of its metrics, by name with labels.
    pub(crate) async fn metrics(&self) -> HashMap<String, f64> {
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
    pub(crate) fn log_lines(&self) -> (usize, usize) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        (
            text.lines().filter(|l| l.contains("WARN")).count(),
            text.lines().filter(|l| l.contains("ERROR")).count(),
        )
    }
}

/// The sum of the samples whose name (with labels) starts with `prefix`.
pub(crate) fn sum(m: &HashMap<String, f64>, prefix: &str) -> f64 {
    m.iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// What a replica counted at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RepSample {
    pub(crate) cpu_s: f64,
    pub(crate) docs: f64,
    pub(crate) entries_ok: f64,
    pub(crate) confirms_ok: f64,
    pub(crate) deliveries: f64,
    pub(crate) transitions: f64,
    pub(crate) writes: f64,
    pub(crate) write_s: f64,
    pub(crate) held: f64,
    pub(crate) followed: f64,
}

pub(crate) async fn sample(r: &Replica) -> RepSample {
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

pub(crate) async fn samples(rs: &[Replica]) -> Vec<RepSample> {
    let mut out = Vec::new();
    for r in rs {
        out.push(sample(r).await);
    }
    out
}

// ---------------------------------------------------------------------------------
// Reading the cluster back.

/// Each node entry of a shard, as written, over its pages.
pub(crate) fn entries(server: &ApiServer, cfg: &Cfg, s: u32) -> BTreeMap<String, String> {
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
pub(crate) fn all_published_healthy(server: &ApiServer, cfg: &Cfg) -> bool {
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
pub(crate) fn published_failed(server: &ApiServer, cfg: &Cfg, i: usize, dev: usize) -> bool {
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
pub(crate) struct LeaseWatch {
    pub(crate) last: Vec<Option<String>>,
    pub(crate) changes: u64,
}

pub(crate) fn watch_leases(server: ApiServer, shards: u32) -> Arc<Mutex<LeaseWatch>> {
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

pub(crate) fn lease_changes(w: &Arc<Mutex<LeaseWatch>>) -> u64 {
    w.lock().unwrap().changes
}

// ---------------------------------------------------------------------------------
// The reference: serde_json reading the fleet's document, timed on this thread's CPU
// clock, so that CPU per document compares across machines as a ratio.

pub(crate) fn thread_cpu_s() -> f64 {
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
pub(crate) async fn reference_us(doc: Arc<Vec<u8>>, n: usize) -> f64 {
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

pub(crate) fn bytes_out(c: &Costs) -> u64 {
    c.total.response_bytes + c.kubelet_fanout_bytes
}

/// One steady-state window.
pub(crate) struct Window {
    pub(crate) label: String,
    pub(crate) latency_ms: u64,
    pub(crate) secs: f64,
    pub(crate) costs: Costs,
    pub(crate) reps: Vec<RepSample>,
    pub(crate) fleet: FleetStats,
    pub(crate) lease_changes: u64,
    pub(crate) reference_us: f64,
    /// CPU seconds of this process (the API server, the benchmark) and of the fleet.
    pub(crate) load: (f64, f64),
}

impl Window {
    pub(crate) fn per_s(&self, v: f64) -> f64 {
        v / self.secs
    }
}

pub(crate) fn delta(a: &[RepSample], b: &[RepSample]) -> Vec<RepSample> {
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
