//! Per-node remediation passes, in the shard holder only, one at a time per node.
//!
//! A node's pass runs in a task of its own: for a quarantined node first the release
//! check (a person's request, the unknown guard lifting, `--release auto`); then, for
//! failed devices (the pipeline's and the verdicts pending from the intake and the
//! kubelet), isolation; then evictions (also for quarantined nodes that nothing says
//! failed now: a budget may still hold a pod back). One task per node, so a release is
//! never skipped because an isolation pass of the same node is running.
//!
//! Who owns what: [`Dispatch`] is owned by the core loop, and so is `pending` inside
//! it; a pass reports the verdicts it settled back through a channel ([`Settled`]) and
//! the core loop removes them. [`InFlight`] is shared with the passes: a pass holds its
//! node's [`Slot`] and gives it back when it ends, however it ends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use faultline_common::fault::{DrainNotice, QuarantineMark};

pub use super::in_flight::{InFlight, Slot};
use super::supervise;
use crate::metrics::{Action, ActionResult, IntakeResult, Metrics};
use crate::model::{Provenance, RecordDevice, Verdict};
use crate::pipeline::Pipeline;
use crate::remediate::{Outcome, RemediateError, Remediator};
use crate::shard::{Fence, Shards};

/// A pass's report: verdicts of `node` that are on the Node now (or deliberately not
/// acted on), no longer pending.
#[derive(Debug)]
pub struct Settled {
    /// The node.
    pub node: String,
    /// The verdicts settled.
    pub devices: Vec<RecordDevice>,
    /// The node's drain intents to publish, and when the next falls due (ms on the
    /// remediator's clock); `None`: the pass did not look.
    pub drains: Option<(Vec<DrainNotice>, Option<u64>)>,
    /// How the node's quarantined devices are kept from new work, by device id, for
    /// `fault.json`; `None`: the pass did not look.
    pub marks: Option<Vec<(String, QuarantineMark)>>,
}

/// Remediation's side of the core loop.
pub struct Dispatch {
    remediator: Arc<Remediator>,
    shards: Shards,
    metrics: Arc<Metrics>,
    in_flight: InFlight,
    /// Devices judged failed by the intake or the kubelet, per node (with the time of
    /// the last verdict), until a pass has recorded them on the Node; a pass that fails
    /// keeps them for the next one. A verdict older than the dedup window is dropped:
    /// one for a shard this replica does not hold must not be acted on much later, when
    /// it takes the shard over (the kubelet's verdicts are sent again on every re-list
    /// while they hold). Owned by this dispatcher alone.
    pending: BTreeMap<String, (Instant, Vec<RecordDevice>)>,
    settled: mpsc::UnboundedSender<Settled>,
    unknown: UnknownGuard,
    /// The unknown guard stood down at its last look.
    standing_down: bool,
    /// When each node's pass must run again for a drain intent's deadline (ms on the
    /// remediator's clock), A pod is evicted at its deadline, never later.
    wakes: BTreeMap<String, u64>,
    /// Refreshes of the list of quarantined nodes that reconciles started and that
    /// have not ended yet.
    listing: Arc<std::sync::atomic::AtomicUsize>,
}

/// When the unknown guard acts.
#[derive(Debug, Clone, Copy)]
pub struct UnknownGuard {
    /// Devices unknown this long may get their node the NoSchedule taint.
    pub tolerance: Duration,
    /// More than this share of followed agents unreachable: the aggregator is the one
    /// cut off (a bad rollout, a NetworkPolicy), and the guard stands down.
    pub standdown_share: f64,
}

impl UnknownGuard {
    /// Whether the guard stands down with `reachable` of `total` agents answering.
    pub fn stands_down(&self, reachable: usize, total: usize) -> bool {
        total > 0 && (total - reachable) as f64 > self.standdown_share * total as f64
    }
}

/// How soon a wake whose node had a pass running is tried again (ms).
const WAKE_RETRY_MS: u64 = 100;

/// Nodes not followed by this replica with verdicts waiting at once, at most.
const MAX_UNFOLLOWED: usize = 64;

/// Devices of one node with verdicts waiting, at most (as many as a node may report,
/// `pipeline::MAX_DEVICES_PER_NODE`): alerts naming ever new devices of one node are
/// dropped and counted past that, not kept.
const MAX_PENDING_DEVICES: usize = crate::pipeline::MAX_DEVICES_PER_NODE;

impl Dispatch {
    /// A dispatcher; passes report to the receiver returned with it.
    pub fn new(
        remediator: Arc<Remediator>,
        shards: Shards,
        metrics: Arc<Metrics>,
        unknown: UnknownGuard,
    ) -> (Self, mpsc::UnboundedReceiver<Settled>) {
        let (settled, rx) = mpsc::unbounded_channel();
        (
            Dispatch {
                remediator,
                shards,
                metrics,
                in_flight: InFlight::default(),
                pending: BTreeMap::new(),
                settled,
                unknown,
                standing_down: false,
                wakes: BTreeMap::new(),
                listing: Arc::default(),
            },
            rx,
        )
    }

    /// The passes running now.
    pub fn in_flight(&self) -> &InFlight {
        &self.in_flight
    }

    /// Whether a refresh of the list of quarantined nodes (which the next reconcile
    /// starts from) is still to end: what a test waits on, with [`Dispatch::in_flight`].
    pub fn listing(&self) -> bool {
        self.listing.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    /// A verdict from the intake or the kubelet: pending until a pass records it.
    pub fn verdict(&mut self, pipeline: &Pipeline, mut v: Verdict) {
        // Checked against what we know (40,000 alerts for nodes that do not
        // exist made a pass, an Event and a failed remediation each): verdicts for nodes
        // this replica does not follow (an agent down, or no such Node) wait at most
        // MAX_UNFOLLOWED nodes at a time; past that they are dropped and counted.
        if !pipeline.knows(&v.node) && !self.pending.contains_key(&v.node) {
            let unfollowed = self.pending.keys().filter(|n| !pipeline.knows(n)).count();
            if unfollowed >= MAX_UNFOLLOWED {
                self.metrics.intake_alert(IntakeResult::UnfollowedOverflow);
                return;
            }
        }
        // Name the device as the node's agent does, where it reports it.
        if let Some(id) = pipeline.device_id(&v.node, &v.device.id) {
            v.device.id = id;
        }
        // On the remediator's clock, as every other window of remediation (tests move it).
        let now = self.remediator.clock().instant();
        let (at, list) = self
            .pending
            .entry(v.node.clone())
            .or_insert_with(|| (now, Vec::new()));
        if !list.iter().any(|d| d.is(&v.device.id)) {
            if list.len() >= MAX_PENDING_DEVICES {
                self.metrics.intake_alert(IntakeResult::NodeDevicesOverflow);
                return;
            }
            list.push(v.device);
        }
        *at = now;
        self.remediate(pipeline, vec![v.node]);
    }

    /// Run `node`'s pass again at `at_ms` (a drain intent's deadline).
    pub fn wake_at(&mut self, node: &str, at_ms: u64) {
        let at = self.wakes.entry(node.to_string()).or_insert(at_ms);
        *at = (*at).min(at_ms);
    }

    /// Run `node`'s pass again in a second (a shard just taken with drain intents
    /// published: its deadlines are read from the record again once it is held).
    pub fn wake_soon(&mut self, node: &str) {
        let at = self.remediator.clock().now_ms() + 1_000;
        self.wake_at(node, at);
    }

    /// When the next wake is due, as an instant.
    pub fn next_wake(&self) -> Option<tokio::time::Instant> {
        let at = *self.wakes.values().min()?;
        let wait = at.saturating_sub(self.remediator.clock().now_ms());
        Some(tokio::time::Instant::now() + Duration::from_millis(wait))
    }

    /// Run the passes whose wake is due; one whose node has a pass running is tried
    /// again shortly (that pass may have begun before the deadline).
    pub fn wake_due(&mut self, pipeline: &Pipeline) {
        let now = self.remediator.clock().now_ms();
        let due: Vec<String> = self
            .wakes
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for node in &due {
            self.wakes.remove(node);
            if self.in_flight.busy(node) {
                self.wakes.insert(node.clone(), now + WAKE_RETRY_MS);
            }
        }
        self.run_passes(pipeline, due, true);
    }

    /// A pass settled some pending verdicts.
    pub fn settle(&mut self, s: Settled) {
        if let Some((_, v)) = self.pending.get_mut(&s.node) {
            v.retain(|d| !s.devices.contains(d));
            if v.is_empty() {
                self.pending.remove(&s.node);
            }
        }
    }

    /// The reconcile: every known, pending and quarantined node looked at again, the
    /// unknown guard, and the list of quarantined nodes refreshed.
    pub fn reconcile(&mut self, pipeline: &Pipeline) {
        self.metrics.reconciled();
        let (reachable, total) = pipeline.reach();
        let down = self.unknown.stands_down(reachable, total);
        if down != self.standing_down {
            if down {
                tracing::warn!(reachable, total, share = self.unknown.standdown_share, "the unknown guard stands down: too many agents are unreachable from this aggregator to blame the nodes");
            } else {
                tracing::info!(reachable, total, "the unknown guard is back");
            }
            self.standing_down = down;
        }
        self.metrics.set_unknown_standing_down(down);
        // A set (a list searched once per pending node was quadratic).
        let mut nodes: std::collections::BTreeSet<String> =
            pipeline.node_names().cloned().collect();
        let window = self.remediator.dedup_window();
        let now = self.remediator.clock().instant();
        self.pending
            .retain(|_, (t, _)| now.saturating_duration_since(*t) < window);
        nodes.extend(self.pending.keys().cloned());
        nodes.extend(self.remediator.known_quarantined());
        self.remediate(pipeline, nodes.into_iter().collect());
        if !self.standing_down {
            self.guard_unknown(pipeline);
        }
        let r = self.remediator.clone();
        let listing = self.listing.clone();
        listing.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let list = async move {
            if let Err(e) = r.list_quarantined().await {
                tracing::warn!(error = %e, "cannot list quarantined nodes");
            }
        };
        let metrics = self.metrics.clone();
        supervise::spawn_contained("listing of quarantined nodes", list, move |panicked| {
            if panicked {
                metrics.remediation_error("panic");
            }
            listing.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        });
    }

    /// Note the `fault.json` sequence being written.
    pub fn note_sequence(&self, sequence: u64) {
        self.remediator
            .sequence_handle()
            .store(sequence, std::sync::atomic::Ordering::Relaxed);
    }

    /// One pass per node of `nodes` that has failed devices or a quarantine, in the
    /// shard holder only.
    pub fn remediate(&self, pipeline: &Pipeline, nodes: Vec<String>) {
        self.run_passes(pipeline, nodes, false);
    }

    /// [`Dispatch::remediate`]; `forced`: also for a node not known to be quarantined
    /// (a drain intent's deadline or acknowledgement: the pass reads the record).
    pub fn run_passes(&self, pipeline: &Pipeline, nodes: Vec<String>, forced: bool) {
        let quarantined: BTreeSet<String> =
            self.remediator.known_quarantined().into_iter().collect();
        for node in nodes {
            let mut devices = pipeline.failed_devices(&node);
            let extra = self
                .pending
                .get(&node)
                .map(|(_, v)| v.clone())
                .unwrap_or_default();
            // An alert acts only on a device the node's agent reports; one the agent
            // does not know must be one the kubelet reports for a pod of the node (the
            // pass checks), or it is only announced.
            let views = pipeline.device_views(&node);
            let (known, unverified): (Vec<RecordDevice>, Vec<RecordDevice>) =
                extra.iter().cloned().partition(|d| {
                    d.source != Some(Provenance::Alert)
                        || views.iter().any(|v| v.device.same_device(d))
                });
            for d in &known {
                if !devices.iter().any(|x| x.is(&d.id)) {
                    devices.push(d.clone());
                }
            }
            let is_quarantined = quarantined.contains(&node);
            let nothing = devices.is_empty() && unverified.is_empty() && !is_quarantined && !forced;
            if nothing || !self.shards.holds_node(&node) {
                continue;
            }
            let Some(slot) = self.in_flight.take(&node) else {
                continue;
            };
            let node_name = node.clone();
            let pass = NodePass {
                remediator: self.remediator.clone(),
                fence: self.shards.fence(&node),
                metrics: self.metrics.clone(),
                settled: self.settled.clone(),
                views: is_quarantined.then_some(views),
                node,
                devices,
                extra,
                unverified,
                followed: pipeline.knows(&node_name),
                acks: pipeline.drain_acks(&node_name),
            };
            let metrics = pass.metrics.clone();
            let work = async move {
                let _slot = slot;
                pass.run().await;
            };
            supervise::spawn_contained("remediation pass", work, move |panicked| {
                if panicked {
                    metrics.remediation_error("panic");
                }
                metrics.pass_done();
            });
        }
    }

    /// Nodes whose devices have been unknown past the tolerance may get the NoSchedule
    /// taint (never an eviction), in the shard holder only.
    fn guard_unknown(&self, pipeline: &Pipeline) {
        // On the remediator's clock, as the pipeline's views are judged (tests move it).
        let now = self.remediator.clock().now_ms();
        for node in pipeline.node_names() {
            let devices =
                pipeline.unknown_devices(node, self.unknown.tolerance.as_millis() as u64, now);
            if devices.is_empty() || !self.shards.holds_node(node) {
                continue;
            }
            let Some(slot) = self.in_flight.take(node) else {
                continue;
            };
            let (r, fence, node, metrics) = (
                self.remediator.clone(),
                self.shards.fence(node),
                node.clone(),
                self.metrics.clone(),
            );
            let work = async move {
                let _slot = slot;
                match r.guard_unknown(&node, devices, &fence).await {
                    Ok(outcome) => tracing::debug!(node = %node, ?outcome, "unknown guard pass"),
                    Err(e) => {
                        tracing::warn!(node = %node, error = %e, "unknown guard pass failed; the next one retries")
                    }
                }
            };
            supervise::spawn_contained("unknown guard pass", work, move |panicked| {
                if panicked {
                    metrics.remediation_error("panic");
                }
                metrics.pass_done();
            });
        }
    }
}

/// One node's pass: what it needs, moved into its task.
struct NodePass {
    remediator: Arc<Remediator>,
    fence: Fence,
    metrics: Arc<Metrics>,
    settled: mpsc::UnboundedSender<Settled>,
    node: String,
    /// The node's devices as the pipeline sees them, when it is quarantined.
    views: Option<Vec<crate::model::DeviceView>>,
    /// Failed devices: the pipeline's and the pending verdicts.
    devices: Vec<RecordDevice>,
    /// The pending verdicts among them.
    extra: Vec<RecordDevice>,
    /// Alerts naming a device the node's agent does not report: acted on only if the
    /// kubelet reports it for a pod of the node.
    unverified: Vec<RecordDevice>,
    /// This replica follows the node's agent (so the Node is known to exist).
    followed: bool,
    /// The drain acknowledgements its agent carries (pod UID, intent's `requested`).
    acks: Vec<(String, String)>,
}

impl NodePass {
    async fn run(mut self) {
        if !self.exists().await {
            return;
        }
        self.verify_alerts().await;
        let (r, node) = (&self.remediator, self.node.as_str());
        let t0 = Instant::now();
        if let Some(views) = &self.views {
            // Cool-downs are judged on the remediator's clock (tests move it).
            match r
                .release_pass(node, views, r.clock().now_ms(), &self.fence)
                .await
            {
                Ok(Outcome::Released) => {
                    tracing::debug!(node = %node, "released");
                    // The record and its drain intents are gone.
                    self.report_drains(Some(Vec::new()), None, Some(Vec::new()));
                    return;
                }
                Ok(outcome) => tracing::debug!(node = %node, ?outcome, "release pass"),
                Err(e) => {
                    self.metrics.remediation_error(e.metric_label());
                    tracing::warn!(node = %node, error = %e, "release pass failed; the next one retries")
                }
            }
        }
        // Every pass that finds failed devices on a node without a failure record
        // counts it for the breaker, a reconcile's or a verdict's as much as a fresh
        // transition's (counted once per node within the window, cluster-wide).
        if !self.devices.is_empty() {
            if let Err(e) = r.note_new_failure(node).await {
                tracing::warn!(node = %node, error = %e, "cannot update the circuit breaker");
            }
        }
        if let Err(e) = self.isolate_then_evict(t0).await {
            self.metrics.action(Action::Quarantine, ActionResult::Error);
            self.metrics.remediation_error(e.metric_label());
            tracing::warn!(node = %node, error = %e, "remediation pass failed; the next one retries");
        }
    }

    /// Verdicts for a node this replica does not follow name a Node that exists, or they
    /// are dropped, counted, and nothing else is done (40,000 alerts for nodes
    /// that do not exist made an Event and a failed pass each). Whether to go on; a
    /// node the API could not be asked about waits for the next pass.
    async fn exists(&self) -> bool {
        if self.followed || self.extra.is_empty() {
            return true;
        }
        match self.remediator.node_exists(&self.node).await {
            Ok(Some(true)) => true,
            // Over the rate of such checks: the verdict waits (the unfollowed ones
            // pending are bounded) for a later pass.
            Ok(None) => {
                tracing::debug!(node = %self.node, "existence checks over their rate: the verdict waits");
                false
            }
            Ok(Some(false)) => {
                self.metrics.intake_alert(IntakeResult::NoSuchNode);
                tracing::debug!(node = %self.node, "verdicts for a node that does not exist: dropped");
                let _ = self.settled.send(Settled {
                    node: self.node.clone(),
                    devices: self.extra.clone(),
                    drains: None,
                    marks: None,
                });
                false
            }
            Err(e) => {
                tracing::warn!(node = %self.node, error = %e, "cannot check that the alerted node exists; the next pass asks");
                false
            }
        }
    }

    /// Alerts on devices the agent does not report count only for devices the kubelet
    /// reports for a pod of the node; the others are announced once and settled.
    async fn verify_alerts(&mut self) {
        if self.unverified.is_empty() {
            return;
        }
        let node = self.node.clone();
        let held = match self
            .remediator
            .kubelet_reports(&node, &self.unverified)
            .await
        {
            Ok(h) => h,
            Err(e) => {
                // Not known either way: neither acted on nor dropped; the next pass asks.
                tracing::warn!(node = %node, error = %e, "cannot check the alerted devices against the node's pods");
                self.extra.retain(|d| !self.unverified.contains(d));
                return;
            }
        };
        let mut unattributed = Vec::new();
        for (d, held) in std::mem::take(&mut self.unverified).into_iter().zip(held) {
            if held {
                if !self.devices.iter().any(|x| x.is(&d.id)) {
                    self.devices.push(d);
                }
            } else {
                self.remediator.announce_unattributed(&node, &d).await;
                unattributed.push(d);
            }
        }
        if !unattributed.is_empty() {
            self.extra.retain(|d| !unattributed.contains(d));
            let _ = self.settled.send(Settled {
                node,
                devices: unattributed,
                drains: None,
                marks: None,
            });
        }
    }

    /// Isolate first (no new pods land there), then move the workloads off.
    async fn isolate_then_evict(&self, t0: Instant) -> Result<(), RemediateError> {
        let (r, node) = (&self.remediator, self.node.as_str());
        let outcome = if self.devices.is_empty() {
            Outcome::AlreadyDone
        } else {
            r.isolate(node, self.devices.clone(), &self.fence).await?
        };
        tracing::debug!(node = %node, ?outcome, "isolation pass");
        if outcome == Outcome::Isolated {
            self.metrics
                .action_time(Action::Quarantine, t0.elapsed().as_secs_f64());
        }
        if !self.extra.is_empty() && outcome.settles() {
            // On the Node now (or deliberately not acted on): done with them. Held back
            // by a budget or the breaker: kept for a later pass.
            let _ = self.settled.send(Settled {
                node: node.to_string(),
                devices: self.extra.clone(),
                drains: None,
                marks: None,
            });
        }
        if r.mode() == crate::remediate::Mode::DryRun {
            r.would_evict(node, &self.devices).await?;
            return Ok(());
        }
        let t1 = Instant::now();
        let mut e = r.evict(node, &self.acks, &self.fence).await?;
        if !e.evicted.is_empty() {
            self.metrics
                .action_time(Action::Evict, t1.elapsed().as_secs_f64());
        }
        self.report_drains(e.drains.take(), e.wake_ms, e.marks.take());
        tracing::debug!(node = %node, ?e, "eviction pass");
        Ok(())
    }

    /// Hand the node's drain intents to the core loop (to publish) with the time its
    /// pass must run again, if the pass looked.
    fn report_drains(
        &self,
        drains: Option<Vec<DrainNotice>>,
        wake_ms: Option<u64>,
        marks: Option<Vec<(String, QuarantineMark)>>,
    ) {
        if drains.is_some() || marks.is_some() {
            let _ = self.settled.send(Settled {
                node: self.node.clone(),
                devices: Vec::new(),
                drains: drains.map(|d| (d, wake_ms)),
                marks,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dispatcher whose remediator judges time by a clock standing at 1,000 s.
    fn dispatcher() -> Dispatch {
        let client =
            kube::Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap()))
                .unwrap();
        let clock = faultline_common::time::Clock::manual(1_000_000);
        let r = Remediator::new(client, crate::remediate::Mode::DryRun, "t", "ns", "me")
            .with_clock(clock);
        let shards = Shards {
            held: crate::shard::Held::default(),
            count: 1,
        };
        let unknown = UnknownGuard {
            tolerance: Duration::from_secs(300),
            standdown_share: 0.5,
        };
        Dispatch::new(Arc::new(r), shards, Arc::new(Metrics::new()), unknown).0
    }

    /// How far from now the next wake is, in whole seconds.
    fn next_in(d: &Dispatch) -> Option<u64> {
        let at = d.next_wake()?;
        let left = at.saturating_duration_since(tokio::time::Instant::now());
        Some((left.as_millis() as u64 + 500) / 1000)
    }

    /// A node's pass is woken at the soonest deadline asked (a drain intent's), on the
    /// remediator's clock; a shard just taken wakes its node a second later.
    #[tokio::test]
    async fn wakes_keep_the_soonest_deadline_on_the_remediators_clock() {
        let mut d = dispatcher();
        assert_eq!(next_in(&d), None);
        d.wake_at("n1", 1_009_000);
        assert_eq!(next_in(&d), Some(9));
        d.wake_at("n1", 1_005_000);
        d.wake_at("n1", 1_007_000);
        assert_eq!(next_in(&d), Some(5), "the soonest");
        d.wake_soon("n2");
        assert_eq!(next_in(&d), Some(1));
    }

    /// The unknown guard stands down only when more than its share of the followed
    /// agents is unreachable: at the share exactly it still acts, and with no agent
    /// followed there is nothing to stand down for.
    #[test]
    fn the_unknown_guard_stands_down_past_its_share_only() {
        let guard = UnknownGuard {
            tolerance: Duration::from_secs(300),
            standdown_share: 0.5,
        };
        assert!(!guard.stands_down(0, 0), "no agent followed");
        assert!(!guard.stands_down(10, 10));
        assert!(!guard.stands_down(5, 10), "half unreachable: at the share");
        assert!(guard.stands_down(4, 10), "past it");
        assert!(guard.stands_down(0, 10));
        let strict = UnknownGuard {
            standdown_share: 0.0,
            ..guard
        };
        assert!(!strict.stands_down(3, 3));
        assert!(
            strict.stands_down(2, 3),
            "one unreachable is past a share of 0"
        );
    }
}
