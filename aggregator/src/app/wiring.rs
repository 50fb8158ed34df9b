//! The aggregator's wiring: [`start_with_clock`] as a table of parts, each built by
//! its own function.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use faultline_common::rules::Rules;
use faultline_common::time::Clock;
use kube::api::Api;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::core::{Core, Inputs, WriteTiming};
use super::dispatch::{self, Dispatch};
use super::follow::{follow_agents, rules};
use super::supervise::{self, Stopped, Supervisor, Tasks};
use crate::agents::deliver::{Deliveries, Fence as DeliveryFence};
use crate::api::{self, ApiState};
use crate::config::{Config, SinkKind};
use crate::device_taint::DeviceQuarantine;
use crate::ingest::watched::Watched;
use crate::ingest::{discover, podhealth, Intake, Route};
use crate::metrics::Metrics;
use crate::model::{ShardEvent, Verdict};
use crate::notify::Notifier;
use crate::pipeline::Pipeline;
use crate::publish::seed::ShardPages;
use crate::publish::{ConfigMapSink, Nudger, Publisher};
use crate::remediate::node_cache::NodeCache;
use crate::remediate::{Breaker, Ledger, Mode, Remediator, DEVICES_LABEL};
use crate::shard::{Held, LeaseConfig, ShardLeases, Shards, Sharing};

/// A running aggregator.
pub struct Aggregator {
    /// The API address.
    pub addr: std::net::SocketAddr,
    tasks: Tasks,
}

impl Aggregator {
    /// The token that stops it.
    pub fn cancel_token(&self) -> CancellationToken {
        self.tasks.cancel.clone()
    }

    /// Wait until it stops (after a cancel, the Leases are released first); an error
    /// when it stopped on its own: a task panicked or ended unasked.
    pub async fn wait(self) -> Result<(), Stopped> {
        self.tasks.wait().await
    }

    /// Stop at once, as a crash would: the Leases are not released, so another
    /// replica must wait for them to run out.
    pub fn abort(self) {
        self.tasks.abort();
    }
}

/// A Kubernetes client for `server` (plain HTTP, the test server), else in-cluster or
/// $KUBECONFIG, with kube's own retries of 429/503 off: callers decide what to retry.
/// `timeout` bounds each request's reads and writes; watches need a client without one
/// (`None`): a quiet watch sends nothing for minutes.
pub async fn connect(
    server: Option<&str>,
    token_file: Option<&std::path::Path>,
    timeout: Option<Duration>,
) -> anyhow::Result<kube::Client> {
    connect_with(server, token_file, timeout, None).await
}

/// [`connect`], each call waiting for its token of `rate` (`--kube-qps`) first.
pub async fn connect_with(
    server: Option<&str>,
    token_file: Option<&std::path::Path>,
    timeout: Option<Duration>,
    rate: Option<&super::ratelimit::KubeRate>,
) -> anyhow::Result<kube::Client> {
    let mut kc = match server {
        Some(url) => kube::Config::new(
            url.parse()
                .with_context(|| format!("--kube-server {url}"))?,
        ),
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration (in-cluster or KUBECONFIG); use --kube-server")?,
    };
    if let Some(f) = token_file {
        kc.auth_info.token_file = Some(f.display().to_string());
    }
    kc.default_retry = false;
    kc.read_timeout = timeout;
    kc.write_timeout = timeout;
    let Some(rate) = rate else {
        return kube::Client::try_from(kc).context("Kubernetes client");
    };
    let builder = kube::client::ClientBuilder::try_from(kc).context("Kubernetes client")?;
    Ok(builder.with_layer(rate).build())
}

/// Where this replica's API is reached by the others.
fn advertise(cfg: &Config, addr: std::net::SocketAddr) -> Option<String> {
    cfg.advertise_url.clone().or_else(|| {
        std::env::var("POD_IP")
            .ok()
            .filter(|ip| !ip.is_empty())
            .map(|ip| format!("http://{ip}:{}", addr.port()))
            .or_else(|| (!addr.ip().is_unspecified()).then(|| format!("http://{addr}")))
    })
}

/// The remediator of `--remediation`, its guards and reporting.
fn remediator(
    cfg: &Config,
    kube: &kube::Client,
    notifier: Option<Arc<Notifier>>,
    metrics: &Arc<Metrics>,
    clock: &Clock,
) -> Remediator {
    let breaker = (cfg.breaker_nodes > 0).then(|| {
        Breaker::new(
            Api::namespaced(kube.clone(), &cfg.namespace),
            format!("{}-breaker", cfg.name),
            cfg.breaker_nodes,
            cfg.breaker_window,
        )
        .with_clock(clock.clone())
    });
    Remediator::new(
        kube.clone(),
        cfg.remediation,
        &cfg.taint_key,
        &cfg.event_namespace,
        &cfg.replica,
    )
    .with_resources(cfg.resource_names.clone(), cfg.eviction_deadline)
    .with_budget(cfg.budget.clone())
    .with_budget_ledger(Some(Ledger::new(
        Api::namespaced(kube.clone(), &cfg.namespace),
        format!("{}-budget", cfg.name),
    )))
    .with_breaker(breaker, cfg.max_evictions_per_minute)
    .with_release(cfg.release.clone())
    .with_force_delete(cfg.force_delete_after_deadline)
    .with_checkpoint_grace(cfg.max_checkpoint_grace)
    .with_reporting(notifier, Some(metrics.clone()))
    .with_clock(clock.clone())
}

/// The device path of `--device-quarantine`, following where the cluster
/// serves DeviceTaintRule (at start, then every 10 minutes).
fn devices(
    cfg: &Config,
    kube: &kube::Client,
    rules: &watch::Receiver<Arc<Rules>>,
    metrics: &Arc<Metrics>,
    (tasks, cancel): (&Supervisor, &CancellationToken),
) -> Option<DeviceQuarantine> {
    let devices = DeviceQuarantine::from_flags(&cfg.devices, rules.clone());
    let found = devices.as_ref().map(|d| d.api.clone()).unwrap_or_default();
    tasks.spawn(
        "DeviceTaintRule discovery",
        crate::device_taint::api::following(kube, metrics, found, cancel),
    );
    devices
}

/// What the ConfigMap sink needs: the shard Leases (their task), the publisher.
fn shard_publisher(
    cfg: &Config,
    kube: &kube::Client,
    held: &Held,
    url: Option<String>,
    metrics: &Arc<Metrics>,
    lease_cancel: &CancellationToken,
    share: Sharing,
) -> (Publisher, tokio::task::JoinHandle<()>) {
    let cfg_lease = LeaseConfig::from_flags(cfg.lease_duration, cfg.lease_retry);
    let leases = ShardLeases {
        api: Api::namespaced(kube.clone(), &cfg.namespace),
        name: cfg.name.clone(),
        me: cfg.replica.clone(),
        shards: cfg.shards,
        cfg: cfg_lease,
        held: held.clone(),
        metrics: metrics.clone(),
        url,
        observer: ShardLeases::observer_for(&cfg.replica, &cfg_lease),
        share: Some(share),
    };
    let task = tokio::spawn(leases.run(lease_cancel.clone()));
    let nudger = (cfg.nudge_rate > 0.0).then(|| {
        Arc::new(Nudger::new(
            Api::all(kube.clone()),
            cfg.nudge_selector.clone(),
            cfg.publish_namespaces.clone(),
            cfg.nudge_rate,
            metrics.clone(),
        ))
    });
    let sinks = cfg
        .publish_namespaces
        .iter()
        .map(|ns| {
            let sink = ConfigMapSink::new(Api::namespaced(kube.clone(), ns), cfg.name.clone())
                .with_pages(cfg.pages)
                .with_metrics(metrics.clone());
            // A copy in another namespace names only that namespace's pods.
            Arc::new(if *ns == cfg.namespace {
                sink
            } else {
                sink.with_drains_of(ns)
            })
        })
        .collect();
    let publisher = Publisher::ConfigMap {
        sinks,
        shards: Shards {
            held: held.clone(),
            count: cfg.shards,
        },
        nudger,
        order: Default::default(),
    };
    (publisher, task)
}

/// Start collectors, the pipeline, publishing, remediation and the API.
pub async fn start(cfg: Config) -> anyhow::Result<Aggregator> {
    start_with_clock(cfg, Clock::default()).await
}

/// [`start`], with remediation and the intake judging time by `clock`: its windows
/// (dedup, cool-down, canary retry and timeout, expiry, breaker, intake counts) move
/// when a test advances it. The pipeline keeps the system clock: it judges the agents'
/// own timestamps. Each part is built by its own function, in this order.
pub async fn start_with_clock(cfg: Config, clock: Clock) -> anyhow::Result<Aggregator> {
    let metrics = Arc::new(Metrics::new());
    let cancel = CancellationToken::new();
    let tasks = Supervisor::new(cancel.clone());
    let rules = rules(&cfg, &metrics, &tasks, &cancel)?;
    let (kube, watch) = clients(&cfg).await?;
    let held = Held::default(); // what the shard Leases say this replica holds
    let sharing = cfg.sink == SinkKind::ConfigMap;
    let deliveries = deliveries(&cfg, &held, &metrics);
    let ownership = sharing.then(|| discover::Ownership {
        held: held.subscribe(),
        shards: cfg.shards,
    });
    let agents = follow_agents(
        &cfg,
        watch.as_ref(),
        &metrics,
        (&tasks, &cancel),
        ownership,
        deliveries.clone(),
    )?;
    // Bound first: the shard Leases advertise where this replica's API is.
    let limits = faultline_common::server::Limits::default();
    let listener = faultline_common::server::bind(cfg.listen, limits.backlog)
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    // Leases (and the notifier's queue) outlive the core loop: on a stop, in-flight
    // remediation finishes first, then the Leases go.
    let lease_cancel = CancellationToken::new();
    let (verdict_tx, verdicts) = mpsc::channel::<Verdict>(1024);
    let (shard_tx, shard_events) = mpsc::channel(64);
    let parts = Parts {
        cfg: &cfg,
        metrics: &metrics,
        cancel: &cancel,
        tasks: &tasks,
        lease_cancel: &lease_cancel,
        clock: &clock,
        held: &held,
        rules: &rules,
        watch: watch.as_ref(),
        verdicts: &verdict_tx,
    };
    let latest = Arc::new(std::sync::Mutex::new(None));
    let built = match (cfg.sink, kube.as_ref()) {
        (SinkKind::File, _) => Built::file(&cfg, parts.intake(), latest.clone()),
        (SinkKind::ConfigMap, None) => anyhow::bail!("the configmap sink needs the Kubernetes API"),
        (SinkKind::ConfigMap, Some(kube)) => {
            parts.on_shards(kube, &shard_tx, advertise(&cfg, addr))
        }
    };
    // The core loop holds the receivers; the senders left are the parts' (verdict_tx
    // goes when this returns).
    drop(shard_tx);
    let ready = Arc::new(AtomicBool::new(false));
    let (asks, api) = parts.serve_api(listener, limits, built.intake, latest, ready.clone());
    tracing::info!(%addr, agents = cfg.agents.len(), out = %cfg.out.display(), "faultline aggregator running");
    let core = parts.core(built.publisher, built.dispatch, ready, deliveries);
    let inputs = Inputs {
        agents,
        verdicts,
        settled: built.settled,
        rules,
        asks,
        shards: sharing.then_some(shard_events),
    };
    let core = supervise::spawn_core(lease_cancel.clone(), core.run(inputs, cancel.clone()));
    let tasks = Tasks {
        cancel,
        lease_cancel,
        core,
        leases: built.lease_task,
        api,
        supervisor: tasks,
    };
    Ok(Aggregator { addr, tasks })
}

/// The Kubernetes clients: one with `--kube-timeout` for calls, one without for
/// watches; none where nothing needs the API (the file sink with `--agents`).
async fn clients(cfg: &Config) -> anyhow::Result<(Option<kube::Client>, Option<kube::Client>)> {
    if cfg.sink != SinkKind::ConfigMap && !cfg.agents.is_empty() {
        return Ok((None, None));
    }
    let (server, token) = (cfg.kube_server.as_deref(), cfg.kube_token_file.as_deref());
    // One bucket for both: the rate is the replica's.
    let rate = cfg
        .kube_rate
        .map(|(qps, burst)| super::ratelimit::KubeRate::new(qps, burst));
    Ok((
        Some(connect_with(server, token, Some(cfg.kube_timeout), rate.as_ref()).await?),
        Some(connect_with(server, token, None, rate.as_ref()).await?),
    ))
}

/// Node-local delivery (`--delivery-token-file`): each followed node's entry to its
/// agent, fenced by the shard Leases with the ConfigMap sink.
fn deliveries(cfg: &Config, held: &Held, metrics: &Arc<Metrics>) -> Option<Arc<Deliveries>> {
    let sharing = cfg.sink == SinkKind::ConfigMap;
    cfg.delivery.as_ref().map(|d| {
        Deliveries::new(
            &cfg.replica,
            (d.token.clone(), d.signer.clone()),
            d.confirm,
            sharing.then(|| DeliveryFence {
                held: held.clone(),
                shards: cfg.shards,
            }),
            metrics.clone(),
        )
    })
}

/// What the sink decides: the publisher, the intake as routed, and on the shards the
/// Lease task and remediation's dispatcher with its reports.
struct Built {
    publisher: Publisher,
    intake: Option<Intake>,
    lease_task: Option<tokio::task::JoinHandle<()>>,
    dispatch: Option<Dispatch>,
    settled: Option<mpsc::UnboundedReceiver<dispatch::Settled>>,
}

impl Built {
    /// The file sink: no Leases, no remediation.
    fn file(cfg: &Config, intake: Option<Intake>, latest: Latest) -> Built {
        Built {
            publisher: Publisher::File {
                out: cfg.out.clone(),
                latest,
            },
            intake,
            lease_task: None,
            dispatch: None,
            settled: None,
        }
    }
}

/// The whole document last written by the file sink, for `/v1/faults`.
type Latest = Arc<std::sync::Mutex<Option<Arc<faultline_common::fault::FaultDocument>>>>;

/// What every part of a starting aggregator is built from.
struct Parts<'a> {
    cfg: &'a Config,
    metrics: &'a Arc<Metrics>,
    cancel: &'a CancellationToken,
    /// Spawns the long-lived parts, watched.
    tasks: &'a Supervisor,
    lease_cancel: &'a CancellationToken,
    clock: &'a Clock,
    held: &'a Held,
    rules: &'a watch::Receiver<Arc<Rules>>,
    watch: Option<&'a kube::Client>,
    verdicts: &'a mpsc::Sender<Verdict>,
}

impl Parts<'_> {
    /// The alert intake of `--intake-token-file`, its verdicts to the core loop.
    fn intake(&self) -> Option<Intake> {
        self.cfg.intake.clone().map(|c| {
            Intake::new(c, self.metrics.clone(), self.verdicts.clone())
                .with_clock(self.clock.clone())
        })
    }

    /// The ConfigMap sink: the shard Leases (their task), the publisher, the intake
    /// routed to the holder of each node's shard, and remediation unless it is off.
    fn on_shards(
        &self,
        kube: &kube::Client,
        events: &mpsc::Sender<ShardEvent>,
        url: Option<String>,
    ) -> Built {
        let cfg = self.cfg;
        let share = Sharing::new(
            Box::new(ShardPages {
                api: Api::namespaced(kube.clone(), &cfg.namespace),
                name: cfg.name.clone(),
                shards: cfg.shards,
                pages: cfg.pages,
            }),
            events.clone(),
        );
        let intake = self.intake().map(|i| {
            i.with_route(Route {
                held: self.held.clone(),
                shards: cfg.shards,
                leases: Api::namespaced(kube.clone(), &cfg.namespace),
                pods: Api::namespaced(kube.clone(), &cfg.namespace),
                name: cfg.name.clone(),
                me: cfg.replica.clone(),
            })
        });
        let (publisher, task) = shard_publisher(
            cfg,
            kube,
            self.held,
            url,
            self.metrics,
            self.lease_cancel,
            share,
        );
        let (dispatch, settled) = match cfg.remediation {
            Mode::Off => (None, None),
            _ => {
                let (d, rx) = self.remediation(kube);
                (Some(d), Some(rx))
            }
        };
        Built {
            publisher,
            intake,
            lease_task: Some(task),
            dispatch,
            settled,
        }
    }

    /// Remediation: the remediator with its device path, the kubelet's device health,
    /// and the dispatcher of the per-node passes.
    fn remediation(
        &self,
        kube: &kube::Client,
    ) -> (Dispatch, mpsc::UnboundedReceiver<dispatch::Settled>) {
        let (cfg, metrics, cancel) = (self.cfg, self.metrics, self.cancel);
        let notifier = (!cfg.notify.is_empty()).then(|| {
            let m = metrics.clone();
            Arc::new(Notifier::start(
                cfg.notify.clone(),
                Arc::new(move |d| m.notification(d)),
                self.lease_cancel.clone(),
            ))
        });
        let cache = self.watch.map(|watch| {
            let cache = NodeCache::default();
            let nodes = Watched::new(
                Api::all(watch.clone()),
                DEVICES_LABEL,
                metrics.clone(),
                "quarantined nodes",
            );
            self.tasks.spawn(
                "quarantined Node watch",
                cache.clone().follow(nodes, cancel.clone()),
            );
            cache
        });
        let r = remediator(cfg, kube, notifier, metrics, self.clock).with_node_cache(cache);
        let watched = (self.tasks, cancel);
        let r = Arc::new(r.with_devices(devices(cfg, kube, self.rules, metrics, watched)));
        // The kubelet's device health (KEP-4680): Unhealthy is a verdict, Unknown an alert.
        if let (true, Some(watch)) = (cfg.watch_pod_health, self.watch) {
            let (tx, rx) = mpsc::channel(1024);
            self.tasks.spawn(
                "pod health watch",
                podhealth::run(
                    Api::all(watch.clone()),
                    r.resources().to_vec(),
                    tx,
                    cancel.clone(),
                ),
            );
            self.tasks.spawn(
                "pod health verdicts",
                podhealth::forward_verdicts(rx, self.verdicts.clone(), metrics.clone()),
            );
        }
        let shards = Shards {
            held: self.held.clone(),
            count: cfg.shards,
        };
        let unknown = dispatch::UnknownGuard {
            tolerance: cfg.unknown_tolerance,
            standdown_share: cfg.unknown_standdown_share,
        };
        Dispatch::new(r, shards, metrics.clone(), unknown)
    }

    /// The API on `listener`; the core loop's requests for the whole document.
    fn serve_api(
        &self,
        listener: tokio::net::TcpListener,
        limits: faultline_common::server::Limits,
        intake: Option<Intake>,
        latest: Latest,
        ready: Arc<AtomicBool>,
    ) -> (
        mpsc::Receiver<api::DocumentAsk>,
        tokio::task::JoinHandle<()>,
    ) {
        let (asks_tx, asks) = mpsc::channel(64);
        let app = api::router(ApiState {
            metrics: self.metrics.clone(),
            latest,
            asks: asks_tx,
            ready,
            intake: intake.map(Arc::new),
            rendered: Default::default(),
        });
        let cancel = self.cancel.clone();
        let task = tokio::spawn(faultline_common::server::serve(
            listener,
            app,
            limits,
            self.metrics.server.clone(),
            async move { cancel.cancelled().await },
        ));
        (asks, task)
    }

    /// The core loop, owner of the pipeline.
    fn core(
        &self,
        publisher: Publisher,
        dispatch: Option<Dispatch>,
        ready: Arc<AtomicBool>,
        deliveries: Option<Arc<Deliveries>>,
    ) -> Core {
        let cfg = self.cfg;
        let pipeline = Pipeline::new(self.rules.borrow().clone(), self.metrics.clone())
            .with_device_forget(cfg.device_forget);
        let timing = WriteTiming {
            interval: cfg.write_interval,
            urgent_spacing: cfg.urgent_spacing,
            refresh: cfg.refresh,
            reconcile: cfg.reconcile_interval,
            shutdown: cfg.shutdown_timeout,
        };
        let core = Core::new(
            pipeline,
            publisher,
            dispatch,
            self.metrics.clone(),
            timing,
            cfg.replica.clone(),
            ready,
        );
        let core = if cfg.sink == SinkKind::ConfigMap {
            core.with_seeding()
        } else {
            core
        };
        core.with_deliveries(deliveries)
    }
}
