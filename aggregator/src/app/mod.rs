//! Wiring: [`start`] builds every part from the [`Config`] (the collectors, the
//! publisher, the shard Leases, remediation and its dispatcher, the intake, the API)
//! and spawns them; the core loop (`core.rs`) runs the pipeline, the dispatcher
//! (`dispatch.rs`) the per-node remediation passes.

pub mod core;
pub mod dispatch;
pub mod schedule;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use faultline_common::rules::Rules;
use faultline_common::time::Clock;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use self::core::{Core, Inputs, WriteTiming};
use self::dispatch::Dispatch;
use crate::api::{self, ApiState};
use crate::config::{Config, Discovery, SinkKind};
use crate::ingest::deliver::{Deliveries, Fence as DeliveryFence};
use crate::ingest::{collect, discover, endpoints, podhealth, AgentEvent, Intake, Route};
use crate::metrics::Metrics;
use crate::model::Verdict;
use crate::notify::Notifier;
use crate::pipeline::Pipeline;
use crate::publish::seed::ShardPages;
use crate::publish::{ConfigMapSink, Nudger, Publisher};
use crate::quarantine::DeviceQuarantine;
use crate::remediate::{Breaker, Mode, Remediator};
use crate::rules_file;
use crate::shard::{Held, LeaseConfig, ShardLeases, Shards, Sharing};

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

/// A Kubernetes client for `server` (plain HTTP, the test server), else in-cluster or
/// $KUBECONFIG, with kube's own retries of 429/503 off: callers decide what to retry.
/// `timeout` bounds each request's reads and writes; watches need a client without one
/// (`None`): a quiet watch sends nothing for minutes.
pub async fn connect(
    server: Option<&str>,
    token_file: Option<&std::path::Path>,
    timeout: Option<Duration>,
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
    kube::Client::try_from(kc).context("Kubernetes client")
}

/// The rules in force, reloaded from `--rules` when it changes.
fn rules(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
) -> anyhow::Result<watch::Receiver<Arc<Rules>>> {
    let rules = match &cfg.rules {
        Some(p) => rules_file::load(p).with_context(|| format!("rules file {}", p.display()))?,
        None => Rules::default(),
    };
    let (tx, rx) = watch::channel(Arc::new(rules));
    if let Some(p) = cfg.rules.clone() {
        tokio::spawn(rules_file::watch_file(
            p,
            tx,
            metrics.clone(),
            Duration::from_secs(1),
            cancel.clone(),
        ));
    }
    Ok(rx)
}

/// Follow the agents: the `--agents` list, or the Nodes found by discovery.
/// Follow the agents: discovered Nodes, or `--agents`. With `ownership` (the
/// ConfigMap sink), only the nodes of the shards this replica holds; an agent named by
/// URL alone is followed by every replica until its document names its node.
fn follow_agents(
    cfg: &Config,
    watch: Option<&kube::Client>,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
    ownership: Option<discover::Ownership>,
    deliveries: Option<Arc<Deliveries>>,
) -> anyhow::Result<mpsc::Receiver<AgentEvent>> {
    let (tx, rx) = mpsc::channel::<AgentEvent>(1024);
    let client = collect::client().with_bearer(cfg.delivery.as_ref().map(|(t, _)| t.as_str()));
    let followers = discover::Followers::new(
        cfg.agent_port,
        client.clone(),
        tx.clone(),
        metrics.clone(),
        cancel.clone(),
        ownership,
    )
    .with_deliveries(deliveries.clone());
    if cfg.agents.is_empty() {
        let client = watch
            .cloned()
            .context("discovery needs the Kubernetes API")?;
        match cfg.discovery {
            Discovery::Endpoints => {
                let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &cfg.namespace);
                let check = endpoints::NodeCheck {
                    api: Api::all(client),
                    selector: cfg.node_selector.clone(),
                    first: cfg.agent_gone_check,
                };
                tokio::spawn(endpoints::run(
                    api,
                    cfg.agent_service.clone(),
                    cfg.agent_port,
                    check,
                    followers,
                ));
            }
            Discovery::Nodes => {
                let api: Api<Node> = Api::all(client);
                tokio::spawn(discover::run(api, cfg.node_selector.clone(), followers));
            }
        }
        return Ok(rx);
    }
    let mut followers = followers;
    // The nodes named with their address are theirs; a bare URL's agent may name only
    // another (issue 26, finding 5).
    let claims = collect::Claims::default();
    for a in &cfg.agents {
        if let Some(node) = &a.node {
            if let Err(by) = claims.claim(node, &a.url) {
                anyhow::bail!("--agents: node {node} is listed at {by} and at {}", a.url);
            }
        }
    }
    for a in &cfg.agents {
        match &a.node {
            Some(node) => followers.add_static(node.clone(), a.url.clone()),
            None => {
                if deliveries.is_some() {
                    tracing::warn!(url = %a.url, "an agent listed by URL alone gets no deliveries: name its node (NODE=URL)");
                }
                tokio::spawn(collect::follow_unnamed(
                    a.url.clone(),
                    claims.clone(),
                    client.clone(),
                    tx.clone(),
                    metrics.clone(),
                    cancel.clone(),
                ));
            }
        }
    }
    tokio::spawn(followers.run_static());
    Ok(rx)
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
    .with_breaker(breaker, cfg.max_evictions_per_minute)
    .with_release(cfg.release.clone())
    .with_force_delete(cfg.force_delete_after_deadline)
    .with_checkpoint_grace(cfg.max_checkpoint_grace)
    .with_reporting(notifier, Some(metrics.clone()))
    .with_clock(clock.clone())
}

/// The device path of `--device-quarantine` (issue 28), following where the cluster
/// serves DeviceTaintRule (at start, then every 10 minutes).
fn devices(
    cfg: &Config,
    kube: &kube::Client,
    rules: &watch::Receiver<Arc<Rules>>,
    metrics: &Arc<Metrics>,
    cancel: &CancellationToken,
) -> Option<DeviceQuarantine> {
    let devices = DeviceQuarantine::from_flags(&cfg.devices, rules.clone());
    let found = devices.as_ref().map(|d| d.api.clone()).unwrap_or_default();
    crate::quarantine::api::spawn_follow(kube, metrics, found, cancel);
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
            Arc::new(
                ConfigMapSink::new(Api::namespaced(kube.clone(), ns), cfg.name.clone())
                    .with_pages(cfg.pages)
                    .with_refresh(cfg.refresh)
                    .with_metrics(metrics.clone()),
            )
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
/// own timestamps.
pub async fn start_with_clock(cfg: Config, clock: Clock) -> anyhow::Result<Aggregator> {
    let metrics = Arc::new(Metrics::new());
    let cancel = CancellationToken::new();
    let rules = rules(&cfg, &metrics, &cancel)?;
    let (kube, watch) = if cfg.sink == SinkKind::ConfigMap || cfg.agents.is_empty() {
        let (server, token) = (cfg.kube_server.as_deref(), cfg.kube_token_file.as_deref());
        (
            Some(connect(server, token, Some(cfg.kube_timeout)).await?),
            Some(connect(server, token, None).await?),
        )
    } else {
        (None, None)
    };
    // Shard ownership (the ConfigMap sink): the Leases decide what this replica holds,
    // and it follows only those shards' nodes (issue 11).
    let held = Held::default();
    let sharing = cfg.sink == SinkKind::ConfigMap;
    let ownership = sharing.then(|| discover::Ownership {
        held: held.subscribe(),
        shards: cfg.shards,
    });
    // Node-local delivery (issue 25): each followed node's entry to its agent.
    let deliveries = cfg.delivery.as_ref().map(|(token, confirm)| {
        Deliveries::new(
            &cfg.replica,
            token.clone(),
            *confirm,
            sharing.then(|| DeliveryFence {
                held: held.clone(),
                shards: cfg.shards,
            }),
            metrics.clone(),
        )
    });
    let agents = follow_agents(
        &cfg,
        watch.as_ref(),
        &metrics,
        &cancel,
        ownership,
        deliveries.clone(),
    )?;
    let (takeover_tx, takeovers) = mpsc::channel(64);
    let (final_tx, final_writes) = mpsc::channel(16);

    // Bound first: the shard Leases advertise where this replica's API is.
    let limits = faultline_common::server::Limits::default();
    let listener = faultline_common::server::bind(cfg.listen, limits.backlog)
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    // Leases (and the notifier's queue) outlive the core loop: on a stop, in-flight
    // remediation finishes first, then the Leases go.
    let lease_cancel = CancellationToken::new();
    let notifier = (!cfg.notify.is_empty()).then(|| {
        let m = metrics.clone();
        Arc::new(Notifier::start(
            cfg.notify.clone(),
            Arc::new(move |d| m.notification(d.as_str())),
            lease_cancel.clone(),
        ))
    });
    let (verdict_tx, verdicts) = mpsc::channel::<Verdict>(1024);
    let mut intake = cfg
        .intake
        .clone()
        .map(|c| Intake::new(c, metrics.clone(), verdict_tx.clone()).with_clock(clock.clone()));
    let latest = Arc::new(std::sync::Mutex::new(None));
    let mut lease_task = None;
    let mut dispatch = None;
    let mut settled = None;
    let publisher = match (cfg.sink, kube.as_ref()) {
        (SinkKind::File, _) => Publisher::File {
            out: cfg.out.clone(),
            latest: latest.clone(),
        },
        (SinkKind::ConfigMap, None) => anyhow::bail!("the configmap sink needs the Kubernetes API"),
        (SinkKind::ConfigMap, Some(kube)) => {
            intake = intake.map(|i| {
                i.with_route(Route {
                    held: held.clone(),
                    shards: cfg.shards,
                    leases: Api::namespaced(kube.clone(), &cfg.namespace),
                    pods: Api::namespaced(kube.clone(), &cfg.namespace),
                    name: cfg.name.clone(),
                    me: cfg.replica.clone(),
                })
            });
            let share = Sharing::new(
                Box::new(ShardPages {
                    api: Api::namespaced(kube.clone(), &cfg.namespace),
                    name: cfg.name.clone(),
                    shards: cfg.shards,
                    pages: cfg.pages,
                }),
                takeover_tx.clone(),
                final_tx.clone(),
            );
            let (publisher, task) = shard_publisher(
                &cfg,
                kube,
                &held,
                advertise(&cfg, addr),
                &metrics,
                &lease_cancel,
                share,
            );
            lease_task = Some(task);
            if cfg.remediation != Mode::Off {
                let r = remediator(&cfg, kube, notifier.clone(), &metrics, &clock);
                let r = Arc::new(r.with_devices(devices(&cfg, kube, &rules, &metrics, &cancel)));
                // The kubelet's device health (KEP-4680): Unhealthy is a verdict, Unknown an alert.
                if let (true, Some(watch)) = (cfg.watch_pod_health, watch.as_ref()) {
                    let (tx, rx) = mpsc::channel(1024);
                    tokio::spawn(podhealth::run(
                        Api::all(watch.clone()),
                        r.resources().to_vec(),
                        tx,
                        cancel.clone(),
                    ));
                    tokio::spawn(podhealth::forward_verdicts(
                        rx,
                        verdict_tx.clone(),
                        metrics.clone(),
                    ));
                }
                let shards = Shards {
                    held: held.clone(),
                    count: cfg.shards,
                };
                let unknown = dispatch::UnknownGuard {
                    tolerance: cfg.unknown_tolerance,
                    standdown_share: cfg.unknown_standdown_share,
                };
                let (d, rx) = Dispatch::new(r, shards, metrics.clone(), unknown);
                dispatch = Some(d);
                settled = Some(rx);
            }
            publisher
        }
    };
    drop(verdict_tx);

    let ready = Arc::new(AtomicBool::new(false));
    let (asks_tx, asks) = mpsc::channel(64);
    let app = api::router(ApiState {
        metrics: metrics.clone(),
        latest,
        asks: asks_tx,
        ready: ready.clone(),
        intake: intake.map(Arc::new),
        rendered: Default::default(),
    });
    {
        let cancel = cancel.clone();
        tokio::spawn(faultline_common::server::serve(
            listener,
            app,
            limits,
            metrics.server.clone(),
            async move { cancel.cancelled().await },
        ));
    }

    tracing::info!(%addr, agents = cfg.agents.len(), out = %cfg.out.display(), "faultline aggregator running");
    let pipeline = Pipeline::new(rules.borrow().clone(), metrics.clone())
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
        metrics,
        timing,
        cfg.replica.clone(),
        ready,
    );
    let core = if sharing { core.with_seeding() } else { core };
    let core = core.with_deliveries(deliveries);
    drop((takeover_tx, final_tx));
    let inputs = Inputs {
        agents,
        verdicts,
        settled,
        rules,
        asks,
        takeovers: sharing.then_some(takeovers),
        final_writes: sharing.then_some(final_writes),
    };
    let done = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            core.run(inputs, cancel).await;
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
