//! The agent's state: the last good reading of every device, each source's status and
//! the recent Xid events. Samplers write into it, streaming sources (NVML events, kmsg)
//! reach it through its [`EventSink`] implementation; the API and the node file render
//! it. Rendering only reads: whoever renders for the metrics refreshes the per-device
//! gauges from the document. Nothing here waits on a source, so a hung source can never
//! block a reader, and nothing slow (logging included) happens while the lock is held.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use faultline_common::classify::Finding;
use faultline_common::document::DrainAck;
use faultline_common::sync::Locked;
use faultline_common::time::{rfc3339_ms, Clock};
use faultline_common::xid::XidVerdict;
use faultline_common::{
    classify, Classification, DeviceHealth, DeviceReading, DeviceStatus, NodeHealth, SourceStatus,
    Summary, Thresholds, XidEvent, XidPolicy, SCHEMA_VERSION,
};
use tokio::sync::watch;

use crate::deadband::Deadband;
use crate::metrics::Metrics;
use crate::reading_checks::{empty, out_of_range};
use crate::sources::{EventSink, ProbeError, SourceSample};

/// Most Xid events kept in memory, whatever the retention says.
const MAX_EVENTS: usize = 4096;
/// Most unattributed events shown in the document.
const MAX_UNATTRIBUTED_SHOWN: usize = 100;
/// The same Xid on the same bus from the same source within this window is one event
/// (the driver prints several lines for one Xid 13, and a fallen-off-the-bus message
/// with and without an Xid number).
const EVENT_DEDUP_MS: u64 = 1_000;
/// The same Xid from two sources (NVML's event and the kernel line) within this window
/// is one event.
const CROSS_SOURCE_DEDUP_MS: u64 = 3_000;
/// A device absent from its source's samples this long is forgotten.
const FORGET_MISSING_AFTER: Duration = Duration::from_secs(3600);

/// What the store needs to know about the node.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub node: String,
    pub cache_ttl: Duration,
    pub thresholds: Thresholds,
    pub xid_policy: XidPolicy,
    /// When a new reading is announced as a new generation.
    pub deadband: Deadband,
}

struct Cached {
    /// The latest reading (what the document shows).
    reading: DeviceReading,
    /// The reading as of the last generation: a new one moves the generation only
    /// past the deadband.
    announced: DeviceReading,
    at: Instant,
    at_ms: u64,
    /// Since when the device is absent from its source's successful samples.
    missing_since: Option<Instant>,
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

/// What upkeep watches, to tell watchers when it changes with time alone.
type TimedView = BTreeMap<String, (bool, Option<(DeviceStatus, String)>)>;

struct Inner {
    devices: BTreeMap<String, Cached>,
    sources: BTreeMap<&'static str, SourceState>,
    events: VecDeque<XidEvent>,
    generation: u64,
    /// When the generation last moved (drift within the deadband waits for a refresh
    /// after it).
    announced_at: Instant,
    /// Per device: stale or not, and its Xid verdict, at the last upkeep.
    timed: TimedView,
    /// Drain intents the node's pods acknowledged, oldest first.
    drain_acks: Vec<DrainAck>,
}

/// Acknowledgements a document carries at most (the oldest go first).
pub const MAX_DRAIN_ACKS: usize = 64;

/// Shared agent state.
pub struct Store {
    cfg: StoreConfig,
    inner: Mutex<Inner>,
    generation: watch::Sender<u64>,
    metrics: Arc<Metrics>,
    /// The clock staleness and Xid windows are judged by; tests move it forward
    /// instead of sleeping.
    clock: Clock,
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
                announced_at: Instant::now(),
                timed: BTreeMap::new(),
                drain_acks: Vec::new(),
            }),
            generation,
            metrics,
            clock: Clock::default(),
        })
    }

    /// Now, on the store's clock: the monotonic instant and the wall clock in ms.
    fn now(&self) -> (Instant, u64) {
        (self.clock.instant(), self.clock.now_ms())
    }

    /// Move the store's clock forward by `d` (tests: time passes without a sleep).
    pub fn advance_clock(&self, d: Duration) {
        self.clock.advance(d);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way
        // that matters more than losing the API, so keep serving.
        self.inner.locked()
    }

    fn bump(&self, inner: &mut Inner) {
        inner.announced_at = self.now().0;
        for c in inner.devices.values_mut() {
            if c.announced != c.reading {
                c.announced = c.reading.clone();
            }
        }
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

    /// Take a pod's acknowledgement of its drain intent (the one `requested` then;):
    /// it joins the document (a new generation) unless it is there already.
    /// Only acknowledgements of intents `listed` still holds are kept,
    /// [`MAX_DRAIN_ACKS`] at most. Whether it is new.
    pub fn ack_drain(
        &self,
        uid: &str,
        requested: &str,
        listed: impl Fn(&DrainAck) -> bool,
    ) -> bool {
        let at = rfc3339_ms(self.now().1);
        let mut inner = self.lock();
        inner.drain_acks.retain(|a| listed(a));
        if inner
            .drain_acks
            .iter()
            .any(|a| a.uid == uid && a.requested == requested)
        {
            return false;
        }
        if inner.drain_acks.len() >= MAX_DRAIN_ACKS {
            inner.drain_acks.remove(0);
        }
        inner.drain_acks.push(DrainAck {
            uid: uid.to_string(),
            requested: requested.to_string(),
            at,
        });
        self.bump(&mut inner);
        true
    }

    /// Drop the acknowledgements of intents `listed` no longer holds (a new entry
    /// arrived without them): a later intent for the same pod starts unacknowledged.
    pub fn prune_drain_acks(&self, listed: impl Fn(&DrainAck) -> bool) {
        let mut inner = self.lock();
        let before = inner.drain_acks.len();
        inner.drain_acks.retain(|a| listed(a));
        if inner.drain_acks.len() != before {
            self.bump(&mut inner);
        }
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

    /// A source answered but its reading was discarded (warm-up): it counts as tried.
    pub fn mark_attempted(&self, source: &'static str) {
        self.lock().sources.entry(source).or_default().attempted = true;
    }

    /// True once every polled source has been tried at least once.
    pub fn ready(&self) -> bool {
        self.lock().sources.values().all(|s| s.attempted)
    }

    /// A source returned a sample.
    pub fn apply_sample(&self, source: &'static str, sample: SourceSample) {
        let (now, now_ms) = self.now();
        let mut logged = Vec::new();
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
        let mut seen = Vec::with_capacity(sample.devices.len());
        for mut reading in sample.devices {
            if out_of_range(&mut reading) {
                self.metrics.count_error(source, "out-of-range");
            }
            seen.push(reading.id.clone());
            let is_empty = empty(&reading);
            match inner.devices.get_mut(&reading.id) {
                // A device that answered nothing this time keeps its last good reading
                // (it ages into unknown after the TTL); the errors are counted.
                Some(c) if is_empty => {
                    self.metrics.count_error(source, "device");
                    if c.missing_since.take().is_some() {
                        changed = true;
                    }
                }
                Some(c) => {
                    changed |= c.missing_since.is_some()
                        || self
                            .cfg
                            .deadband
                            .moved(&c.announced, &reading, &self.cfg.thresholds);
                    c.reading = reading;
                    c.at = now;
                    c.at_ms = now_ms;
                    c.missing_since = None;
                }
                None => {
                    changed = true;
                    inner.devices.insert(
                        reading.id.clone(),
                        Cached {
                            announced: reading.clone(),
                            reading,
                            at: now,
                            at_ms: now_ms,
                            missing_since: None,
                        },
                    );
                }
            }
        }
        // Devices this source no longer lists are unknown at once: a device that drops
        // out of the enumeration is not one we may keep calling healthy.
        for (id, c) in inner.devices.iter_mut() {
            if c.reading.source == source && c.missing_since.is_none() && !seen.contains(id) {
                c.missing_since = Some(now);
                changed = true;
            }
        }
        for e in sample.events {
            if let Some(e) = self.push_event(&mut inner, e) {
                logged.push(e);
                changed = true;
            }
        }
        if changed {
            self.bump(&mut inner);
        }
        drop(inner);
        log_events(&logged);
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
        let added = self.push_event(&mut inner, e);
        if added.is_some() {
            self.bump(&mut inner);
        }
        drop(inner);
        log_events(added.as_slice());
    }

    /// Keep `e` unless ignored or a duplicate; returns it when kept (to log it later).
    fn push_event(&self, inner: &mut Inner, e: XidEvent) -> Option<XidEvent> {
        let ignored = self.cfg.xid_policy.ignores(e.xid);
        self.metrics.count_xid(&e, ignored);
        if ignored {
            return None;
        }
        let dup = inner.events.iter().rev().take(64).any(|o| {
            let window = if o.source == e.source {
                EVENT_DEDUP_MS
            } else {
                CROSS_SOURCE_DEDUP_MS
            };
            o.xid == e.xid && o.pci_bus_id == e.pci_bus_id && e.at_ms.abs_diff(o.at_ms) <= window
        });
        if dup {
            return None;
        }
        inner.events.push_back(e.clone());
        while inner.events.len() > MAX_EVENTS {
            inner.events.pop_front();
        }
        Some(e)
    }

    fn verdict(
        &self,
        inner: &Inner,
        bus: Option<&str>,
        now_ms: u64,
    ) -> (Vec<XidEvent>, Option<XidVerdict>) {
        let events: Vec<XidEvent> = match bus {
            Some(bus) => inner
                .events
                .iter()
                .filter(|e| e.pci_bus_id.as_deref() == Some(bus))
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let v = self.cfg.xid_policy.evaluate(&events, now_ms);
        (events, v)
    }

    /// Periodic upkeep: notice what changes with time alone (a device going stale, an
    /// Xid window running out) so watchers hear of it; drop events past retention and
    /// devices missing for long.
    pub fn tick(&self) {
        let (now, now_ms) = self.now();
        let mut inner = self.lock();
        let retention = self.cfg.xid_policy.retention.as_millis() as u64;
        let before = inner.events.len();
        inner
            .events
            .retain(|e| now_ms.saturating_sub(e.at_ms) <= retention);
        let forgotten = {
            let n = inner.devices.len();
            inner.devices.retain(|_, c| {
                c.missing_since
                    .is_none_or(|m| now.duration_since(m) < FORGET_MISSING_AFTER)
            });
            n != inner.devices.len()
        };
        let view: TimedView = inner
            .devices
            .iter()
            .map(|(id, c)| {
                let stale = now.duration_since(c.at) > self.cfg.cache_ttl;
                let (_, v) = self.verdict(&inner, c.reading.pci_bus_id.as_deref(), now_ms);
                (id.clone(), (stale, v.map(|v| (v.status, v.reason))))
            })
            .collect();
        // Readings that drifted within the deadband, once a refresh has passed.
        let drifted = now.duration_since(inner.announced_at) >= self.cfg.deadband.refresh
            && inner.devices.values().any(|c| c.announced != c.reading);
        if view != inner.timed || before != inner.events.len() || forgotten || drifted {
            inner.timed = view;
            self.bump(&mut inner);
        }
    }

    /// Render the node document as of now. Reads only, metrics included: to refresh the
    /// per-device gauges, pass the document's devices to
    /// [`Metrics::observe_devices`](crate::metrics::Metrics::observe_devices).
    pub fn render(&self) -> NodeHealth {
        let (now, now_ms) = self.now();
        let inner = self.lock();
        let mut attributed: Vec<&str> = Vec::new();
        let mut npus = Vec::with_capacity(inner.devices.len());
        for c in inner.devices.values() {
            let r = &c.reading;
            if let Some(bus) = r.pci_bus_id.as_deref() {
                attributed.push(bus);
            }
            let (events, verdict) = self.verdict(&inner, r.pci_bus_id.as_deref(), now_ms);
            let age = now.duration_since(c.at);
            let unknown = if let Some(m) = c.missing_since {
                Some((
                    "missing",
                    format!(
                        "absent from the source's samples for {}s",
                        now.duration_since(m).as_secs()
                    ),
                ))
            } else if age > self.cfg.cache_ttl {
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
                Some((code, detail))
            } else {
                None
            };
            let class = match unknown {
                Some((code, detail)) => {
                    let mut cl = Classification::unknown(code, detail);
                    // Fresh evidence from the kernel log still counts when the poll is
                    // stale: an Xid verdict outranks "we could not look".
                    if let Some(v) = verdict {
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
                }
                None => classify(r, verdict.as_ref(), &self.cfg.thresholds),
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
        }
        let unattributed: Vec<XidEvent> = inner
            .events
            .iter()
            .filter(|e| {
                e.pci_bus_id
                    .as_deref()
                    .is_none_or(|b| !attributed.contains(&b))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .take(MAX_UNATTRIBUTED_SHOWN)
            .rev()
            .cloned()
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
        let drain_acks = inner.drain_acks.clone();
        drop(inner);
        NodeHealth {
            schema_version: SCHEMA_VERSION.to_string(),
            generation,
            timestamp: rfc3339_ms(now_ms),
            node: self.cfg.node.clone(),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            summary: Summary::of(&npus),
            npus,
            sources,
            unattributed_xids: unattributed,
            drain_acks,
        }
    }
}

fn log_events(events: &[XidEvent]) {
    for e in events {
        tracing::warn!(xid = e.xid, class = ?e.class, bus = ?e.pci_bus_id, source = %e.source, "Xid event");
    }
}

/// Streaming sources report here: events go through [`Store::add_event`] (dedup and
/// ignore rules included), a stream is a source that does not gate readiness, up is an
/// empty successful sample and down a failure with no hung calls.
impl EventSink for Store {
    fn register_stream(&self, source: &'static str) {
        self.register_source(source, false);
    }

    fn event(&self, event: XidEvent) {
        self.add_event(event);
    }

    fn stream_up(&self, source: &'static str) {
        self.apply_sample(source, SourceSample::default());
    }

    fn stream_down(&self, source: &'static str, err: &ProbeError) {
        self.record_failure(source, err, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::time::now_ms;
    use faultline_common::xid::{class_of, XidThreshold};
    use faultline_common::Vendor;

    fn store(ttl_ms: u64, policy: XidPolicy) -> Arc<Store> {
        Store::new(
            StoreConfig {
                node: "n".into(),
                cache_ttl: Duration::from_millis(ttl_ms),
                thresholds: Thresholds::default(),
                xid_policy: policy,
                deadband: Deadband::default(),
            },
            Arc::new(Metrics::new()),
        )
    }

    fn reading(id: &str, bus: &str) -> DeviceReading {
        let mut r = DeviceReading::new(id, Vendor::Nvidia, "nvml");
        r.pci_bus_id = Some(bus.into());
        r.temperature_c = Some(40.0);
        r
    }

    fn sample(rs: Vec<DeviceReading>) -> SourceSample {
        SourceSample {
            devices: rs,
            events: vec![],
        }
    }

    fn xid(x: u32, bus: &str, source: &str, at_ms: u64) -> XidEvent {
        XidEvent {
            xid: x,
            class: class_of(x),
            pci_bus_id: Some(bus.into()),
            at_ms,
            source: source.into(),
            message: String::new(),
        }
    }

    fn status(s: &Store, id: &str) -> (DeviceStatus, Option<String>) {
        let d = s.render();
        let dev = d.npus.iter().find(|x| x.reading.id == id).unwrap();
        (dev.status, dev.reason.clone())
    }

    #[test]
    fn going_stale_moves_the_generation() {
        let s = store(50, XidPolicy::default());
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        s.tick();
        let g = s.generation();
        s.tick();
        assert_eq!(s.generation(), g, "nothing changed");
        s.advance_clock(Duration::from_millis(80));
        s.tick();
        assert!(s.generation() > g, "stale must be announced");
        assert_eq!(status(&s, "gpu0").0, DeviceStatus::Unknown);
    }

    #[test]
    fn an_xid_window_running_out_moves_the_generation() {
        let mut p = XidPolicy::default();
        p.thresholds.insert(
            79,
            XidThreshold {
                count: 1,
                window: Duration::from_millis(100),
            },
        );
        let s = store(60_000, p);
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        s.add_event(xid(79, "0000:18:00.0", "kmsg", now_ms()));
        s.tick();
        assert_eq!(status(&s, "gpu0").0, DeviceStatus::Failed);
        let g = s.generation();
        s.advance_clock(Duration::from_millis(150));
        s.tick();
        assert!(
            s.generation() > g,
            "the verdict lapsed; watchers must hear of it"
        );
        assert_eq!(status(&s, "gpu0").0, DeviceStatus::Healthy);
    }

    #[test]
    fn one_xid_seen_by_nvml_and_the_kernel_log_counts_once() {
        let s = store(60_000, XidPolicy::default());
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        let t = now_ms();
        s.add_event(xid(13, "0000:18:00.0", "nvml-event", t));
        s.add_event(xid(13, "0000:18:00.0", "kmsg", t + 1_500));
        s.add_event(xid(13, "0000:18:00.0", "kmsg", t + 1_800));
        assert_eq!(s.render().npus[0].recent_xids.len(), 1);
        // A later one is a new event.
        s.add_event(xid(13, "0000:18:00.0", "kmsg", t + 5_000));
        assert_eq!(s.render().npus[0].recent_xids.len(), 2);
    }

    #[test]
    fn a_device_that_drops_out_of_the_enumeration_is_unknown_at_once() {
        let s = store(60_000, XidPolicy::default());
        s.apply_sample(
            "nvml",
            sample(vec![
                reading("gpu0", "0000:18:00.0"),
                reading("gpu1", "0000:28:00.0"),
            ]),
        );
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        assert_eq!(
            status(&s, "gpu1"),
            (DeviceStatus::Unknown, Some("missing".into()))
        );
        // ...unless the kernel says why: then it is failed.
        s.add_event(xid(79, "0000:28:00.0", "kmsg", now_ms()));
        assert_eq!(
            status(&s, "gpu1"),
            (DeviceStatus::Failed, Some("xid-79".into()))
        );
        // It comes back.
        s.apply_sample(
            "nvml",
            sample(vec![
                reading("gpu0", "0000:18:00.0"),
                reading("gpu1", "0000:28:00.0"),
            ]),
        );
        assert_ne!(status(&s, "gpu1").1.as_deref(), Some("missing"));
    }

    #[test]
    fn a_stream_reports_its_status_through_the_sink() {
        let s = store(60_000, XidPolicy::default());
        let sink: Arc<dyn EventSink> = s.clone();
        sink.register_stream("kmsg");
        assert!(s.ready(), "a stream does not gate readiness");
        let src = |s: &Store| s.render().sources.into_iter().find(|x| x.name == "kmsg");
        let kmsg = src(&s).unwrap();
        assert!(kmsg.up && kmsg.last_success.is_none() && kmsg.last_error.is_none());
        let g = s.generation();
        sink.stream_down("kmsg", &ProbeError::Init("/dev/kmsg: gone".into()));
        let kmsg = src(&s).unwrap();
        assert!(!kmsg.up);
        assert_eq!(kmsg.consecutive_failures, 1);
        assert_eq!(
            kmsg.last_error.as_deref(),
            Some("source cannot start: /dev/kmsg: gone")
        );
        assert!(s.generation() > g);
        sink.stream_up("kmsg");
        let kmsg = src(&s).unwrap();
        assert!(kmsg.up && kmsg.last_success.is_some() && kmsg.last_error.is_none());
        assert_eq!(kmsg.consecutive_failures, 0);
        // Events go through the same dedup as add_event.
        let t = now_ms();
        sink.event(xid(79, "0000:18:00.0", "kmsg", t));
        sink.event(xid(79, "0000:18:00.0", "kmsg", t + 10));
        assert_eq!(s.render().unattributed_xids.len(), 1);
    }

    /// A reading no sensor reads (a driver's invalid marker) is dropped, not
    /// served: the aggregator would refuse the whole document for it.
    #[test]
    fn a_reading_out_of_range_is_dropped() {
        let s = store(60_000, XidPolicy::default());
        let mut r = reading("gpu0", "0000:18:00.0");
        r.temperature_c = Some(65535.0);
        r.power_w = Some(300.0);
        s.apply_sample("nvml", sample(vec![r]));
        let doc = s.render();
        assert_eq!(doc.npus[0].reading.temperature_c, None);
        assert_eq!(doc.npus[0].reading.power_w, Some(300.0));
    }

    /// Power and temperature noise within the deadband moves no generation
    /// (the document shows the latest reading all the same); a step past it does at
    /// once, and the drift goes out at the refresh.
    #[test]
    fn reading_noise_waits_for_the_refresh_and_a_step_goes_out_at_once() {
        let s = store(60_000, XidPolicy::default());
        let at = |temp: f64, power: f64| {
            let mut r = reading("gpu0", "0000:18:00.0");
            r.temperature_c = Some(temp);
            r.power_w = Some(power);
            sample(vec![r])
        };
        s.apply_sample("nvml", at(50.0, 400.0));
        s.tick();
        let g = s.generation();
        for (i, p) in [401.3, 398.7, 412.0, 395.5].iter().enumerate() {
            s.apply_sample("nvml", at(50.0 + i as f64 * 0.4, *p));
            s.tick();
        }
        assert_eq!(s.generation(), g, "noise moved the generation");
        let doc = s.render();
        assert_eq!(
            doc.npus[0].reading.power_w,
            Some(395.5),
            "the latest reading shown"
        );
        s.advance_clock(Duration::from_secs(61));
        s.apply_sample("nvml", at(51.0, 396.0));
        s.tick();
        assert_eq!(s.generation(), g + 1, "the drift went out at the refresh");
        s.apply_sample("nvml", at(51.0, 460.0));
        assert_eq!(s.generation(), g + 2, "a step past the band at once");
    }

    #[test]
    fn rendering_leaves_the_metrics_alone() {
        let metrics = Arc::new(Metrics::new());
        let s = Store::new(
            StoreConfig {
                node: "n".into(),
                cache_ttl: Duration::from_secs(60),
                thresholds: Thresholds::default(),
                xid_policy: XidPolicy::default(),
                deadband: Deadband::default(),
            },
            metrics.clone(),
        );
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        let before = metrics.encode();
        let doc = s.render();
        assert_eq!(metrics.encode(), before);
        assert!(!before.contains("device=\"gpu0\""), "{before}");
        metrics.observe_devices(&doc.npus);
        assert!(metrics.encode().contains("device=\"gpu0\""));
    }

    #[test]
    fn an_empty_reading_keeps_the_last_good_one() {
        let s = store(60_000, XidPolicy::default());
        s.apply_sample("nvml", sample(vec![reading("gpu0", "0000:18:00.0")]));
        let mut bad = DeviceReading::new("gpu0", Vendor::Nvidia, "nvml");
        bad.probe_errors.push("temperature: Unknown".into());
        s.apply_sample("nvml", sample(vec![bad]));
        let d = s.render();
        assert_eq!(d.npus[0].reading.temperature_c, Some(40.0));
        assert_eq!(d.npus[0].status, DeviceStatus::Healthy);
    }
}
