//! The guards that keep remediation from doing too much at once. Each owns its own lock
//! and exposes operations, so no caller ever holds two:
//!
//! - [`BudgetGuard`]: how many nodes may be quarantined, decided one at a time;
//! - [`Breaker`]: very many failures within a short time stop everything;
//! - [`EvictionRate`]: evictions per minute;
//! - [`HeldBack`]: the nodes a budget holds back now, announced once each.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use faultline_common::sync::Locked;
use faultline_common::time::Clock;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams};

use super::error::RemediateError;
use super::ledger::{Ledger, NODES_KEY, UNKNOWN_KEY};
use super::policy::{take_place, Budget, Noted, Place};
use super::record::{DEVICES_LABEL, UNKNOWN_MARK};

/// The quarantine budget, counted from the Nodes themselves (the devices label), so
/// every replica sees the same count, and from the ledger: the places taken for
/// quarantines not yet landed, in a ConfigMap every replica writes by compare-and-swap.
/// Without the ledger, replicas of different shards deciding at once could each see
/// room for one more (the bound was B + R − 1); with it the budget holds exactly.
pub struct BudgetGuard {
    /// The limits.
    pub budget: Budget,
    /// One decision (count, then write) at a time in this replica, so concurrent passes
    /// cannot all see room for one more. Held by a pass from its check to its write.
    turn: tokio::sync::Mutex<()>,
    /// The shared ledger of places (none: the Nodes' count alone, within one replica).
    ledger: Option<Ledger>,
}

impl BudgetGuard {
    /// A guard of `budget`, counting from the Nodes alone.
    pub fn new(budget: Budget) -> Self {
        BudgetGuard {
            budget,
            turn: tokio::sync::Mutex::new(()),
            ledger: None,
        }
    }

    /// Count the places of `ledger` too: the budget holds across replicas.
    pub fn set_ledger(&mut self, ledger: Option<Ledger>) {
        self.ledger = ledger;
    }

    /// This replica's turn to decide; hold it until the write is done.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.turn.lock().await
    }

    /// Why quarantining `node` now would exceed the budget, if it would; else its place
    /// is taken in the ledger (stamped `at` by `by`) before this returns, so every
    /// replica counts it from then on. Nodes the unknown guard tainted do not count:
    /// they have their own budget ([`BudgetGuard::unknown_refusal`]). Every read of the
    /// Nodes is of metadata only, in pages (a real GPU Node is 15-40 KB; a list of every
    /// Node in one answer was 0.3-0.8 GB at 20,000 nodes).
    pub async fn refusal(
        &self,
        nodes: &Api<Node>,
        node: &Node,
        (by, clock): (&str, &Clock),
    ) -> Result<Option<String>, RemediateError> {
        // A consistent read: a count from a lagging cache could miss a quarantine just
        // made and let one more through (this list is one per new quarantine, not per
        // pass).
        let domain = |m: &ObjectMeta| {
            let label = self.budget.per_domain.as_ref().map(|(l, _)| l.as_str())?;
            m.labels.as_ref()?.get(label).cloned()
        };
        let name = node.metadata.name.clone().unwrap_or_default();
        // The other nodes quarantined (the node itself may carry the label, set by
        // another owner: it is the one asking).
        let mut quarantined: BTreeMap<String, Option<String>> = BTreeMap::new();
        each_page(nodes, DEVICES_LABEL, |page| {
            quarantined.extend(
                page.filter(|m| !unknown_only(m) && !device_scoped(m))
                    .filter(|m| m.name.as_ref() != Some(&name))
                    .map(|m| (m.name.clone().unwrap_or_default(), domain(&m))),
            );
        })
        .await?;
        let mine = domain(&node.metadata);
        // The share's base, asked only when the Nodes' count leaves room (else the count
        // refuses before the share is asked): counted page by page, nothing kept; once
        // per decision (a conflict retries with it).
        let mut total = None;
        if quarantined.len() < self.budget.max_nodes {
            let mut n = 0;
            each_page(nodes, &self.budget.node_selector, |page| n += page.count()).await?;
            total = Some(n);
        }
        // Never asked without it; were it, no share refuses.
        let total = || total.unwrap_or(usize::MAX);
        let taker = Some((by, clock));
        self.take(
            NODES_KEY,
            &self.budget,
            &quarantined,
            (&name, mine),
            taker,
            total,
        )
        .await
    }

    /// Why the unknown guard may not taint `node` now, if it may not: it has
    /// `max_unknown` nodes tainted already (a consistent read, as above) or placed in
    /// the ledger; else `node`'s place is taken by `taker` (replica, clock), as for
    /// [`BudgetGuard::refusal`]. No taker (a dry run): the Nodes' count, nothing taken.
    pub async fn unknown_refusal(
        &self,
        nodes: &Api<Node>,
        node: &str,
        taker: Option<(&str, &Clock)>,
    ) -> Result<Option<String>, RemediateError> {
        let mut tainted: BTreeMap<String, Option<String>> = BTreeMap::new();
        each_page(nodes, &format!("{DEVICES_LABEL}={UNKNOWN_MARK}"), |page| {
            tainted.extend(page.map(|m| (m.name.unwrap_or_default(), None)))
        })
        .await?;
        // The count alone: no share (the base is unbounded) and no domain.
        let budget = Budget {
            max_nodes: self.budget.max_unknown,
            ..Budget::default()
        };
        let why = self
            .take(UNKNOWN_KEY, &budget, &tainted, (node, None), taker, || {
                usize::MAX
            })
            .await?;
        Ok(why.map(|why| format!("unknown-guard budget: {why}")))
    }

    /// Ask `budget` for `node`'s place (failure domain `domain`) under `key`, with
    /// `counted` the nodes the Nodes show: by a compare-and-swap on the ledger, the place
    /// taken by `taker` (replica, clock); without a ledger or a taker (a dry run), the
    /// Nodes' count alone, nothing taken. The refusal, if any.
    async fn take(
        &self,
        key: &str,
        budget: &Budget,
        counted: &BTreeMap<String, Option<String>>,
        (node, domain): (&str, Option<String>),
        taker: Option<(&str, &Clock)>,
        total: impl Fn() -> usize + Copy,
    ) -> Result<Option<String>, RemediateError> {
        let ask = |places: &mut BTreeMap<String, Place>,
                   place: Place,
                   age: &dyn Fn(&str) -> Option<f64>| {
            take_place(
                budget,
                places,
                counted,
                (node, domain.as_deref()),
                place,
                age,
                total,
            )
        };
        let Some((ledger, (by, clock))) = self.ledger.as_ref().zip(taker) else {
            return Ok(ask(&mut BTreeMap::new(), Place::default(), &|_| None));
        };
        ledger
            .update(key, |places| {
                let place = Place {
                    at: clock.rfc3339(),
                    by: by.to_string(),
                    domain: domain.clone(),
                };
                match ask(places, place, &|at| clock.age_secs(at)) {
                    Some(why) => Err(why),
                    None => Ok(true),
                }
            })
            .await
    }

    /// This replica's pass for `node` took a place and its write surely did not land (the
    /// API server refused it with a 4xx, or it was never sent): the place goes back
    /// now, not when it expires. Only a place `by` this replica (its budget turn is held
    /// meanwhile, so no other pass of it took one since); best effort.
    pub async fn give_back(&self, node: &str, by: &str) {
        let Some(ledger) = &self.ledger else {
            return;
        };
        for key in [NODES_KEY, UNKNOWN_KEY] {
            let mine = |places: &mut BTreeMap<String, Place>| {
                let ours = places.get(node).is_some_and(|p| p.by == by);
                Ok(ours && places.remove(node).is_some())
            };
            if let Err(e) = ledger.update(key, mine).await {
                tracing::warn!(node, error = %e, "a place in the budget ledger stays until it expires");
            }
        }
    }

    /// `node` was released: its places go (best effort: a place left is dropped once
    /// [`PLACE_TTL`](super::policy::PLACE_TTL) old, its node no longer quarantined).
    pub async fn forget(&self, node: &str) {
        let Some(ledger) = &self.ledger else {
            return;
        };
        for key in [NODES_KEY, UNKNOWN_KEY] {
            let gone = ledger
                .update(key, |places| Ok(places.remove(node).is_some()))
                .await;
            if let Err(e) = gone {
                tracing::warn!(node, error = %e, "released, but its place in the budget ledger stays until it expires");
            }
        }
    }
}

/// Nodes listed per page.
const PAGE: u32 = 500;

/// The metadata of every Node matching `selector` (empty: all), a consistent read in
/// pages of [`PAGE`] (`limit`/`continue`: the watch cache would ignore a limit at
/// `resourceVersion=0` and answer whole), each page handed to `each` and dropped.
async fn each_page(
    nodes: &Api<Node>,
    selector: &str,
    mut each: impl FnMut(&mut dyn Iterator<Item = ObjectMeta>),
) -> Result<(), kube::Error> {
    let mut lp = ListParams::default().limit(PAGE);
    if !selector.is_empty() {
        lp = lp.labels(selector);
    }
    loop {
        let page = nodes.list_metadata(&lp).await?;
        let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
        each(&mut page.items.into_iter().map(|p| p.metadata));
        match next {
            Some(c) => lp = lp.continue_token(&c),
            None => return Ok(()),
        }
    }
}

/// Whether only devices of the node are quarantined, not the node.
fn device_scoped(node: &ObjectMeta) -> bool {
    node.labels
        .as_ref()
        .is_some_and(|l| l.contains_key(super::record::SCOPE_LABEL))
}

/// Whether the devices label says only the unknown guard acted on a node.
fn unknown_only(node: &ObjectMeta) -> bool {
    node.labels
        .as_ref()
        .and_then(|l| l.get(DEVICES_LABEL))
        .is_some_and(|v| v == UNKNOWN_MARK)
}

/// The circuit breaker: when very many nodes fail within a short time it is usually the
/// monitoring, not the hardware. Once `nodes` distinct nodes failed within `window`,
/// the breaker opens: a ConfigMap `<name>-breaker` with `state: open`, which every
/// replica reads before acting. Nothing is isolated or evicted until a person closes it
/// (`faultline breaker close`).
///
/// The failures counted live in the same ConfigMap (`failures`: node → when), updated
/// by compare-and-swap on its resourceVersion, so the threshold is cluster-wide (not
/// per replica) and survives restarts.
pub struct Breaker {
    api: Api<ConfigMap>,
    name: String,
    nodes: usize,
    window: Duration,
    /// The clock the window is judged by (tests move it instead of sleeping).
    clock: faultline_common::time::Clock,
}

/// Attempts at one compare-and-swap before giving up for this pass.
const CAS_ATTEMPTS: usize = 8;

/// The breaker's stored state.
#[derive(Debug, Default)]
struct BreakerState {
    open: bool,
    /// Nodes counted, with when (RFC 3339).
    failures: BTreeMap<String, String>,
}

impl BreakerState {
    fn of(cm: Option<&ConfigMap>) -> Self {
        let Some(data) = cm.and_then(|c| c.data.as_ref()) else {
            return BreakerState::default();
        };
        BreakerState {
            open: data.get("state").map(String::as_str) == Some("open"),
            failures: data
                .get("failures")
                .and_then(|f| serde_json::from_str(f).ok())
                .unwrap_or_default(),
        }
    }
}

impl Breaker {
    /// A breaker stored in the ConfigMap `name` through `api`.
    pub fn new(api: Api<ConfigMap>, name: String, nodes: usize, window: Duration) -> Self {
        Breaker {
            api,
            name,
            nodes: nodes.max(1),
            window,
            clock: Default::default(),
        }
    }

    /// Judge the window by `clock`.
    pub fn with_clock(mut self, clock: faultline_common::time::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Whether it is open now (a person has not closed it).
    pub async fn is_open(&self) -> Result<bool, RemediateError> {
        Ok(BreakerState::of(self.api.get_opt(&self.name).await?.as_ref()).open)
    }

    /// Note that `node` failed now, in the shared count; opens the breaker when
    /// `nodes` distinct nodes failed within the window. Whether it is open after.
    pub async fn note_failure(&self, node: &str) -> Result<bool, RemediateError> {
        let mut last = None;
        for _ in 0..CAS_ATTEMPTS {
            let cur = self.api.get_opt(&self.name).await?;
            let mut state = BreakerState::of(cur.as_ref());
            let trip = match super::policy::note_failure(
                state.open,
                &mut state.failures,
                node,
                &self.clock.rfc3339(),
                |at| self.clock.age_secs(at),
                self.nodes,
                self.window.as_secs_f64(),
            ) {
                Noted::Open => return Ok(true),
                Noted::Unchanged => return Ok(false),
                Noted::Counted => false,
                Noted::Tripped => true,
            };
            let count = state.failures.len();
            let mut data = cur
                .as_ref()
                .and_then(|c| c.data.clone())
                .unwrap_or_default();
            data.insert(
                "failures".into(),
                serde_json::to_string(&state.failures).unwrap_or_default(),
            );
            if trip {
                data.insert("state".into(), "open".into());
                data.insert("since".into(), self.clock.rfc3339());
                data.insert(
                    "reason".into(),
                    format!("{count} nodes failed within {}s", self.window.as_secs()),
                );
            } else {
                data.entry("state".into())
                    .or_insert_with(|| "closed".into());
            }
            // The resourceVersion read above makes the replace a compare-and-swap.
            let written = super::ledger::replace_or_create(&self.api, &self.name, cur, data).await;
            match written {
                Ok(()) => {
                    if trip {
                        tracing::error!(count, window = ?self.window, "circuit breaker opened: remediation stopped until a person closes it");
                    }
                    return Ok(trip);
                }
                // Another replica wrote first: read again and recount.
                Err(kube::Error::Api(e)) if e.code == 409 => last = Some(e),
                Err(e) => return Err(e.into()),
            }
        }
        Err(kube::Error::Api(last.expect("a conflict was seen")).into())
    }
}

/// Evictions per minute at most: a token bucket. A pod past the rate waits for a later
/// pass.
pub struct EvictionRate {
    per_minute: f64,
    /// Tokens and when they were last counted; owned by this bucket.
    tokens: Mutex<(f64, Instant)>,
}

impl EvictionRate {
    /// `per_minute` evictions a minute (0: no limit), starting full.
    pub fn new(per_minute: f64) -> Self {
        EvictionRate {
            per_minute,
            tokens: Mutex::new((per_minute, Instant::now())),
        }
    }

    /// Take one eviction's token now, if there is one.
    pub fn take(&self) -> bool {
        self.take_at(Instant::now())
    }

    /// Take one eviction's token at `now`, if there is one.
    pub fn take_at(&self, now: Instant) -> bool {
        if self.per_minute <= 0.0 {
            return true;
        }
        let mut g = self.tokens.locked();
        let refill = now.saturating_duration_since(g.1).as_secs_f64() * self.per_minute / 60.0;
        // At least one token fits, or a rate under 1 per minute would never evict.
        g.0 = (g.0 + refill).min(self.per_minute.max(1.0));
        g.1 = now;
        if g.0 >= 1.0 {
            g.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The nodes a budget holds back now (each announced once).
#[derive(Default)]
pub struct HeldBack {
    /// Owned by this set; passes add and remove nodes.
    nodes: Mutex<BTreeSet<String>>,
}

/// What holding a node back means for its announcements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The node was not held back before.
    pub first_for_node: bool,
    /// No node was held back before.
    pub first_overall: bool,
    /// Nodes held back now.
    pub count: usize,
}

impl HeldBack {
    /// Hold `node` back.
    pub fn hold(&self, node: &str) -> Hold {
        let mut g = self.nodes.locked();
        let first_overall = g.is_empty();
        Hold {
            first_for_node: g.insert(node.to_string()),
            first_overall,
            count: g.len(),
        }
    }

    /// `node` was quarantined after all.
    pub fn release(&self, node: &str) {
        self.nodes.locked().remove(node);
    }

    /// The nodes held back now.
    pub fn list(&self) -> Vec<String> {
        self.nodes.locked().iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eviction_rate_refills_over_time() {
        let r = EvictionRate::new(2.0);
        let t0 = Instant::now();
        assert!(r.take_at(t0) && r.take_at(t0));
        assert!(!r.take_at(t0), "two a minute");
        assert!(!r.take_at(t0 + Duration::from_secs(29)));
        assert!(
            r.take_at(t0 + Duration::from_secs(30)),
            "one more after 30 s"
        );
        // Under one a minute still evicts, one at a time.
        let slow = EvictionRate::new(0.5);
        assert!(!slow.take_at(t0), "starts with half a token");
        assert!(slow.take_at(t0 + Duration::from_secs(60)));
        assert!(!slow.take_at(t0 + Duration::from_secs(61)));
        let off = EvictionRate::new(0.0);
        assert!((0..1000).all(|_| off.take_at(t0)));
    }

    #[test]
    fn held_back_nodes_are_announced_once_each() {
        let h = HeldBack::default();
        assert_eq!(
            h.hold("a"),
            Hold {
                first_for_node: true,
                first_overall: true,
                count: 1
            }
        );
        assert_eq!(
            h.hold("b"),
            Hold {
                first_for_node: true,
                first_overall: false,
                count: 2
            }
        );
        assert!(!h.hold("a").first_for_node);
        h.release("a");
        assert_eq!(h.list(), vec!["b".to_string()]);
    }
}
