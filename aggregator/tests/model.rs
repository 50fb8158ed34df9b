//! The shard Lease, the fence, the budget, the breaker and the
//! release, model-checked with `stateright`. Every transition asks the product's own pure
//! decisions, so the checker checks the code, not a copy of it:
//!
//! - the Lease pass: [`Observer::pass`] (others' Leases judged on this replica's clock)
//!   and [`plan`] (renew, hand back, take up to the fair share);
//! - the hold a renewal gives: [`LeaseConfig::hold_until`]; the fence: [`holding`];
//! - the budget: [`policy::take_place`] (the ledger's places and the quarantined
//!   Nodes, counted by [`Budget::refusal`]); the breaker's shared count:
//!   [`policy::note_failure`]; what an open breaker stops: [`policy::breaker_stops`];
//! - eviction: [`policy::record_evicts`] (an unknown-only quarantine never evicts) and
//!   [`policy::wants_eviction`].
//!
//! What the model adds is the world: a Lease store with compare-and-swap on a version
//! (the resourceVersion), replicas whose Lease pass is a read and then a write with
//! anything in between (time, the other replica, a lost answer), a crash, a graceful
//! stop that releases, nodes that fail, turn Unknown and heal, a person who closes the
//! breaker. Virtual seconds; in the four protocol labs each replica's `Instant`s are
//! that clock. In the two-clock lab a replica's clock may fall behind the other's (by
//! up to the margin) and a Lease write may go a second after its read.
//!
//! The invariants are the README's: one writer per shard; the budget (at most
//! `max_nodes` quarantined: each quarantine takes its place in the budget's ledger by
//! compare-and-swap before its write, so a replica counts the other's decision before
//! it lands; docs/remediation.md proves the bound); no eviction on Unknown; no action without the
//! Lease; a release never blocked by an open breaker. `sometimes` properties are the
//! floors: each interesting thing happens in some reachable state of its lab, so a lab
//! that cannot reach them fails. Each invariant fails when its guard in product code is
//! mutated (scripts/guardrail-mutations.py, group 19), not a flag of the model's.
//!
//! `cargo test -p faultline-aggregator --test model` explores five labs (CI, 22.1 M
//! states); `MODEL_FULL=1 cargo test -p faultline-aggregator --test model --
//! --nocapture the_lease` the full one (more than 10^7 states; docs/testing.md has the
//! figures). `MODEL_UNTIL` and `MODEL_EVENTS` set its bounds.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::time::Instant;

use faultline_aggregator::model::RecordDevice;
use faultline_aggregator::remediate::policy::{self, Budget, Noted, Place, Step};
use faultline_aggregator::remediate::view::PodView;
use faultline_aggregator::shard::held::holding;
use faultline_aggregator::shard::plan::{plan, Listing, Observer, PlanInput, Record};
use faultline_aggregator::shard::LeaseConfig;
use stateright::{Checker, Model, Property};

/// Lease timing, in virtual seconds: what the tests' replicas use, scaled (the labs
/// on one clock).
const DURATION: u64 = 3;
const RETRY: u64 = 1;
const MARGIN: u64 = 1;

/// One base instant: virtual second `t` is `base() + t s` on every replica.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn at(t: u64) -> Instant {
    base() + Duration::from_secs(t)
}

fn cfg() -> LeaseConfig {
    LeaseConfig {
        duration: Duration::from_secs(DURATION),
        retry: Duration::from_secs(RETRY),
        margin: Duration::from_secs(MARGIN),
    }
}

/// The two-clock lab's Lease: a margin of two seconds, so a clock may fall behind by
/// as much (in whole seconds, with the fence's `now < until`, a take lands no sooner
/// than the lagging holder's hold ends), and a call may take one second (the loop gives
/// a Lease call up at half the hold, `call_deadline`).
fn two_clocks_cfg() -> LeaseConfig {
    LeaseConfig {
        duration: Duration::from_secs(4),
        retry: Duration::from_secs(1),
        margin: Duration::from_secs(2),
    }
}

fn name(r: usize) -> String {
    format!("r{r}")
}

#[derive(Clone)]
struct Lab {
    replicas: usize,
    shards: u32,
    /// Each node's shard.
    nodes: Vec<u32>,
    /// The last virtual second explored.
    until: u64,
    /// Environment events (a node failing, Unknown or healing; a crash; a stop; the
    /// breaker closed by a person) at most.
    events: u8,
    budget: Budget,
    /// Distinct failed nodes that trip the breaker.
    breaker_nodes: usize,
    /// The Lease's timing.
    cfg: LeaseConfig,
    /// How far a replica's clock may fall behind the world's (seconds): a clock that
    /// stands still for a second now and then, as a slow one does. 0: one clock.
    max_lag: u64,
    /// A Lease pass's write may go in a later second than its read (within the call
    /// deadline); else both fall within one second.
    slow_writes: bool,
    /// The Lease alone: the node is failed from the start (a write to make, under the
    /// fence), nodes change no more, and instead of single lost answers a replica may
    /// be cut off: every Lease write of its from then on is lost, while its other
    /// writes still go (a partition; the Lease calls time out).
    lease_only: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Status {
    Healthy,
    Failed,
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Lease {
    holder: Option<usize>,
    /// The resourceVersion: every write moves it.
    version: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    Renew,
    HandBack,
    Take,
}

/// A Lease pass between its read and its write.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Pass {
    /// When it read the Leases (world seconds).
    read_at: u64,
    /// (shard, what, the version read); takes in the plan's order of preference.
    ops: Vec<(u32, Op, u32)>,
    /// How many of the takes to make at most.
    room: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Replica {
    alive: bool,
    observer: Observer,
    /// Per shard, held until (this replica's clock).
    held: Vec<Option<Instant>>,
    joined: bool,
    hold_off: Option<Instant>,
    pass: Option<Pass>,
    /// A Lease pass began this virtual second: one per `RETRY`, as the loop's timer
    /// (and what keeps the versions, so the state space, finite).
    passed: bool,
    /// A quarantine decided (budget and breaker asked) and not yet written: the
    /// replica's budget turn is held meanwhile.
    decided: Option<usize>,
    /// Restarted after a crash (once: a new process, nothing kept but the cluster).
    restarted: bool,
    /// How far this replica's clock is behind the world's (seconds).
    lag: u64,
    /// Its Lease writes are lost from now on (`Lab::lease_only`).
    cut_off: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct NodeState {
    status: Status,
    /// Our taint, and whether it is the unknown guard's (unknown-only).
    quarantine: Option<bool>,
    /// The pod on its device evicted.
    evicted: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct World {
    t: u64,
    leases: Vec<Option<Lease>>,
    /// Member Leases: each replica's renewal count, while it has one.
    members: Vec<Option<u32>>,
    replicas: Vec<Replica>,
    nodes: Vec<NodeState>,
    breaker_open: bool,
    /// The breaker's shared count: node -> when (virtual seconds, as text).
    failures: BTreeMap<String, String>,
    /// The budget's ledger: the places taken (compare-and-swap), landed or not. They are
    /// all younger than `PLACE_TTL` within the labs' seconds: none expires.
    places: BTreeMap<String, Place>,
    events: u8,
    /// No replica has stepped since the clock moved: a node's health and a person's
    /// hand change only here, on the second (a reduction: what a replica does within a
    /// second interleaves freely with the other replica, crashes and stops, but a node
    /// event lands between seconds).
    on_the_second: bool,
    /// History: something written for a node whose shard's Lease did not name the writer.
    acted_without_lease: bool,
    /// History: a pod evicted from a node no failed verdict quarantined.
    evicted_on_unknown: bool,
    /// Floors.
    held_back: bool,
    took_over: bool,
    released: bool,
    tripped: bool,
    unknown_then_failed: bool,
    restarted: bool,
    /// A renewal or take written a second after its read.
    late_lease_write: bool,
    /// A replica acting on a clock behind the world's.
    lagged_holder: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    /// The world's clock moves and this replica's stands still (it falls behind).
    TickSlow(usize),
    LeaseRead(usize),
    LeaseWrite(usize),
    /// The Lease write's answer is lost: nothing known, the holds run out on their own.
    LeaseLost(usize),
    Decide(usize, usize),
    Quarantine(usize),
    GuardUnknown(usize, usize),
    Evict(usize, usize),
    Release(usize, usize),
    Fail(usize),
    TurnUnknown(usize),
    Heal(usize),
    Crash(usize),
    /// A crashed replica's process starts again (once).
    Restart(usize),
    /// From now on this replica's Lease writes are lost (`Lab::lease_only`).
    CutOff(usize),
    Stop(usize),
    CloseBreaker,
}

fn device() -> RecordDevice {
    RecordDevice {
        id: "gpu0".into(),
        uuid: None,
        pci_bus_id: None,
        reason: "xid-79".into(),
        source: None,
        metric: None,
        value: None,
        recovery_action: None,
        phy_id: None,
        dra: None,
    }
}

/// The training pod on the node's device; the kubelet does not say which device it
/// holds (no KEP-4680), the common case.
fn pod() -> PodView {
    PodView {
        finished: false,
        terminating: false,
        mirror: false,
        daemon: false,
        canary: false,
        accelerator: true,
        held: vec![],
    }
}

impl Lab {
    /// Replica `r` as its process starts: nothing held, nothing observed. A restarted
    /// one waits for the next second for its first pass, as its loop's timer does.
    fn fresh(&self, r: usize, restarted: bool) -> Replica {
        Replica {
            alive: true,
            observer: Observer::new(&name(r), self.cfg.duration),
            held: vec![None; self.shards as usize],
            joined: false,
            hold_off: None,
            pass: None,
            passed: restarted,
            decided: None,
            restarted,
            lag: 0,
            cut_off: false,
        }
    }

    /// Now on replica `r`'s clock.
    fn now(&self, w: &World, r: usize) -> Instant {
        at(w.t - w.replicas[r].lag)
    }

    fn holds(&self, w: &World, r: usize, shard: u32) -> bool {
        let rep = &w.replicas[r];
        rep.alive && holding(rep.held[shard as usize], self.now(w, r))
    }

    /// What the fence lets through for a write of `node` by `r` now.
    fn fence(&self, w: &World, r: usize, node: usize) -> bool {
        self.holds(w, r, self.nodes[node])
    }

    fn quarantined(&self, w: &World) -> usize {
        w.nodes
            .iter()
            .filter(|n| n.quarantine == Some(false))
            .count()
    }

    fn breaker_stops(&self, step: Step) -> bool {
        policy::breaker_stops(step)
    }

    fn can_release(&self, w: &World, r: usize, n: usize) -> bool {
        let node = &w.nodes[n];
        node.quarantine.is_some()
            && node.status == Status::Healthy
            && self.holds(w, r, self.nodes[n])
            && !(w.breaker_open && self.breaker_stops(Step::Release))
    }

    fn listing(&self, w: &World) -> Listing {
        let record = |holder: Option<usize>, version: u32| Record {
            holder: holder.map(name),
            renew: Some(i128::from(version)),
            acquire: None,
            transitions: None,
            duration_secs: Some(self.cfg.duration.as_secs() as i32),
        };
        Listing {
            shards: w
                .leases
                .iter()
                .enumerate()
                .filter_map(|(s, l)| {
                    Some((s as u32, record(l.as_ref()?.holder, l.as_ref()?.version)))
                })
                .collect(),
            members: w
                .members
                .iter()
                .enumerate()
                .filter_map(|(r, v)| Some((name(r), record(Some(r), (*v)?))))
                .collect(),
        }
    }

    fn act(&self, w: &mut World, r: usize, node: usize) {
        if w.replicas[r].lag > 0 {
            w.lagged_holder = true;
        }
        if w.leases[self.nodes[node] as usize]
            .as_ref()
            .and_then(|l| l.holder)
            != Some(r)
        {
            w.acted_without_lease = true;
        }
    }

    fn lease_read(&self, w: &mut World, r: usize) {
        let now = self.now(w, r);
        let listing = self.listing(w);
        let rep = &mut w.replicas[r];
        let seen = rep.observer.pass(&listing, self.shards, now);
        let me = name(r);
        let p = plan(&PlanInput {
            me: &me,
            shards: &seen.shards,
            live: Some(&seen.live),
            joined: rep.joined,
            hold_off: rep.hold_off,
            retry: self.cfg.retry,
            now,
        });
        rep.joined = p.joined;
        rep.hold_off = p.hold_off;
        let version = |s: u32| w.leases[s as usize].as_ref().map_or(0, |l| l.version);
        let mut ops: Vec<(u32, Op, u32)> = Vec::new();
        ops.extend(p.renew.iter().map(|s| (*s, Op::Renew, version(*s))));
        ops.extend(p.hand_back.iter().map(|s| (*s, Op::HandBack, version(*s))));
        ops.extend(p.take.iter().map(|s| (*s, Op::Take, version(*s))));
        w.replicas[r].pass = Some(Pass {
            read_at: w.t,
            ops,
            room: p.room,
        });
        w.replicas[r].passed = true;
    }

    fn lease_write(&self, w: &mut World, r: usize) {
        let Some(pass) = w.replicas[r].pass.take() else {
            return;
        };
        if w.replicas[r].cut_off {
            return;
        }
        if pass.read_at < w.t {
            w.late_lease_write = true;
        }
        // The member Lease is renewed with every pass, and lost with its other writes
        // when the API server's answers are (LeaseLost: a partitioned replica).
        w.members[r] = Some(w.members[r].map_or(0, |v| v + 1));
        // Sent now: the hold counts from here, on this replica's clock (the loop's
        // `started`, taken right before the write goes).
        let now = self.now(w, r);
        let mut taken = 0;
        for (s, op, read) in pass.ops {
            let i = s as usize;
            let current = w.leases[i].clone();
            let unchanged = current.as_ref().map_or(0, |l| l.version) == read;
            let next = current.as_ref().map_or(1, |l| l.version + 1);
            match op {
                Op::Renew => {
                    if unchanged && current.as_ref().and_then(|l| l.holder) == Some(r) {
                        w.leases[i] = Some(Lease {
                            holder: Some(r),
                            version: next,
                        });
                        w.replicas[r].held[i] = Some(self.cfg.hold_until(now));
                    } else {
                        w.replicas[r].held[i] = None;
                    }
                }
                Op::HandBack => {
                    w.replicas[r].held[i] = None;
                    if unchanged {
                        w.leases[i] = Some(Lease {
                            holder: None,
                            version: next,
                        });
                    }
                }
                Op::Take => {
                    if taken >= pass.room {
                        continue;
                    }
                    w.replicas[r].observer.forget_shard(s);
                    if unchanged {
                        let previous = current.as_ref().and_then(|l| l.holder);
                        if previous.is_some_and(|p| p != r) {
                            w.took_over = true;
                        }
                        w.leases[i] = Some(Lease {
                            holder: Some(r),
                            version: next,
                        });
                        w.replicas[r].held[i] = Some(self.cfg.hold_until(now));
                        taken += 1;
                    }
                }
            }
        }
    }
}

impl Model for Lab {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let mut w = World {
            t: 0,
            leases: vec![None; self.shards as usize],
            members: vec![None; self.replicas],
            replicas: (0..self.replicas).map(|r| self.fresh(r, false)).collect(),
            nodes: vec![
                NodeState {
                    status: if self.lease_only {
                        Status::Failed
                    } else {
                        Status::Healthy
                    },
                    quarantine: None,
                    evicted: false,
                };
                self.nodes.len()
            ],
            breaker_open: false,
            failures: BTreeMap::new(),
            places: BTreeMap::new(),
            events: self.events,
            on_the_second: true,
            acted_without_lease: false,
            evicted_on_unknown: false,
            held_back: false,
            took_over: false,
            released: false,
            tripped: false,
            unknown_then_failed: false,
            restarted: false,
            late_lease_write: false,
            lagged_holder: false,
        };
        if self.lease_only {
            // Replica 0 holds the shard from the start: it took it just now.
            w.leases[0] = Some(Lease {
                holder: Some(0),
                version: 1,
            });
            w.members[0] = Some(0);
            w.replicas[0].held[0] = Some(self.cfg.hold_until(at(0)));
        }
        vec![w]
    }

    fn actions(&self, w: &World, actions: &mut Vec<Action>) {
        // The clock moves once every live replica's Lease pass of this second is done
        // (written or its answer lost): each loop keeps its timer. A loop slower than
        // that is a lost answer, a crash or a stop, all of which happen here.
        // With slow writes, a pass begun this second may write in the next (its write
        // waits for the call deadline at most; the loop does not begin another pass
        // before it is done).
        let passes_done = w
            .replicas
            .iter()
            .all(|rep| !rep.alive || (rep.passed && (self.slow_writes || rep.pass.is_none())));
        if w.t < self.until && passes_done {
            actions.push(Action::Tick);
            // Replica 0's clock may fall behind; what counts is the skew between the
            // two, so one clock drifting covers either running slow or fast.
            if w.replicas[0].lag < self.max_lag {
                actions.push(Action::TickSlow(0));
            }
        }
        let deadline = self.cfg.call_deadline().as_secs();
        for (r, rep) in w.replicas.iter().enumerate() {
            if !rep.alive {
                if !rep.restarted {
                    actions.push(Action::Restart(r));
                }
                continue;
            }
            if rep.pass.is_none() {
                if !rep.passed {
                    actions.push(Action::LeaseRead(r));
                }
            } else {
                if rep
                    .pass
                    .as_ref()
                    .is_some_and(|p| w.t - p.read_at <= deadline)
                {
                    actions.push(Action::LeaseWrite(r));
                }
                if !self.lease_only {
                    actions.push(Action::LeaseLost(r));
                }
            }
            if rep.decided.is_some() {
                actions.push(Action::Quarantine(r));
            }
            for (n, node) in w.nodes.iter().enumerate() {
                if !self.holds(w, r, self.nodes[n]) {
                    continue;
                }
                match (node.status, node.quarantine) {
                    // A node the unknown guard tainted whose device then fails is
                    // quarantined for the failure, asking the budget as any other.
                    (Status::Failed, None | Some(true)) if rep.decided.is_none() => {
                        actions.push(Action::Decide(r, n))
                    }
                    (Status::Unknown, None) => actions.push(Action::GuardUnknown(r, n)),
                    _ => {}
                }
                if node.quarantine.is_some() && !node.evicted {
                    actions.push(Action::Evict(r, n));
                }
                if self.can_release(w, r, n) {
                    actions.push(Action::Release(r, n));
                }
            }
            if w.events > 0 {
                actions.push(Action::Crash(r));
                actions.push(Action::Stop(r));
                if self.lease_only && !rep.cut_off {
                    actions.push(Action::CutOff(r));
                }
            }
        }
        if w.events > 0 && w.on_the_second && !self.lease_only {
            for (n, node) in w.nodes.iter().enumerate() {
                match node.status {
                    Status::Healthy => {
                        actions.push(Action::Fail(n));
                        actions.push(Action::TurnUnknown(n));
                    }
                    // An unknown device that then reads failed.
                    Status::Unknown => {
                        actions.push(Action::Fail(n));
                        actions.push(Action::Heal(n));
                    }
                    Status::Failed => actions.push(Action::Heal(n)),
                }
            }
            if w.breaker_open {
                actions.push(Action::CloseBreaker);
            }
        }
    }

    fn next_state(&self, last: &World, action: Action) -> Option<World> {
        let mut w = last.clone();
        w.on_the_second = matches!(
            action,
            Action::Tick
                | Action::TickSlow(_)
                | Action::Fail(_)
                | Action::TurnUnknown(_)
                | Action::Heal(_)
                | Action::CloseBreaker
        );
        match action {
            Action::Tick | Action::TickSlow(_) => {
                w.t += 1;
                for rep in &mut w.replicas {
                    rep.passed = false;
                }
                if let Action::TickSlow(r) = action {
                    w.replicas[r].lag += 1;
                }
            }
            Action::LeaseRead(r) => self.lease_read(&mut w, r),
            Action::LeaseWrite(r) => self.lease_write(&mut w, r),
            Action::LeaseLost(r) => w.replicas[r].pass = None,
            Action::CutOff(r) => {
                w.events -= 1;
                w.replicas[r].cut_off = true;
            }
            Action::Decide(r, n) => {
                // The breaker counts the failed node (cluster-wide, compare-and-swap).
                let now = w.t;
                let noted = policy::note_failure(
                    w.breaker_open,
                    &mut w.failures,
                    &format!("n{n}"),
                    &now.to_string(),
                    |when| Some(now.saturating_sub(when.parse().ok()?) as f64),
                    self.breaker_nodes,
                    60.0,
                );
                if noted == Noted::Tripped {
                    w.breaker_open = true;
                    w.tripped = true;
                }
                if w.breaker_open && self.breaker_stops(Step::Isolate) {
                    return Some(w);
                }
                // The budget, asked with this replica's turn held until the write: the
                // quarantined Nodes and the ledger's places, the node's place taken in
                // one compare-and-swap (a conflict reads again: one atomic step here).
                let quarantined: BTreeMap<String, Option<String>> = (0..self.nodes.len())
                    .filter(|m| w.nodes[*m].quarantine == Some(false))
                    .map(|m| (format!("n{m}"), None))
                    .collect();
                let place = Place {
                    at: "0".into(),
                    by: format!("r{r}"),
                    domain: None,
                };
                let refused = policy::take_place(
                    &self.budget,
                    &mut w.places,
                    &quarantined,
                    (&format!("n{n}"), None),
                    place,
                    |_| Some(0.0),
                    || self.nodes.len(),
                )
                .is_some();
                if refused {
                    w.held_back = true;
                } else {
                    w.replicas[r].decided = Some(n);
                }
            }
            Action::Quarantine(r) => {
                let n = w.replicas[r].decided.take()?;
                if self.fence(&w, r, n) && w.nodes[n].quarantine != Some(false) {
                    self.act(&mut w, r, n);
                    if w.nodes[n].quarantine == Some(true) {
                        w.unknown_then_failed = true;
                    }
                    w.nodes[n].quarantine = Some(false);
                }
            }
            Action::GuardUnknown(r, n) => {
                self.act(&mut w, r, n);
                w.nodes[n].quarantine = Some(true);
            }
            Action::Evict(r, n) => {
                if w.breaker_open && self.breaker_stops(Step::Evict) {
                    return None;
                }
                let unknown_only = w.nodes[n].quarantine == Some(true);
                let evicts = policy::record_evicts(unknown_only);
                // The devices the quarantine recorded failed (none for an unknown-only one).
                let failed = if unknown_only { vec![] } else { vec![device()] };
                if !evicts || !policy::wants_eviction(&pod(), &failed) {
                    return None;
                }
                self.act(&mut w, r, n);
                if unknown_only {
                    w.evicted_on_unknown = true;
                }
                w.nodes[n].evicted = true;
            }
            Action::Release(r, n) => {
                self.act(&mut w, r, n);
                // The node's place goes with its quarantine (`BudgetGuard::forget`).
                w.places.remove(&format!("n{n}"));
                w.nodes[n].quarantine = None;
                w.nodes[n].evicted = false;
                w.released = true;
            }
            Action::Fail(n) => {
                w.events -= 1;
                w.nodes[n].status = Status::Failed;
            }
            Action::TurnUnknown(n) => {
                w.events -= 1;
                w.nodes[n].status = Status::Unknown;
            }
            Action::Heal(n) => {
                w.events -= 1;
                w.nodes[n].status = Status::Healthy;
            }
            Action::Crash(r) => {
                w.events -= 1;
                w.replicas[r].alive = false;
                w.replicas[r].decided = None;
                w.replicas[r].pass = None;
            }
            Action::Restart(r) => {
                // A new process: nothing held, nothing observed; its old member
                // Lease is still there, renewed by the new one.
                let lag = w.replicas[r].lag;
                w.replicas[r] = self.fresh(r, true);
                w.replicas[r].lag = lag;
                w.restarted = true;
            }
            Action::Stop(r) => {
                // SIGTERM: every shard held is released (compare-and-swap on what this
                // replica last wrote), and the member Lease deleted.
                w.events -= 1;
                for s in 0..self.shards as usize {
                    if w.replicas[r].held[s].is_some() {
                        if let Some(l) = &mut w.leases[s] {
                            if l.holder == Some(r) {
                                l.holder = None;
                                l.version += 1;
                            }
                        }
                    }
                }
                w.members[r] = None;
                w.replicas[r].alive = false;
            }
            Action::CloseBreaker => {
                w.events -= 1;
                w.breaker_open = false;
            }
        }
        Some(w)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("one writer per shard", |lab: &Lab, w: &World| {
                (0..lab.shards)
                    .all(|s| (0..lab.replicas).filter(|r| lab.holds(w, *r, s)).count() <= 1)
            }),
            Property::always("budget", |lab: &Lab, w: &World| {
                lab.quarantined(w) <= lab.budget.max_nodes
            }),
            Property::always("no eviction on Unknown", |_: &Lab, w: &World| {
                !w.evicted_on_unknown
            }),
            Property::always("no action without the Lease", |_: &Lab, w: &World| {
                !w.acted_without_lease
            }),
            Property::always(
                "a release never blocked by an open breaker",
                |lab: &Lab, w: &World| {
                    !w.breaker_open
                        || (0..lab.replicas).all(|r| {
                            (0..lab.nodes.len()).all(|n| {
                                let node = &w.nodes[n];
                                let due = node.quarantine.is_some()
                                    && node.status == Status::Healthy
                                    && lab.holds(w, r, lab.nodes[n]);
                                !due || lab.can_release(w, r, n)
                            })
                        })
                },
            ),
            Property::sometimes("a quarantine", |lab: &Lab, w: &World| {
                lab.quarantined(w) > 0
            }),
            Property::sometimes("the budget's bound reached", |lab: &Lab, w: &World| {
                lab.quarantined(w) == lab.budget.max_nodes
            }),
            Property::sometimes("an eviction", |_: &Lab, w: &World| {
                w.nodes.iter().any(|n| n.evicted)
            }),
            Property::sometimes("a budget hold-back", |_: &Lab, w: &World| w.held_back),
            Property::sometimes("a takeover", |_: &Lab, w: &World| w.took_over),
            Property::sometimes("a release", |_: &Lab, w: &World| w.released),
            Property::sometimes("the breaker trips", |_: &Lab, w: &World| w.tripped),
            Property::sometimes("tainted unknown, then failed", |_: &Lab, w: &World| {
                w.unknown_then_failed
            }),
            Property::sometimes("a restart", |_: &Lab, w: &World| w.restarted),
            Property::sometimes(
                "a Lease written a second after its read",
                |_: &Lab, w: &World| w.late_lease_write,
            ),
            Property::sometimes("a holder acting on a clock behind", |_: &Lab, w: &World| {
                w.lagged_holder
            }),
        ]
    }
}

/// 2 replicas, 2 shards, 3 nodes (one on shard 0, two on shard 1), a budget of
/// `max_nodes`, a breaker at `breaker_nodes`.
fn lab(until: u64, events: u8, max_nodes: usize, breaker_nodes: usize) -> Lab {
    Lab {
        replicas: 2,
        shards: 2,
        nodes: vec![0, 1, 1],
        until,
        events,
        budget: Budget {
            max_nodes,
            max_percent: 100.0,
            per_domain: None,
            node_selector: String::new(),
            max_unknown: 1,
        },
        breaker_nodes,
        cfg: cfg(),
        max_lag: 0,
        slow_writes: false,
        lease_only: false,
    }
}

/// The Lease on two clocks: 2 replicas, 1 shard, 1 node failed from the start, a Lease
/// of 4 s with a 2 s margin, replica 0 holding it; replica 0's clock may fall up to two
/// seconds behind the world's (the other's), and a Lease write may go a second after
/// its read. The events: a crash, a stop, a replica
/// cut off from the Lease (its renewals lost, its other writes going on: it must stop
/// on its own clock before the other takes the shard).
fn two_clocks(until: u64, events: u8) -> Lab {
    Lab {
        shards: 1,
        nodes: vec![0],
        cfg: two_clocks_cfg(),
        max_lag: 2,
        slow_writes: true,
        lease_only: true,
        ..lab(until, events, 1, 3)
    }
}

const INVARIANTS: [&str; 5] = [
    "one writer per shard",
    "budget",
    "no eviction on Unknown",
    "no action without the Lease",
    "a release never blocked by an open breaker",
];

fn bound(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Explores `lab`; every invariant holds in every reachable state and every floor is
/// reached in some state. Returns the number of distinct states.
fn explore(what: &str, lab: Lab, floors: &[&'static str]) -> usize {
    let started = Instant::now();
    let (until, events) = (lab.until, lab.events);
    let checker = lab.checker().threads(2).spawn_dfs().join();
    let states = checker.unique_state_count();
    eprintln!(
        "model, {what}: {states} states ({} generated) in {:?}, {until} s, {events} events",
        checker.state_count(),
        started.elapsed()
    );
    for invariant in INVARIANTS {
        if let Some(path) = checker.discovery(invariant) {
            panic!("{invariant:?} broken: {:?}", path.into_actions());
        }
    }
    for floor in floors {
        assert!(
            checker.discovery(floor).is_some(),
            "{floor:?} never happened in {states} states ({until} s, {events} events)"
        );
    }
    states
}

/// The Lease: a long lab with one environment event (a crash lets the other replica
/// take over after the Lease runs out, and the crashed one restarts; or a stop; or a
/// replica's writes go unanswered). One writer per shard and no action without the
/// Lease hold in every state. Each fails with its guard in product code mutated
/// (scripts/guardrail-mutations.py, "model:"): the fence's `holding`, the Observer's
/// expiry. `MODEL_FULL=1` explores one lab of more than 10^7 states (7 s, 1 event by
/// default).
#[test]
fn the_lease_keeps_one_writer_per_shard() {
    if std::env::var_os("MODEL_FULL").is_some() {
        let until = bound("MODEL_UNTIL", 7);
        let events = bound("MODEL_EVENTS", 1) as u8;
        let states = explore(
            "full",
            lab(until, events, 1, 3),
            &["a takeover", "a quarantine", "an eviction", "a restart"],
        );
        assert!(states > 10_000_000, "{states} states: fewer than 10^7");
        return;
    }
    let states = explore(
        "the Lease",
        lab(5, 1, 1, 3),
        &["a takeover", "a quarantine", "an eviction", "a restart"],
    );
    assert!(states > 1_000_000, "{states} states: too small to say much");
}

/// The Lease on two clocks: time passes between a Lease pass's read and its write, and a
/// replica's clock falls behind the other's by up to the 2 s margin. One writer per
/// shard and no action without the Lease still hold in every state (7.7 M states, 97 s
/// on 2 cores). With the margin taken out of the hold (`LeaseConfig::hold_until`), the
/// holder cut off from the Lease, its clock behind, still holds when the other takes the
/// shard: two writers (scripts/guardrail-mutations.py, "1 Lease margin").
#[test]
fn the_lease_keeps_one_writer_on_two_clocks() {
    let states = explore(
        "two clocks",
        two_clocks(bound("MODEL_CLOCKS_UNTIL", 5), 1),
        &[
            "a takeover",
            "a quarantine",
            "a Lease written a second after its read",
            "a holder acting on a clock behind",
        ],
    );
    assert!(states > 100_000, "{states} states: too small to say much");
}

/// Nodes fail, turn Unknown and heal (2 events in 3 s): a quarantine, the budget's
/// bound, a hold-back, an eviction, a node the unknown guard tainted whose device then
/// fails. No eviction on Unknown fails with `policy::record_evicts` mutated.
#[test]
fn the_nodes_are_quarantined_and_unknown_never_evicts() {
    explore(
        "the nodes",
        lab(3, 2, 1, 3),
        &[
            "a quarantine",
            "the budget's bound reached",
            "an eviction",
            "a budget hold-back",
            "tainted unknown, then failed",
        ],
    );
}

/// Three nodes fail (3 s, 3 events), against a budget of one and a breaker at four:
/// the budget (B = 1) is reached and holds across the two replicas; without the
/// ledger's places in `policy::take_place` two are quarantined (B + R − 1), without the
/// budget's check in `Budget::refusal` all three.
#[test]
fn the_budget_holds_with_three_failed_nodes() {
    explore(
        "the budget",
        lab(2, 3, 1, 4),
        &["the budget's bound reached", "a budget hold-back"],
    );
}

/// The breaker trips at the second failed node, and the first, healed, is released
/// while it is open (3 s, 3 events). With `policy::breaker_stops` stopping releases
/// too, a release waits behind the open breaker.
#[test]
fn the_breaker_trips_and_never_blocks_a_release() {
    explore(
        "the breaker",
        lab(2, 3, 2, 2),
        &["the breaker trips", "a release"],
    );
}
