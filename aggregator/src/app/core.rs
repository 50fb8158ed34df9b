//! The core loop: one task that owns the [`Pipeline`] and decides when documents are
//! written. Agents' documents, the once-a-second tick, verdicts, rules reloads and
//! requests for the whole document all arrive here, one at a time, so the pipeline
//! needs no lock.
//!
//! Writes: a document is written at most every `--write-interval` (jittered up to
//! +20%), and a shard whose nodes did not change every `--refresh` (its unchanged pages
//! are not written at all), one write at a time; a shard where a
//! device turned failed by an urgent write of its own, `--urgent-spacing` after that
//! shard's last write, beside the other write if one is in flight, and beside up to
//! three other urgent writes (the file sink: its one document, after the previous
//! write). A failed write is retried by the next round.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use faultline_common::fault::FaultDocument;
use faultline_common::rules::Rules;
use faultline_common::time::now_ms;
use futures_util::FutureExt;
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::dispatch::{Dispatch, Settled};
use super::schedule::WriteSchedule;
pub use super::schedule::WriteTiming;
use crate::agents::collect::admit_raw;
use crate::agents::deliver::Deliveries;
use crate::agents::AgentEvent;
use crate::api::DocumentAsk;
use crate::metrics::{Metrics, Poll};
use crate::model::{ShardEvent, Takeover, Verdict};
use crate::pipeline::{Change, Pipeline, TICK_MS};
use crate::publish::{document, Publisher, Stamp, Written};

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
    /// The Lease loop's events, in order (the ConfigMap sink): shards taken with what
    /// to seed them from, the shards granted as they change, final writes.
    pub shards: Option<mpsc::Receiver<ShardEvent>>,
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
    /// When to write, and what.
    schedule: WriteSchedule,
    /// The urgent writes in flight (at most [`Publisher::urgent_in_flight`]).
    urgent_writing: Vec<tokio::task::JoinHandle<Written>>,
    sequence: u64,
    /// The whole document built for `GET /v1/faults`, shared by every asker until the
    /// next sequence (a burst of requests builds it once).
    asked: Option<(u64, Arc<FaultDocument>)>,
    writing: Option<tokio::task::JoinHandle<Written>>,
    /// Nodes whose pods are nudged once their shard is written.
    alarming: BTreeSet<String>,
    last_reconcile: Instant,
    /// Final writes waiting for the next write to finish.
    final_waiters: Vec<tokio::sync::oneshot::Sender<()>>,
    /// Node-local delivery of each changed entry, when on.
    deliveries: Option<Arc<Deliveries>>,
    /// Per node: when a refused document was last logged, and how many since were not.
    refused_logged: std::collections::HashMap<String, (u64, u32)>,
}

/// A node's refused documents are logged at most this often.
const REFUSED_LOG_MS: u64 = 60_000;
/// Agent events handled in one turn of the loop after the one that woke it.
const AGENT_BATCH: usize = 64;

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
            schedule: WriteSchedule::new(timing, publisher.held(), jittered(timing.interval)),
            pipeline,
            publisher,
            dispatch,
            metrics,
            timing,
            replica,
            ready,
            urgent_writing: Vec::new(),
            sequence: 0,
            asked: None,
            writing: None,
            alarming: BTreeSet::new(),
            last_reconcile: Instant::now(),
            final_waiters: Vec::new(),
            deliveries: None,
            refused_logged: std::collections::HashMap::new(),
        }
    }

    /// Deliver each node's entry to its agent as it changes.
    pub fn with_deliveries(mut self, deliveries: Option<Arc<Deliveries>>) -> Self {
        self.deliveries = deliveries;
        self
    }

    /// Offer `node`'s entry for delivery: when it changed, or when its agent has had
    /// none yet (just followed: a start, a takeover).
    fn deliver(&self, node: &str, changed: bool) {
        if let Some(d) = &self.deliveries {
            if changed || d.wants(node) {
                if let Some(entry) = self.pipeline.node_faults(node) {
                    d.offer(node, entry);
                }
            }
        }
    }

    /// Write a shard only once it is seeded from its last holder's document.
    pub fn with_seeding(mut self) -> Self {
        self.schedule.seed_before_writing();
        self
    }

    /// One event of the Lease loop's stream.
    fn on_shard_event(&mut self, ev: ShardEvent) {
        match ev {
            ShardEvent::Taken(t) => self.on_takeover(t),
            ShardEvent::Held => self.on_grants(),
            ShardEvent::FinalWrite(f) => {
                tracing::debug!(shard = f.shard, "final write before handing the shard back");
                self.final_waiters.push(f.done);
                self.schedule.final_write();
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
        // Drain intents stay published; their passes re-arm the deadlines.
        if let Some(d) = self.dispatch.as_mut() {
            for n in t.nodes.iter().filter(|n| !n.drain.is_empty()) {
                d.wake_soon(&n.node);
            }
        }
        // Written once granted (`on_grants`), by a write of its own.
        self.schedule.seeded_shard(t.shard);
    }

    /// When the next write is due.
    fn due(&self) -> tokio::time::Instant {
        match self.schedule.due() {
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
        // The stop and the write timer live across iterations (made anew for
        // each document, they were a waiter registered on the token and a timer wheel
        // insertion and removal each).
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
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
                .schedule
                .urgent_due(Instant::now())
                .map(tokio::time::Instant::from_std)
                .filter(|_| self.urgent_room());
            // Biased, in this order: the Lease loop's events before all else (a
            // shard's seed is in before its agents' documents: the Lease loop sends the
            // takeover before the shard counts as held, and the followers start only
            // then), and the agents last (their flood never holds back a timer).
            tokio::select! {
                biased;
                Some(ev) = recv_opt(&mut inputs.shards) => self.on_shard_event(ev),
                _ = &mut cancelled => break,
                _ = sleep_until_opt(urgent_at) => self.write_urgent(),
                _ = &mut write_timer, if can_write => self.write(),
                _ = tick.tick() => self.on_tick(),
                v = inputs.verdicts.recv(), if !inputs.verdicts.is_closed() || !inputs.verdicts.is_empty() => {
                    if let (Some(v), Some(d)) = (v, self.dispatch.as_mut()) {
                        d.verdict(&self.pipeline, v);
                    }
                }
                Some(s) = recv_settled(&mut inputs.settled) => self.on_settled(s),
                _ = sleep_until_opt(self.dispatch.as_ref().and_then(|d| d.next_wake())) => {
                    if let Some(d) = self.dispatch.as_mut() {
                        d.wake_due(&self.pipeline);
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
                ev = inputs.agents.recv() => {
                    let Some(ev) = ev else { break };
                    self.on_agent(ev);
                    // Whatever else is queued, in the same turn (bounded, so the other
                    // inputs are not starved), until a shard event comes first.
                    for _ in 0..AGENT_BATCH {
                        if inputs.shards.as_ref().is_some_and(|s| !s.is_empty()) {
                            break;
                        }
                        match inputs.agents.try_recv() {
                            Ok(ev) => self.on_agent(ev),
                            Err(_) => break,
                        }
                    }
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

    /// Log a refused document, at most once a minute per node with the count of those
    /// not logged (a line per refused document was 394 KB/s of logs from one
    /// hostile agent); the metric counts every one.
    fn log_refused(&mut self, node: &str, error: &str, now: u64) {
        if let Some(suppressed) = once_per(&mut self.refused_logged, node, now, REFUSED_LOG_MS) {
            tracing::warn!(%node, %error, suppressed, "agent document refused (logged once a minute per node)");
        }
    }

    fn on_agent(&mut self, ev: AgentEvent) {
        let now = now_ms();
        let followed: Option<Arc<str>> = match &ev {
            AgentEvent::Raw { node, .. } => Some(node.clone()),
            AgentEvent::Unreachable { node, .. } => Some(Arc::from(node.as_str())),
            AgentEvent::Removed { .. } => None,
        };
        let c = match ev {
            AgentEvent::Raw { node, body } => match admit_raw(&node, &body) {
                Ok(doc) => {
                    self.metrics.agent_poll(Poll::Ok);
                    self.pipeline.on_view(&doc, &body, now)
                }
                Err(e) => {
                    self.metrics.agent_poll(Poll::Error);
                    self.metrics.agent_poll_error(e.metric_label());
                    let error = e.to_string();
                    self.log_refused(&node, &error, now);
                    self.pipeline.on_unreachable(&node, &error, now)
                }
            },
            AgentEvent::Unreachable { node, error } => {
                self.pipeline.on_unreachable(&node, &error, now)
            }
            AgentEvent::Removed { node } => Change {
                nodes: {
                    self.refused_logged.remove(&node);
                    if self.pipeline.remove_node(&node) {
                        vec![node]
                    } else {
                        vec![]
                    }
                },
                ..Default::default()
            },
        };
        self.on_change(c);
        if let Some(node) = followed {
            self.deliver(&node, false);
        }
    }

    /// A pass's report: verdicts settled, and the node's drain intents,
    /// published at once (an urgent write, and the node's agent) with a wake at the
    /// next deadline.
    fn on_settled(&mut self, mut s: Settled) {
        if let Some(marks) = s.marks.take() {
            if self.pipeline.set_marks(&s.node, marks, now_ms()) {
                self.on_change(Change {
                    nodes: vec![s.node.clone()],
                    ..Default::default()
                });
            }
        }
        if let Some((notices, wake)) = s.drains.take() {
            if self.pipeline.set_drain(&s.node, notices, now_ms()) {
                self.on_change(Change {
                    nodes: vec![s.node.clone()],
                    urgent: true,
                    ..Default::default()
                });
            }
            if let (Some(at), Some(d)) = (wake, self.dispatch.as_mut()) {
                d.wake_at(&s.node, at);
            }
        }
        if let Some(d) = self.dispatch.as_mut() {
            d.settle(s);
        }
    }

    /// What a change means beyond the document: urgency, remediation, nudges.
    fn on_change(&mut self, c: Change) {
        for n in &c.nodes {
            self.schedule.changed(self.publisher.shard_of(n));
            self.deliver(n, true);
        }
        if c.urgent {
            for n in &c.nodes {
                self.schedule.urgent(self.publisher.shard_of(n));
            }
            if let Some(d) = &self.dispatch {
                d.remediate(&self.pipeline, c.alarming.clone());
            }
        }
        // A pod acknowledged its drain intent: its node's pass evicts it now (shortly,
        // if one is running).
        if let (false, Some(d)) = (c.drain_acked.is_empty(), self.dispatch.as_mut()) {
            for n in &c.drain_acked {
                d.wake_at(n, 0);
            }
            d.wake_due(&self.pipeline);
        }
        self.alarming.extend(c.alarming);
    }

    fn on_tick(&mut self) {
        let c = self.pipeline.tick(now_ms());
        self.reap_writes();
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
    /// the tick): a shard just taken is written at once, and so is one whose hold ran
    /// out and was renewed between two looks (a write meanwhile skipped it).
    fn on_grants(&mut self) {
        self.schedule
            .held(self.publisher.held(), self.publisher.granted());
        self.schedule.held_again(self.publisher.take_lapsed());
    }

    /// Whether another urgent write may start: fewer than the publisher's bound are in
    /// flight (a fault of another shard waited for the one before it, up to a
    /// page write of 80 ms).
    fn urgent_room(&mut self) -> bool {
        self.reap_writes();
        self.urgent_writing.len() < self.publisher.urgent_in_flight()
    }

    /// Take the write tasks that ended: a write that failed (or whose task died) makes
    /// the next one cover every shard. (A finished task's result is read without
    /// waiting; one that tokio's cooperative budget defers is read at the next look.)
    fn reap_writes(&mut self) {
        let mut failed = false;
        let mut ended = |h: &mut tokio::task::JoinHandle<Written>| -> bool {
            if !h.is_finished() {
                return false;
            }
            match h.now_or_never() {
                Some(r) => {
                    failed |= !matches!(r, Ok(Written::Done));
                    true
                }
                None => false,
            }
        };
        self.urgent_writing.retain_mut(|h| !ended(h));
        if self.writing.as_mut().is_some_and(&mut ended) {
            self.writing = None;
        }
        if failed {
            tracing::debug!("a write failed; the next one retries it");
            self.schedule.write_failed();
        }
    }

    /// The next document's sequence, noted for remediation (a DeviceTaintRule names
    /// the one current when it was decided).
    fn next_sequence(&mut self) {
        self.sequence += 1;
        if let Some(d) = &self.dispatch {
            d.note_sequence(self.sequence);
        }
    }

    /// Write the urgent shards whose spacing has passed, and only them.
    fn write_urgent(&mut self) {
        let Some(plan) = self.schedule.take_urgent(Instant::now()) else {
            return;
        };
        self.next_sequence();
        self.ready.store(true, Ordering::Release);
        let task = self.publisher.write(
            &self.pipeline,
            Stamp {
                sequence: self.sequence,
                writer: &self.replica,
                seeded: self.schedule.seeded(),
                urgent: &plan.shards,
                changed: &plan.shards,
                include: &plan.shards,
                refresh: &plan.refresh,
                whole: false,
            },
            &mut self.alarming,
            &self.metrics,
        );
        self.urgent_writing.push(task);
    }

    fn write(&mut self) {
        self.reap_writes();
        if self.writing.take().is_some() {
            // Finished (the timer waits for that), its result deferred by tokio's budget:
            // written again whole, as after a failure, rather than lost.
            self.schedule.write_failed();
        }
        self.next_sequence();
        self.ready.store(true, Ordering::Release);
        let held = self.publisher.held();
        let plan = self
            .schedule
            .take_write(&held, Instant::now(), jittered(self.timing.interval));
        let task = self.publisher.write(
            &self.pipeline,
            Stamp {
                sequence: self.sequence,
                writer: &self.replica,
                seeded: self.schedule.seeded(),
                urgent: &plan.urgent,
                changed: &plan.changed,
                include: &plan.include,
                refresh: &plan.refresh,
                whole: plan.whole,
            },
            &mut self.alarming,
            &self.metrics,
        );
        let waiters = std::mem::take(&mut self.final_waiters);
        self.writing = Some(if waiters.is_empty() {
            task
        } else {
            tokio::spawn(async move {
                let written = task.await.unwrap_or(Written::Failed);
                for w in waiters {
                    let _ = w.send(());
                }
                written
            })
        });
    }

    /// Graceful stop: the intake no longer accepts (the server stopped with the same
    /// token); in-flight remediation gets --shutdown-timeout to finish, then the caller
    /// releases the Leases and the next holder continues from the records.
    async fn finish(self) {
        for w in self.urgent_writing {
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

/// Whether `key` may be logged at `now` (once per `every` ms): the number of times it was
/// not since the last, or `None` (counted).
fn once_per(
    log: &mut std::collections::HashMap<String, (u64, u32)>,
    key: &str,
    now: u64,
    every: u64,
) -> Option<u32> {
    let slot = log.entry(key.to_string()).or_insert((0, 0));
    if slot.0 != 0 && now.saturating_sub(slot.0) < every {
        slot.1 += 1;
        return None;
    }
    slot.0 = now;
    Some(std::mem::take(&mut slot.1))
}

/// Until `at`, or never.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
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

    /// A node's refused documents are logged once a minute, with the count
    /// of those that were not.
    #[test]
    fn refused_documents_are_logged_once_a_minute_per_node() {
        let mut log = std::collections::HashMap::new();
        assert_eq!(once_per(&mut log, "evil", 1_000, 60_000), Some(0));
        for t in 1..=100 {
            assert_eq!(once_per(&mut log, "evil", 1_000 + t * 100, 60_000), None);
        }
        assert_eq!(
            once_per(&mut log, "good", 2_000, 60_000),
            Some(0),
            "per node"
        );
        assert_eq!(once_per(&mut log, "evil", 61_000, 60_000), Some(100));
        assert_eq!(once_per(&mut log, "evil", 61_500, 60_000), None);
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
