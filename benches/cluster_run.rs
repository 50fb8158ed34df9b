//! The phases of a run: start, steady state under latency, hard faults, steady state again.

use super::*;

/// What the run shares.
pub(crate) struct Run<'a> {
    pub(crate) cfg: &'a Cfg,
    pub(crate) server: ApiServer,
    pub(crate) reps: Vec<Replica>,
    pub(crate) fleets: Fleets,
    pub(crate) leases: Arc<Mutex<LeaseWatch>>,
    pub(crate) doc: Arc<Vec<u8>>,
    pub(crate) rng: rand::rngs::StdRng,
    /// When the injected latency changed (ms since the epoch, latency in ms), to tell a
    /// slow answer from the latency in force.
    pub(crate) latencies: Mutex<Vec<(u64, u64)>>,
    /// Nodes not faulted yet.
    pub(crate) fresh: Vec<usize>,
    pub(crate) fleet_started: Instant,
}

impl Run<'_> {
    pub(crate) fn latency(&self, ms: u64) {
        self.server.set_faults(api_faults(ms));
        self.latencies.lock().unwrap().push((now_us() / 1000, ms));
    }

    pub(crate) async fn window(&mut self, label: String, latency_ms: u64) -> Result<Window> {
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
    pub(crate) fn load(&self) -> (f64, f64) {
        (
            cpu_secs(std::process::id()),
            self.fleets.0.iter().map(|p| cpu_secs(p.proc.0.id())).sum(),
        )
    }

    pub(crate) fn names(&self) -> Vec<String> {
        self.reps.iter().map(|r| r.name.clone()).collect()
    }

    pub(crate) fn pick(&mut self) -> usize {
        let k = self.rng.random_range(0..self.fresh.len());
        self.fresh.swap_remove(k)
    }

    /// A hard fault on a fresh node: (node, injected at µs, to its ConfigMap).
    pub(crate) async fn fault(
        &mut self,
        dev: usize,
        within: Duration,
    ) -> Result<(usize, u64, Option<f64>)> {
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
    pub(crate) async fn faults(&mut self, n: usize, within: Duration) -> Result<FaultRun> {
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
    pub(crate) async fn single_cost(&mut self) -> Result<Single> {
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
pub(crate) struct FaultRun {
    pub(crate) injected: Vec<(usize, u64)>,
    pub(crate) to_configmap: Vec<f64>,
    pub(crate) to_node: Vec<f64>,
    pub(crate) missed_configmap: usize,
    pub(crate) missed_node: usize,
    /// The API server's time for each ConfigMap update meanwhile (ms, from its arrival
    /// to its answer, injected latency included).
    pub(crate) server_ms: Vec<f64>,
    /// Shard writes the replicas made meanwhile, and the seconds they took.
    pub(crate) writes: f64,
    pub(crate) write_s: f64,
    /// Lease holder changes meanwhile.
    pub(crate) lease_changes: u64,
    /// Each replica's documents and CPU meanwhile.
    pub(crate) replicas: String,
    /// Faults that took over 100 ms to their ConfigMap: (node, injected at ms, ms).
    pub(crate) slow: Vec<(usize, u64, f64)>,
}

/// What the API server was doing while a slow fault (node `i`, injected at `t0` ms,
/// in its ConfigMap after `ms`) waited: its page's updates, and the calls that took
/// 30 ms or more and overlapped the wait.
pub(crate) fn slow_fault(
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
