//! From agents' documents to smoothed device states: per node, per device, the sliding
//! windows and correlation rules turn each sample into an observation and the state
//! machine turns observations into a status with a reason and a since-when.
//!
//! Each device gets about one observation per second: a document arriving within a
//! second of the last evaluation is kept for the next tick, unless it carries a hard
//! fault, which is evaluated at once (the fast path to `failed`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use faultline_common::document::DocView;
use faultline_common::fault::{
    fnv1a64, shard_of_hash, AgentReach, FaultSummary, NodeFaults, NpuFault, SourceReach,
    FAULT_VERSION,
};
use faultline_common::rules::{DeviceWindows, Measure, Rules};
use faultline_common::state::{step, DeviceState};
use faultline_common::time::rfc3339_ms as rfc3339;
use faultline_common::{DeviceStatus, NodeHealth};

use crate::metrics::Metrics;
use crate::model::{DeviceView, RecordDevice};

/// Evaluations closer together than this are merged into the next tick.
pub const MIN_EVAL_SPACING_MS: u64 = 900;

/// The time between two ticks ([`Pipeline::tick`], once a second by the core loop).
pub const TICK_MS: u64 = 1000;

struct Device {
    windows: DeviceWindows,
    state: DeviceState,
    /// The last full evaluation observed a clean sample.
    clean: bool,
    /// When the agent last reported this device.
    reported_ms: u64,
}

/// Nodes followed at most: past it a new node is refused, logged and counted (issue 10;
/// the 20,000-node target with room to spare).
pub const MAX_NODES: usize = 50_000;

/// How long a device its reachable agent no longer reports is kept (`--device-forget`).
pub const DEFAULT_DEVICE_FORGET_MS: u64 = 3_600_000;

/// A device's readings as the last document gave them: what is published and what a
/// quarantine record names the device by.
struct Last {
    /// [`texts`] of the entry these readings came from: a document listing the same
    /// device with the same texts (the usual case) is told by it, without a look at the
    /// cold strings below (issue 11).
    texts: u64,
    id: Box<str>,
    uuid: Option<Box<str>>,
    pci_bus_id: Option<Box<str>>,
    temperature_c: Option<f64>,
    power_w: Option<f64>,
    ecc_errors: Option<u64>,
    pcie_link_status: Option<Box<str>>,
}

struct Node {
    devices: BTreeMap<String, Device>,
    /// The last document, measured when it arrived (one [`Measure`] per entry of
    /// `last`), while it is still to be judged or while some device is not quiet (each
    /// tick observes it again). A quiet node's is dropped once judged (issue 11: the
    /// parsed document kept for the tick was most of a node's memory, and judging it a
    /// second later a cache miss per field); its next ticks are clean samples without
    /// it, as [`Node::record_quiet`] records them.
    pending: Option<Vec<Measure>>,
    /// The document's bytes while `pending` is kept, so new rules can measure it anew.
    raw: Option<Box<[u8]>>,
    /// Readings of the last document, for each device it listed.
    last: Vec<Last>,
    /// The sources of the last document.
    sources: Vec<SourceReach>,
    /// The document arrived since the last evaluation.
    unseen: bool,
    /// Reachability as published, but for `last_seen` (kept as `last_seen_ms`: a
    /// timestamp formatted for every document was an allocation each).
    reach: AgentReach,
    last_seen_ms: Option<u64>,
    reachable_since_ms: Option<u64>,
    last_eval_ms: Option<u64>,
    changed_ms: u64,
    /// Quiet and not looked at by the ticks since the tick of this number (issue 11:
    /// walking every quiet device every second was a tenth of a replica's CPU). Every
    /// tick after it would have recorded a clean sample for each device, and does so
    /// when the node is next touched ([`Node::settle`]).
    lazy_since_tick: Option<u64>,
    /// [`fnv1a64`] of the name, which decides its shard (issue 11: a shard's document
    /// hashed every node's name to find its own, 5,000 names for each shard written).
    name_hash: u64,
}

/// What an update changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Change {
    /// Nodes whose published entry changed.
    pub nodes: Vec<String>,
    /// Some device turned failed: flush sooner.
    pub urgent: bool,
    /// Nodes where a device turned degraded or failed: their pods are nudged.
    pub alarming: Vec<String>,
}

impl Change {
    fn merge(&mut self, o: Change) {
        self.nodes.extend(o.nodes);
        self.urgent |= o.urgent;
        self.alarming.extend(o.alarming);
    }
}

/// Nodes by name, hashed (issue 11: a lookup in an ordered map of 5,000 names was a
/// dozen cold string comparisons, three times a document; foldhash, randomly seeded).
type Nodes = HashMap<String, Node, foldhash::fast::RandomState>;

/// Every node's devices.
pub struct Pipeline {
    nodes: Nodes,
    /// The nodes the tick looks at: each node not skipped as quiet
    /// ([`Node::lazy_since_tick`] unset), in the order they became so; a name may be
    /// stale (removed, or skipped since), and is then dropped by the next tick (issue
    /// 11: walking 5,000 nodes a second to skip most of them was a tenth of the CPU).
    active: Vec<String>,
    rules: Arc<Rules>,
    metrics: Arc<Metrics>,
    forget_ms: u64,
    max_nodes: usize,
    /// Ticks so far, and the time of the last one (quiet nodes' skipped samples).
    ticks: u64,
    last_tick_ms: Option<u64>,
    /// Reachability or a device's status changed since the gauges were last set.
    counts_stale: bool,
}

/// A device of `n` for a quarantine record, with the UUID and bus id of its last
/// reading; the verdict is the agent's (through this pipeline).
fn record_device(n: &Node, id: &str, reason: String) -> RecordDevice {
    let last = n.last(id);
    RecordDevice {
        uuid: last.and_then(|l| l.uuid.as_deref().map(String::from)),
        pci_bus_id: last.and_then(|l| l.pci_bus_id.as_deref().map(String::from)),
        source: Some("agent".into()),
        ..RecordDevice::new(id, reason)
    }
}

/// A fingerprint of a device entry's texts: its id, UUID, bus id and link status.
fn texts(d: &faultline_common::document::DeviceView<'_>) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(0x2545f4914f6cdd1d).build_hasher();
    d.id.hash(&mut h);
    d.uuid.as_deref().hash(&mut h);
    d.pci_bus_id.as_deref().hash(&mut h);
    d.pcie_link_status.as_deref().hash(&mut h);
    h.finish()
}

/// Each device entry of a document, measured by `rules`, in the document's order.
fn measures(rules: &Rules, doc: &DocView<'_>) -> Vec<Measure> {
    doc.npus.iter().map(|d| rules.measure(Some(d))).collect()
}

impl Node {
    /// The last document's readings of device `id`, if it listed the device.
    fn last(&self, id: &str) -> Option<&Last> {
        self.last.iter().find(|l| &*l.id == id)
    }

    /// Keep the readings and sources of a document. The same devices as last time (the
    /// usual case) are updated in place: no allocation unless a text changed.
    fn remember(&mut self, doc: &DocView<'_>) {
        fn set(slot: &mut Option<Box<str>>, v: Option<&str>) {
            if slot.as_deref() != v {
                *slot = v.map(Box::from);
            }
        }
        let fps: Vec<u64> = doc.npus.iter().map(texts).collect();
        let same = self.last.len() == doc.npus.len()
            && self
                .last
                .iter()
                .zip(&doc.npus)
                .zip(&fps)
                .all(|((l, d), fp)| l.texts == *fp || *l.id == *d.id);
        let same_sources = self.sources.len() == doc.sources.len()
            && self
                .sources
                .iter()
                .zip(&doc.sources)
                .all(|(a, b)| a.name == b.name && a.up == b.up);
        if same {
            for ((l, d), fp) in self.last.iter_mut().zip(&doc.npus).zip(&fps) {
                if l.texts != *fp {
                    set(&mut l.uuid, d.uuid.as_deref());
                    set(&mut l.pci_bus_id, d.pci_bus_id.as_deref());
                    set(&mut l.pcie_link_status, d.pcie_link_status.as_deref());
                    l.texts = *fp;
                }
                l.temperature_c = d.temperature_c;
                l.power_w = d.power_w;
                l.ecc_errors = d.ecc_errors;
            }
        } else {
            let text = |v: &Option<std::borrow::Cow<'_, str>>| v.as_deref().map(Box::from);
            self.last = doc
                .npus
                .iter()
                .zip(&fps)
                .map(|(d, fp)| Last {
                    texts: *fp,
                    id: d.id.as_ref().into(),
                    uuid: text(&d.uuid),
                    pci_bus_id: text(&d.pci_bus_id),
                    temperature_c: d.temperature_c,
                    power_w: d.power_w,
                    ecc_errors: d.ecc_errors,
                    pcie_link_status: text(&d.pcie_link_status),
                })
                .collect();
        }
        if !same_sources {
            self.sources = doc
                .sources
                .iter()
                .map(|s| SourceReach {
                    name: s.name.to_string(),
                    up: s.up,
                })
                .collect();
        }
    }

    /// Judged again, every device would observe a clean sample (so a tick records that
    /// without the work, and the document need not be kept): the agent is
    /// reachable, its last document listed exactly the devices known, and every one
    /// is healthy with quiet windows.
    fn quiet(&self) -> bool {
        self.reach.reachable
            && self.last.len() == self.devices.len()
            && self.devices.values().all(|d| {
                d.state.status == DeviceStatus::Healthy
                    && d.state.soft_since_ms.is_none()
                    && d.windows.quiet()
            })
    }

    /// Record the clean samples of the ticks it skipped while quiet: the ticks after
    /// `lazy_since_tick` up to `ticks`, the last of them at `last_tick_ms`.
    /// Whether the node was skipped (and is now looked at again).
    #[must_use]
    fn settle(&mut self, ticks: u64, last_tick_ms: Option<u64>) -> bool {
        let Some(since) = self.lazy_since_tick.take() else {
            return false;
        };
        let Some(at) = last_tick_ms else {
            return true;
        };
        let skipped = u32::try_from(ticks.saturating_sub(since)).unwrap_or(u32::MAX);
        if skipped == 0 {
            return true;
        }
        self.last_eval_ms = Some(at);
        for d in self.devices.values_mut() {
            d.state.last_fresh_ms = Some(at);
            d.state.clean_streak = d.state.clean_streak.saturating_add(skipped);
        }
        true
    }

    /// A device's state as if the skipped ticks had been recorded.
    fn state_of(&self, d: &Device, ticks: u64, last_tick_ms: Option<u64>) -> DeviceState {
        let mut s = d.state.clone();
        if let (Some(since), Some(at)) = (self.lazy_since_tick, last_tick_ms) {
            let skipped = u32::try_from(ticks.saturating_sub(since)).unwrap_or(u32::MAX);
            if skipped > 0 {
                s.last_fresh_ms = Some(at);
                s.clean_streak = s.clean_streak.saturating_add(skipped);
            }
        }
        s
    }

    /// Record a clean sample for every device, as judging the node would.
    fn record_quiet(&mut self, now_ms: u64) {
        self.last_eval_ms = Some(now_ms);
        for d in self.devices.values_mut() {
            d.state.last_fresh_ms = Some(now_ms);
            d.state.clean_streak = d.state.clean_streak.saturating_add(1);
        }
    }
}

impl Pipeline {
    /// An empty pipeline.
    pub fn new(rules: Arc<Rules>, metrics: Arc<Metrics>) -> Self {
        Pipeline {
            nodes: Nodes::default(),
            active: Vec::new(),
            rules,
            metrics,
            forget_ms: DEFAULT_DEVICE_FORGET_MS,
            max_nodes: MAX_NODES,
            ticks: 0,
            last_tick_ms: None,
            counts_stale: true,
        }
    }

    /// Follow at most `n` nodes (tests; the default is [`MAX_NODES`]).
    pub fn with_max_nodes(mut self, n: usize) -> Self {
        self.max_nodes = n;
        self
    }

    /// Forget devices the reachable agent has not reported for `forget` (issue 10: a
    /// GPU that left, or a device id that changed, must not stay unknown forever).
    pub fn with_device_forget(mut self, forget: std::time::Duration) -> Self {
        self.forget_ms = forget.as_millis() as u64;
        self
    }

    /// (reachable agents, followed agents).
    pub fn reach(&self) -> (usize, usize) {
        (
            self.nodes.values().filter(|n| n.reach.reachable).count(),
            self.nodes.len(),
        )
    }

    /// Use new rules from the next evaluation on (windows keep their samples); every
    /// node whose document is kept is measured and judged again, since the new rules
    /// may see it anew. A quiet node (its document dropped) is judged by them at its
    /// next document.
    pub fn set_rules(&mut self, rules: Arc<Rules>) {
        self.rules = rules;
        for n in self.nodes.values_mut() {
            let Some(raw) = n.raw.as_deref() else {
                continue;
            };
            match DocView::parse(raw) {
                Ok(doc) if doc.npus.len() == n.last.len() => {
                    n.pending = Some(measures(&self.rules, &doc));
                    n.unseen = true;
                }
                _ => {}
            }
        }
    }

    /// Make sure a node is known (discovered before its agent answered). False when it
    /// is new and the pipeline already follows [`MAX_NODES`]: refused, counted.
    pub fn ensure_node(&mut self, node: &str, now_ms: u64) -> bool {
        if self.nodes.contains_key(node) {
            return true;
        }
        if self.nodes.len() >= self.max_nodes {
            self.metrics.node_refused();
            tracing::warn!(
                node,
                max = self.max_nodes,
                "too many nodes: this one is not followed"
            );
            return false;
        }
        self.active.push(node.to_string());
        self.nodes.entry(node.to_string()).or_insert_with(|| Node {
            devices: BTreeMap::new(),
            pending: None,
            raw: None,
            last: Vec::new(),
            sources: Vec::new(),
            unseen: false,
            reach: AgentReach {
                reachable: false,
                last_seen: None,
                error: Some("not polled yet".into()),
                sources: Vec::new(),
            },
            last_seen_ms: None,
            reachable_since_ms: None,
            last_eval_ms: None,
            changed_ms: now_ms,
            lazy_since_tick: None,
            name_hash: fnv1a64(node.as_bytes()),
        });
        self.counts_stale = true;
        true
    }

    /// Seed a node of a shard just taken from what its last holder published (issue
    /// 11): each device's status, reason and since, windows empty, fresh as of now so
    /// the rules about missing data count from the takeover. A node already followed
    /// (fresher than any document) is left as it is. The number of devices seeded.
    pub fn seed(&mut self, faults: &NodeFaults, now_ms: u64) -> usize {
        if self.nodes.contains_key(&faults.node) || !self.ensure_node(&faults.node, now_ms) {
            return 0;
        }
        self.counts_stale = true;
        let node = self.nodes.get_mut(&faults.node).expect("just ensured");
        node.reach = AgentReach {
            sources: Vec::new(),
            last_seen: None,
            ..faults.agent.clone()
        };
        node.last_seen_ms = faults
            .agent
            .last_seen
            .as_deref()
            .and_then(faultline_common::time::parse_rfc3339_ms);
        node.changed_ms =
            faultline_common::time::parse_rfc3339_ms(&faults.timestamp).unwrap_or(now_ms);
        for d in &faults.npus {
            let since_ms = faultline_common::time::parse_rfc3339_ms(&d.since).unwrap_or(now_ms);
            let mut state = DeviceState::new(since_ms);
            state.status = d.status;
            state.reason = d.reason.clone();
            state.last_fresh_ms = Some(now_ms);
            if d.status == DeviceStatus::Degraded {
                state.soft_since_ms = Some(since_ms);
            }
            node.devices.insert(
                d.id.clone(),
                Device {
                    windows: DeviceWindows::default(),
                    state,
                    clean: d.status == DeviceStatus::Healthy,
                    reported_ms: now_ms,
                },
            );
        }
        faults.npus.len()
    }

    /// Forget a node (it left the cluster or the shard).
    pub fn remove_node(&mut self, node: &str) -> bool {
        self.counts_stale = true;
        self.nodes.remove(node).is_some()
    }

    /// Names of the known nodes, sorted.
    pub fn node_names(&self) -> impl Iterator<Item = &String> {
        let mut names: Vec<&String> = self.nodes.keys().collect();
        names.sort_unstable();
        names.into_iter()
    }

    /// An agent answered with its document.
    pub fn on_document(&mut self, doc: NodeHealth, now_ms: u64) -> Change {
        let raw = serde_json::to_vec(&doc).unwrap_or_default();
        match DocView::parse(&raw) {
            Ok(view) => self.on_view(&view, &raw, now_ms),
            Err(_) => Change::default(),
        }
    }

    /// An agent's document, read (and checked) from `raw`, its bytes, which are kept
    /// while the node is not quiet, for a rules reload.
    pub fn on_view(&mut self, doc: &DocView<'_>, raw: &[u8], now_ms: u64) -> Change {
        let name: &str = &doc.node;
        let hard = doc.npus.iter().any(|d| d.status == DeviceStatus::Failed);
        // One lookup for a known node.
        let node = match self.nodes.get_mut(name) {
            Some(n) => n,
            None => {
                if !self.ensure_node(name, now_ms) {
                    return Change::default();
                }
                self.nodes.get_mut(name).expect("just ensured")
            }
        };
        let was_skipped = node.settle(self.ticks, self.last_tick_ms);
        let reach_changed = !node.reach.reachable;
        self.counts_stale |= reach_changed;
        node.reach.reachable = true;
        node.reach.error = None;
        node.last_seen_ms = Some(now_ms);
        if reach_changed {
            node.reachable_since_ms = Some(now_ms);
            node.changed_ms = now_ms;
        }
        node.remember(doc);
        node.pending = Some(measures(&self.rules, doc));
        node.unseen = true;
        let due = node
            .last_eval_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= MIN_EVAL_SPACING_MS);
        let before = node.devices.len();
        let mut change = if due || hard {
            let (rules, metrics) = (&self.rules, &self.metrics);
            Self::judge(node, name, now_ms, rules, metrics, self.forget_ms)
        } else {
            Change::default()
        };
        self.counts_stale |= !change.nodes.is_empty() || node.devices.len() != before;
        let next_tick_too_soon = self
            .last_tick_ms
            .is_some_and(|t| now_ms.saturating_sub(t) + MIN_EVAL_SPACING_MS > TICK_MS);
        if !node.unseen && next_tick_too_soon && node.quiet() {
            // Judged now, quiet, and the next tick (due a second after the last) comes
            // within the spacing of this document, so it is no sample for the node:
            // skipped by the ticks from the one after it on, without a visit (issue 11:
            // put back on the ticks' list, a name copied and looked up by the next tick
            // only to be found quiet, a tenth of a replica's CPU). A tick that comes late
            // would have been a sample and is not: one clean sample fewer, never one
            // more (stricter). A document just after a tick is left to the next tick,
            // which judges whether it is a sample.
            node.lazy_since_tick = Some(self.ticks + 1);
        } else if was_skipped {
            self.active.push(name.to_string());
        }
        // Kept for the ticks: the bytes too, so that new rules can measure it again.
        node.raw = node.pending.as_ref().map(|_| Box::from(raw));
        if reach_changed && !change.nodes.iter().any(|n| n == name) {
            change.nodes.push(name.to_string());
        }
        change
    }

    /// An agent could not be reached.
    pub fn on_unreachable(&mut self, node: &str, error: &str, now_ms: u64) -> Change {
        if !self.ensure_node(node, now_ms) {
            return Change::default();
        }
        let n = self.nodes.get_mut(node).expect("just ensured");
        if n.settle(self.ticks, self.last_tick_ms) {
            self.active.push(node.to_string());
        }
        let was = n.reach.reachable;
        // A new reason is news too: a node never reached yet ("not polled yet") that
        // is refused says why in the next write, not at the next heartbeat. The same
        // reason again (a retry that fails alike) is not.
        let reason_changed = n.reach.error.as_deref() != Some(error);
        self.counts_stale |= was;
        n.reach.reachable = false;
        if reason_changed {
            n.reach.error = Some(error.to_string());
        }
        n.reachable_since_ms = None;
        // The last readings stay; the document is no longer evaluated.
        n.pending = None;
        n.raw = None;
        if was || reason_changed {
            n.changed_ms = now_ms;
            Change {
                nodes: vec![node.to_string()],
                ..Default::default()
            }
        } else {
            Change::default()
        }
    }

    /// The once-a-second look at every node not evaluated within the last second. A
    /// quiet node is recorded once and then skipped ([`Node::lazy_since_tick`]) until
    /// it is touched again; the gauges are set again only when some count changed.
    pub fn tick(&mut self, now_ms: u64) -> Change {
        let (rules, metrics, forget) = (self.rules.clone(), self.metrics.clone(), self.forget_ms);
        // A skipped node counts every tick after its last as a sample; a tick closer to
        // the last than the spacing would not be one for it. Ticks are a second apart
        // (tokio's interval, delayed when late), so this is for tests and clock jumps:
        // every skipped node is brought up to date first, and this tick is judged as
        // usual.
        if self
            .last_tick_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < MIN_EVAL_SPACING_MS)
        {
            for (name, n) in self.nodes.iter_mut() {
                if n.settle(self.ticks, self.last_tick_ms) {
                    self.active.push(name.clone());
                }
            }
        }
        self.ticks += 1;
        self.last_tick_ms = Some(now_ms);
        let mut change = Change::default();
        let mut active = std::mem::take(&mut self.active);
        active.retain(|name| {
            // Gone, or skipped already (a name listed twice): no longer looked at.
            let Some(node) = self.nodes.get_mut(name.as_str()) else {
                return false;
            };
            if node.lazy_since_tick.is_some() {
                return false;
            }
            let due = node
                .last_eval_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= MIN_EVAL_SPACING_MS);
            if !node.unseen && node.quiet() {
                // Judged again it would be the same: a clean sample each, without the
                // work, and the next ticks' samples when it is next touched. Judged less
                // than the spacing ago (a document between ticks), this tick is no
                // sample for it and every later one is (the first check of this
                // function settles skipped nodes before a tick that comes too soon):
                // skipped from now on all the same (issue 11: it was looked up again at
                // the next tick only to be found quiet, a second lookup per document).
                if due {
                    node.record_quiet(now_ms);
                }
                node.lazy_since_tick = Some(self.ticks);
                return false;
            }
            if !due {
                return true;
            }
            let before = node.devices.len();
            let c = Self::judge(node, name, now_ms, &rules, &metrics, forget);
            self.counts_stale |= !c.nodes.is_empty() || node.devices.len() != before;
            change.merge(c);
            true
        });
        self.active = active;
        if std::mem::take(&mut self.counts_stale) {
            let (reachable, total) = self.reach();
            self.metrics.set_agents(reachable, total);
            self.metrics.set_devices(&self.summary());
        }
        change
    }

    /// Judge one node: each device's windows observe its entry of the document (or its
    /// absence) and the state machine steps. Never called for a quiet node whose
    /// document was dropped: the tick records its clean samples instead.
    fn judge(
        node: &mut Node,
        name: &str,
        now_ms: u64,
        rules: &Rules,
        metrics: &Metrics,
        forget: u64,
    ) -> Change {
        node.last_eval_ms = Some(now_ms);
        node.unseen = false;
        let Node {
            devices,
            pending,
            last,
            reach,
            changed_ms,
            ..
        } = node;
        // Only a reachable agent's document is evidence.
        let measured = pending.as_deref().filter(|_| reach.reachable);
        let mut forgotten = false;
        // The same devices as known, in the same order (the usual case): reported now.
        let same = measured.is_some()
            && last.len() == devices.len()
            && devices.keys().zip(last.iter()).all(|(id, l)| **id == *l.id);
        if same {
            for d in devices.values_mut() {
                d.reported_ms = now_ms;
            }
        } else if measured.is_some() {
            for l in last.iter() {
                // Known devices (all but a new one's first document) are not keyed anew.
                match devices.get_mut(&*l.id) {
                    Some(known) => known.reported_ms = now_ms,
                    None => {
                        devices.insert(
                            l.id.to_string(),
                            Device {
                                windows: DeviceWindows::default(),
                                state: DeviceState::new(now_ms),
                                clean: false,
                                reported_ms: now_ms,
                            },
                        );
                    }
                }
            }
            // A device the reachable agent has not reported for the forget time has
            // left the node: dropped, never unknown. (While the agent is unreachable
            // nothing is forgotten: that blindness is what the unknown guard is for.)
            let before = devices.len();
            devices.retain(|id, dev| {
                let keep = now_ms.saturating_sub(dev.reported_ms) < forget;
                if !keep {
                    tracing::info!(node = name, device = %id, "device not reported for the forget time: forgotten");
                }
                keep
            });
            if devices.len() != before {
                metrics.devices_forgotten(before - devices.len());
                *changed_ms = now_ms;
                forgotten = true;
            }
        }
        let mut change = Change::default();
        if forgotten {
            change.nodes.push(name.to_string());
        }
        // Devices the agent reports, and devices we knew that it no longer reports. Both
        // are sorted by id (the agent sorts its list), so the entry is usually the one
        // at the cursor.
        let mut cursor = 0;
        for (id, dev) in devices.iter_mut() {
            let entry = measured.and_then(|m| {
                let at = match last.get(cursor) {
                    Some(l) if *l.id == **id => cursor,
                    _ => last.iter().position(|l| *l.id == **id)?,
                };
                cursor = at + 1;
                m.get(at)
            });
            let obs = match entry {
                Some(m) => dev.windows.apply(m, rules),
                None => faultline_common::state::Observation::Missing,
            };
            dev.clean = obs == faultline_common::state::Observation::Clean;
            let next = step(&dev.state, &obs, now_ms, &rules.state_machine);
            if next.status != dev.state.status || next.reason != dev.state.reason {
                if next.status != dev.state.status {
                    metrics.transition(next.status, next.reason.as_deref().unwrap_or("clean"));
                    tracing::info!(
                        node = name, device = %id, from = dev.state.status.as_str(),
                        to = next.status.as_str(), reason = ?next.reason, "device state changed"
                    );
                    change.urgent |= next.status == DeviceStatus::Failed;
                    if matches!(next.status, DeviceStatus::Failed | DeviceStatus::Degraded)
                        && !change.alarming.iter().any(|n| n == name)
                    {
                        change.alarming.push(name.to_string());
                    }
                }
                if change.nodes.is_empty() {
                    change.nodes.push(name.to_string());
                }
                *changed_ms = now_ms;
            }
            dev.state = next;
        }
        if node.quiet() {
            // Its bytes too (issue 11: a document deferred to the tick kept its copy
            // until the next one came, about 3 KiB a node).
            node.pending = None;
            node.raw = None;
        }
        change
    }

    /// The published entry of one node.
    pub fn node_faults(&self, name: &str) -> Option<NodeFaults> {
        self.nodes.get(name).map(|n| Self::faults(name, n))
    }

    /// The published entries of the nodes of shard `shard` of `shards` (every node
    /// with 1), in no order.
    pub fn shard_faults(
        &self,
        shard: u32,
        shards: u32,
    ) -> impl Iterator<Item = (&String, NodeFaults)> {
        self.nodes
            .iter()
            .filter(move |(_, n)| shards <= 1 || shard_of_hash(n.name_hash, shards) == shard)
            .map(|(name, n)| (name, Self::faults(name, n)))
    }

    /// The published entry of node `name`.
    fn faults(name: &str, n: &Node) -> NodeFaults {
        let npus: Vec<NpuFault> = n
            .devices
            .iter()
            .map(|(id, d)| {
                // Readings from the last document, if it listed the device.
                let last = n.last(id);
                let text = |f: fn(&Last) -> &Option<Box<str>>| {
                    last.and_then(|l| f(l).as_deref().map(String::from))
                };
                NpuFault {
                    id: id.clone(),
                    status: d.state.status,
                    reason: d.state.reason.clone(),
                    since: rfc3339(d.state.since_ms),
                    temperature_c: last.and_then(|l| l.temperature_c),
                    power_w: last.and_then(|l| l.power_w),
                    ecc_errors: last.and_then(|l| l.ecc_errors),
                    pcie_link_status: text(|l| &l.pcie_link_status),
                    uuid: text(|l| &l.uuid),
                    pci_bus_id: text(|l| &l.pci_bus_id),
                }
            })
            .collect();
        NodeFaults {
            version: FAULT_VERSION.into(),
            timestamp: rfc3339(n.changed_ms),
            node: name.to_string(),
            agent: AgentReach {
                sources: n.sources.clone(),
                last_seen: n.last_seen_ms.map(rfc3339),
                ..n.reach.clone()
            },
            summary: FaultSummary::of(npus.iter().map(|d| &d.status)),
            npus,
        }
    }

    /// The failed devices of a node, for its quarantine record.
    pub fn failed_devices(&self, name: &str) -> Vec<RecordDevice> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        n.devices
            .iter()
            .filter(|(_, d)| d.state.status == DeviceStatus::Failed)
            .map(|(id, d)| record_device(n, id, d.state.reason.clone().unwrap_or_default()))
            .collect()
    }

    /// The devices of a node unknown for at least `tolerance_ms` (none failed: a failed
    /// device is isolation's business).
    pub fn unknown_devices(&self, name: &str, tolerance_ms: u64, now_ms: u64) -> Vec<RecordDevice> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        if n.devices
            .values()
            .any(|d| d.state.status == DeviceStatus::Failed)
        {
            return Vec::new();
        }
        n.devices
            .iter()
            .filter(|(_, d)| {
                d.state.status == DeviceStatus::Unknown
                    && now_ms.saturating_sub(d.state.since_ms) >= tolerance_ms
            })
            .map(|(id, d)| {
                record_device(
                    n,
                    id,
                    d.state.reason.clone().unwrap_or_else(|| "unknown".into()),
                )
            })
            .collect()
    }

    /// What a release decision needs to know of a node's devices: state, clean streak
    /// and since when, with the identities a record may name them by.
    pub fn device_views(&self, name: &str) -> Vec<DeviceView> {
        let Some(n) = self.nodes.get(name) else {
            return Vec::new();
        };
        n.devices
            .iter()
            .map(|(id, d)| DeviceView {
                device: record_device(n, id, d.state.reason.clone().unwrap_or_default()),
                status: d.state.status,
                clean_streak: n.state_of(d, self.ticks, self.last_tick_ms).clean_streak,
                since_ms: d.state.since_ms,
            })
            .collect()
    }

    /// The agent-side id of a device known by UUID or bus id, if the node reports it.
    pub fn device_id(&self, node: &str, key: &str) -> Option<String> {
        self.device_views(node)
            .into_iter()
            .find(|v| v.device.is(key))
            .map(|v| v.device.id)
    }

    /// Counts over every device.
    pub fn summary(&self) -> FaultSummary {
        FaultSummary::of(
            self.nodes
                .values()
                .flat_map(|n| n.devices.values().map(|d| &d.state.status)),
        )
    }

    /// The state of one device (tests and the API).
    pub fn device_state(&self, node: &str, device: &str) -> Option<DeviceState> {
        let n = self.nodes.get(node)?;
        let d = n.devices.get(device)?;
        Some(n.state_of(d, self.ticks, self.last_tick_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::classify::Finding;
    use faultline_common::{DeviceHealth, DeviceReading, Summary, Vendor, SCHEMA_VERSION};

    fn doc(node: &str, devs: Vec<DeviceHealth>) -> NodeHealth {
        NodeHealth {
            schema_version: SCHEMA_VERSION.into(),
            generation: 1,
            timestamp: String::new(),
            node: node.into(),
            agent_version: "test".into(),
            summary: Summary::of(&devs),
            npus: devs,
            sources: vec![],
            unattributed_xids: vec![],
        }
    }

    fn dev(id: &str, temp: f64, failed: Option<&str>) -> DeviceHealth {
        let mut r = DeviceReading::new(id, Vendor::Nvidia, "sim");
        r.temperature_c = Some(temp);
        DeviceHealth {
            reading: r,
            status: if failed.is_some() {
                DeviceStatus::Failed
            } else {
                DeviceStatus::Healthy
            },
            reason: failed.map(String::from),
            findings: failed
                .map(|c| {
                    vec![Finding {
                        code: c.into(),
                        status: DeviceStatus::Failed,
                        detail: String::new(),
                    }]
                })
                .unwrap_or_default(),
            ecc_errors: Some(0),
            pcie_link_status: Some("up".into()),
            sampled_at: None,
            sample_age_ms: Some(1),
            recent_xids: vec![],
        }
    }

    fn pipeline() -> Pipeline {
        Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()))
    }

    #[test]
    fn a_hard_fault_fails_at_once_even_between_ticks() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 1_000);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Healthy
        );
        // 100 ms later, a hard fault: evaluated at once and marked urgent.
        let c = p.on_document(doc("n1", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 1_100);
        assert!(c.urgent);
        assert_eq!(c.nodes, vec!["n1".to_string()]);
        let s = p.device_state("n1", "gpu0").unwrap();
        assert_eq!(
            (s.status, s.reason.as_deref()),
            (DeviceStatus::Failed, Some("gpu-lost"))
        );
        let f = p.node_faults("n1").unwrap();
        assert_eq!(f.summary.failed, 1);
        assert_eq!(f.npus[0].since, rfc3339(1_100));
    }

    #[test]
    fn documents_faster_than_once_a_second_count_once() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 0);
        // Ten clean documents within one second are one sample, not ten.
        for i in 1..=10 {
            p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), i * 50);
        }
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Failed
        );
        for t in 1..=5 {
            p.tick(t * 1_000);
        }
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Healthy
        );
    }

    #[test]
    fn an_unreachable_agent_turns_devices_unknown_after_the_grace_never_failed() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
        p.on_unreachable("n1", "connection refused", 500);
        for t in 1..=29 {
            p.tick(t * 1_000);
        }
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Healthy
        );
        p.tick(30_000);
        let f = p.node_faults("n1").unwrap();
        assert_eq!(f.npus[0].status, DeviceStatus::Unknown);
        assert!(!f.agent.reachable);
        assert_eq!(f.agent.error.as_deref(), Some("connection refused"));
        for t in 31..=400 {
            p.tick(t * 1_000);
        }
        assert_eq!(p.summary().failed, 0);
    }

    /// A node that was never reached publishes why as soon as it is known, and again
    /// when the reason changes; the same failure again is no change (no write per
    /// retry). CI caught the first: an agent refused before its node was known was
    /// published only at the next heartbeat.
    #[test]
    fn a_new_reason_for_an_unreachable_agent_is_a_change_the_same_one_is_not() {
        let mut p = pipeline();
        assert_eq!(
            p.on_unreachable("n1", "identity mismatch", 500).nodes,
            ["n1"]
        );
        assert_eq!(
            p.node_faults("n1").unwrap().agent.error.as_deref(),
            Some("identity mismatch")
        );
        assert!(p
            .on_unreachable("n1", "identity mismatch", 700)
            .nodes
            .is_empty());
        assert_eq!(
            p.on_unreachable("n1", "connection refused", 900).nodes,
            ["n1"]
        );
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 1_000);
        assert_eq!(
            p.on_unreachable("n1", "connection refused", 1_500).nodes,
            ["n1"]
        );
    }

    /// Issue 11: a quiet node's document is dropped once judged; its ticks are still
    /// clean samples (never missing ones), and what is published keeps its readings.
    /// A node with a device not healthy keeps its document for the next ticks.
    #[test]
    fn a_quiet_nodes_document_is_dropped_and_its_readings_kept() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 41.5, None)]), 0);
        assert!(p.nodes["n1"].pending.is_none(), "judged quiet: dropped");
        for t in 1..=120 {
            p.tick(t * 1_000);
        }
        let s = p.device_state("n1", "gpu0").unwrap();
        assert_eq!(s.status, DeviceStatus::Healthy);
        assert!(s.clean_streak >= 120, "{}", s.clean_streak);
        let f = p.node_faults("n1").unwrap();
        assert_eq!(f.npus[0].temperature_c, Some(41.5));
        assert_eq!(f.npus[0].pcie_link_status.as_deref(), Some("up"));
        // The same devices again: readings updated in place, a changed text too.
        let mut d = dev("gpu0", 47.0, None);
        d.pcie_link_status = Some("down".into());
        p.on_document(doc("n1", vec![d]), 121_500);
        let f = p.node_faults("n1").unwrap();
        assert_eq!(f.npus[0].temperature_c, Some(47.0));
        assert_eq!(f.npus[0].pcie_link_status.as_deref(), Some("down"));
        // A document within a second of the last evaluation waits for the tick, bytes
        // and all; judged quiet there, both are dropped.
        p.on_document(doc("n1", vec![dev("gpu0", 46.0, None)]), 122_000);
        assert!(p.nodes["n1"].pending.is_some() && p.nodes["n1"].raw.is_some());
        p.tick(122_600);
        assert!(p.nodes["n1"].pending.is_none(), "judged quiet: dropped");
        assert!(p.nodes["n1"].raw.is_none(), "its bytes too");
        p.on_document(doc("n2", vec![dev("gpu0", 40.0, Some("gpu-lost"))]), 0);
        assert!(p.nodes["n2"].pending.is_some(), "not quiet: kept");
        assert!(p.nodes["n2"].raw.is_some(), "its bytes too, for new rules");
        // Unreachable: nothing to judge; the readings stay.
        p.on_unreachable("n2", "down", 500);
        assert!(p.nodes["n2"].pending.is_none());
        assert_eq!(
            p.node_faults("n2").unwrap().npus[0].temperature_c,
            Some(40.0)
        );
    }

    /// A shard's entries are those of the nodes [`shard_of`] puts in it, each as
    /// [`Pipeline::node_faults`] has it (the kept hash decides as the name would).
    #[test]
    fn a_shards_entries_are_its_nodes() {
        use faultline_common::fault::shard_of;
        let mut p = pipeline();
        let names: Vec<String> = (0..200)
            .map(|i| format!("node-{i}.rack-{}", i % 7))
            .collect();
        for n in &names {
            p.on_document(doc(n, vec![dev("gpu0", 40.0, None)]), 1_000);
        }
        for shards in [1, 2, 7, 32] {
            let mut all = Vec::new();
            for shard in 0..shards {
                let mut got: Vec<String> = p
                    .shard_faults(shard, shards)
                    .map(|(name, f)| {
                        assert_eq!(f, p.node_faults(name).unwrap());
                        name.clone()
                    })
                    .collect();
                got.sort();
                let mut want: Vec<String> = names
                    .iter()
                    .filter(|n| shard_of(n, shards) == shard)
                    .cloned()
                    .collect();
                want.sort();
                assert_eq!(got, want, "shard {shard} of {shards}");
                all.extend(got);
            }
            assert_eq!(all.len(), names.len());
        }
    }

    /// Issue 10, finding 1: the nodes followed are capped; past the cap a new node's
    /// documents change nothing, and known nodes go on.
    #[test]
    fn nodes_past_the_cap_are_refused() {
        let mut p = pipeline().with_max_nodes(2);
        for n in ["a", "b", "c"] {
            p.on_document(doc(n, vec![dev("gpu0", 40.0, None)]), 1_000);
        }
        assert_eq!(p.node_names().cloned().collect::<Vec<_>>(), ["a", "b"]);
        assert!(p.on_unreachable("d", "down", 2_000).nodes.is_empty());
        assert!(!p
            .on_document(
                doc("a", vec![dev("gpu0", 40.0, Some("row-remap-failure"))]),
                3_000
            )
            .nodes
            .is_empty());
    }

    /// Issue 10, finding 7: a device its reachable agent stops reporting is forgotten
    /// after the forget time (never unknown for ever); while the agent is unreachable
    /// nothing is forgotten.
    #[test]
    fn devices_no_longer_reported_are_forgotten() {
        let mut p = pipeline().with_device_forget(std::time::Duration::from_secs(60));
        p.on_document(
            doc("n1", vec![dev("gpu0", 40.0, None), dev("gpu1", 40.0, None)]),
            1_000,
        );
        // gpu1 disappears; the agent keeps answering.
        let mut t = 2_000;
        while t < 60_000 {
            p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), t);
            t += 1_000;
        }
        assert!(
            p.device_state("n1", "gpu1").is_some(),
            "kept within the forget time"
        );
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 61_500);
        assert!(p.device_state("n1", "gpu1").is_none(), "forgotten");
        assert!(p.unknown_devices("n1", 0, 61_500).is_empty());
        // An unreachable agent's devices stay, however long.
        p.on_unreachable("n1", "down", 62_000);
        p.tick(62_000 + 3_600_000);
        assert!(p.device_state("n1", "gpu0").is_some());
    }

    #[test]
    fn a_device_missing_from_the_document_is_not_a_fault() {
        let mut p = pipeline();
        p.on_document(
            doc("n1", vec![dev("gpu0", 40.0, None), dev("gpu1", 40.0, None)]),
            0,
        );
        for t in 1..=60 {
            p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), t * 1_000);
        }
        assert_eq!(
            p.device_state("n1", "gpu1").unwrap().status,
            DeviceStatus::Unknown
        );
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Healthy
        );
    }

    #[test]
    fn skipping_quiet_nodes_changes_no_outcome() {
        // The same history through the pipeline, with documents now and then: the
        // states must match what evaluating every tick in full gives (the state
        // machine run by hand below).
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
        for t in 1..=10 {
            p.tick(t * 1_000);
        }
        let s = p.device_state("n1", "gpu0").unwrap();
        assert_eq!(s.status, DeviceStatus::Healthy);
        assert_eq!(
            s.last_fresh_ms,
            Some(10_000),
            "quiet ticks still count as fresh samples"
        );
        assert_eq!(s.clean_streak, 11);
        // Unreachable after that: unknown 30 s after the last fresh sample, not earlier.
        p.on_unreachable("n1", "gone", 10_500);
        for t in 11..=39 {
            p.tick(t * 1_000);
        }
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Healthy
        );
        p.tick(40_000);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().status,
            DeviceStatus::Unknown
        );
    }

    /// Issue 11: a quiet node is skipped by the ticks and its samples recorded when it
    /// is next read or touched; the streak and freshness are what recording every due
    /// tick gives, also when ticks come closer together than the spacing (a tick within
    /// 900 ms of a node's last sample is no sample for it).
    #[test]
    fn skipped_ticks_count_as_recorded_ones() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
        // Due ticks at 1 s, 2 s, 3 s; 3.5 s is within 900 ms of the last recorded
        // sample, 4.4 s is not; 4.5 s is again within, 5.5 s is due.
        let streak = |p: &Pipeline| p.device_state("n1", "gpu0").unwrap().clean_streak;
        for (t, want) in [
            (1_000, 2),
            (2_000, 3),
            (3_000, 4),
            (3_500, 4),
            (4_400, 5),
            (4_500, 5),
            (5_500, 6),
        ] {
            p.tick(t);
            assert_eq!(streak(&p), want, "at {t} ms");
        }
        let s = p.device_state("n1", "gpu0").unwrap();
        assert_eq!(s.last_fresh_ms, Some(5_500));
        assert!(
            p.nodes["n1"].lazy_since_tick.is_some(),
            "skipped while quiet"
        );
        // A document between ticks brings it up to date before it is judged; judged
        // quiet 1.1 s after the last tick, it is skipped at once (the next tick, at 7 s
        // here, is within 900 ms of it): not put back on the ticks' list.
        p.on_document(doc("n1", vec![dev("gpu0", 41.0, None)]), 6_600);
        assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
        assert_eq!(streak(&p), 7);
        assert_eq!(
            p.device_views("n1")[0].clean_streak,
            7,
            "release decisions see the same streak"
        );
        // 7 s is within 900 ms of the document: no sample, and skipped from there on
        // (not looked at again by the next tick); 8 s to 20 s are 13 samples.
        p.tick(7_000);
        assert_eq!(streak(&p), 7);
        assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
        for t in 8..=20 {
            p.tick(t * 1_000);
        }
        assert_eq!(streak(&p), 20);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
            Some(20_000)
        );
        // The same with a tick that comes too soon after the one that skipped it.
        p.on_document(doc("n1", vec![dev("gpu0", 42.0, None)]), 20_950);
        assert_eq!(streak(&p), 21);
        p.tick(21_000);
        assert!(p.nodes["n1"].lazy_since_tick.is_some());
        p.tick(21_300);
        assert_eq!(streak(&p), 21, "21.3 s is within 900 ms of the document");
        p.tick(22_000);
        assert_eq!(streak(&p), 22);
        // Unreachable: the skipped samples are kept, and no fresh one is added after.
        p.on_unreachable("n1", "gone", 22_500);
        assert_eq!(streak(&p), 22);
        p.tick(23_000);
        p.tick(24_000);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
            Some(22_000)
        );
    }

    /// Issue 11: a quiet node judged at its document is skipped at once when the next
    /// tick is within the spacing of the document; a document just after a tick is
    /// left to the next tick, which is a sample for it.
    #[test]
    fn a_document_just_after_a_tick_is_left_to_the_next() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
        let streak = |p: &Pipeline| p.device_state("n1", "gpu0").unwrap().clean_streak;
        for t in 1..=3 {
            p.tick(t * 1_000);
        }
        assert_eq!(streak(&p), 4);
        // 50 ms after the tick at 3 s, its last sample: not judged yet, left to the
        // next tick (on its list), which is a sample.
        p.on_document(doc("n1", vec![dev("gpu0", 41.0, None)]), 3_050);
        assert!(p.nodes["n1"].lazy_since_tick.is_none() && p.active.len() == 1);
        assert_eq!(streak(&p), 4);
        p.tick(4_000);
        assert_eq!(streak(&p), 5, "judged at the tick");
        p.tick(5_000);
        p.tick(6_000);
        assert_eq!(streak(&p), 7);
        assert!(p.nodes["n1"].lazy_since_tick.is_some());
        // 950 ms after the tick at 6 s: judged now, and the tick at 7 s is within
        // 900 ms of it, so no sample: skipped at once, off the list, and the ticks
        // after it count.
        p.on_document(doc("n1", vec![dev("gpu0", 42.0, None)]), 6_950);
        assert!(p.nodes["n1"].lazy_since_tick.is_some() && p.active.is_empty());
        assert_eq!(streak(&p), 8);
        p.tick(7_000);
        assert_eq!(streak(&p), 8, "7 s is 50 ms after the document");
        for t in 8..=10 {
            p.tick(t * 1_000);
        }
        assert_eq!(streak(&p), 11);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().last_fresh_ms,
            Some(10_000)
        );
    }

    #[test]
    fn sustained_heat_degrades_after_the_window_and_the_hold() {
        let mut p = pipeline();
        p.on_document(doc("n1", vec![dev("gpu0", 40.0, None)]), 0);
        let mut t = 0;
        while p.device_state("n1", "gpu0").unwrap().status == DeviceStatus::Healthy {
            t += 1_000;
            assert!(t < 120_000, "never degraded");
            p.on_document(doc("n1", vec![dev("gpu0", 95.0, None)]), t);
        }
        // 3 of 5 samples over 85 C from the third hot sample, then held 60 s.
        assert_eq!(t, 63_000);
        assert_eq!(
            p.device_state("n1", "gpu0").unwrap().reason.as_deref(),
            Some("high-temp")
        );
    }
}
