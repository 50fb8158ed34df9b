//! Node-local delivery: each followed node's published entry goes to that
//! node's agent (`PUT /v1/fault`, the bearer token of `--delivery-token-file`), which
//! keeps it as the node's own `fault.json` for its pods. A change costs one node, not a
//! page that every kubelet of the fleet receives; no kubelet volume refresh is involved.
//!
//! Each followed node has a slot holding its latest entry and a task that delivers it:
//! a new entry at once, then a confirmation (no entry: the writer and sequence only)
//! every `--delivery-confirm`, so the agent can tell a silent aggregator from a quiet
//! node (it turns the verdict stale after three confirmations missed). An agent that
//! answers a confirmation with 409 (it restarted, or holds another writer's entry) gets
//! the entry again. A slow or dead agent delays only its own slot. Only the holder of a
//! node's shard delivers (asked before every send), as only it writes the shard.
//!
//! Sequences are per writer and never go back across restarts: they start from the
//! wall clock in microseconds and count up. Each message names its node, the digest of
//! the entry it carries or confirms, and when it was sent (milliseconds, increasing
//! with every message); with `--delivery-signing-key-file` its body is signed
//! ([`faultline_common::seal`]), so that an agent takes it from this aggregator only,
//! never from another node that holds the shared token.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::fault::{shard_of, Delivery, NodeFaults};
use faultline_common::seal::{Reloaded, SigningKey, SIGNATURE_HEADER};
use faultline_common::supervise::spawn_contained;
use faultline_common::sync::Locked;
use faultline_common::time::{now_ms, now_rfc3339};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::http::{Conn, Target};
use crate::metrics::{Delivered, DeliveryKind, Metrics};
use crate::shard::Held;

/// Bound on one delivery, connecting included.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest answer read from an agent.
const MAX_ANSWER: usize = 64 << 10;
/// The first retry after a failed delivery.
const RETRY_FIRST: Duration = Duration::from_millis(500);
/// The path deliveries go to.
const PATH: &str = "/v1/fault";

/// One node's entry as offered for delivery.
#[derive(Debug)]
pub struct Offer {
    sequence: u64,
    published: String,
    digest: String,
    entry: NodeFaults,
}

type Slot = watch::Sender<Option<Arc<Offer>>>;

/// Who may deliver: the holder of the node's shard (with shard ownership).
#[derive(Clone)]
pub struct Fence {
    /// The shards held.
    pub held: Held,
    /// Number of shards.
    pub shards: u32,
}

/// Every followed node's slot, and what their deliveries share.
pub struct Deliveries {
    writer: String,
    token: Arc<Reloaded<String>>,
    signer: Option<Arc<Reloaded<SigningKey>>>,
    confirm: Duration,
    next: AtomicU64,
    /// The last message's send time (ms): every message says a later one.
    sent: AtomicU64,
    slots: Mutex<HashMap<String, Slot>>,
    fence: Option<Fence>,
    metrics: Arc<Metrics>,
}

impl Deliveries {
    /// Deliveries by `writer` with `token` (and signed by `signer`), confirmed every
    /// `confirm`, fenced by `fence` (none: this replica publishes every node).
    pub fn new(
        writer: &str,
        (token, signer): (Arc<Reloaded<String>>, Option<Arc<Reloaded<SigningKey>>>),
        confirm: Duration,
        fence: Option<Fence>,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new(Deliveries {
            writer: writer.to_string(),
            token,
            signer,
            confirm,
            next: AtomicU64::new(now_ms().saturating_mul(1000)),
            sent: AtomicU64::new(0),
            slots: Mutex::new(HashMap::new()),
            fence,
            metrics,
        })
    }

    /// Offer `node`'s new entry (a node not followed here: nothing).
    pub fn offer(&self, node: &str, entry: NodeFaults) {
        let slots = self.slots.locked();
        if let Some(slot) = slots.get(node) {
            let offer = Offer {
                sequence: self.next.fetch_add(1, Ordering::Relaxed),
                published: now_rfc3339(),
                digest: entry.digest(),
                entry,
            };
            slot.send_replace(Some(Arc::new(offer)));
        }
    }

    /// Whether `node` is followed here and has had no entry yet.
    pub fn wants(&self, node: &str) -> bool {
        self.slots
            .locked()
            .get(node)
            .is_some_and(|s| s.borrow().is_none())
    }

    /// Start delivering to `node`'s agent at `url` until `cancel`.
    pub fn open(self: &Arc<Self>, node: &str, url: &str, cancel: CancellationToken) {
        let target = match Target::parse(url) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(%node, %url, error = %e, "no delivery to an agent whose URL does not parse");
                return;
            }
        };
        let (tx, rx) = watch::channel(None);
        self.slots.locked().insert(node.to_string(), tx);
        let metrics = self.metrics.clone();
        let run = self.clone().run(node.to_string(), target, rx, cancel);
        spawn_contained("delivery to an agent", run, move |panicked| {
            if panicked {
                metrics.agent_poll_error("panic");
            }
        });
    }

    /// Stop delivering to `node` (its task ends with its follower's token).
    pub fn close(&self, node: &str) {
        self.slots.locked().remove(node);
    }

    fn may(&self, node: &str) -> bool {
        self.fence
            .as_ref()
            .is_none_or(|f| f.held.holds(shard_of(node, f.shards)))
    }

    async fn run(
        self: Arc<Self>,
        node: String,
        target: Target,
        mut rx: watch::Receiver<Option<Arc<Offer>>>,
        cancel: CancellationToken,
    ) {
        let mut conn = Conn::new(target, DELIVERY_TIMEOUT);
        // The sequence the agent holds, as far as this task knows.
        let mut acked: Option<u64> = None;
        let mut confirm_at = tokio::time::Instant::now() + self.confirm;
        // After a failed delivery, the next try comes sooner than a confirmation: half a
        // second, doubling up to the confirmation period while it keeps failing.
        let mut retry = RETRY_FIRST;
        // The first period after the first delivery is drawn at random (a tenth to all
        // of it): the followers start together, so without it every node's confirmation
        // went out in the same instant, 5,000 a replica every period on its one thread
        // (the cluster benchmark: faults then waited up to 2 s for their write).
        let mut phase = Some(
            self.confirm
                .mul_f64(rand::Rng::random_range(&mut rand::rng(), 0.1..1.0)),
        );
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                r = rx.changed() => if r.is_err() { return },
                _ = tokio::time::sleep_until(confirm_at) => {}
            }
            confirm_at = tokio::time::Instant::now() + self.confirm;
            let Some(offer) = rx.borrow_and_update().clone() else {
                continue;
            };
            if !self.may(&node) {
                // Not held now (a hold that ran out on this replica's clock is usually
                // held again by the next renewal): look again soon, not a confirmation
                // period later (the cluster benchmark: a fault reached its node 10 s
                // late after a lapse under 2 s of API latency).
                acked = None;
                confirm_at = tokio::time::Instant::now() + RETRY_FIRST;
                continue;
            }
            let full = acked != Some(offer.sequence);
            acked = match self.send(&mut conn, &node, &offer, full).await {
                Ok(()) => Some(offer.sequence),
                // Not held there (the agent restarted, or took another writer's): the
                // entry itself, at once.
                Err(409) if !full => match self.send(&mut conn, &node, &offer, true).await {
                    Ok(()) => Some(offer.sequence),
                    Err(_) => None,
                },
                Err(_) => None,
            };
            if acked.is_none() {
                tracing::debug!(%node, ?retry, "delivery failed; trying again");
                confirm_at = tokio::time::Instant::now() + retry;
                retry = (retry * 2).min(self.confirm);
            } else {
                retry = RETRY_FIRST;
                if let Some(p) = phase.take() {
                    confirm_at = tokio::time::Instant::now() + p;
                }
            }
        }
    }

    /// A send time in milliseconds, later than every one before (the wall clock, or one
    /// past the last when the clock stands still or steps back).
    fn sent_now(&self) -> u64 {
        let now = now_ms();
        let prev = self
            .sent
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                Some(now.max(last + 1))
            })
            .unwrap_or_default();
        now.max(prev + 1)
    }

    /// Deliver `offer` (its entry when `full`, else a confirmation). `Err(status)`:
    /// refused with that status (0: not answered).
    async fn send(
        &self,
        conn: &mut Conn,
        node: &str,
        offer: &Offer,
        full: bool,
    ) -> Result<(), u16> {
        let d = Delivery {
            writer: self.writer.clone(),
            sequence: offer.sequence,
            published: offer.published.clone(),
            stale_after_ms: (self.confirm * 3).as_millis() as u64,
            node: Some(node.to_string()),
            sent_ms: Some(self.sent_now()),
            digest: Some(offer.digest.clone()),
            entry: full.then(|| offer.entry.clone()),
        };
        let kind = if full {
            DeliveryKind::Entry
        } else {
            DeliveryKind::Confirm
        };
        let body = match serde_json::to_vec(&d) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a delivery");
                return Err(0);
            }
        };
        let signature = self.signer.as_ref().map(|s| {
            let (key, e) = s.get();
            if let Some(e) = e {
                tracing::error!(error = %e, "cannot use the changed --delivery-signing-key-file; signing with the last good key");
            }
            key.sign(&body)
        });
        let extra = signature.as_deref().map(|s| (SIGNATURE_HEADER, s));
        let (token, e) = self.token.get();
        if let Some(e) = e {
            tracing::error!(error = %e, "cannot use the changed --delivery-token-file; keeping the last good token");
        }
        let r = tokio::time::timeout(
            DELIVERY_TIMEOUT,
            conn.put_json(PATH, &token, extra, &body, MAX_ANSWER),
        )
        .await;
        let status = match r {
            Ok(Ok(resp)) => resp.status,
            Ok(Err(_)) | Err(_) => 0,
        };
        let result = match status {
            200 => Delivered::Ok,
            409 => Delivered::Conflict,
            401 | 403 => Delivered::Refused,
            0 => Delivered::Unreachable,
            _ => Delivered::Error,
        };
        self.metrics.delivery(kind, result);
        if status == 200 {
            Ok(())
        } else {
            Err(status)
        }
    }
}
