//! What a run prints: the windows, the requests, the faults, the machine and commit, the summary block.

use super::*;

pub(crate) struct Single {
    pub(crate) before: Costs,
    pub(crate) after: Costs,
    pub(crate) changes: f64,
    pub(crate) to_configmap: Option<f64>,
}

impl Single {
    pub(crate) fn extra_bytes(&self) -> f64 {
        bytes_out(&self.after) as f64 - bytes_out(&self.before) as f64
    }
}

pub(crate) fn pctl(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 - 1.0) * p).round() as usize]
}

// ---------------------------------------------------------------------------------
// The summary.

pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok {
        "PASS"
    } else {
        "FAIL"
    }
}

pub(crate) fn human(b: f64) -> String {
    if b.abs() >= MB {
        format!("{:.2} MB", b / MB)
    } else if b.abs() >= KB {
        format!("{:.1} KB", b / KB)
    } else {
        format!("{b:.0} B")
    }
}

pub(crate) fn sh(args: &[&str]) -> String {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub(crate) fn machine() -> String {
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

pub(crate) fn proc_meminfo_gib() -> f64 {
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

pub(crate) fn commit() -> String {
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
pub(crate) fn requests_line(w: &Window) -> String {
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

pub(crate) struct Report {
    pub(crate) cfg: Cfg,
    pub(crate) machine: String,
    pub(crate) commit: String,
    pub(crate) date: String,
    pub(crate) command: String,
    pub(crate) seeded: Seeded,
    pub(crate) start_s: f64,
    pub(crate) start_costs: Costs,
    pub(crate) hwm_start: Vec<(String, f64)>,
    pub(crate) hwm_steady: Vec<(String, f64)>,
    pub(crate) hwm_end: Vec<(String, f64)>,
    pub(crate) windows: Vec<Window>,
    pub(crate) singles: Vec<Single>,
    pub(crate) fast: FaultRun,
    pub(crate) slow: Option<FaultRun>,
    pub(crate) logs: Vec<(String, usize, usize)>,
    pub(crate) names: Vec<String>,
    /// Shard ConfigMap updates in each minute since the replicas started.
    pub(crate) cm_updates_by_minute: Vec<usize>,
    /// API calls answered a second or more past the latency in force, and the calls.
    pub(crate) slow_calls: (usize, usize, Vec<String>),
    /// When the latency changed: seconds since the replicas started, latency in ms.
    pub(crate) latency_changes: Vec<(f64, u64)>,
}

/// The API calls the test server answered a second or more later than the latency
/// injected when they arrived (its own time, or a wait for its lock): how many, of how
/// many, and the slowest ten (seconds since the replicas started, method, path, ms).
pub(crate) fn slow_calls(
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

pub(crate) fn print_window(r: &Report, w: &Window, out: &mut Vec<String>) {
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
    pub(crate) fn seeded_doc_len(&self) -> usize {
        serde_json::to_vec(&cluster_fleet::first_doc(0)).map_or(0, |v| v.len())
    }

    pub(crate) fn print(&self) {
        let mut o = Vec::new();
        let cfg = &self.cfg;
        o.push("==================== faultline cluster costs =============================".into());
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

    pub(crate) fn print_faults(&self, o: &mut Vec<String>) {
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
pub(crate) fn fault_breakdown(s: &Single) -> String {
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
