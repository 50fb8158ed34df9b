//! faultline aggregator: follows the agents, denoises their readings with windows, rules
//! and a per-device state machine, and publishes a versioned fault.json.
#![forbid(unsafe_code)]

pub mod collect;
pub mod config;
pub mod discover;
pub mod intake;
pub mod lease;
pub mod metrics;
pub mod notify;
pub mod nudge;
pub mod pipeline;
pub mod podhealth;
pub mod remediate;
pub mod rules_file;
pub mod sink;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use faultline_common::fault::{shard_of, FaultDocument, FaultSummary, FAULT_VERSION};
use faultline_common::rules::Rules;
use rand::Rng;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::collect::AgentEvent;
use crate::config::{Config, SinkKind};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use crate::sink::configmap::ConfigMapSink;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

/// A running aggregator.
pub struct Aggregator {
    /// The API address.
    pub addr: std::net::SocketAddr,
    cancel: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    lease_task: Option<tokio::task::JoinHandle<()>>,
}

impl Aggregator {
    /// The token that stops it.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
    /// Wait until it stops (after a cancel, the Leases are released first).
    pub async fn wait(self) {
        let _ = self.done.await;
        if let Some(t) = self.lease_task {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }

    /// Stop at once, as a crash would: the Leases are not released, so another
    /// replica must wait for them to run out.
    pub fn abort(self) {
        if let Some(t) = self.lease_task {
            t.abort();
        }
        self.done.abort();
        self.cancel.cancel();
    }
}

#[derive(Clone)]
struct ApiState {
    metrics: Arc<Metrics>,
    /// The file sink's last document (it is built for the files anyway).
    latest: Arc<Mutex<Option<Arc<FaultDocument>>>>,
    /// The ConfigMap sink builds the whole document only when someone asks.
    asks: mpsc::Sender<tokio::sync::oneshot::Sender<Arc<FaultDocument>>>,
    /// A first document was written.
    ready: Arc<std::sync::atomic::AtomicBool>,
    intake: Option<Arc<intake::Intake>>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(1.0..1.2))
}

/// Build the document of the nodes of one shard (every node with `shards` = 1).
fn document(p: &Pipeline, sequence: u64, writer: &str, shard: u32, shards: u32) -> FaultDocument {
    let mut nodes = BTreeMap::new();
    let mut summary = FaultSummary::default();
    for name in p
        .node_names()
        .filter(|n| shards == 1 || shard_of(n, shards) == shard)
    {
        if let Some(n) = p.node_faults(name) {
            summary.add(&n.summary);
            nodes.insert(name.clone(), n);
        }
    }
    FaultDocument {
        version: FAULT_VERSION.into(),
        timestamp: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        sequence,
        shard,
        shards,
        writer: writer.to_string(),
        summary,
        nodes,
    }
}

/// The files of the file sink: `fault.json` (every node) and `<node>.json` (one node,
/// seed 003's shape).
fn files(doc: &FaultDocument) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut f = BTreeMap::new();
    f.insert("fault.json".to_string(), serde_json::to_vec_pretty(doc)?);
    for (name, n) in &doc.nodes {
        let key = format!("{name}.json");
        if sink::file::valid_key(&key) {
            f.insert(key, serde_json::to_vec_pretty(n)?);
        }
    }
    Ok(f)
}

enum Sink {
    File(std::path::PathBuf),
    ConfigMap {
        /// One per namespace written, the aggregator's own first.
        sinks: Vec<Arc<ConfigMapSink>>,
        held: lease::Held,
        shards: u32,
        nudger: Option<Arc<nudge::Nudger>>,
        remediator: Option<Arc<remediate::Remediator>>,
    },
}

/// The nodes with a pass running: one pass per node at a time.
#[derive(Clone, Default)]
struct InFlight(Arc<Mutex<std::collections::BTreeSet<String>>>);

/// A node's turn, given back when dropped (however the pass ends).
struct Slot(InFlight, String);

impl InFlight {
    /// The node's turn, unless a pass of it is running.
    fn take(&self, node: &str) -> Option<Slot> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string())
            .then(|| Slot(self.clone(), node.to_string()))
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        (self.0)
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
    }
}

/// Devices judged failed by the intake or the kubelet, per node (with the time of the
/// last verdict), until a pass has recorded them on the Node; a pass that fails keeps
/// them for the next one. A verdict older than the dedup window is dropped: one for a
/// shard this replica does not hold must not be acted on much later, when it takes the
/// shard over (the kubelet's verdicts are sent again on every re-list while they hold).
type Pending = Arc<Mutex<BTreeMap<String, (Instant, Vec<remediate::RecordDevice>)>>>;

/// One pass per node of `nodes`, in the shard holder only, one at a time per node:
/// for a quarantined node first the release check (a person's request, the unknown
/// guard lifting, `--release auto`); then, for failed devices (the pipeline's and those
/// pending from the intake), isolation; then evictions (also for quarantined nodes that
/// nothing says failed now: a budget may still hold a pod back). One task per node, so
/// a release is never skipped because an isolation pass of the same node is running.
fn remediate_nodes(
    sink: &Sink,
    pipeline: &Pipeline,
    in_flight: &InFlight,
    pending: &Pending,
    nodes: Vec<String>,
    // Nodes that just turned failed (they may feed the circuit breaker).
    fresh: bool,
    metrics: &Arc<Metrics>,
) {
    let Sink::ConfigMap {
        held,
        shards,
        remediator: Some(r),
        ..
    } = sink
    else {
        return;
    };
    let quarantined: std::collections::BTreeSet<String> =
        r.known_quarantined().into_iter().collect();
    for node in nodes {
        let mut devices = pipeline.failed_devices(&node);
        let extra = pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&node)
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        for d in &extra {
            if !devices.iter().any(|x| x.is(&d.id)) {
                devices.push(d.clone());
            }
        }
        let shard = shard_of(&node, *shards);
        if (devices.is_empty() && !quarantined.contains(&node)) || !held.holds(shard) {
            continue;
        }
        let Some(slot) = in_flight.take(&node) else {
            continue;
        };
        let views = if quarantined.contains(&node) {
            Some(pipeline.device_views(&node))
        } else {
            None
        };
        let (r, held, pending, metrics) =
            (r.clone(), held.clone(), pending.clone(), metrics.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let fence = move || held.holds(shard);
            let t0 = Instant::now();
            if let Some(views) = views {
                match r.release_pass_fenced(&node, &views, now_ms(), &fence).await {
                    Ok(remediate::Outcome::Released) => {
                        tracing::debug!(node = %node, "released");
                        return;
                    }
                    Ok(outcome) => tracing::debug!(node = %node, ?outcome, "release pass"),
                    Err(e) => {
                        tracing::warn!(node = %node, error = %e, "release pass failed; the next one retries")
                    }
                }
            }
            if fresh && !devices.is_empty() {
                if let Err(e) = r.note_new_failure(&node).await {
                    tracing::warn!(node = %node, error = %e, "cannot update the circuit breaker");
                }
            }
            // Isolate first (no new pods land there), then move the workloads off.
            let isolated = if devices.is_empty() {
                Ok(remediate::Outcome::AlreadyDone)
            } else {
                r.isolate_fenced(&node, devices, &fence).await
            };
            let pass = match isolated {
                Ok(outcome) => {
                    tracing::debug!(node = %node, ?outcome, "isolation pass");
                    if outcome == remediate::Outcome::Isolated {
                        metrics.action_time("quarantine", t0.elapsed().as_secs_f64());
                    }
                    let settled = matches!(
                        outcome,
                        remediate::Outcome::Isolated
                            | remediate::Outcome::AlreadyDone
                            | remediate::Outcome::Suppressed
                            | remediate::Outcome::Announced
                            | remediate::Outcome::Off
                    );
                    if !extra.is_empty() && settled {
                        // On the Node now (or deliberately not acted on): done with them.
                        // Held back by a budget or the breaker: kept for a later pass.
                        let mut p = pending.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some((_, v)) = p.get_mut(&node) {
                            v.retain(|d| !extra.contains(d));
                            if v.is_empty() {
                                p.remove(&node);
                            }
                        }
                    }
                    let t1 = Instant::now();
                    r.evict_fenced(&node, &fence).await.map(|e| {
                        if !e.evicted.is_empty() {
                            metrics.action_time("evict", t1.elapsed().as_secs_f64());
                        }
                        tracing::debug!(node = %node, ?e, "eviction pass")
                    })
                }
                Err(e) => Err(e),
            };
            if let Err(e) = pass {
                metrics.action("quarantine", "error");
                tracing::warn!(node = %node, error = %e, "remediation pass failed; the next one retries");
            }
        });
    }
}

/// List the quarantined nodes (the next reconcile's release checks and eviction passes
/// work from this list; the gauges are updated).
fn refresh_quarantined(sink: &Sink) {
    let Sink::ConfigMap {
        remediator: Some(r),
        ..
    } = sink
    else {
        return;
    };
    let r = r.clone();
    tokio::spawn(async move {
        if let Err(e) = r.list_quarantined().await {
            tracing::warn!(error = %e, "cannot list quarantined nodes");
        }
    });
}

/// Nodes whose devices have been unknown past the tolerance may get the NoSchedule taint
/// (never an eviction), in the shard holder only.
fn guard_unknown_nodes(
    sink: &Sink,
    pipeline: &Pipeline,
    in_flight: &InFlight,
    tolerance: Duration,
) {
    let Sink::ConfigMap {
        held,
        shards,
        remediator: Some(r),
        ..
    } = sink
    else {
        return;
    };
    let now = now_ms();
    for node in pipeline.node_names() {
        let devices = pipeline.unknown_devices(node, tolerance.as_millis() as u64, now);
        let shard = shard_of(node, *shards);
        if devices.is_empty() || !held.holds(shard) {
            continue;
        }
        let Some(slot) = in_flight.take(node) else {
            continue;
        };
        let (r, held, node) = (r.clone(), held.clone(), node.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let fence = move || held.holds(shard);
            match r.guard_unknown_fenced(&node, devices, &fence).await {
                Ok(outcome) => tracing::debug!(node = %node, ?outcome, "unknown guard pass"),
                Err(e) => {
                    tracing::warn!(node = %node, error = %e, "unknown guard pass failed; the next one retries")
                }
            }
        });
    }
}

/// A Kubernetes client: `--kube-server` (plain, for the test server), else in-cluster
/// or $KUBECONFIG. kube's own retry of 429/503 is off: callers decide what to retry.
async fn kube_client(cfg: &Config) -> anyhow::Result<kube::Client> {
    connect(cfg.kube_server.as_deref(), cfg.kube_timeout).await
}

/// A Kubernetes client for `server` (plain HTTP, the test server), else in-cluster or
/// $KUBECONFIG, with kube's own retries off.
pub async fn connect(server: Option<&str>, timeout: Duration) -> anyhow::Result<kube::Client> {
    let mut kc = match server {
        Some(url) => kube::Config::new(
            url.parse()
                .with_context(|| format!("--kube-server {url}"))?,
        ),
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster or KUBECONFIG); use --kube-server")?,
    };
    kc.default_retry = false;
    kc.read_timeout = Some(timeout);
    kc.write_timeout = Some(timeout);
    kube::Client::try_from(kc).context("Kubernetes client")
}

/// Start collectors, the pipeline and the API.
pub async fn start(cfg: Config) -> anyhow::Result<Aggregator> {
    let metrics = Arc::new(Metrics::new());
    let rules = match &cfg.rules {
        Some(p) => rules_file::load(p).with_context(|| format!("rules file {}", p.display()))?,
        None => Rules::default(),
    };
    let (rules_tx, mut rules_rx) = watch::channel(Arc::new(rules));
    let cancel = CancellationToken::new();
    // The core keeps a sender too: with every sender gone, `changed()` would return at
    // once, forever, and spin the core loop.
    let rules_keepalive = rules_tx.clone();
    if let Some(p) = cfg.rules.clone() {
        tokio::spawn(rules_file::watch_file(
            p,
            rules_tx,
            metrics.clone(),
            Duration::from_secs(1),
            cancel.clone(),
        ));
    }

    let (tx, mut rx) = mpsc::channel::<AgentEvent>(1024);
    let client = collect::client();
    let kube = if cfg.sink == SinkKind::ConfigMap || cfg.agents.is_empty() {
        Some(kube_client(&cfg).await?)
    } else {
        None
    };
    if cfg.agents.is_empty() {
        let api: Api<Node> = Api::all(kube.clone().context("discovery needs the Kubernetes API")?);
        tokio::spawn(discover::run(
            api,
            cfg.node_selector.clone(),
            cfg.agent_port,
            Duration::from_secs(5),
            client.clone(),
            tx.clone(),
            metrics.clone(),
            cancel.clone(),
        ));
    }
    for url in &cfg.agents {
        tokio::spawn(collect::follow(
            url.clone(),
            url.clone(),
            client.clone(),
            tx.clone(),
            metrics.clone(),
            cancel.clone(),
        ));
    }
    drop(tx);

    // Bound first: the shard Leases advertise where this replica's API is.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let advertise = cfg.advertise_url.clone().or_else(|| {
        std::env::var("POD_IP")
            .ok()
            .filter(|ip| !ip.is_empty())
            .map(|ip| format!("http://{ip}:{}", addr.port()))
            .or_else(|| (!addr.ip().is_unspecified()).then(|| format!("http://{addr}")))
    });
    let mut lease_task = None;
    // Leases (and the notifier's queue) outlive the core loop: on a stop, in-flight
    // remediation finishes first, then the Leases go.
    let lease_cancel = CancellationToken::new();
    let notifier = (!cfg.notify.is_empty()).then(|| {
        Arc::new(notify::Notifier::start(
            cfg.notify.clone(),
            metrics.clone(),
            lease_cancel.clone(),
        ))
    });
    let (verdict_tx, mut verdict_rx) = mpsc::channel::<intake::Verdict>(1024);
    let mut intake = cfg
        .intake
        .clone()
        .map(|c| intake::Intake::new(c, metrics.clone(), verdict_tx.clone()));
    let sink = match cfg.sink {
        SinkKind::File => Sink::File(cfg.out.clone()),
        SinkKind::ConfigMap => {
            let kube = kube
                .clone()
                .context("the configmap sink needs the Kubernetes API")?;
            let held = lease::Held::default();
            let leases: Api<Lease> = Api::namespaced(kube.clone(), &cfg.namespace);
            let lcfg = lease::LeaseConfig {
                duration: cfg.lease_duration,
                retry: cfg.lease_retry,
                margin: cfg.lease_retry + Duration::from_secs(1),
            };
            let leases = lease::ShardLeases {
                api: leases,
                name: cfg.name.clone(),
                me: cfg.replica.clone(),
                shards: cfg.shards,
                cfg: lcfg,
                held: held.clone(),
                metrics: metrics.clone(),
                url: advertise.clone(),
            };
            intake = intake.map(|i| {
                i.with_route(intake::Route {
                    held: held.clone(),
                    shards: cfg.shards,
                    leases: Api::namespaced(kube.clone(), &cfg.namespace),
                    name: cfg.name.clone(),
                    me: cfg.replica.clone(),
                })
            });
            lease_task = Some(tokio::spawn(leases.run(lease_cancel.clone())));
            let nudger = (cfg.nudge_rate > 0.0).then(|| {
                Arc::new(nudge::Nudger::new(
                    Api::all(kube.clone()),
                    cfg.nudge_selector.clone(),
                    cfg.nudge_rate,
                    metrics.clone(),
                ))
            });
            Sink::ConfigMap {
                sinks: cfg
                    .publish_namespaces
                    .iter()
                    .map(|ns| {
                        Arc::new(
                            ConfigMapSink::new(Api::namespaced(kube.clone(), ns), cfg.name.clone())
                                .with_metrics(metrics.clone()),
                        )
                    })
                    .collect(),
                held,
                shards: cfg.shards,
                nudger,
                remediator: (cfg.remediation != remediate::Mode::Off).then(|| {
                    Arc::new(
                        remediate::Remediator::new(
                            kube.clone(),
                            cfg.remediation,
                            &cfg.taint_key,
                            &cfg.event_namespace,
                            &cfg.replica,
                        )
                        .with_resources(cfg.resource_names.clone(), cfg.eviction_deadline)
                        .with_budget(cfg.budget.clone())
                        .with_breaker(
                            (cfg.breaker_nodes > 0).then(|| {
                                remediate::Breaker::new(
                                    Api::namespaced(kube.clone(), &cfg.namespace),
                                    format!("{}-breaker", cfg.name),
                                    cfg.breaker_nodes,
                                    cfg.breaker_window,
                                )
                            }),
                            cfg.max_evictions_per_minute,
                        )
                        .with_release(cfg.release.clone())
                        .with_force_delete(cfg.force_delete_after_deadline)
                        .with_reporting(notifier.clone(), Some(metrics.clone())),
                    )
                }),
            }
        }
    };

    // The kubelet's device health (KEP-4680): Unhealthy is a verdict, Unknown an alert.
    if let (
        Sink::ConfigMap {
            remediator: Some(r),
            ..
        },
        Some(kube),
        true,
    ) = (&sink, kube.clone(), cfg.watch_pod_health)
    {
        let (tx, mut rx) = mpsc::channel::<podhealth::PodDevice>(1024);
        tokio::spawn(podhealth::run(
            Api::all(kube),
            r.resources().to_vec(),
            tx,
            cancel.clone(),
        ));
        let (verdicts, metrics) = (verdict_tx.clone(), metrics.clone());
        tokio::spawn(async move {
            while let Some(d) = rx.recv().await {
                if d.health != "Unhealthy" {
                    metrics.intake_alert("kubelet-unknown");
                    tracing::warn!(node = %d.node, device = %d.id, pod = %d.pod, health = %d.health, "the kubelet cannot tell this device's health: alert only, no action");
                    continue;
                }
                metrics.intake_alert("kubelet-unhealthy");
                tracing::warn!(node = %d.node, device = %d.id, pod = %d.pod, "the kubelet reports the device unhealthy");
                let device = remediate::RecordDevice {
                    uuid: d.id.starts_with("GPU-").then(|| d.id.clone()),
                    source: Some("kubelet".into()),
                    metric: Some(format!("{} allocatedResourcesStatus", d.resource)),
                    value: Some(d.health.clone()),
                    ..remediate::RecordDevice::new(d.id.clone(), "kubelet:Unhealthy")
                };
                if verdicts
                    .send(intake::Verdict {
                        node: d.node,
                        device,
                    })
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
    }
    drop(verdict_tx);

    let latest: Arc<Mutex<Option<Arc<FaultDocument>>>> = Arc::new(Mutex::new(None));
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (asks, mut asked) = mpsc::channel::<tokio::sync::oneshot::Sender<Arc<FaultDocument>>>(64);
    let app = router(ApiState {
        metrics: metrics.clone(),
        latest: latest.clone(),
        asks,
        ready: ready.clone(),
        intake: intake.map(Arc::new),
    });
    {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { cancel.cancelled().await })
                .await;
        });
    }

    tracing::info!(%addr, agents = cfg.agents.len(), out = %cfg.out.display(), "faultline aggregator running");
    let done = {
        let cancel = cancel.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _rules_keepalive = rules_keepalive;
            let mut pipeline = Pipeline::new(rules_rx.borrow_and_update().clone(), metrics.clone());
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut dirty = true;
            let mut urgent = false;
            let mut sequence = 0u64;
            let mut last_write: Option<Instant> = None;
            let mut spacing = jittered(cfg.write_interval);
            let mut writing: Option<tokio::task::JoinHandle<()>> = None;
            let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let mut last_held: Vec<u32> = Vec::new();
            // Nodes whose pods are nudged once their shard is written.
            let mut alarming: std::collections::BTreeSet<String> = Default::default();
            // Nodes being remediated now, and when every failed node was last looked at
            // (a new holder of a shard finishes what the last one started).
            let remediating = InFlight::default();
            let pending: Pending = Default::default();
            let mut last_reconcile = Instant::now();
            loop {
                // When the next write is due.
                let due = match last_write {
                    None => tokio::time::Instant::now(),
                    Some(t) => {
                        let wait = if urgent {
                            cfg.urgent_spacing
                        } else if dirty {
                            spacing
                        } else {
                            cfg.heartbeat
                        };
                        tokio::time::Instant::from_std(t + wait)
                    }
                };
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    ev = rx.recv() => {
                        let Some(ev) = ev else { break };
                        let now = now_ms();
                        let c = match ev {
                            AgentEvent::Document(doc) => pipeline.on_document(*doc, now),
                            AgentEvent::Unreachable { node, error } => pipeline.on_unreachable(&node, &error, now),
                            AgentEvent::Removed { node } => pipeline::Change {
                                nodes: if pipeline.remove_node(&node) { vec![node] } else { vec![] },
                                ..Default::default()
                            },
                        };
                        dirty |= !c.nodes.is_empty();
                        urgent |= c.urgent;
                        if c.urgent {
                            remediate_nodes(&sink, &pipeline, &remediating, &pending, c.alarming.clone(), true, &metrics);
                        }
                        alarming.extend(c.alarming);
                    }
                    _ = tick.tick() => {
                        let c = pipeline.tick(now_ms());
                        dirty |= !c.nodes.is_empty() || failed.load(std::sync::atomic::Ordering::Acquire);
                        urgent |= c.urgent;
                        if c.urgent {
                            remediate_nodes(&sink, &pipeline, &remediating, &pending, c.alarming.clone(), true, &metrics);
                        }
                        alarming.extend(c.alarming);
                        if last_reconcile.elapsed() >= cfg.reconcile_interval {
                            last_reconcile = Instant::now();
                            let mut nodes: Vec<String> = pipeline.node_names().cloned().collect();
                            let mut p = pending.lock().unwrap_or_else(|p| p.into_inner());
                            p.retain(|_, (t, _)| t.elapsed() < cfg.release.dedup_window);
                            for n in p.keys() {
                                if !nodes.contains(n) {
                                    nodes.push(n.clone());
                                }
                            }
                            drop(p);
                            if let Sink::ConfigMap { remediator: Some(r), .. } = &sink {
                                for n in r.known_quarantined() {
                                    if !nodes.contains(&n) {
                                        nodes.push(n);
                                    }
                                }
                            }
                            remediate_nodes(&sink, &pipeline, &remediating, &pending, nodes, false, &metrics);
                            guard_unknown_nodes(&sink, &pipeline, &remediating, cfg.unknown_tolerance);
                            refresh_quarantined(&sink);
                        }
                        // A shard just taken is written at once.
                        if let Sink::ConfigMap { held, .. } = &sink {
                            let now_held = held.shards();
                            if now_held != last_held {
                                dirty = true;
                                last_held = now_held;
                            }
                        }
                    }
                    v = verdict_rx.recv(), if !verdict_rx.is_closed() || !verdict_rx.is_empty() => {
                        let Some(mut v) = v else { continue };
                        // Name the device as the node's agent does, where it reports it.
                        if let Some(id) = pipeline.device_id(&v.node, &v.device.id) {
                            v.device.id = id;
                        }
                        {
                            let mut p = pending.lock().unwrap_or_else(|p| p.into_inner());
                            let (at, list) = p
                                .entry(v.node.clone())
                                .or_insert_with(|| (Instant::now(), Vec::new()));
                            *at = Instant::now();
                            if !list.iter().any(|d| d.is(&v.device.id)) {
                                list.push(v.device);
                            }
                        }
                        remediate_nodes(&sink, &pipeline, &remediating, &pending, vec![v.node], true, &metrics);
                    }
                    // GET /v1/faults with the ConfigMap sink: the whole document, now.
                    Some(reply) = asked.recv() => {
                        let _ = reply.send(Arc::new(document(&pipeline, sequence, &cfg.replica, 0, 1)));
                    }
                    r = rules_rx.changed() => {
                        if r.is_ok() {
                            pipeline.set_rules(rules_rx.borrow_and_update().clone());
                        }
                    }
                    _ = tokio::time::sleep_until(due), if writing.as_ref().is_none_or(|w| w.is_finished()) => {
                        if failed.swap(false, std::sync::atomic::Ordering::AcqRel) {
                            tracing::debug!("the last write failed; this one retries it");
                        }
                        sequence += 1;
                        ready.store(true, std::sync::atomic::Ordering::Release);
                        writing = Some(match &sink {
                            Sink::File(out) => {
                                let whole = Arc::new(document(&pipeline, sequence, &cfg.replica, 0, 1));
                                *latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(whole.clone());
                                let (out, metrics, failed) = (out.clone(), metrics.clone(), failed.clone());
                                tokio::task::spawn_blocking(move || {
                                    let t = Instant::now();
                                    let r = files(&whole).and_then(|f| {
                                        let bytes = f.values().map(Vec::len).sum::<usize>();
                                        sink::file::write(&out, &f)?;
                                        Ok(bytes)
                                    });
                                    match r {
                                        Ok(bytes) => metrics.write("file", 0, t.elapsed().as_secs_f64(), bytes, true),
                                        Err(e) => {
                                            failed.store(true, std::sync::atomic::Ordering::Release);
                                            metrics.write("file", 0, 0.0, 0, false);
                                            tracing::error!(error = %e, out = %out.display(), "cannot write fault documents");
                                        }
                                    }
                                })
                            }
                            Sink::ConfigMap { sinks, held, shards, nudger, .. } => {
                                let mine = held.shards();
                                for s in (0..*shards).filter(|s| !mine.contains(s)) {
                                    metrics.write_skipped("configmap", s);
                                }
                                let jobs: Vec<(FaultDocument, Vec<String>)> = mine
                                    .iter()
                                    .map(|s| {
                                        let doc = document(&pipeline, 0, &cfg.replica, *s, *shards);
                                        let nudge: Vec<String> = alarming.iter().filter(|n| doc.nodes.contains_key(*n)).cloned().collect();
                                        (doc, nudge)
                                    })
                                    .collect();
                                // Nodes of shards we do not hold are the holder's to nudge.
                                alarming.clear();
                                let (sinks, held, metrics, failed, nudger) =
                                    (sinks.clone(), held.clone(), metrics.clone(), failed.clone(), nudger.clone());
                                tokio::spawn(async move {
                                    for (doc, nudge) in jobs {
                                        let shard = doc.shard;
                                        let mut written = false;
                                        for sink in &sinks {
                                            let t = Instant::now();
                                            match sink.write(doc.clone(), &held).await {
                                                Ok(bytes) => {
                                                    written = true;
                                                    metrics.write("configmap", shard, t.elapsed().as_secs_f64(), bytes, true);
                                                }
                                                Err(sink::configmap::WriteError::NotHolder(_)) => {
                                                    metrics.write_skipped("configmap", shard);
                                                    break;
                                                }
                                                Err(e) => {
                                                    failed.store(true, std::sync::atomic::Ordering::Release);
                                                    metrics.write("configmap", shard, 0.0, 0, false);
                                                    tracing::error!(shard, error = %e, "cannot write the shard ConfigMap");
                                                }
                                            }
                                        }
                                        // After the write, so the sync the nudge causes finds the new content.
                                        if let (true, Some(n)) = (written, nudger.as_ref()) {
                                            let stamp = now_ms().to_string();
                                            for node in nudge {
                                                n.nudge(&node, &stamp).await;
                                            }
                                        }
                                    }
                                })
                            }
                        });
                        last_write = Some(Instant::now());
                        spacing = jittered(cfg.write_interval);
                        // A failed write leaves the document dirty for the next round.
                        dirty = false;
                        urgent = false;
                    }
                }
            }
            if let Some(w) = writing {
                let _ = w.await;
            }
            // Graceful stop: the intake no longer accepts (the server stopped with the
            // same token); in-flight remediation gets --shutdown-timeout to finish, then
            // the Leases are released and the next holder continues from the records.
            let deadline = Instant::now() + cfg.shutdown_timeout;
            loop {
                let left = remediating.len();
                if left == 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    tracing::warn!(
                        in_flight = left,
                        "shutdown timeout: handing the rest over to the next holder"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            lease_cancel.cancel();
        })
    };
    Ok(Aggregator {
        addr,
        cancel,
        done,
        lease_task,
    })
}

fn router(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/v1/faults", get(faults))
        .route("/v1/alerts", axum::routing::post(alerts))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                Json(json!({"error": "no such endpoint", "status": 404})),
            )
        })
        .with_state(state)
}

async fn ready(State(s): State<ApiState>) -> Response {
    if s.ready.load(std::sync::atomic::Ordering::Acquire) {
        Json(json!({"ready": true})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "no document written yet", "status": 503})),
        )
            .into_response()
    }
}

async fn metrics_text(State(s): State<ApiState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn alerts(
    State(s): State<ApiState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Response {
    match &s.intake {
        Some(i) => i.handle(&headers, body).await,
        None => {
            s.metrics.intake_response(404);
            (
                StatusCode::NOT_FOUND,
                Json(json!({"error": "the alert intake is off (no --intake-token-file)", "status": 404})),
            )
                .into_response()
        }
    }
}

async fn faults(State(s): State<ApiState>) -> Response {
    let not_yet = || {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "no document yet", "status": 503})),
        )
            .into_response()
    };
    if !s.ready.load(std::sync::atomic::Ordering::Acquire) {
        return not_yet();
    }
    let cached = s.latest.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(d) = cached {
        return Json(d.as_ref().clone()).into_response();
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    if s.asks.send(tx).await.is_err() {
        return not_yet();
    }
    match tokio::time::timeout(Duration::from_secs(10), rx).await {
        Ok(Ok(d)) => Json(d.as_ref().clone()).into_response(),
        _ => not_yet(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::classify::Finding;
    use faultline_common::{
        DeviceHealth, DeviceReading, DeviceStatus, NodeHealth, Summary, Vendor, SCHEMA_VERSION,
    };

    fn node_doc(node: &str, devices: u32) -> NodeHealth {
        let npus: Vec<DeviceHealth> = (0..devices)
            .map(|i| {
                let mut r = DeviceReading::new(format!("gpu{i}"), Vendor::Nvidia, "nvml");
                r.uuid = Some(format!("GPU-5157e000-0000-4000-8000-{i:012x}"));
                r.pci_bus_id = Some(format!("0000:{:02x}:00.0", 0x18 + i * 0x10));
                r.temperature_c = Some(61.5);
                r.power_w = Some(312.25);
                let failed = i == 3;
                DeviceHealth {
                    reading: r,
                    status: if failed {
                        DeviceStatus::Failed
                    } else {
                        DeviceStatus::Healthy
                    },
                    reason: failed.then(|| "xid-79".to_string()),
                    findings: if failed {
                        vec![Finding {
                            code: "xid-79".into(),
                            status: DeviceStatus::Failed,
                            detail: String::new(),
                        }]
                    } else {
                        vec![]
                    },
                    ecc_errors: Some(12),
                    pcie_link_status: Some("up".into()),
                    sampled_at: None,
                    sample_age_ms: Some(100),
                    recent_xids: vec![],
                }
            })
            .collect();
        NodeHealth {
            schema_version: SCHEMA_VERSION.into(),
            generation: 1,
            timestamp: String::new(),
            node: node.into(),
            agent_version: "test".into(),
            summary: Summary::of(&npus),
            npus,
            sources: vec![],
            unattributed_xids: vec![],
        }
    }

    /// 5,000 nodes x 8 devices in 16 shards: every shard ConfigMap under the limit
    /// (written to the test API server, which refuses anything over 1 MiB), and every
    /// node found in the shard its name hashes to.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_thousand_nodes_fit_and_every_node_is_findable() {
        const NODES: usize = 5_000;
        const SHARDS: u32 = 16;
        let mut p = Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()));
        let names: Vec<String> = (0..NODES)
            .map(|i| format!("gpu-node-{i:05}.rack-{:03}.example.internal", i / 40))
            .collect();
        for n in &names {
            p.on_document(node_doc(n, 8), 1_000);
        }
        let server = faultline_test_apiserver::ApiServer::new();
        server
            .create(
                "namespaces",
                "",
                serde_json::json!({"metadata": {"name": "faultline"}}),
            )
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(faultline_test_apiserver::serve(
            listener,
            server.clone(),
            CancellationToken::new(),
        ));
        let mut kc = kube::Config::new(url.parse().unwrap());
        kc.default_retry = false;
        let client = kube::Client::try_from(kc).unwrap();
        let sink = ConfigMapSink::new(Api::namespaced(client, "faultline"), "faultline".into());
        let held = lease::Held::default();
        let mut largest = 0;
        for s in 0..SHARDS {
            held.grant(s, Instant::now() + Duration::from_secs(60));
            let doc = document(&p, 0, "r1", s, SHARDS);
            let bytes = sink
                .write(doc, &held)
                .await
                .unwrap_or_else(|e| panic!("shard {s}: {e}"));
            largest = largest.max(bytes);
        }
        assert!(
            largest < sink::configmap::MAX_BYTES,
            "largest shard {largest} bytes"
        );
        for n in names.iter().step_by(97).chain(names.last()) {
            let cm = server
                .get(
                    "configmaps",
                    "faultline",
                    &format!("faultline-shard-{}", shard_of(n, SHARDS)),
                )
                .unwrap();
            let entry: faultline_common::fault::NodeFaults =
                serde_json::from_str(cm["data"][format!("{n}.json")].as_str().unwrap()).unwrap();
            assert_eq!(entry.summary.total, 8);
            assert_eq!(entry.summary.failed, 1);
        }
        let total: usize = (0..SHARDS)
            .map(|s| {
                server
                    .get("configmaps", "faultline", &format!("faultline-shard-{s}"))
                    .unwrap()["data"]
                    .as_object()
                    .unwrap()
                    .len()
                    - 1
            })
            .sum();
        assert_eq!(total, NODES, "every node in exactly one shard");
        eprintln!("5000 nodes x 8 devices in {SHARDS} shards: largest ConfigMap {largest} bytes");
    }
}
