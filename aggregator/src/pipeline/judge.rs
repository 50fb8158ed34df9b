//! The pipeline itself: every followed node's devices, each sample judged by the
//! windows, the rules and the state machine on the tick or at once (a hard fault), the
//! nodes capped and forgotten as the module's doc says.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use faultline_common::document::DocView;
use faultline_common::fault::{fnv1a64, AgentReach, NodeFaults};
use faultline_common::rules::{DeviceWindows, Rules};
use faultline_common::state::{step, DeviceState};
use faultline_common::DeviceStatus;

use crate::metrics::Metrics;

use super::node::{measures, Device, Node, NEW_ID_WINDOW_MS};

/// Evaluations closer together than this are merged into the next tick.
pub const MIN_EVAL_SPACING_MS: u64 = 900;

/// The time between two ticks ([`Pipeline::tick`], once a second by the core loop).
pub const TICK_MS: u64 = 1000;

/// Nodes followed at most: past it a new node is refused, logged and counted
/// (the 20,000-node target with room to spare).
pub const MAX_NODES: usize = 50_000;

/// How long a device its reachable agent no longer reports is kept (`--device-forget`).
pub const DEFAULT_DEVICE_FORGET_MS: u64 = 3_600_000;

/// What an update changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Change {
    /// Nodes whose published entry changed.
    pub nodes: Vec<String>,
    /// Some device turned failed: flush sooner.
    pub urgent: bool,
    /// Nodes where a device turned degraded or failed: their pods are nudged.
    pub alarming: Vec<String>,
    /// Nodes whose agent carried a new drain acknowledgement: their pass runs now.
    pub drain_acked: Vec<String>,
}

impl Change {
    fn merge(&mut self, o: Change) {
        self.nodes.extend(o.nodes);
        self.urgent |= o.urgent;
        self.alarming.extend(o.alarming);
        self.drain_acked.extend(o.drain_acked);
    }
}

/// Nodes by name, hashed (a lookup in an ordered map of 5,000 names was a
/// dozen cold string comparisons, three times a document; foldhash, randomly seeded).
type Nodes = HashMap<String, Node, foldhash::fast::RandomState>;

/// Every node's devices.
pub struct Pipeline {
    pub(super) nodes: Nodes,
    /// The nodes the tick looks at: each node not skipped as quiet
    /// ([`Node::lazy_since_tick`] unset), in the order they became so; a name may be
    /// stale (removed, or skipped since), and is then dropped by the next tick
    /// (walking 5,000 nodes a second to skip most of them was a tenth of the CPU).
    active: Vec<String>,
    rules: Arc<Rules>,
    pub(super) metrics: Arc<Metrics>,
    forget_ms: u64,
    max_nodes: usize,
    /// Ticks so far, and the time of the last one (quiet nodes' skipped samples).
    pub(super) ticks: u64,
    pub(super) last_tick_ms: Option<u64>,
    /// Reachability or a device's status changed since the gauges were last set.
    counts_stale: bool,
    /// Which node reported each GPU UUID first.
    pub(super) uuids: super::uuids::UuidClaims,
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
            uuids: super::uuids::UuidClaims::default(),
        }
    }

    /// Follow at most `n` nodes (tests; the default is [`MAX_NODES`]).
    pub fn with_max_nodes(mut self, n: usize) -> Self {
        self.max_nodes = n;
        self
    }

    /// Forget devices the reachable agent has not reported for `forget` (a
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
            churn: (0, 0),
            refused_logged_ms: None,
            uuid_logged_ms: None,
            drain: None,
        });
        self.counts_stale = true;
        true
    }

    /// Seed a node of a shard just taken from what its last holder published:
    /// each device's status, reason and since, windows empty, fresh as of now so
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
        // Its drain intents stay published until this holder's pass reads the record.
        let marks: Vec<_> = faults
            .npus
            .iter()
            .filter_map(|d| Some((d.id.clone(), d.quarantine.clone()?)))
            .collect();
        if !faults.drain.is_empty() || !marks.is_empty() {
            node.drain = Some(Box::new(super::node::NodeDrain {
                notices: faults.drain.clone(),
                acks: Vec::new(),
                marks,
            }));
        }
        faults.npus.len()
    }

    /// Forget a node (it left the cluster or the shard).
    pub fn remove_node(&mut self, node: &str) -> bool {
        self.counts_stale = true;
        match self.nodes.remove(node) {
            Some(n) => {
                self.uuids.release(n.name_hash);
                true
            }
            None => false,
        }
    }

    /// Whether `node` is followed (known to this pipeline).
    pub fn knows(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    /// Names of the known nodes, sorted.
    pub fn node_names(&self) -> impl Iterator<Item = &String> {
        let mut names: Vec<&String> = self.nodes.keys().collect();
        names.sort_unstable();
        names.into_iter()
    }

    /// A document built in a test, judged as the core loop judges one received: its
    /// bytes read through the same checks ([`DocView::check_bounds`]).
    #[cfg(test)]
    pub(crate) fn on_document(&mut self, doc: faultline_common::NodeHealth, now_ms: u64) -> Change {
        let raw = serde_json::to_vec(&doc).expect("a document serializes");
        let view = DocView::parse(&raw).expect("a document reads back");
        view.check_bounds()
            .expect("a test document within the limits");
        self.on_view(&view, &raw, now_ms)
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
        if let Err(why) = node.admit_ids(doc, now_ms) {
            self.metrics.agent_poll_error("device-churn");
            // One line per node per window: a hostile agent sends one a second.
            if node
                .refused_logged_ms
                .is_none_or(|t| now_ms.saturating_sub(t) >= NEW_ID_WINDOW_MS)
            {
                node.refused_logged_ms = Some(now_ms);
                tracing::warn!(node = name, %why, "agent document refused (logged once per window)");
            }
            return Change::default();
        }
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
        let texts_changed = node.remember(doc);
        let acked = node.take_acks(doc);
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
            // skipped by the ticks from the one after it on, without a visit
            // (put back on the ticks' list, a name copied and looked up by the next tick
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
        if texts_changed {
            self.check_uuids(name, now_ms);
        }
        if acked {
            change.drain_acked.push(name.to_string());
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
                // skipped from now on all the same (it was looked up again at
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

    /// Drop the devices `keep` refuses, logged and counted; whether any went.
    fn forget(
        devices: &mut BTreeMap<String, Device>,
        name: &str,
        metrics: &Metrics,
        mut keep: impl FnMut(&str, &Device) -> bool,
    ) -> bool {
        let before = devices.len();
        devices.retain(|id, dev| {
            let kept = keep(id, dev);
            if !kept {
                tracing::info!(node = name, device = %id, "device not reported for the forget time: forgotten");
            }
            kept
        });
        let gone = before - devices.len();
        if gone > 0 {
            metrics.devices_forgotten(gone);
        }
        gone > 0
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
            // left the node: dropped, never unknown.
            forgotten = Self::forget(devices, name, metrics, |_, dev| {
                now_ms.saturating_sub(dev.reported_ms) < forget
            });
        } else if !reach.reachable && devices.len() > last.len() {
            // While the agent is unreachable, the devices of its last document stay:
            // their being unknown is what the unknown guard is for. One that document
            // did not list either (a device that had left already, or an id an agent
            // churned through) goes after the forget time all the same
            // (churned ids were kept for as long as their agent stayed away).
            forgotten = Self::forget(devices, name, metrics, |id, dev| {
                now_ms.saturating_sub(dev.reported_ms) < forget || last.iter().any(|l| *l.id == *id)
            });
        }
        if forgotten {
            *changed_ms = now_ms;
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
            // Its bytes too (a document deferred to the tick kept its copy
            // until the next one came, about 3 KiB a node).
            node.pending = None;
            node.raw = None;
        }
        change
    }
}

#[cfg(test)]
#[path = "judge_tests.rs"]
mod tests;
