//! The agent's state: the last good reading of every device, each source's status and
//! the recent Xid events. Samplers write into it; the API renders it. Nothing here
//! waits on a source, so a hung source can never block a reader.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use faultline_common::classify::Finding;
use faultline_common::{
    classify, Classification, DeviceHealth, DeviceReading, DeviceStatus, NodeHealth, SourceStatus,
    Summary, Thresholds, XidEvent, XidPolicy, SCHEMA_VERSION,
};
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::sources::{now_ms, ProbeError, SourceSample};

/// Most Xid events kept in memory, whatever the retention says.
const MAX_EVENTS: usize = 4096;
/// The same Xid on the same bus from the same source within this window is one event
/// (the driver prints several lines for one Xid 13, and a fallen-off-the-bus message
/// with and without an Xid number).
const EVENT_DEDUP_MS: u64 = 1_000;

/// What the store needs to know about the node.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub node: String,
    pub cache_ttl: Duration,
    pub thresholds: Thresholds,
    pub xid_policy: XidPolicy,
}

struct Cached {
    reading: DeviceReading,
    at: Instant,
    at_ms: u64,
}

#[derive(Default)]
struct SourceState {
    polled: bool,
    attempted: bool,
    up: bool,
    init_error: bool,
    last_success_ms: Option<u64>,
    last_error: Option<String>,
    consecutive_failures: u32,
    abandoned: u32,
}

struct Inner {
    devices: BTreeMap<String, Cached>,
    sources: BTreeMap<&'static str, SourceState>,
    events: VecDeque<XidEvent>,
    generation: u64,
    /// Devices past their TTL at the last look, to notice when one goes stale.
    stale: BTreeSet<String>,
}

/// Shared agent state.
pub struct Store {
    cfg: StoreConfig,
    inner: Mutex<Inner>,
    generation: watch::Sender<u64>,
    metrics: Arc<Metrics>,
}

impl Store {
    /// An empty store.
    pub fn new(cfg: StoreConfig, metrics: Arc<Metrics>) -> Arc<Self> {
        let (generation, _) = watch::channel(1);
        Arc::new(Store {
            cfg,
            inner: Mutex::new(Inner {
                devices: BTreeMap::new(),
                sources: BTreeMap::new(),
                events: VecDeque::new(),
                generation: 1,
                stale: BTreeSet::new(),
            }),
            generation,
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way
        // that matters more than losing the API, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self, inner: &mut Inner) {
        inner.generation += 1;
        self.generation.send_replace(inner.generation);
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.cfg.node
    }

    /// Current generation.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Watch the generation.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Declare a source. Polled sources gate readiness until their first attempt.
    pub fn register_source(&self, name: &'static str, polled: bool) {
        let mut inner = self.lock();
        let s = inner.sources.entry(name).or_default();
        s.polled = polled;
        s.up = !polled;
        if !polled {
            s.attempted = true;
        }
        self.metrics.set_source_up(name, !polled);
    }

    /// True once every polled source has been tried at least once.
    pub fn ready(&self) -> bool {
        self.lock().sources.values().all(|s| s.attempted)
    }

    /// A source returned a sample.
    pub fn apply_sample(&self, source: &'static str, sample: SourceSample) {
        let now = Instant::now();
        let now_ms = now_ms();
        let mut inner = self.lock();
        let mut changed = false;
        {
            let s = inner.sources.entry(source).or_default();
            changed |= !s.up || s.last_error.is_some();
            s.attempted = true;
            s.up = true;
            s.init_error = false;
            s.last_error = None;
            s.consecutive_failures = 0;
            s.last_success_ms = Some(now_ms);
        }
        self.metrics.set_source_up(source, true);
        for reading in sample.devices {
            let empty = reading.temperature_c.is_none()
                && reading.power_w.is_none()
                && reading.ecc.is_none()
                && reading.pcie.is_none()
                && reading.vendor_health.is_none()
                && reading.reported_status.is_none()
                && !reading.lost;
            match inner.devices.get_mut(&reading.id) {
                // A device that answered nothing this time keeps its last good reading
                // (it ages into unknown after the TTL); the errors are counted.
                Some(_) if empty => {
                    self.metrics.count_error(source, "device");
                }
                Some(c) => {
                    changed |= c.reading != reading;
                    c.reading = reading;
                    c.at = now;
                    c.at_ms = now_ms;
                }
                None => {
                    changed = true;
                    inner.devices.insert(
                        reading.id.clone(),
                        Cached {
                            reading,
                            at: now,
                            at_ms: now_ms,
                        },
                    );
                }
            }
        }
        for e in sample.events {
            changed |= self.push_event(&mut inner, e);
        }
        if changed {
            self.bump(&mut inner);
        }
    }

    /// A sample failed.
    pub fn record_failure(&self, source: &'static str, err: &ProbeError, abandoned: u32) {
        let mut inner = self.lock();
        let msg = err.to_string();
        let s = inner.sources.entry(source).or_default();
        let changed =
            s.up || s.last_error.as_deref() != Some(msg.as_str()) || s.abandoned != abandoned;
        s.attempted = true;
        s.up = false;
        s.init_error = matches!(err, ProbeError::Init(_));
        s.last_error = Some(msg);
        s.consecutive_failures = s.consecutive_failures.saturating_add(1);
        s.abandoned = abandoned;
        self.metrics.set_source_up(source, false);
        if changed {
            self.bump(&mut inner);
        }
    }

    /// Update how many calls of a source are hung.
    pub fn set_abandoned(&self, source: &'static str, abandoned: u32) {
        let mut inner = self.lock();
        let s = inner.sources.entry(source).or_default();
        if s.abandoned != abandoned {
            s.abandoned = abandoned;
            self.bump(&mut inner);
        }
    }

    /// A streaming source saw an Xid.
    pub fn add_event(&self, e: XidEvent) {
        let mut inner = self.lock();
        if self.push_event(&mut inner, e) {
            self.bump(&mut inner);
        }
    }

    fn push_event(&self, inner: &mut Inner, e: XidEvent) -> bool {
        let ignored = self.cfg.xid_policy.ignores(e.xid);
        self.metrics.count_xid(&e, ignored);
        if ignored {
            return false;
        }
        let dup = inner.events.iter().rev().take(64).any(|o| {
            o.xid == e.xid
                && o.pci_bus_id == e.pci_bus_id
                && o.source == e.source
                && e.at_ms.abs_diff(o.at_ms) <= EVENT_DEDUP_MS
        });
        if dup {
            return false;
        }
        tracing::warn!(xid = e.xid, class = ?e.class, bus = ?e.pci_bus_id, source = %e.source, "Xid event");
        inner.events.push_back(e);
        while inner.events.len() > MAX_EVENTS {
            inner.events.pop_front();
        }
        true
    }

    /// Periodic upkeep: notice devices that went stale (so watchers hear of it) and
    /// drop events past retention.
    pub fn tick(&self) {
        let now = Instant::now();
        let now_ms = now_ms();
        let mut inner = self.lock();
        let stale: BTreeSet<String> = inner
            .devices
            .iter()
            .filter(|(_, c)| now.duration_since(c.at) > self.cfg.cache_ttl)
            .map(|(id, _)| id.clone())
            .collect();
        let retention = self.cfg.xid_policy.retention.as_millis() as u64;
        let before = inner.events.len();
        inner
            .events
            .retain(|e| now_ms.saturating_sub(e.at_ms) <= retention);
        if stale != inner.stale || before != inner.events.len() {
            inner.stale = stale;
            self.bump(&mut inner);
        }
    }

    /// Render the node document as of now.
    pub fn render(&self) -> NodeHealth {
        let now = Instant::now();
        let now_ms = now_ms();
        let inner = self.lock();
        let policy = &self.cfg.xid_policy;
        let mut attributed = vec![false; inner.events.len()];
        let mut npus = Vec::with_capacity(inner.devices.len());
        for (id, c) in &inner.devices {
            let r = &c.reading;
            let events: Vec<XidEvent> = match &r.pci_bus_id {
                Some(bus) => inner
                    .events
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.pci_bus_id.as_deref() == Some(bus.as_str()))
                    .map(|(i, e)| {
                        attributed[i] = true;
                        e.clone()
                    })
                    .collect(),
                None => Vec::new(),
            };
            let verdict = policy.evaluate(&events, now_ms);
            let age = now.duration_since(c.at);
            let class = if age > self.cfg.cache_ttl {
                let src = inner.sources.get(r.source.as_str());
                let (code, why) = match src {
                    Some(s) if s.init_error => ("source-down", s.last_error.clone()),
                    Some(s) if s.last_error.is_some() => ("probe-error", s.last_error.clone()),
                    _ => ("stale", None),
                };
                let mut detail = format!(
                    "last good reading {}s old (cache TTL {}s)",
                    age.as_secs(),
                    self.cfg.cache_ttl.as_secs()
                );
                if let Some(w) = why {
                    detail.push_str(": ");
                    detail.push_str(&w);
                }
                let mut cl = Classification::unknown(code, detail);
                // Fresh evidence from the kernel log still counts when the poll is stale.
                if let Some(v) = verdict.filter(|v| v.status != DeviceStatus::Unknown) {
                    cl.findings.insert(
                        0,
                        Finding {
                            code: v.reason.clone(),
                            status: v.status,
                            detail: v.detail,
                        },
                    );
                    cl.status = v.status;
                    cl.reason = Some(v.reason);
                }
                cl
            } else {
                classify(r, verdict.as_ref(), &self.cfg.thresholds)
            };
            npus.push(DeviceHealth {
                reading: r.clone(),
                status: class.status,
                reason: class.reason,
                findings: class.findings,
                ecc_errors: r.ecc.map(|e| e.volatile_total()),
                pcie_link_status: r.pcie.map(|p| if p.up { "up" } else { "down" }.to_string()),
                sampled_at: Some(rfc3339_ms(c.at_ms)),
                sample_age_ms: Some(age.as_millis() as u64),
                recent_xids: events,
            });
            let _ = id;
        }
        let unattributed_xids = inner
            .events
            .iter()
            .zip(&attributed)
            .filter(|(_, a)| !**a)
            .map(|(e, _)| e.clone())
            .collect();
        let sources = inner
            .sources
            .iter()
            .map(|(name, s)| SourceStatus {
                name: name.to_string(),
                up: s.up,
                last_success: s.last_success_ms.map(rfc3339_ms),
                last_error: s.last_error.clone(),
                consecutive_failures: s.consecutive_failures,
                abandoned_calls: s.abandoned,
            })
            .collect();
        let generation = inner.generation;
        drop(inner);
        self.metrics.observe_devices(&npus);
        NodeHealth {
            schema_version: SCHEMA_VERSION.to_string(),
            generation,
            timestamp: rfc3339_ms(now_ms),
            node: self.cfg.node.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            summary: Summary::of(&npus),
            npus,
            sources,
            unattributed_xids,
        }
    }
}

/// RFC 3339 UTC with milliseconds.
pub fn rfc3339_ms(ms: u64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}
