//! The node's own `fault.json`: the aggregator's verdict on this node,
//! handed to this agent (`PUT /v1/fault`, bearer token), served to the node's pods
//! (`GET /v1/fault`, a watch; the file of `--fault-dir`), so that a change costs one
//! node, not a write that every kubelet of the fleet receives.
//!
//! Only the aggregator sets it: a delivery must carry the token of
//! `--delivery-token-file`, compared in constant time, and with `--delivery-key-file`
//! the aggregator's signature over the body ([`faultline_common::seal`]): the token is
//! every node's, the signing key the aggregator's alone, so a node that is compromised
//! cannot set another's verdict. Both files are read again when they change. The
//! verdict's statuses are the
//! aggregator's; its readings are this agent's latest (`readings_at`). A verdict holds
//! for `stale_after` (the delivery's, at most `--verdict-stale-after`) after the node
//! last heard from the aggregator; past that, and before any verdict, the document says
//! `verdict.stale` and every device the verdict called healthy is `unknown`
//! (`verdict-stale`): it never silently keeps saying "healthy".
//!
//! Order: from one writer, only a higher sequence replaces the entry held (a late
//! delivery is refused, and so is other content under the sequence held: the same
//! entry again only confirms it); another writer's entry replaces it (a shard changed
//! holder, and the aggregator writes only shards it holds). A confirmation that names a
//! digest confirms only the entry with that digest. A message that says when it was
//! sent must be newer than the last one taken; signed, it must say so, name this node,
//! and be no older than `--verdict-stale-after`: a recorded message cannot be played
//! again, here or on another node.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::fault::{
    AgentReach, Delivery, DrainNotice, FaultSummary, NodeFaults, NpuFault, SourceReach,
    VerdictSource, FAULT_VERSION,
};
use faultline_common::seal::{KeyError, Reloaded, SealError, VerifyingKeys};
use faultline_common::sync::Locked;
use faultline_common::time::{now_ms, rfc3339_ms};
use faultline_common::{DeviceStatus, NodeHealth};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::store::Store;

/// The reason of a device whose healthy verdict is no longer confirmed.
pub const STALE_REASON: &str = "verdict-stale";
/// The reason of a device before any verdict arrived.
pub const NO_VERDICT_REASON: &str = "no-verdict";
/// Shortest time a verdict holds without a confirmation.
const MIN_STALE_AFTER: Duration = Duration::from_secs(1);
/// Most devices a delivered entry may list.
const MAX_DEVICES: usize = 1024;
/// Most drain intents a delivered entry may list (a node runs at most a few hundred
/// pods, and only those on a failed device that opted in get one).
const MAX_DRAIN: usize = 512;

/// Why a delivery was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// This agent takes no deliveries (no `--delivery-token-file`).
    #[error("deliveries are off on this agent (no --delivery-token-file)")]
    Off,
    /// No or the wrong bearer token.
    #[error("a delivery needs the aggregator's bearer token")]
    Unauthorized,
    /// No or a wrong signature, where signatures are required.
    #[error("{0}")]
    Unsigned(SealError),
    /// Not a delivery this agent can hold.
    #[error("{0}")]
    Invalid(String),
    /// A confirmation of an entry not held, or an entry older than the one held: send
    /// the current entry.
    #[error("{0}")]
    Conflict(String),
}

impl Refused {
    /// As a metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Refused::Off => "off",
            Refused::Unauthorized => "unauthorized",
            Refused::Unsigned(_) => "signature",
            Refused::Invalid(_) => "invalid",
            Refused::Conflict(_) => "conflict",
        }
    }
}

/// The verdict held.
#[derive(Debug, Clone)]
struct Held {
    writer: String,
    sequence: u64,
    published: String,
    stale_after: Duration,
    confirmed_ms: u64,
    entry: NodeFaults,
    digest: String,
    /// When the last message taken was sent, where it said.
    sent_ms: Option<u64>,
}

/// Who may set the verdict: the token every delivery carries, and the public keys
/// whose signature it must carry (none: the token alone). Each is read again when its
/// file changes.
#[derive(Default)]
pub struct Trust {
    /// `--delivery-token-file`.
    pub token: Option<Reloaded<Vec<u8>>>,
    /// `--delivery-key-file`.
    pub keys: Option<Reloaded<VerifyingKeys>>,
}

/// Whether a delivery was checked against a signature (and so must say where it goes
/// and when it was sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// The token only.
    Token,
    /// The token and the aggregator's signature.
    Signed,
}

/// The aggregator's verdicts on this node.
pub struct Verdicts {
    node: String,
    trust: Trust,
    max_stale: Duration,
    held: Mutex<Option<Held>>,
    /// Moves whenever the document would read otherwise (a new entry, a confirmation,
    /// turning stale).
    version: watch::Sender<u64>,
}

/// The current value of a reloaded file; a change that cannot be used is logged, and the
/// last good value stays in force.
fn current<T>(r: &Reloaded<T>) -> Arc<T> {
    let (v, e) = r.get();
    if let Some(e) = e {
        tracing::error!(path = %r.path().display(), error = %e, "cannot use the changed file; keeping the last good one");
    }
    v
}

/// `a == b` in time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Verdicts {
    /// Verdicts on `node`, set by whoever presents `token` (none: nobody).
    pub fn new(node: &str, token: Option<Vec<u8>>, max_stale: Duration) -> Arc<Self> {
        let token = token.filter(|t| !t.is_empty()).map(Reloaded::fixed);
        Self::trusting(node, Trust { token, keys: None }, max_stale)
    }

    /// Verdicts on `node`, set by whoever `trust` names.
    pub fn trusting(node: &str, trust: Trust, max_stale: Duration) -> Arc<Self> {
        Arc::new(Verdicts {
            node: node.to_string(),
            trust,
            max_stale: max_stale.max(MIN_STALE_AFTER),
            held: Mutex::new(None),
            version: watch::channel(0).0,
        })
    }

    /// The token of `path`, read again when the file changes.
    /// While there is no file (the Secret is optional, not made yet), no token: every
    /// delivery is refused until it appears, and the agent serves its health meanwhile
    /// (it did not start at all).
    pub fn read_token(path: &Path) -> Result<Reloaded<Vec<u8>>, KeyError> {
        Reloaded::load_or(path, faultline_common::seal::token, Vec::new())
    }

    /// The public keys of `path`, read again when the file changes; none while there
    /// is no file (every signed delivery refused until it appears).
    pub fn read_keys(path: &Path) -> Result<Reloaded<VerifyingKeys>, KeyError> {
        Reloaded::load_or(path, VerifyingKeys::from_pem, VerifyingKeys::none())
    }

    /// Whether a token is set (deliveries can be authorized at all).
    pub fn has_token(&self) -> bool {
        self.trust.token.is_some()
    }

    /// Whether the token is `got` (a bearer token's bytes).
    pub fn is_token(&self, got: &[u8]) -> bool {
        self.trust.token.as_ref().is_some_and(|t| {
            let held = current(t);
            // No token yet (its file not there): nothing matches, "" neither.
            !held.is_empty() && same_secret(got, &held)
        })
    }

    /// Whether `authorization` (the header's value) carries the token and, where keys
    /// are set, `signature` (the `Faultline-Signature` value) signs `body`.
    pub fn authorize(
        &self,
        authorization: Option<&[u8]>,
        signature: Option<&[u8]>,
        body: &[u8],
    ) -> Result<Checked, Refused> {
        let want = current(self.trust.token.as_ref().ok_or(Refused::Off)?);
        let got = authorization
            .and_then(faultline_common::names::bearer_token)
            .ok_or(Refused::Unauthorized)?;
        if !same_secret(got, &want) {
            return Err(Refused::Unauthorized);
        }
        match &self.trust.keys {
            None => Ok(Checked::Token),
            Some(keys) => current(keys)
                .verify(body, signature)
                .map(|()| Checked::Signed)
                .map_err(Refused::Unsigned),
        }
    }

    /// Watch the document's version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// What a delivery must say, checked `how`, before it is weighed against the
    /// entry held.
    fn admit(&self, d: &Delivery, how: Checked, now_ms: u64) -> Result<(), Refused> {
        if let Some(node) = d.node.as_deref().filter(|n| *n != self.node) {
            return Err(Refused::Invalid(format!(
                "a delivery for node {node:?}; this agent serves {:?}",
                self.node
            )));
        }
        if how == Checked::Signed {
            if d.node.is_none() || d.sent_ms.is_none() || (d.entry.is_none() && d.digest.is_none())
            {
                return Err(Refused::Invalid(
                    "a signed delivery names its node, when it was sent and, confirming, the entry's digest".into(),
                ));
            }
            let sent = d.sent_ms.unwrap_or_default();
            let max = self.max_stale.as_millis() as u64;
            if sent.saturating_add(max) < now_ms {
                return Err(Refused::Conflict(format!(
                    "sent {} ms ago, more than --verdict-stale-after: a recording played again, or this node's clock is off",
                    now_ms - sent
                )));
            }
        }
        Ok(())
    }

    /// Take a delivery, authorized as `how`, at `now_ms`.
    pub fn apply(&self, d: Delivery, how: Checked, now_ms: u64) -> Result<(), Refused> {
        self.admit(&d, how, now_ms)?;
        let stale_after =
            Duration::from_millis(d.stale_after_ms).clamp(MIN_STALE_AFTER, self.max_stale);
        let mut held = self.held.locked();
        let last_sent = held.as_ref().and_then(|h| h.sent_ms);
        if let (Some(sent), Some(last)) = (d.sent_ms, last_sent) {
            if sent <= last {
                return Err(Refused::Conflict(format!(
                    "sent at {sent}, not after the last message taken ({last}): a recording played again"
                )));
            }
        }
        match d.entry {
            None => match held.as_mut() {
                Some(h)
                    if h.writer == d.writer
                        && h.sequence == d.sequence
                        && d.digest.as_ref().is_none_or(|x| *x == h.digest) =>
                {
                    h.confirmed_ms = now_ms;
                    h.stale_after = stale_after;
                    h.sent_ms = d.sent_ms.or(h.sent_ms);
                }
                _ => {
                    return Err(Refused::Conflict(format!(
                        "no entry {} of {} held with that digest: send it",
                        d.sequence, d.writer
                    )))
                }
            },
            Some(entry) => {
                if entry.node != self.node {
                    return Err(Refused::Invalid(format!(
                        "an entry for node {:?}; this agent serves {:?}",
                        entry.node, self.node
                    )));
                }
                if entry.npus.len() > MAX_DEVICES {
                    return Err(Refused::Invalid(format!(
                        "{} devices, at most {MAX_DEVICES}",
                        entry.npus.len()
                    )));
                }
                if entry.drain.len() > MAX_DRAIN {
                    return Err(Refused::Invalid(format!(
                        "{} drain intents, at most {MAX_DRAIN}",
                        entry.drain.len()
                    )));
                }
                let digest = entry.digest();
                if d.digest.as_ref().is_some_and(|x| *x != digest) {
                    return Err(Refused::Invalid(format!(
                        "the entry's digest is {digest}, not {}",
                        d.digest.unwrap_or_default()
                    )));
                }
                if let Some(h) = held.as_mut() {
                    if h.writer == d.writer && d.sequence < h.sequence {
                        return Err(Refused::Conflict(format!(
                            "entry {} of {} is older than the one held ({})",
                            d.sequence, d.writer, h.sequence
                        )));
                    }
                    // A sequence is written once: the same entry again (a retry whose
                    // answer was lost) confirms it; other content under it (a replay
                    // or a forgery) never replaces what is held.
                    if h.writer == d.writer && d.sequence == h.sequence {
                        if h.entry != entry {
                            return Err(Refused::Conflict(format!(
                                "entry {} of {} is held with other content: a sequence is written once",
                                d.sequence, d.writer
                            )));
                        }
                        h.confirmed_ms = now_ms;
                        h.stale_after = stale_after;
                        h.sent_ms = d.sent_ms.or(h.sent_ms);
                        drop(held);
                        self.bump();
                        return Ok(());
                    }
                }
                *held = Some(Held {
                    writer: d.writer,
                    sequence: d.sequence,
                    published: d.published,
                    stale_after,
                    confirmed_ms: now_ms,
                    entry,
                    digest,
                    sent_ms: d.sent_ms.or(last_sent),
                });
            }
        }
        drop(held);
        self.bump();
        Ok(())
    }

    /// The drain intent of pod `uid` in the entry held, if it lists one.
    pub fn drain_notice(&self, uid: &str) -> Option<DrainNotice> {
        let held = self.held.locked();
        held.as_ref()?
            .entry
            .drain
            .iter()
            .find(|n| n.uid == uid)
            .cloned()
    }

    /// Whether the entry held lists the intent an acknowledgement answers.
    pub fn lists(&self, ack: &faultline_common::document::DrainAck) -> bool {
        self.drain_notice(&ack.uid)
            .is_some_and(|n| n.requested == ack.requested)
    }

    /// Whether the verdict held is stale at `now_ms` (none held: stale).
    pub fn stale(&self, now_ms: u64) -> bool {
        self.held.locked().as_ref().is_none_or(|h| {
            now_ms.saturating_sub(h.confirmed_ms) > h.stale_after.as_millis() as u64
        })
    }

    /// The node's `fault.json` at `now_ms`: the verdict held with this agent's latest
    /// readings (`doc`), or, stale, with its healthy devices unknown.
    pub fn render(&self, doc: &NodeHealth, now_ms: u64) -> NodeFaults {
        let held = self.held.locked().clone();
        let stale = held.as_ref().is_none_or(|h| {
            now_ms.saturating_sub(h.confirmed_ms) > h.stale_after.as_millis() as u64
        });
        let (mut entry, source) = match held {
            Some(h) => {
                let source = VerdictSource {
                    writer: Some(h.writer),
                    sequence: h.sequence,
                    published: Some(h.published),
                    confirmed: Some(rfc3339_ms(h.confirmed_ms)),
                    stale,
                    stale_after_s: h.stale_after.as_millis().div_ceil(1000) as u64,
                };
                (h.entry, source)
            }
            None => (
                self.unjudged(doc, now_ms),
                VerdictSource {
                    writer: None,
                    sequence: 0,
                    published: None,
                    confirmed: None,
                    stale: true,
                    stale_after_s: self.max_stale.as_secs(),
                },
            ),
        };
        for npu in &mut entry.npus {
            if let Some(d) = doc.npus.iter().find(|d| d.reading.id == npu.id) {
                npu.temperature_c = d.reading.temperature_c;
                npu.power_w = d.reading.power_w;
                npu.ecc_errors = d.ecc_errors;
                npu.pcie_link_status.clone_from(&d.pcie_link_status);
                npu.recovery_action = d.reading.recovery_action;
            }
            if stale && npu.status == DeviceStatus::Healthy {
                npu.status = DeviceStatus::Unknown;
                npu.reason = Some(STALE_REASON.into());
            }
        }
        entry.summary = FaultSummary::of(entry.npus.iter().map(|d| &d.status));
        entry.readings_at = Some(doc.timestamp.clone());
        entry.verdict = Some(source);
        entry
    }

    /// Before any verdict: this agent's devices, every one unknown.
    fn unjudged(&self, doc: &NodeHealth, now_ms: u64) -> NodeFaults {
        let since = rfc3339_ms(now_ms);
        let npus: Vec<NpuFault> = doc
            .npus
            .iter()
            .map(|d| NpuFault {
                id: d.reading.id.clone(),
                status: DeviceStatus::Unknown,
                reason: Some(NO_VERDICT_REASON.into()),
                since: since.clone(),
                temperature_c: None,
                power_w: None,
                ecc_errors: None,
                pcie_link_status: None,
                uuid: d.reading.uuid.clone(),
                pci_bus_id: d.reading.pci_bus_id.clone(),
                recovery_action: d.reading.recovery_action,
                quarantine: None,
            })
            .collect();
        NodeFaults {
            version: FAULT_VERSION.into(),
            timestamp: since.clone(),
            node: self.node.clone(),
            agent: AgentReach {
                reachable: true,
                last_seen: None,
                error: None,
                sources: doc
                    .sources
                    .iter()
                    .map(|s| SourceReach {
                        name: s.name.clone(),
                        up: s.up,
                    })
                    .collect(),
            },
            summary: FaultSummary::of(npus.iter().map(|d| &d.status)),
            npus,
            readings_at: None,
            verdict: None,
            trimmed: None,
            drain: Vec::new(),
        }
    }
}

/// Keep the node's `fault.json` (in `dir`) as [`Verdicts::render`] reads: rewritten
/// (atomically) when the verdict moves, when this agent's document does, and when the
/// verdict turns stale.
pub async fn run_file(
    dir: PathBuf,
    verdicts: Arc<Verdicts>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let path = dir.join("fault.json");
    let mut moved = verdicts.subscribe();
    let mut doc = store.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_stale = None;
    loop {
        let now = now_ms();
        let stale = verdicts.stale(now);
        if was_stale != Some(stale) {
            was_stale = Some(stale);
            let body = serde_json::to_vec_pretty(&verdicts.render(&store.render(), now));
            match body {
                Ok(bytes) => {
                    let p = path.clone();
                    let r = tokio::task::spawn_blocking(move || {
                        crate::health_file::write_atomic(&p, &bytes)
                    })
                    .await;
                    if let Ok(Err(e)) | Err(e) = r.map_err(std::io::Error::other) {
                        metrics.count_error("fault-file", "write");
                        tracing::warn!(path = %path.display(), error = %e, "cannot write the node's fault.json");
                    }
                }
                Err(e) => tracing::error!(error = %e, "cannot encode the node's fault.json"),
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = moved.changed() => if r.is_err() { return } else { was_stale = None },
            r = doc.changed() => if r.is_err() { return } else { was_stale = None },
            _ = tick.tick() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::testing;

    const NODE: &str = "gpu-node-7";

    fn entry(status: DeviceStatus) -> NodeFaults {
        let doc = testing::node(NODE).devices(2).build();
        let v = Verdicts::new(NODE, None, Duration::from_secs(60));
        let mut e = v.unjudged(&doc, 1_000);
        for d in &mut e.npus {
            d.status = DeviceStatus::Healthy;
            d.reason = None;
        }
        e.npus[1].status = status;
        e
    }

    /// The delivery Secret is optional: without its file the agent starts (it did not
    /// start at all, health included), refuses every token, an empty one too, and
    /// takes the token once the kubelet mounts it.
    #[test]
    fn a_token_file_not_there_yet_refuses_all_until_it_appears() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let token = Verdicts::read_token(&path)
            .unwrap()
            .checking_every(Duration::ZERO);
        let v = Verdicts::trusting(
            NODE,
            Trust {
                token: Some(token),
                keys: None,
            },
            Duration::from_secs(60),
        );
        assert!(!v.is_token(b"s3cret") && !v.is_token(b""));
        std::fs::write(&path, "s3cret\n").unwrap();
        assert!(v.is_token(b"s3cret"));
        // A file there that cannot be used is still a start-up error.
        std::fs::write(&path, "\n").unwrap();
        assert!(Verdicts::read_token(&path).is_err());
        assert!(Verdicts::read_keys(&dir.path().join("keys")).is_ok());
    }

    fn delivery(writer: &str, sequence: u64, entry: Option<NodeFaults>) -> Delivery {
        Delivery {
            writer: writer.into(),
            sequence,
            published: "2026-12-02T10:00:00.000Z".into(),
            stale_after_ms: 3_000,
            node: None,
            sent_ms: None,
            digest: None,
            entry,
        }
    }

    #[test]
    fn only_the_token_sets_a_verdict() {
        let v = Verdicts::new(NODE, Some(b"s3cret".to_vec()), Duration::from_secs(60));
        assert!(v.authorize(Some(b"Bearer s3cret"), None, b"{}").is_ok());
        assert!(
            v.authorize(Some(b"bearer s3cret"), None, b"{}").is_ok(),
            "RFC 9110: any case"
        );
        for bad in [
            None,
            Some(&b"Bearer s3cre"[..]),
            Some(b"s3cret"),
            Some(b"Bearer s3cret2"),
        ] {
            assert!(
                matches!(v.authorize(bad, None, b"{}"), Err(Refused::Unauthorized)),
                "{bad:?}"
            );
        }
        let off = Verdicts::new(NODE, None, Duration::from_secs(60));
        assert!(matches!(
            off.authorize(Some(b"Bearer x"), None, b"{}"),
            Err(Refused::Off)
        ));
    }

    #[test]
    fn entries_confirmations_and_their_order() {
        let v = Verdicts::new(NODE, None, Duration::from_secs(60));
        let doc = testing::node(NODE).devices(2).build();
        // Before any verdict: stale, every device unknown.
        let first = v.render(&doc, 1_000);
        assert!(first.verdict.as_ref().unwrap().stale);
        assert!(first.npus.iter().all(|d| d.status == DeviceStatus::Unknown));
        // A confirmation of nothing held: send the entry.
        assert!(matches!(
            v.apply(delivery("r1", 5, None), Checked::Token, 1_000),
            Err(Refused::Conflict(_))
        ));
        v.apply(
            delivery("r1", 5, Some(entry(DeviceStatus::Failed))),
            Checked::Token,
            1_000,
        )
        .unwrap();
        let now = v.render(&doc, 1_500);
        assert!(!now.verdict.as_ref().unwrap().stale);
        assert_eq!(now.summary.failed, 1);
        assert_eq!(now.summary.healthy, 1);
        assert_eq!(now.readings_at.as_deref(), Some(doc.timestamp.as_str()));
        // A late delivery of an older entry by the same writer is refused.
        let late = v.apply(
            delivery("r1", 4, Some(entry(DeviceStatus::Healthy))),
            Checked::Token,
            1_600,
        );
        assert!(matches!(late, Err(Refused::Conflict(_))));
        assert_eq!(v.render(&doc, 1_600).summary.failed, 1);
        // The same sequence again: the same entry confirms it, other content is
        // refused and changes nothing.
        v.apply(
            delivery("r1", 5, Some(entry(DeviceStatus::Failed))),
            Checked::Token,
            1_650,
        )
        .unwrap();
        let replay = v.apply(
            delivery("r1", 5, Some(entry(DeviceStatus::Healthy))),
            Checked::Token,
            1_660,
        );
        assert!(matches!(replay, Err(Refused::Conflict(_))), "{replay:?}");
        assert_eq!(v.render(&doc, 1_660).summary.failed, 1);
        // A confirmation of another sequence: send the entry.
        assert!(v
            .apply(delivery("r1", 6, None), Checked::Token, 1_700)
            .is_err());
        // Another writer (a new holder of the shard) replaces it.
        v.apply(
            delivery("r2", 1, Some(entry(DeviceStatus::Healthy))),
            Checked::Token,
            1_800,
        )
        .unwrap();
        assert_eq!(v.render(&doc, 1_800).summary.healthy, 2);
        // An entry for another node is refused.
        let mut other = entry(DeviceStatus::Healthy);
        other.node = "elsewhere".into();
        assert!(matches!(
            v.apply(delivery("r2", 2, Some(other)), Checked::Token, 1_900),
            Err(Refused::Invalid(_))
        ));
    }

    #[test]
    fn an_unconfirmed_verdict_turns_stale_and_never_stays_healthy() {
        let v = Verdicts::new(NODE, None, Duration::from_secs(60));
        let doc = testing::node(NODE).devices(2).build();
        v.apply(
            delivery("r1", 1, Some(entry(DeviceStatus::Failed))),
            Checked::Token,
            10_000,
        )
        .unwrap();
        assert!(!v.stale(12_900));
        // Confirmed at 12.9 s: fresh until 15.9 s.
        v.apply(delivery("r1", 1, None), Checked::Token, 12_900)
            .unwrap();
        assert!(!v.stale(15_800));
        assert!(v.stale(16_000));
        let stale = v.render(&doc, 16_000);
        let src = stale.verdict.as_ref().unwrap();
        assert!(src.stale);
        assert_eq!(src.stale_after_s, 3);
        assert_eq!(stale.npus[0].status, DeviceStatus::Unknown);
        assert_eq!(stale.npus[0].reason.as_deref(), Some(STALE_REASON));
        assert_eq!(
            stale.npus[1].status,
            DeviceStatus::Failed,
            "a failure stays"
        );
        // The delivery's own bound is capped by the agent's.
        let short = Verdicts::new(NODE, None, Duration::from_secs(2));
        let mut d = delivery("r1", 1, Some(entry(DeviceStatus::Healthy)));
        d.stale_after_ms = 600_000;
        short.apply(d, Checked::Token, 0).unwrap();
        assert!(short.stale(2_001));
    }
    /// A verdict checked against the aggregator's key, with the token every node holds.
    fn signed() -> (Arc<Verdicts>, faultline_common::seal::SigningKey) {
        let (private, _) = faultline_common::seal::SigningKey::generate_pem().unwrap();
        let key = faultline_common::seal::SigningKey::from_pem(&private).unwrap();
        (trusting(&key), key)
    }

    /// Verdicts on NODE that take `key`'s signatures, and the shared token.
    fn trusting(key: &faultline_common::seal::SigningKey) -> Arc<Verdicts> {
        let trust = Trust {
            token: Some(Reloaded::fixed(b"shared".to_vec())),
            keys: Some(Reloaded::fixed(
                VerifyingKeys::from_pem(&key.public_pem()).unwrap(),
            )),
        };
        Verdicts::trusting(NODE, trust, Duration::from_secs(60))
    }

    /// `d` as the aggregator sends it: its node, when, the digest, signed by `key`.
    fn sealed(
        key: &faultline_common::seal::SigningKey,
        mut d: Delivery,
        node: &str,
        sent_ms: u64,
    ) -> (Vec<u8>, String) {
        d.node = Some(node.into());
        d.sent_ms = Some(sent_ms);
        d.digest = d.entry.as_ref().map(NodeFaults::digest).or(d.digest);
        let body = serde_json::to_vec(&d).unwrap();
        let sig = key.sign(&body);
        (body, sig)
    }

    /// What the agent's handler does with a body: authorize, parse, apply.
    fn put(v: &Verdicts, body: &[u8], sig: Option<&str>, now: u64) -> Result<(), Refused> {
        let how = v.authorize(Some(b"Bearer shared"), sig.map(str::as_bytes), body)?;
        v.apply(serde_json::from_slice(body).unwrap(), how, now)
    }

    #[test]
    fn the_shared_token_alone_cannot_set_a_signed_verdict() {
        let (v, key) = signed();
        let doc = testing::node(NODE).devices(2).build();
        let now = 1_000_000;
        let mut failed = entry(DeviceStatus::Failed);
        failed.drain.push(DrainNotice {
            namespace: "train".into(),
            pod: "worker-0".into(),
            uid: "uid-0".into(),
            pod_ips: vec!["10.0.0.7".into()],
            devices: vec![failed.npus[1].id.clone()],
            reasons: vec!["xid-79".into()],
            requested: "2026-12-02T10:00:00.000Z".into(),
            evict_after: "2026-12-02T10:10:00.000Z".into(),
            acknowledged: None,
        });
        let (body, sig) = sealed(&key, delivery("r1", 5, Some(failed)), NODE, now);
        put(&v, &body, Some(&sig), now).unwrap();
        // A node holds the token and the public key, and writes its own: unsigned,
        // signed by another key, or the real signature over other content.
        let forged = serde_json::to_vec(&{
            let mut d = delivery("r1", 9, Some(entry(DeviceStatus::Healthy)));
            d.node = Some(NODE.into());
            d.sent_ms = Some(now + 1);
            d
        })
        .unwrap();
        assert!(matches!(
            put(&v, &forged, None, now + 1),
            Err(Refused::Unsigned(SealError::Missing))
        ));
        let (stranger, _) = faultline_common::seal::SigningKey::generate_pem().unwrap();
        let stranger = faultline_common::seal::SigningKey::from_pem(&stranger).unwrap();
        let other = stranger.sign(&forged);
        assert!(matches!(
            put(&v, &forged, Some(&other), now + 1),
            Err(Refused::Unsigned(SealError::Mismatch))
        ));
        assert!(matches!(
            put(&v, &forged, Some(&sig), now + 1),
            Err(Refused::Unsigned(SealError::Mismatch))
        ));
        // A drain intent re-addressed under the real signature: refused the same way.
        let mut moved: Delivery = serde_json::from_slice(&body).unwrap();
        moved.entry.as_mut().unwrap().drain[0].pod_ips = vec!["10.0.0.66".into()];
        let moved = serde_json::to_vec(&moved).unwrap();
        assert!(matches!(
            put(&v, &moved, Some(&sig), now + 1),
            Err(Refused::Unsigned(_))
        ));
        assert_eq!(
            v.render(&doc, now + 2).summary.failed,
            1,
            "the real verdict stands"
        );
    }

    #[test]
    fn a_signed_message_cannot_be_played_again_here_or_elsewhere() {
        let (v, key) = signed();
        let doc = testing::node(NODE).devices(2).build();
        let t = 1_000_000;
        let failed = sealed(
            &key,
            delivery("r1", 5, Some(entry(DeviceStatus::Failed))),
            NODE,
            t,
        );
        let healthy = sealed(
            &key,
            delivery("r1", 6, Some(entry(DeviceStatus::Healthy))),
            NODE,
            t + 10,
        );
        put(&v, &failed.0, Some(&failed.1), t).unwrap();
        put(&v, &healthy.0, Some(&healthy.1), t + 10).unwrap();
        // The older one again: refused (and so is another writer's older message).
        assert!(matches!(
            put(&v, &failed.0, Some(&failed.1), t + 20),
            Err(Refused::Conflict(_))
        ));
        let other_writer = sealed(
            &key,
            delivery("r0", 99, Some(entry(DeviceStatus::Failed))),
            NODE,
            t + 5,
        );
        assert!(matches!(
            put(&v, &other_writer.0, Some(&other_writer.1), t + 20),
            Err(Refused::Conflict(_))
        ));
        assert_eq!(v.render(&doc, t + 20).summary.failed, 0);
        // A confirmation is taken once; a recording of it keeps nothing fresh.
        let mut c = delivery("r1", 6, None);
        c.digest = Some(entry(DeviceStatus::Healthy).digest());
        let confirm = sealed(&key, c, NODE, t + 30);
        put(&v, &confirm.0, Some(&confirm.1), t + 30).unwrap();
        assert!(matches!(
            put(&v, &confirm.0, Some(&confirm.1), t + 40),
            Err(Refused::Conflict(_))
        ));
        // A message for another node is refused there, even signed.
        let elsewhere = sealed(
            &key,
            delivery("r1", 7, Some(entry(DeviceStatus::Healthy))),
            "other-node",
            t + 50,
        );
        let signed_elsewhere = trusting(&key);
        assert!(matches!(
            put(&signed_elsewhere, &elsewhere.0, Some(&elsewhere.1), t + 50),
            Err(Refused::Invalid(_))
        ));
        // A message older than --verdict-stale-after, to an agent that restarted and
        // holds nothing: refused.
        let fresh = trusting(&key);
        assert!(matches!(
            put(&fresh, &failed.0, Some(&failed.1), t + 61_000),
            Err(Refused::Conflict(_))
        ));
        // Signed but silent on its node or time: refused.
        let bare =
            serde_json::to_vec(&delivery("r1", 8, Some(entry(DeviceStatus::Healthy)))).unwrap();
        let sig = key.sign(&bare);
        assert!(matches!(
            put(&fresh, &bare, Some(&sig), t),
            Err(Refused::Invalid(_))
        ));
    }

    #[test]
    fn a_confirmation_confirms_only_the_entry_it_names() {
        let v = Verdicts::new(NODE, None, Duration::from_secs(60));
        v.apply(
            delivery("r1", 5, Some(entry(DeviceStatus::Failed))),
            Checked::Token,
            1_000,
        )
        .unwrap();
        let mut wrong = delivery("r1", 5, None);
        wrong.digest = Some(entry(DeviceStatus::Healthy).digest());
        assert!(matches!(
            v.apply(wrong, Checked::Token, 2_000),
            Err(Refused::Conflict(_))
        ));
        let mut right = delivery("r1", 5, None);
        right.digest = Some(entry(DeviceStatus::Failed).digest());
        v.apply(right, Checked::Token, 2_000).unwrap();
        // A full delivery whose digest is not its entry's: refused.
        let mut lying = delivery("r1", 6, Some(entry(DeviceStatus::Healthy)));
        lying.digest = Some(entry(DeviceStatus::Failed).digest());
        assert!(matches!(
            v.apply(lying, Checked::Token, 2_100),
            Err(Refused::Invalid(_))
        ));
    }
}
