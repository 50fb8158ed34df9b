//! real-cluster-bench's measures: the control plane's processes, its metrics and
//! etcd's, in windows; the report.

use super::*;

// Measuring.

/// The samples of a Prometheus text exposition whose name is in `names`, summed by
/// (name, the values of `keys`).
pub(crate) fn parse_metrics(
    text: &str,
    names: &[&str],
    keys: &[&str],
) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        if !names.contains(&name) {
            continue;
        }
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches(['"', '}']).to_string())
                .unwrap_or_default()
        };
        let key: Vec<String> = keys
            .iter()
            .map(|k| label(k))
            .filter(|v| !v.is_empty())
            .collect();
        *out.entry((name.to_string(), key.join(" "))).or_default() += v;
    }
    out
}

pub(crate) async fn text_of(url: &str) -> String {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let Ok(url) = url.parse() else {
        return String::new();
    };
    let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(10), client.get(url)).await else {
        return String::new();
    };
    match http_body_util::BodyExt::collect(resp.into_body()).await {
        Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
        Err(_) => String::new(),
    }
}

pub(crate) const API_SERIES: [&str; 4] = [
    "apiserver_request_total",
    "apiserver_response_sizes_sum",
    "apiserver_watch_events_sizes_sum",
    "apiserver_watch_events_total",
];
pub(crate) const ETCD_SERIES: [&str; 6] = [
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
    "etcd_debugging_mvcc_current_revision",
    "etcd_disk_wal_write_bytes_total",
    "etcd_mvcc_put_total",
    "etcd_debugging_mvcc_keys_total",
];

/// Everything read at one moment.
pub(crate) struct Sample {
    pub(crate) at: Instant,
    pub(crate) cpu: BTreeMap<String, f64>,
    pub(crate) rss_mib: BTreeMap<String, f64>,
    pub(crate) api: BTreeMap<(String, String), f64>,
    pub(crate) etcd: BTreeMap<(String, String), f64>,
    pub(crate) docs: f64,
}

pub(crate) async fn sample(
    cp: &ControlPlane,
    admin: &kube::Client,
    reps: &[Replica],
    fleets: Option<&Fleets>,
) -> Sample {
    let mut cpu = BTreeMap::new();
    let mut rss_mib = BTreeMap::new();
    let mut procs: Vec<(String, u32)> = cp
        .pids()
        .into_iter()
        .map(|(n, p)| (n.to_string(), p))
        .collect();
    procs.extend(reps.iter().map(|r| (r.name.clone(), r.proc.0.id())));
    procs.push(("bench (the kubelets' Leases)".into(), std::process::id()));
    if let Some(f) = fleets {
        for (k, p) in f.0.iter().enumerate() {
            procs.push((format!("fleet-{k}"), p.proc.0.id()));
        }
    }
    for (name, pid) in procs {
        cpu.insert(name.clone(), cpu_secs(pid));
        rss_mib.insert(name, proc_kib(pid, "VmRSS:") as f64 / 1024.0);
    }
    let req = hyper::Request::get("/metrics")
        .body(Vec::new())
        .expect("a request");
    let api_text = admin.request_text(req).await.unwrap_or_default();
    let api = parse_metrics(&api_text, &API_SERIES, &["verb", "resource", "kind"]);
    let etcd_text = text_of(&format!("{}/metrics", cp.etcd)).await;
    let etcd = parse_metrics(&etcd_text, &ETCD_SERIES, &[]);
    let mut docs = 0.0;
    for r in reps {
        docs += replica_docs(r).await;
    }
    Sample {
        at: Instant::now(),
        cpu,
        rss_mib,
        api,
        etcd,
        docs,
    }
}

/// Documents a replica took from agents (`agent_polls_total{result="ok"}`).
pub(crate) async fn replica_docs(r: &Replica) -> f64 {
    let log =
        std::fs::read_to_string(format!("/proc/{}/cmdline", r.proc.0.id())).unwrap_or_default();
    let listen = log
        .split('\0')
        .skip_while(|a| *a != "--listen")
        .nth(1)
        .unwrap_or("")
        .to_string();
    let text = text_of(&format!("http://{listen}/metrics")).await;
    parse_metrics(
        &text,
        &["faultline_aggregator_agent_polls_total"],
        &["result"],
    )
    .get(&(
        "faultline_aggregator_agent_polls_total".to_string(),
        "ok".to_string(),
    ))
    .copied()
    .unwrap_or(0.0)
}

/// A steady window: its samples at either end.
pub(crate) struct Window {
    pub(crate) a: Sample,
    pub(crate) b: Sample,
}

impl Window {
    pub(crate) fn secs(&self) -> f64 {
        (self.b.at - self.a.at).as_secs_f64()
    }
    pub(crate) fn cores(&self, proc: &str) -> f64 {
        (self.b.cpu.get(proc).copied().unwrap_or(0.0)
            - self.a.cpu.get(proc).copied().unwrap_or(0.0))
            / self.secs()
    }
    pub(crate) fn rate(
        &self,
        m: &BTreeMap<(String, String), f64>,
        n: &BTreeMap<(String, String), f64>,
        key: &(String, String),
    ) -> f64 {
        (n.get(key).copied().unwrap_or(0.0) - m.get(key).copied().unwrap_or(0.0)) / self.secs()
    }
    pub(crate) fn api_rate(&self, key: &(String, String)) -> f64 {
        self.rate(&self.a.api, &self.b.api, key)
    }
    pub(crate) fn etcd_rate(&self, name: &str) -> f64 {
        self.rate(
            &self.a.etcd,
            &self.b.etcd,
            &(name.to_string(), String::new()),
        )
    }
    pub(crate) fn etcd_now(&self, name: &str) -> f64 {
        self.b
            .etcd
            .get(&(name.to_string(), String::new()))
            .copied()
            .unwrap_or(0.0)
    }
}

pub(crate) async fn window(
    label: &'static str,
    secs: u64,
    cp: &ControlPlane,
    admin: &kube::Client,
    reps: &[Replica],
    fleets: Option<&Fleets>,
) -> Window {
    let a = sample(cp, admin, reps, fleets).await;
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let b = sample(cp, admin, reps, fleets).await;
    eprintln!("window {label}: {:.0} s", (b.at - a.at).as_secs_f64());
    Window { a, b }
}

// ---------------------------------------------------------------------------------
// The report.

pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// The fleet alone before and after faultline ran, and with it.
pub(crate) struct Windows {
    pub(crate) before: Window,
    pub(crate) with: Window,
    pub(crate) after: Window,
}

impl Windows {
    /// A figure in each window, and faultline's share: with it less the mean alone.
    pub(crate) fn row(&self, what: &str, f: impl Fn(&Window) -> f64, digits: usize) {
        let (a, b, c) = (f(&self.before), f(&self.with), f(&self.after));
        println!(
            "| {what} | {a:.digits$} | {b:.digits$} | {c:.digits$} | {:+.digits$} |",
            b - (a + c) / 2.0
        );
    }
}

pub(crate) fn report(
    cfg: &Cfg,
    w: &Windows,
    faults: &mut [f64],
    local: &mut [f64],
    seeded_bytes: u64,
) {
    let mib = 1024.0 * 1024.0;
    println!(
        "## real-cluster-bench: {} nodes, {} replicas, {} shards x {} pages, Kubernetes {}",
        cfg.nodes,
        cfg.replicas,
        cfg.shards,
        cfg.pages,
        cfg.release.minor()
    );
    println!(
        "Nodes seeded: {:.1} MB of JSON; windows of {:.0}, {:.0} and {:.0} s",
        seeded_bytes as f64 / 1e6,
        w.before.secs(),
        w.with.secs(),
        w.after.secs()
    );
    println!();
    println!("| | the fleet alone, before | with faultline | the fleet alone, after | faultline's share |");
    println!("|---|---|---|---|---|");
    for p in [
        "kube-apiserver",
        "etcd",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        w.row(&format!("{p} CPU (cores)"), |x| x.cores(p), 3);
        w.row(
            &format!("{p} RSS (MiB, at the end)"),
            |x| x.b.rss_mib.get(p).copied().unwrap_or(0.0),
            0,
        );
    }
    w.row(
        "etcd revisions/s",
        |x| x.etcd_rate("etcd_debugging_mvcc_current_revision"),
        1,
    );
    w.row(
        "etcd WAL KB/s",
        |x| x.etcd_rate("etcd_disk_wal_write_bytes_total") / 1e3,
        1,
    );
    w.row(
        "etcd database (MiB, at the end)",
        |x| x.etcd_now("etcd_mvcc_db_total_size_in_bytes") / mib,
        1,
    );
    w.row(
        "etcd database in use (MiB, at the end)",
        |x| x.etcd_now("etcd_mvcc_db_total_size_in_use_in_bytes") / mib,
        1,
    );
    w.row(
        "etcd keys (at the end)",
        |x| x.etcd_now("etcd_debugging_mvcc_keys_total"),
        0,
    );
    let bench = "bench (the kubelets' Leases)";
    w.row(
        "this process: the Lease renewals (cores)",
        |x| x.cores(bench),
        3,
    );
    let with = &w.with;
    let reps: Vec<&String> = with
        .b
        .cpu
        .keys()
        .filter(|k| k.starts_with('r') && k.len() <= 3)
        .collect();
    let rep_cores: f64 = reps.iter().map(|r| with.cores(r)).sum();
    let docs = (with.b.docs - with.a.docs) / with.secs();
    println!();
    print!("Replicas: {rep_cores:.3} cores in all; RSS");
    for r in &reps {
        print!(
            " {r} {:.0} MiB",
            with.b.rss_mib.get(*r).copied().unwrap_or(0.0)
        );
    }
    println!(
        "; {docs:.0} documents/s taken from the agents{}",
        if docs > 0.0 {
            format!(
                ", {:.1} µs of replica CPU per document",
                rep_cores / docs * 1e6
            )
        } else {
            String::new()
        }
    );
    println!();
    println!("Requests/s by verb and resource where faultline's share is 0.01/s or more, and its share of response bytes (reads only):");
    println!();
    println!(
        "| verb resource | before | with faultline | after | share req/s | share response KB/s |"
    );
    println!("|---|---|---|---|---|---|");
    let mean = |f: &dyn Fn(&Window) -> f64| f(&w.with) - (f(&w.before) + f(&w.after)) / 2.0;
    let keys: Vec<(String, String)> = with
        .b
        .api
        .keys()
        .filter(|(n, _)| n == "apiserver_request_total")
        .cloned()
        .collect();
    for k in keys {
        let share = mean(&|x: &Window| x.api_rate(&k));
        if share < 0.01 {
            continue;
        }
        let sk = ("apiserver_response_sizes_sum".to_string(), k.1.clone());
        let kb = mean(&|x: &Window| x.api_rate(&sk)) / 1e3;
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {share:+.2} | {kb:+.1} |",
            k.1,
            w.before.api_rate(&k),
            with.api_rate(&k),
            w.after.api_rate(&k)
        );
    }
    println!();
    println!("Watch events sent, KB/s by kind (to every watcher):");
    println!();
    println!("| kind | before | with faultline | after | share |");
    println!("|---|---|---|---|---|");
    let keys: Vec<(String, String)> = with
        .b
        .api
        .keys()
        .filter(|(n, _)| n == "apiserver_watch_events_sizes_sum")
        .cloned()
        .collect();
    for k in keys {
        let rates = [&w.before, with, &w.after].map(|x| x.api_rate(&k) / 1e3);
        if rates.iter().all(|r| *r < 0.1) {
            continue;
        }
        let share = rates[1] - (rates[0] + rates[2]) / 2.0;
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {share:+.1} |",
            k.1, rates[0], rates[1], rates[2]
        );
    }
    println!();
    let n = faults.len();
    println!(
        "{n} hard faults one at a time: to the shard ConfigMap p50 {:.1} / p99 {:.1} / max {:.1} ms; to the node's delivered fault.json p50 {:.1} / p99 {:.1} ms",
        pct(faults, 0.5), pct(faults, 0.99), pct(faults, 1.0), pct(local, 0.5), pct(local, 0.99)
    );
}

/// Until the Nodes stop changing: after they are made, kube-controller-manager's TTL
/// controller annotates every Node again each time the cluster's size crosses one of
/// its thresholds (pkg/controller/ttl: 100, 500, 1,000 and 2,000 nodes), at its client's
/// 20 writes a second, and each write is a whole Node to every watcher. Watch event
/// bytes of Nodes below 1 KB/s over 15 s, twice in a row; at most `most`. How long it
/// took.
pub(crate) async fn settle(admin: &kube::Client, most: Duration) -> Duration {
    let t = Instant::now();
    let nodes = |m: &BTreeMap<(String, String), f64>| {
        m.get(&(
            "apiserver_watch_events_sizes_sum".to_string(),
            "nodes".to_string(),
        ))
        .copied()
        .unwrap_or(0.0)
    };
    let read = || async {
        let req = hyper::Request::get("/metrics")
            .body(Vec::new())
            .expect("a request");
        let text = admin.request_text(req).await.unwrap_or_default();
        parse_metrics(&text, &API_SERIES, &["verb", "resource", "kind"])
    };
    let (mut quiet, mut last) = (0, nodes(&read().await));
    while quiet < 2 && t.elapsed() < most {
        tokio::time::sleep(Duration::from_secs(15)).await;
        let now = nodes(&read().await);
        let rate = (now - last) / 15.0;
        last = now;
        quiet = if rate < 1e3 { quiet + 1 } else { 0 };
        eprintln!(
            "{:.0} s: Node watch events {:.1} KB/s",
            t.elapsed().as_secs_f64(),
            rate / 1e3
        );
    }
    t.elapsed()
}
