//! The node's own `fault.json`: the aggregator's verdict on this node,
//! handed to this agent (`PUT /v1/fault`, bearer token), served to the node's pods
//! (`GET /v1/fault`, a watch; the file of `--fault-dir`), so that a change costs one
//! node, not a write that every kubelet of the fleet receives.
//!
//! Only the aggregator sets it: a delivery must carry the token of
//! `--delivery-token-file`, compared in constant time. The verdict's statuses are the
//! aggregator's; its readings are this agent's latest (`readings_at`). A verdict holds
//! for `stale_after` (the delivery's, at most `--verdict-stale-after`) after the node
//! last heard from the aggregator; past that, and before any verdict, the document says
//! `verdict.stale` and every device the verdict called healthy is `unknown`
//! (`verdict-stale`): it never silently keeps saying "healthy".
//!
//! Order: from one writer, only a higher sequence replaces the entry held (a late
//! delivery is refused, and so is other content under the sequence held: the same
//! entry again only confirms it); another writer's entry replaces it (a shard changed
//! holder, and the aggregator writes only shards it holds).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::fault::{
    AgentReach, Delivery, DrainNotice, FaultSummary, NodeFaults, NpuFault, SourceReach,
    VerdictSource, FAULT_VERSION,
};
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
}

/// The aggregator's verdicts on this node.
pub struct Verdicts {
    node: String,
    token: Option<Vec<u8>>,
    max_stale: Duration,
    held: Mutex<Option<Held>>,
    /// Moves whenever the document would read otherwise (a new entry, a confirmation,
    /// turning stale).
    version: watch::Sender<u64>,
}

/// `a == b` in time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Verdicts {
    /// Verdicts on `node`, set by whoever presents `token` (none: nobody).
    pub fn new(node: &str, token: Option<Vec<u8>>, max_stale: Duration) -> Arc<Self> {
        Arc::new(Verdicts {
            node: node.to_string(),
            token: token.filter(|t| !t.is_empty()),
            max_stale: max_stale.max(MIN_STALE_AFTER),
            held: Mutex::new(None),
            version: watch::channel(0).0,
        })
    }

    /// The token of `path`: its content, trimmed.
    pub fn read_token(path: &Path) -> std::io::Result<Vec<u8>> {
        let t = std::fs::read(path)?;
        let t = t.trim_ascii();
        if t.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is empty", path.display()),
            ));
        }
        Ok(t.to_vec())
    }

    /// Whether a token is set (deliveries can be authorized at all).
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `authorization` (the header's value) carries the token.
    pub fn authorize(&self, authorization: Option<&[u8]>) -> Result<(), Refused> {
        let want = self.token.as_deref().ok_or(Refused::Off)?;
        let got = authorization
            .and_then(faultline_common::names::bearer_token)
            .ok_or(Refused::Unauthorized)?;
        if same_secret(got, want) {
            Ok(())
        } else {
            Err(Refused::Unauthorized)
        }
    }

    /// Watch the document's version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Take a delivery (already authorized) at `now_ms`.
    pub fn apply(&self, d: Delivery, now_ms: u64) -> Result<(), Refused> {
        let stale_after =
            Duration::from_millis(d.stale_after_ms).clamp(MIN_STALE_AFTER, self.max_stale);
        let mut held = self.held.locked();
        match d.entry {
            None => match held.as_mut() {
                Some(h) if h.writer == d.writer && h.sequence == d.sequence => {
                    h.confirmed_ms = now_ms;
                    h.stale_after = stale_after;
                }
                _ => {
                    return Err(Refused::Conflict(format!(
                        "no entry {} of {} held: send it",
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

    fn delivery(writer: &str, sequence: u64, entry: Option<NodeFaults>) -> Delivery {
        Delivery {
            writer: writer.into(),
            sequence,
            published: "2026-12-02T10:00:00.000Z".into(),
            stale_after_ms: 3_000,
            entry,
        }
    }

    #[test]
    fn only_the_token_sets_a_verdict() {
        let v = Verdicts::new(NODE, Some(b"s3cret".to_vec()), Duration::from_secs(60));
        assert!(v.authorize(Some(b"Bearer s3cret")).is_ok());
        assert!(
            v.authorize(Some(b"bearer s3cret")).is_ok(),
            "RFC 9110: any case"
        );
        for bad in [
            None,
            Some(&b"Bearer s3cre"[..]),
            Some(b"s3cret"),
            Some(b"Bearer s3cret2"),
        ] {
            assert!(
                matches!(v.authorize(bad), Err(Refused::Unauthorized)),
                "{bad:?}"
            );
        }
        let off = Verdicts::new(NODE, None, Duration::from_secs(60));
        assert!(matches!(
            off.authorize(Some(b"Bearer x")),
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
            v.apply(delivery("r1", 5, None), 1_000),
            Err(Refused::Conflict(_))
        ));
        v.apply(delivery("r1", 5, Some(entry(DeviceStatus::Failed))), 1_000)
            .unwrap();
        let now = v.render(&doc, 1_500);
        assert!(!now.verdict.as_ref().unwrap().stale);
        assert_eq!(now.summary.failed, 1);
        assert_eq!(now.summary.healthy, 1);
        assert_eq!(now.readings_at.as_deref(), Some(doc.timestamp.as_str()));
        // A late delivery of an older entry by the same writer is refused.
        let late = v.apply(delivery("r1", 4, Some(entry(DeviceStatus::Healthy))), 1_600);
        assert!(matches!(late, Err(Refused::Conflict(_))));
        assert_eq!(v.render(&doc, 1_600).summary.failed, 1);
        // The same sequence again: the same entry confirms it, other content is
        // refused and changes nothing.
        v.apply(delivery("r1", 5, Some(entry(DeviceStatus::Failed))), 1_650)
            .unwrap();
        let replay = v.apply(delivery("r1", 5, Some(entry(DeviceStatus::Healthy))), 1_660);
        assert!(matches!(replay, Err(Refused::Conflict(_))), "{replay:?}");
        assert_eq!(v.render(&doc, 1_660).summary.failed, 1);
        // A confirmation of another sequence: send the entry.
        assert!(v.apply(delivery("r1", 6, None), 1_700).is_err());
        // Another writer (a new holder of the shard) replaces it.
        v.apply(delivery("r2", 1, Some(entry(DeviceStatus::Healthy))), 1_800)
            .unwrap();
        assert_eq!(v.render(&doc, 1_800).summary.healthy, 2);
        // An entry for another node is refused.
        let mut other = entry(DeviceStatus::Healthy);
        other.node = "elsewhere".into();
        assert!(matches!(
            v.apply(delivery("r2", 2, Some(other)), 1_900),
            Err(Refused::Invalid(_))
        ));
    }

    #[test]
    fn an_unconfirmed_verdict_turns_stale_and_never_stays_healthy() {
        let v = Verdicts::new(NODE, None, Duration::from_secs(60));
        let doc = testing::node(NODE).devices(2).build();
        v.apply(delivery("r1", 1, Some(entry(DeviceStatus::Failed))), 10_000)
            .unwrap();
        assert!(!v.stale(12_900));
        // Confirmed at 12.9 s: fresh until 15.9 s.
        v.apply(delivery("r1", 1, None), 12_900).unwrap();
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
        short.apply(d, 0).unwrap();
        assert!(short.stale(2_001));
    }
}
