//! The agent's wiring: [`start`] as a table of parts, each built by its own function.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use faultline_common::supervise::{judge, Stopped, Supervisor};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, SourceKind};
use crate::metrics::Metrics;
use crate::sampler::SamplerConfig;
use crate::sources::sim::SimControl;
use crate::sources::{EventSink, Source};
use crate::store::{Store, StoreConfig};
use crate::{api, fault_api, health_file, reaper, sampler, sources, verdict};

/// Connections of the API port kept for the aggregator beyond `--http-max-connections`
/// (requests carrying the delivery token), so that a crowd of other peers cannot shut it
/// out. Its replicas hold one or two each (a stream and a delivery).
pub const AGGREGATOR_CONNECTIONS: usize = 16;

/// A running agent.
pub struct Agent {
    /// Its state.
    pub store: Arc<Store>,
    /// Its metrics.
    pub metrics: Arc<Metrics>,
    /// The address the API listens on.
    pub addr: std::net::SocketAddr,
    /// The address of `--fault-listen`, if given.
    pub fault_addr: Option<std::net::SocketAddr>,
    cancel: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    /// The other long-lived parts: samplers, upkeep, the files, the pods' port.
    parts: Supervisor,
}

impl Agent {
    /// Stop sampling and serving.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
    }

    /// Wait until the agent stops: on cancel, or when a part panics or ends on its own
    /// (the API server, a sampler, ...), which stops the rest and is the error.
    pub async fn wait(self) -> Result<(), Stopped> {
        let server = judge("API server", self.server.await, self.cancel.is_cancelled());
        self.cancel.cancel();
        self.parts.failure().and(server)
    }

    /// The cancellation token that stops everything.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

/// Start every configured source, the upkeep tick, the health file writer and the API:
/// each part built by its own function below, in this order.
pub async fn start(cfg: Config) -> anyhow::Result<Agent> {
    // As PID 1 (no init in the container), orphaned tool descendants are ours to reap.
    if reaper::start(false) {
        tracing::info!("running as PID 1: reaping orphaned children");
    }
    let metrics = Arc::new(Metrics::new());
    let store = Store::new(
        StoreConfig {
            node: cfg.node_name.clone(),
            cache_ttl: cfg.cache_ttl,
            thresholds: cfg.thresholds,
            xid_policy: cfg.xid_policy.clone(),
            deadband: cfg.deadband,
        },
        metrics.clone(),
    );
    let cancel = CancellationToken::new();
    let tasks = Supervisor::new(cancel.clone());
    let parts = Parts {
        cfg: &cfg,
        store: &store,
        metrics: &metrics,
        cancel: &cancel,
        tasks: &tasks,
    };
    let (polled, sim_control) = parts.sources()?;
    if cfg.fail_on_init_error {
        parts.check_init(&polled).await?;
    }
    parts.spawn_samplers(polled);
    parts.spawn_upkeep();
    if let Some(path) = cfg.health_file.clone() {
        let run = health_file::run(path, store.clone(), metrics.clone(), cancel.clone());
        tasks.spawn("health file writer", run);
    }
    let verdicts = parts.verdicts()?;
    let state = api::ApiState::new(store.clone(), metrics.clone(), sim_control)
        .with_stop(cancel.clone())
        .with_verdicts(verdicts);
    let fault_addr = parts.spawn_pod_port(&state)?;
    let (addr, server) = parts.spawn_api(state)?;
    tracing::info!(%addr, node = %cfg.node_name, sources = ?cfg.sources, "faultline agent serving");
    Ok(Agent {
        store,
        metrics,
        addr,
        fault_addr,
        cancel,
        server,
        parts: tasks,
    })
}

/// The polled sources, and the simulator's control when `sim` is one of them.
type Polled = (Vec<Arc<dyn Source>>, Option<Arc<SimControl>>);

/// What every part of a starting agent is built from.
struct Parts<'a> {
    cfg: &'a Config,
    store: &'a Arc<Store>,
    metrics: &'a Arc<Metrics>,
    cancel: &'a CancellationToken,
    /// Spawns the long-lived parts, watched.
    tasks: &'a Supervisor,
}

impl Parts<'_> {
    /// The polled sources of `--source` (kmsg, which streams, is started here), and the
    /// simulator's control when `sim` is one of them.
    fn sources(&self) -> anyhow::Result<Polled> {
        let (cfg, metrics, cancel) = (self.cfg, self.metrics, self.cancel);
        // Streaming sources see the store only as where their events and status go.
        let sink: Arc<dyn EventSink> = self.store.clone();
        let mut sim_control = None;
        let mut polled: Vec<Arc<dyn Source>> = Vec::new();
        for kind in &cfg.sources {
            match kind {
                SourceKind::Nvml => polled.push(Arc::new(sources::nvml::NvmlSource::new(
                    cfg.nvml_lib.clone(),
                    Some(sources::nvml::EventStream {
                        sink: sink.clone(),
                        cancel: cancel.clone(),
                        metrics: metrics.clone(),
                    }),
                ))),
                SourceKind::Dcmi => polled.push(Arc::new(
                    sources::dcmi::DcmiSource::new(cfg.dcmi_lib.clone())
                        .with_fault_codes(cfg.fault_codes.clone())
                        .with_escalation(cfg.escalation.clone())
                        .with_metrics(metrics.clone()),
                )),
                SourceKind::NpuSmi => polled.push(Arc::new(
                    sources::npu_smi::NpuSmiSource::new(cfg.npu_smi.clone())
                        .with_fault_codes(cfg.fault_codes.clone())
                        .with_escalation(cfg.escalation.clone())
                        .with_davinci_dir(cfg.davinci_dir.clone()),
                )),
                SourceKind::Exec => {
                    let argv = cfg.exec.clone().context("exec source without --exec")?;
                    polled.push(Arc::new(sources::exec::ExecSource::new(argv)));
                }
                SourceKind::Sim => {
                    let sim = self.sim()?;
                    sim_control = Some(sim.control());
                    polled.push(Arc::new(sim));
                }
                SourceKind::Kmsg => sources::kmsg::spawn(
                    cfg.kmsg.clone(),
                    sources::kmsg::TextTrust::from_flag(cfg.kmsg_trust_text),
                    sink.clone(),
                    metrics.clone(),
                    cancel.clone(),
                ),
            }
        }
        Ok((polled, sim_control))
    }

    /// The simulator, its scenario loaded.
    fn sim(&self) -> anyhow::Result<sources::sim::SimSource> {
        let cfg = self.cfg;
        let scenario = match &cfg.sim_scenario {
            Some(p) => sources::sim::SimSource::load_scenario(p)?,
            None => Vec::new(),
        };
        Ok(sources::sim::SimSource::new(
            &cfg.node_name,
            cfg.sim_devices,
            cfg.sim_vendor,
            cfg.sim_seed,
            scenario,
        ))
    }

    /// `--fail-on-init-error`: a source that cannot start stops the agent.
    async fn check_init(&self, polled: &[Arc<dyn Source>]) -> anyhow::Result<()> {
        for s in polled {
            let caller = sampler::Caller::new(s.clone(), self.metrics.clone());
            if let Err(e @ sources::ProbeError::Init(_)) =
                caller.call(self.cfg.timeout, self.cfg.max_abandoned).await
            {
                anyhow::bail!(
                    "source {} cannot start: {e} (--fail-on-init-error)",
                    s.name()
                );
            }
        }
        Ok(())
    }

    /// One sampler per polled source.
    fn spawn_samplers(&self, polled: Vec<Arc<dyn Source>>) {
        let cfg = self.cfg;
        let sampler_cfg = SamplerConfig {
            interval: cfg.interval,
            timeout: cfg.timeout,
            retries: cfg.retries,
            max_abandoned: cfg.max_abandoned,
        };
        for s in polled {
            self.store.register_source(s.name(), true);
            let (store, metrics) = (self.store.clone(), self.metrics.clone());
            let run = sampler::run(s, store, metrics, sampler_cfg, self.cancel.clone());
            self.tasks.spawn("sampler", run);
        }
    }

    /// Upkeep: notice devices going stale and age out old events.
    fn spawn_upkeep(&self) {
        let (store, cancel) = (self.store.clone(), self.cancel.clone());
        let period =
            (self.cfg.interval / 4).clamp(Duration::from_millis(50), Duration::from_millis(500));
        self.tasks.spawn("upkeep", async move {
            let mut t = tokio::time::interval(period);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = t.tick() => store.tick(),
                }
            }
        });
    }

    /// The aggregator's verdicts (the delivery token and keys read), kept in
    /// `--fault-dir`.
    fn verdicts(&self) -> anyhow::Result<Arc<verdict::Verdicts>> {
        let cfg = self.cfg;
        for p in [&cfg.delivery_token_file, &cfg.delivery_key_file]
            .into_iter()
            .flatten()
            .filter(|p| !p.exists())
        {
            tracing::warn!(path = %p.display(), "no such file yet (an optional Secret or ConfigMap not made): deliveries are refused until it appears");
        }
        let token = match &cfg.delivery_token_file {
            Some(p) => Some(
                verdict::Verdicts::read_token(p)
                    .with_context(|| format!("--delivery-token-file {}", p.display()))?,
            ),
            None => None,
        };
        let keys = match &cfg.delivery_key_file {
            Some(p) => Some(
                verdict::Verdicts::read_keys(p)
                    .with_context(|| format!("--delivery-key-file {}", p.display()))?,
            ),
            None => None,
        };
        let trust = verdict::Trust { token, keys };
        let verdicts = verdict::Verdicts::trusting(&cfg.node_name, trust, cfg.verdict_stale_after);
        if let Some(dir) = cfg.fault_dir.clone() {
            let (store, metrics) = (self.store.clone(), self.metrics.clone());
            let run = verdict::run_file(dir, verdicts.clone(), store, metrics, self.cancel.clone());
            self.tasks.spawn("fault file writer", run);
        }
        Ok(verdicts)
    }

    /// `--fault-listen`: the node's pods' port; where it listens.
    fn spawn_pod_port(
        &self,
        state: &api::ApiState,
    ) -> anyhow::Result<Option<std::net::SocketAddr>> {
        let Some(at) = self.cfg.fault_listen else {
            return Ok(None);
        };
        let l = faultline_common::server::bind(at, self.cfg.http.backlog)
            .with_context(|| format!("cannot listen on {at} (--fault-listen)"))?;
        let bound = l.local_addr()?;
        let (cancel, stats) = (self.cancel.clone(), self.metrics.server.clone());
        // The pods' watches have a cap of their own: they never take the aggregator's
        // place among /v1/health's streams.
        let mut pods = state.clone();
        pods.waiters = Arc::new(tokio::sync::Semaphore::new(fault_api::POD_WAITERS));
        let serve = faultline_common::server::serve(
            l,
            fault_api::pod_router(pods),
            self.cfg.http,
            stats,
            async move { cancel.cancelled().await },
        );
        self.tasks.spawn("pods' port (--fault-listen)", serve);
        Ok(Some(bound))
    }

    /// The API port (`--listen`): where it listens, and its server.
    fn spawn_api(
        &self,
        state: api::ApiState,
    ) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
        let listen = self.cfg.listen;
        let listener = faultline_common::server::bind(listen, self.cfg.http.backlog)
            .with_context(|| format!("cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        // With a delivery token, connections kept for the aggregator (it sends the token
        // on every request): a crowd on the API port cannot shut it out.
        let trust: Option<faultline_common::server::Trust> =
            state.verdicts.has_token().then(|| {
                let v = state.verdicts.clone();
                Arc::new(move |h: &axum::http::HeaderMap| {
                    h.get(axum::http::header::AUTHORIZATION)
                        .and_then(|v| faultline_common::names::bearer_token(v.as_bytes()))
                        .is_some_and(|t| v.is_token(t))
                }) as faultline_common::server::Trust
            });
        let app = api::router_with(state, fault_api::routes());
        let cancel = self.cancel.clone();
        let limits = faultline_common::server::Limits {
            reserved: AGGREGATOR_CONNECTIONS,
            ..self.cfg.http
        };
        let server = tokio::spawn(faultline_common::server::serve_trusted(
            listener,
            app,
            limits,
            self.metrics.server.clone(),
            trust,
            async move { cancel.cancelled().await },
        ));
        Ok((addr, server))
    }
}
