//! The core loop: one task that owns the [`Pipeline`] and decides when documents are
//! written. Agents' documents, the once-a-second tick, verdicts, rules reloads and
//! requests for the whole document all arrive here, one at a time, so the pipeline
//! needs no lock.
//!
//! Writes: a document is written at most every `--write-interval` (jittered up to
//! +20%), and an unchanged one every `--heartbeat`, one write at a time; a shard where a
//! device turned failed by an urgent write of its own, `--urgent-spacing` after that
//! shard's last write, beside the other write if one is in flight (the file sink: its
//! one document, after the previous write). A failed write is retried by the next round.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use faultline_common::fault::FaultDocument;
use faultline_common::rules::Rules;
use faultline_common::time::now_ms;
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::dispatch::{Dispatch, Settled};
use crate::api::DocumentAsk;
use crate::ingest::collect::admit_raw;
use crate::ingest::AgentEvent;
use crate::metrics::Metrics;
use crate::model::{FinalWrite, Takeover, Verdict};
use crate::pipeline::{Change, Pipeline, TICK_MS};
use crate::publish::{document, Publisher, Stamp};

/// What the core loop listens to.
pub struct Inputs {
    /// Agents' documents and reachability.
    pub agents: mpsc::Receiver<AgentEvent>,
    /// Verdicts of the intake and the kubelet.
    pub verdicts: mpsc::Receiver<Verdict>,
    /// Passes' reports of settled verdicts.
    pub settled: Option<mpsc::UnboundedReceiver<Settled>>,
    /// The rules in force.
    pub rules: watch::Receiver<Arc<Rules>>,
    /// Requests for the whole document.
    pub asks: mpsc::Receiver<DocumentAsk>,
    /// Shards taken, with what to seed them from (fair sharing).
    pub takeovers: Option<mpsc::Receiver<Takeover>>,
    /// Shards to write once more before they are handed back.
    pub final_writes: Option<mpsc::Receiver<FinalWrite>>,
}

/// The write timing of the core loop.
#[derive(Debug, Clone, Copy)]
pub struct WriteTiming {
    /// `--write-interval`.
    pub interval: Duration,
    /// `--urgent-spacing`.
    pub urgent_spacing: Duration,
    /// `--heartbeat`.
    pub heartbeat: Duration,
    /// `--reconcile-interval`.
    pub reconcile: Duration,
    /// `--shutdown-timeout`.
    pub shutdown: Duration,
}

/// The core loop's state.
pub struct Core {
    pipeline: Pipeline,
    publisher: Publisher,
    /// Remediation, when on.
    dispatch: Option<Dispatch>,
    metrics: Arc<Metrics>,
    timing: WriteTiming,
    replica: String,
    /// A first document was written (shared with the API's `/readyz`).
    ready: Arc<AtomicBool>,
    dirty: bool,
    /// A device turned failed (the file sink: its one document).
    urgent: bool,
    /// With shards: those where a device turned failed since they were last written.
    /// They are written by an urgent write of their own, `--urgent-spacing` after their
    /// last write, beside a write of others in flight (issue 11: a fault waited behind
    /// another shard's heartbeat).
    urgent_shards: BTreeSet<u32>,
    /// When each shard's last write started (for the urgent spacing).
    shard_written: HashMap<u32, Instant>,
    /// The urgent write in flight.
    urgent_writing: Option<tokio::task::JoinHandle<()>>,
    /// Shards whose nodes changed since the last write; when only node changes are
    /// due, only they are written.
    changed: BTreeSet<u32>,
    /// Something other than a node's change is due (the first write, a final write, a
    /// failed write): the next write covers every shard held.
    whole: bool,
    /// When each shard was last written (its heartbeat counts from it). Each shard has
    /// its own, spread over the heartbeat period, so that no write carries every shard
    /// at once (issue 11: 32 shards of 700 KB rewritten together every 30 s were a
    /// sixth of a replica's CPU and most of its peak memory).
    written: HashMap<u32, Instant>,
    sequence: u64,
    /// The whole document built for `GET /v1/faults`, shared by every asker until the
    /// next sequence (issue 10: a burst of requests builds it once).
    asked: Option<(u64, Arc<FaultDocument>)>,
    last_write: Option<Instant>,
    spacing: Duration,
    writing: Option<tokio::task::JoinHandle<()>>,
    /// The last write failed (set by the write task, read here).
    failed: Arc<AtomicBool>,
    last_held: Vec<u32>,
    /// Nodes whose pods are nudged once their shard is written.
    alarming: BTreeSet<String>,
    last_reconcile: Instant,
    /// With fair sharing: the shards seeded since this replica took them; a shard is
    /// written only once seeded (a takeover changes no published status).
    seeded: Option<BTreeSet<u32>>,
    /// Final writes waiting for the next write to finish.
    final_waiters: Vec<tokio::sync::oneshot::Sender<()>>,
    /// The shards granted at the last tick (fair sharing).
    last_granted: BTreeSet<u32>,
}

/// When the next write is due after one at `last` (`None`: now): `urgent_spacing`
/// after it when a device turned failed since, `spacing` (the jittered interval) when
/// anything else changed, and otherwise a heartbeat after the write of the shard
/// written longest ago (`oldest`), never sooner than `spacing`. Changes between two
/// writes are one write: urgency and dirtiness are flags, not a queue.
fn write_due(
    last: Option<Instant>,
    urgent: bool,
    dirty: bool,
    spacing: Duration,
    t: &WriteTiming,
    oldest: Option<Instant>,
) -> Option<Instant> {
    let last = last?;
    let at = if urgent {
        last + t.urgent_spacing
    } else if dirty {
        last + spacing
    } else {
        let beat = oldest.unwrap_or(last) + t.heartbeat;
        beat.max(last + spacing)
    };
    Some(at)
}

/// Agent events handled in one turn of the loop after the one that woke it.
const AGENT_BATCH: usize = 64;

/// The shards of `held` whose heartbeat is due at `now`: never written, or last
/// written a heartbeat ago.
fn heartbeat_due(
    held: &[u32],
    written: &HashMap<u32, Instant>,
    heartbeat: Duration,
    now: Instant,
) -> BTreeSet<u32> {
    held.iter()
        .copied()
        .filter(|s| {
            written
                .get(s)
                .is_none_or(|t| now.saturating_duration_since(*t) >= heartbeat)
        })
        .collect()
}

/// After a write of every shard in `shards` at `now`: their heartbeats spread evenly
/// over the next period (the i-th of n counts as written i/n of a period earlier), so
/// the next ones come a shard or two at a time.
fn spread(shards: &[u32], written: &mut HashMap<u32, Instant>, heartbeat: Duration, now: Instant) {
    let n = shards.len().max(1) as u32;
    for (i, s) in shards.iter().enumerate() {
        let back = heartbeat * (i as u32) / n;
        written.insert(*s, now.checked_sub(back).unwrap_or(now));
    }
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(1.0..1.2))
}

impl Core {
    /// A core loop publishing through `publisher`, remediating through `dispatch`.
    pub fn new(
        pipeline: Pipeline,
        publisher: Publisher,
        dispatch: Option<Dispatch>,
        metrics: Arc<Metrics>,
        timing: WriteTiming,
        replica: String,
        ready: Arc<AtomicBool>,
    ) -> Self {
        Core {
            last_held: publisher.held(),
            pipeline,
            publisher,
            dispatch,
            metrics,
            spacing: jittered(timing.interval),
            timing,
            replica,
            ready,
            dirty: true,
            urgent: false,
            urgent_shards: BTreeSet::new(),
            shard_written: HashMap::new(),
            urgent_writing: None,
            changed: BTreeSet::new(),
            whole: true,
            written: HashMap::new(),
            sequence: 0,
            asked: None,
            last_write: None,
            writing: None,
            failed: Arc::new(AtomicBool::new(false)),
            alarming: BTreeSet::new(),
            last_reconcile: Instant::now(),
            seeded: None,
            final_waiters: Vec::new(),
            last_granted: BTreeSet::new(),
        }
    }

    /// Write a shard only once it is seeded from its last holder's document.
    pub fn with_seeding(mut self) -> Self {
        self.seeded = Some(BTreeSet::new());
        self
    }

    /// Every takeover already sent.
    fn drain_takeovers(&mut self, rx: &mut Option<mpsc::Receiver<Takeover>>) {
        if let Some(rx) = rx.as_mut() {
            while let Ok(t) = rx.try_recv() {
                self.on_takeover(t);
            }
        }
    }

    /// A shard was taken: seed its nodes, then let it be written, at once.
    fn on_takeover(&mut self, t: Takeover) {
        let now = now_ms();
        let mut devices = 0;
        for n in &t.nodes {
            devices += self.pipeline.seed(n, now);
        }
        tracing::info!(
            shard = t.shard,
            nodes = t.nodes.len(),
            devices,
            "shard taken; seeded from its last document"
        );
        if let Some(s) = self.seeded.as_mut() {
            s.insert(t.shard);
        }
        // Written once granted (`on_grants`), by a write of its own.
        self.changed.insert(t.shard);
        self.dirty = true;
    }

    /// When the next write is due.
    fn due(&self) -> tokio::time::Instant {
        let oldest = self
            .last_held
            .iter()
            .filter_map(|s| self.written.get(s))
            .min()
            .copied();
        match write_due(
            self.last_write,
            self.urgent,
            self.dirty,
            self.spacing,
            &self.timing,
            oldest,
        ) {
            None => tokio::time::Instant::now(),
            Some(t) => tokio::time::Instant::from_std(t),
        }
    }

    /// Run until `cancel`, then finish: the write in flight, then the remediation
    /// passes in flight (within `--shutdown-timeout`).
    pub async fn run(mut self, mut inputs: Inputs, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // With every rules sender gone, `changed()` returns at once, forever: stop
        // listening then, or the loop spins.
        let mut rules_open = true;
        // The stop and the write timer live across iterations (issue 11: made anew for
        // each document, they were a waiter registered on the token and a timer wheel
        // insertion and removal each).
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        // A shard taken is written at once, not at the next tick (issue 11: up to a
        // second of a takeover).
        let mut grants = self.publisher.subscribe();
        let mut armed = self.due();
        let write_timer = tokio::time::sleep_until(armed);
        tokio::pin!(write_timer);
        loop {
            let due = self.due();
            let now = tokio::time::Instant::now();
            // Moved only when it would fire at another time than wanted: a write due
            // at once finds a timer that has fired already as good as a new one.
            if due != armed && !(due <= now && armed <= now) {
                armed = due;
                write_timer.as_mut().reset(due);
            }
            let can_write = self.writing.as_ref().is_none_or(|w| w.is_finished());
            let urgent_at = self
                .urgent_due()
                .filter(|_| self.urgent_writing.as_ref().is_none_or(|w| w.is_finished()));
            tokio::select! {
                _ = sleep_until_opt(urgent_at) => {
                    self.drain_takeovers(&mut inputs.takeovers);
                    self.write_urgent()
                }
                Some(t) = recv_opt(&mut inputs.takeovers) => self.on_takeover(t),
                _ = &mut cancelled => break,
                Some(f) = recv_opt(&mut inputs.final_writes) => {
                    tracing::debug!(shard = f.shard, "final write before handing the shard back");
                    self.final_waiters.push(f.done);
                    self.dirty = true;
                    self.whole = true;
                    self.last_write = None;
                }
                ev = inputs.agents.recv() => {
                    let Some(ev) = ev else { break };
                    // A shard's seed is in before its agents' documents: the Lease loop
                    // sends the takeover before it counts the shard as held, and the
                    // followers start only then.
                    self.drain_takeovers(&mut inputs.takeovers);
                    self.on_agent(ev);
                    // Whatever else is queued, in the same turn (bounded, so the other
                    // inputs are not starved).
                    for _ in 0..AGENT_BATCH {
                        match inputs.agents.try_recv() {
                            Ok(ev) => self.on_agent(ev),
                            Err(_) => break,
                        }
                    }
                }
                _ = tick.tick() => self.on_tick(),
                Some(()) = changed_opt(&mut grants) => {
                    // A grant follows its seed: the seed first, or the shard would not
                    // be written yet (a shard is written only once seeded).
                    self.drain_takeovers(&mut inputs.takeovers);
                    self.on_grants()
                }
                v = inputs.verdicts.recv(), if !inputs.verdicts.is_closed() || !inputs.verdicts.is_empty() => {
                    if let (Some(v), Some(d)) = (v, self.dispatch.as_mut()) {
                        d.verdict(&self.pipeline, v);
                    }
                }
                Some(s) = recv_settled(&mut inputs.settled) => {
                    if let Some(d) = self.dispatch.as_mut() {
                        d.settle(s);
                    }
                }
                // GET /v1/faults with the ConfigMap sink: the whole document, now.
                Some(reply) = inputs.asks.recv() => {
                    let _ = reply.send(self.whole_document());
                }
                r = inputs.rules.changed(), if rules_open => {
                    match r {
                        Ok(()) => self.pipeline.set_rules(inputs.rules.borrow_and_update().clone()),
                        Err(_) => rules_open = false,
                    }
                }
                _ = &mut write_timer, if can_write => {
                    self.drain_takeovers(&mut inputs.takeovers);
                    self.write()
                }
            }
        }
        self.finish().await;
    }

    /// The whole document for this sequence, built at most once per sequence.
    fn whole_document(&mut self) -> Arc<FaultDocument> {
        match &self.asked {
            Some((seq, d)) if *seq == self.sequence => d.clone(),
            _ => {
                let d = Arc::new(document(&self.pipeline, self.sequence, &self.replica, 0, 1));
                self.asked = Some((self.sequence, d.clone()));
                d
            }
        }
    }

    fn on_agent(&mut self, ev: AgentEvent) {
        let now = now_ms();
        let c = match ev {
            AgentEvent::Raw { node, body } => match admit_raw(&node, &body) {
                Ok(doc) => {
                    self.metrics.agent_poll("ok");
                    self.pipeline.on_view(&doc, &body, now)
                }
                Err(e) => {
                    self.metrics.agent_poll("error");
                    self.metrics.agent_poll_error(e.metric_label());
                    let error = e.to_string();
                    tracing::warn!(%node, %error, "agent document refused");
                    self.pipeline.on_unreachable(&node, &error, now)
                }
            },
            AgentEvent::Unreachable { node, error } => {
                self.pipeline.on_unreachable(&node, &error, now)
            }
            AgentEvent::Removed { node } => Change {
                nodes: if self.pipeline.remove_node(&node) {
                    vec![node]
                } else {
                    vec![]
                },
                ..Default::default()
            },
        };
        self.dirty |= !c.nodes.is_empty();
        self.on_change(c);
    }

    /// Note the shards of the nodes a change touched.
    fn note_shards(&mut self, nodes: &[String]) {
        for n in nodes {
            match self.publisher.shard_of(n) {
                Some(s) => {
                    self.changed.insert(s);
                }
                None => self.whole = true,
            }
        }
    }

    /// What a change means beyond the document: urgency, remediation, nudges.
    fn on_change(&mut self, c: Change) {
        self.note_shards(&c.nodes);
        if c.urgent {
            for n in &c.nodes {
                match self.publisher.shard_of(n) {
                    Some(s) => {
                        self.urgent_shards.insert(s);
                    }
                    None => self.urgent = true,
                }
            }
            if let Some(d) = &self.dispatch {
                d.remediate(&self.pipeline, c.alarming.clone());
            }
        }
        self.alarming.extend(c.alarming);
    }

    fn on_tick(&mut self) {
        let c = self.pipeline.tick(now_ms());
        let failed = self.failed.load(Ordering::Acquire);
        self.dirty |= !c.nodes.is_empty() || failed;
        self.whole |= failed;
        self.on_change(c);
        if self.last_reconcile.elapsed() >= self.timing.reconcile {
            self.last_reconcile = Instant::now();
            if let Some(d) = self.dispatch.as_mut() {
                d.reconcile(&self.pipeline);
            }
        }
        self.on_grants();
    }

    /// The shards held changed (at a grant or a release, and as holds run out, seen at
    /// the tick): a shard just taken is written at once.
    fn on_grants(&mut self) {
        let held = self.publisher.held();
        if held != self.last_held {
            // A shard just taken (or held again) is written at once by an urgent write
            // of its own, beside any write in flight; the others are not rewritten with
            // it (issue 11: a takeover of three shards was three rewrites of all eleven,
            // one after the other, seconds at 20,000 nodes).
            for s in held.iter().filter(|s| !self.last_held.contains(s)) {
                self.urgent_shards.insert(*s);
                self.changed.insert(*s);
                self.shard_written.remove(s);
            }
            self.dirty = true;
            self.last_held = held;
        }
        // A shard released is seeded afresh when taken again. Judged on the grants, not
        // the holds: a hold that ran out on our clock and was renewed is not a new take
        // (no new seed comes), and a shard just seeded is granted only after its seed.
        if let (Some(s), Some(granted)) = (self.seeded.as_mut(), self.publisher.granted()) {
            for gone in self.last_granted.iter().filter(|x| !granted.contains(x)) {
                s.remove(gone);
            }
            self.last_granted = granted;
        }
    }

    /// When the next urgent write is due: the soonest of the urgent shards'
    /// `--urgent-spacing` after its last write (`None`: no shard is urgent).
    fn urgent_due(&self) -> Option<tokio::time::Instant> {
        let now = Instant::now();
        self.urgent_shards
            .iter()
            .map(|s| self.urgent_at(*s).unwrap_or(now))
            .min()
            .map(tokio::time::Instant::from_std)
    }

    /// When shard `s` may have an urgent write: `--urgent-spacing` after its last write
    /// (`None`: never written, at once).
    fn urgent_at(&self, s: u32) -> Option<Instant> {
        self.shard_written
            .get(&s)
            .map(|t| *t + self.timing.urgent_spacing)
    }

    /// Write the urgent shards whose spacing has passed, and only them.
    fn write_urgent(&mut self) {
        let now = Instant::now();
        let ready: BTreeSet<u32> = self
            .urgent_shards
            .iter()
            .filter(|s| self.urgent_at(**s).is_none_or(|t| now >= t))
            .copied()
            .collect();
        if ready.is_empty() {
            return;
        }
        self.urgent_shards.retain(|s| !ready.contains(s));
        self.changed.retain(|s| !ready.contains(s));
        for s in &ready {
            self.shard_written.insert(*s, now);
            self.written.insert(*s, now);
        }
        self.sequence += 1;
        self.ready.store(true, Ordering::Release);
        self.urgent_writing = Some(self.publisher.write(
            &self.pipeline,
            Stamp {
                sequence: self.sequence,
                writer: &self.replica,
                seeded: self.seeded.as_ref(),
                urgent: &ready,
                changed: &ready,
                include: &ready,
                whole: false,
            },
            &mut self.alarming,
            &self.metrics,
            &self.failed,
        ));
    }

    fn write(&mut self) {
        if self.failed.swap(false, Ordering::AcqRel) {
            tracing::debug!("the last write failed; this one retries it");
            self.whole = true;
        }
        self.sequence += 1;
        self.ready.store(true, Ordering::Release);
        let now = Instant::now();
        let held = self.publisher.held();
        // Every shard when asked for and after a failed write (it may have been any);
        // else the shards whose nodes changed and those due their heartbeat.
        let whole = self.whole;
        let changed = std::mem::take(&mut self.changed);
        let due = heartbeat_due(&held, &self.written, self.timing.heartbeat, now);
        let include: BTreeSet<u32> = changed.union(&due).copied().collect();
        if whole {
            spread(&held, &mut self.written, self.timing.heartbeat, now);
        } else {
            for s in &include {
                self.written.insert(*s, now);
            }
        }
        // The urgent shards this write carries are written first, and are urgent no
        // more.
        let urgent: BTreeSet<u32> = if whole {
            std::mem::take(&mut self.urgent_shards)
        } else {
            let (carried, rest) = std::mem::take(&mut self.urgent_shards)
                .into_iter()
                .partition(|s| include.contains(s));
            self.urgent_shards = rest;
            carried
        };
        for s in held.iter().filter(|s| whole || include.contains(s)) {
            self.shard_written.insert(*s, now);
        }
        let task = self.publisher.write(
            &self.pipeline,
            Stamp {
                sequence: self.sequence,
                writer: &self.replica,
                seeded: self.seeded.as_ref(),
                urgent: &urgent,
                changed: &changed,
                include: &include,
                whole,
            },
            &mut self.alarming,
            &self.metrics,
            &self.failed,
        );
        let waiters = std::mem::take(&mut self.final_waiters);
        self.writing = Some(if waiters.is_empty() {
            task
        } else {
            tokio::spawn(async move {
                let _ = task.await;
                for w in waiters {
                    let _ = w.send(());
                }
            })
        });
        self.last_write = Some(now);
        self.whole = false;
        self.spacing = jittered(self.timing.interval);
        // A failed write leaves the document dirty for the next round.
        self.dirty = false;
        self.urgent = false;
    }

    /// Graceful stop: the intake no longer accepts (the server stopped with the same
    /// token); in-flight remediation gets --shutdown-timeout to finish, then the caller
    /// releases the Leases and the next holder continues from the records.
    async fn finish(self) {
        if let Some(w) = self.urgent_writing {
            let _ = w.await;
        }
        if let Some(w) = self.writing {
            let _ = w.await;
        }
        let Some(d) = self.dispatch else {
            return;
        };
        let deadline = Instant::now() + self.timing.shutdown;
        while !d.in_flight().is_empty() {
            if Instant::now() >= deadline {
                tracing::warn!(
                    in_flight = d.in_flight().len(),
                    "shutdown timeout: handing the rest over to the next holder"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Until `at`, or never.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The next change of a watch, if there is one (`None`: none, or its sender is gone).
async fn changed_opt<T>(rx: &mut Option<watch::Receiver<T>>) -> Option<()> {
    match rx {
        Some(r) => match r.changed().await {
            Ok(()) => Some(()),
            Err(_) => {
                *rx = None;
                None
            }
        },
        None => std::future::pending().await,
    }
}

/// The next message of an optional channel, or never.
async fn recv_opt<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The next report of a pass, or never without remediation.
async fn recv_settled(rx: &mut Option<mpsc::UnboundedReceiver<Settled>>) -> Option<Settled> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing() -> WriteTiming {
        WriteTiming {
            interval: Duration::from_secs(1),
            urgent_spacing: Duration::from_millis(50),
            heartbeat: Duration::from_secs(30),
            reconcile: Duration::from_secs(10),
            shutdown: Duration::from_secs(20),
        }
    }

    /// Issue 14, guardrail 9: a failed device is written `--urgent-spacing` after the
    /// last write, whatever the interval; other changes wait for the jittered interval;
    /// nothing changed waits for the heartbeat; the first write is at once.
    #[test]
    fn write_scheduling() {
        let t = timing();
        let last = Instant::now();
        let spacing = jittered(t.interval);
        assert!(
            write_due(None, false, false, spacing, &t, None).is_none(),
            "first: now"
        );
        assert_eq!(
            write_due(Some(last), true, true, spacing, &t, None),
            Some(last + t.urgent_spacing)
        );
        assert_eq!(
            write_due(Some(last), false, true, spacing, &t, None),
            Some(last + spacing)
        );
        assert_eq!(
            write_due(Some(last), false, false, spacing, &t, Some(last)),
            Some(last + t.heartbeat)
        );
        // The shard written longest ago decides, but never sooner than the interval.
        let earlier = last - Duration::from_secs(20);
        assert_eq!(
            write_due(Some(last), false, false, spacing, &t, Some(earlier)),
            Some(earlier + t.heartbeat)
        );
        let long_ago = last - Duration::from_secs(60);
        assert_eq!(
            write_due(Some(last), false, false, spacing, &t, Some(long_ago)),
            Some(last + spacing)
        );
    }

    /// Issue 11: after a write of every shard, the shards' heartbeats are spread over
    /// the period, so each later write carries one or two shards, never all; a shard
    /// never written is due at once.
    #[test]
    fn heartbeats_are_spread_over_the_period() {
        let beat = Duration::from_secs(30);
        let now = Instant::now() + Duration::from_secs(100);
        let shards: Vec<u32> = (0..32).collect();
        let mut written = HashMap::new();
        assert_eq!(heartbeat_due(&shards, &written, beat, now).len(), 32);
        spread(&shards, &mut written, beat, now);
        assert!(heartbeat_due(&shards, &written, beat, now).is_empty());
        // Each second of the next period finds about one shard due.
        let mut most = 0;
        for sec in 1..=30 {
            let at = now + Duration::from_secs(sec);
            let due = heartbeat_due(&shards, &written, beat, at);
            for s in &due {
                written.insert(*s, at);
            }
            most = most.max(due.len());
        }
        assert!(most <= 2, "{most} shards due at once");
        assert!(
            heartbeat_due(&shards, &written, beat, now + Duration::from_secs(30)).is_empty(),
            "every shard written within the period"
        );
    }

    /// The interval is jittered within 1.0-1.2 of itself, so a fleet of replicas does
    /// not write in lockstep.
    #[test]
    fn the_interval_is_jittered_within_a_fifth() {
        let d = Duration::from_secs(1);
        let all: Vec<Duration> = (0..200).map(|_| jittered(d)).collect();
        assert!(all.iter().all(|j| *j >= d && *j < d.mul_f64(1.2)));
        assert!(all.iter().any(|j| *j != all[0]), "it varies");
    }
}
