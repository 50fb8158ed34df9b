//! faultline aggregator: follows the agents, denoises their readings with windows, rules
//! and a per-device state machine, and publishes a versioned fault.json.
#![forbid(unsafe_code)]

pub mod collect;
pub mod config;
pub mod metrics;
pub mod pipeline;
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
use faultline_common::fault::{FaultDocument, FaultSummary, FAULT_VERSION};
use faultline_common::rules::Rules;
use rand::Rng;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::collect::AgentEvent;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;

/// A running aggregator.
pub struct Aggregator {
    /// The API address.
    pub addr: std::net::SocketAddr,
    cancel: CancellationToken,
    done: tokio::task::JoinHandle<()>,
}

impl Aggregator {
    /// The token that stops it.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
    /// Wait until it stops.
    pub async fn wait(self) {
        let _ = self.done.await;
    }
}

#[derive(Clone)]
struct ApiState {
    metrics: Arc<Metrics>,
    latest: Arc<Mutex<Option<Arc<FaultDocument>>>>,
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

/// Build the document of every node.
fn document(p: &Pipeline, sequence: u64, writer: &str) -> FaultDocument {
    let mut nodes = BTreeMap::new();
    let mut summary = FaultSummary::default();
    for name in p.node_names() {
        if let Some(n) = p.node_faults(name) {
            summary.add(&n.summary);
            nodes.insert(name.clone(), n);
        }
    }
    FaultDocument {
        version: FAULT_VERSION.into(),
        timestamp: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        sequence,
        shard: 0,
        shards: 1,
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

/// Start collectors, the pipeline and the API.
pub async fn start(cfg: Config) -> anyhow::Result<Aggregator> {
    let metrics = Arc::new(Metrics::new());
    let rules = match &cfg.rules {
        Some(p) => rules_file::load(p).with_context(|| format!("rules file {}", p.display()))?,
        None => Rules::default(),
    };
    let (rules_tx, mut rules_rx) = watch::channel(Arc::new(rules));
    let cancel = CancellationToken::new();
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

    let latest: Arc<Mutex<Option<Arc<FaultDocument>>>> = Arc::new(Mutex::new(None));
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let app = router(ApiState {
        metrics: metrics.clone(),
        latest: latest.clone(),
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
            let mut pipeline = Pipeline::new(rules_rx.borrow_and_update().clone(), metrics.clone());
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut dirty = true;
            let mut urgent = false;
            let mut sequence = 0u64;
            let mut last_write: Option<Instant> = None;
            let mut spacing = jittered(cfg.write_interval);
            let mut writing: Option<tokio::task::JoinHandle<()>> = None;
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
                        };
                        dirty |= !c.nodes.is_empty();
                        urgent |= c.urgent;
                    }
                    _ = tick.tick() => {
                        let c = pipeline.tick(now_ms());
                        dirty |= !c.nodes.is_empty();
                        urgent |= c.urgent;
                    }
                    r = rules_rx.changed() => {
                        if r.is_ok() {
                            pipeline.set_rules(rules_rx.borrow_and_update().clone());
                        }
                    }
                    _ = tokio::time::sleep_until(due), if writing.as_ref().is_none_or(|w| w.is_finished()) => {
                        sequence += 1;
                        let doc = Arc::new(document(&pipeline, sequence, &cfg.replica));
                        *latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(doc.clone());
                        let (out, metrics) = (cfg.out.clone(), metrics.clone());
                        writing = Some(tokio::task::spawn_blocking(move || {
                            let t = Instant::now();
                            let r = files(&doc).and_then(|f| {
                                let bytes = f.values().map(Vec::len).sum::<usize>();
                                sink::file::write(&out, &f)?;
                                Ok(bytes)
                            });
                            match r {
                                Ok(bytes) => metrics.write("file", 0, t.elapsed().as_secs_f64(), bytes, true),
                                Err(e) => {
                                    metrics.write("file", 0, 0.0, 0, false);
                                    tracing::error!(error = %e, out = %out.display(), "cannot write fault documents");
                                }
                            }
                        }));
                        last_write = Some(Instant::now());
                        spacing = jittered(cfg.write_interval);
                        dirty = false;
                        urgent = false;
                    }
                }
            }
            if let Some(w) = writing {
                let _ = w.await;
            }
        })
    };
    Ok(Aggregator { addr, cancel, done })
}

fn router(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"ok": true})) }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/v1/faults", get(faults))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                Json(json!({"error": "no such endpoint", "status": 404})),
            )
        })
        .with_state(state)
}

async fn ready(State(s): State<ApiState>) -> Response {
    if s.latest.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
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

async fn faults(State(s): State<ApiState>) -> Response {
    match s.latest.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        Some(d) => Json(d.as_ref().clone()).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "no document yet", "status": 503})),
        )
            .into_response(),
    }
}
