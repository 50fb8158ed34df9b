//! One followed node as the pipeline keeps it: its devices (windows and state), the
//! readings of its last document, and whether the ticks may skip it while it is quiet.

use std::collections::BTreeMap;

use faultline_common::document::DocView;
use faultline_common::fault::{AgentReach, SourceReach};
use faultline_common::rules::{DeviceWindows, Measure, Rules};
use faultline_common::state::DeviceState;
use faultline_common::DeviceStatus;

use crate::model::{Provenance, RecordDevice};

pub(super) struct Device {
    pub(super) windows: DeviceWindows,
    pub(super) state: DeviceState,
    /// The last full evaluation observed a clean sample.
    pub(super) clean: bool,
    /// When the agent last reported this device.
    pub(super) reported_ms: u64,
}

/// Why a document's device ids were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Churn {
    #[error("{new} new device ids beside {kept} kept: at most {MAX_DEVICES_PER_NODE} per node")]
    TooMany { new: usize, kept: usize },
    #[error(
        "{new} new device ids, {in_window} already in this window: at most {NEW_IDS_PER_WINDOW} per {} min",
        NEW_ID_WINDOW_MS / 60_000
    )]
    TooFast { new: usize, in_window: u32 },
}

/// A device's readings as the last document gave them: what is published and what a
/// quarantine record names the device by.
pub(super) struct Last {
    /// [`texts`] of the entry these readings came from: a document listing the same
    /// device with the same texts (the usual case) is told by it, without a look at the
    /// cold strings below.
    pub(super) texts: u64,
    pub(super) id: Box<str>,
    pub(super) uuid: Option<Box<str>>,
    pub(super) pci_bus_id: Option<Box<str>>,
    pub(super) temperature_c: Option<f64>,
    pub(super) power_w: Option<f64>,
    pub(super) ecc_errors: Option<u64>,
    pub(super) pcie_link_status: Option<Box<str>>,
    pub(super) recovery_action: Option<faultline_common::RecoveryAction>,
    /// An Ascend chip's physical id, where its agent learned it.
    pub(super) phy_id: Option<u32>,
}

pub(super) struct Node {
    pub(super) devices: BTreeMap<String, Device>,
    /// The last document, measured when it arrived (one [`Measure`] per entry of
    /// `last`), while it is still to be judged or while some device is not quiet (each
    /// tick observes it again). A quiet node's is dropped once judged (the
    /// parsed document kept for the tick was most of a node's memory, and judging it a
    /// second later a cache miss per field); its next ticks are clean samples without
    /// it, as [`Node::record_quiet`] records them.
    pub(super) pending: Option<Vec<Measure>>,
    /// The document's bytes while `pending` is kept, so new rules can measure it anew.
    pub(super) raw: Option<Box<[u8]>>,
    /// Readings of the last document, for each device it listed.
    pub(super) last: Vec<Last>,
    /// The sources of the last document.
    pub(super) sources: Vec<SourceReach>,
    /// The document arrived since the last evaluation.
    pub(super) unseen: bool,
    /// Reachability as published, but for `last_seen` (kept as `last_seen_ms`: a
    /// timestamp formatted for every document was an allocation each).
    pub(super) reach: AgentReach,
    pub(super) last_seen_ms: Option<u64>,
    pub(super) reachable_since_ms: Option<u64>,
    pub(super) last_eval_ms: Option<u64>,
    pub(super) changed_ms: u64,
    /// Quiet and not looked at by the ticks since the tick of this number
    /// (walking every quiet device every second was a tenth of a replica's CPU). Every
    /// tick after it would have recorded a clean sample for each device, and does so
    /// when the node is next touched ([`Node::settle`]).
    pub(super) lazy_since_tick: Option<u64>,
    /// [`fnv1a64`] of the name, which decides its shard (a shard's document
    /// hashed every node's name to find its own, 5,000 names for each shard written).
    pub(super) name_hash: u64,
    /// New device ids taken in the current window: when it began, and how many
    /// ([`Node::admit_ids`]).
    pub(super) churn: (u64, u32),
    /// When a refused document was last logged for this node.
    pub(super) refused_logged_ms: Option<u64>,
    /// When UUIDs another node reported first were last logged for this node.
    pub(super) uuid_logged_ms: Option<u64>,
    /// Drain intents published and acknowledgements carried; boxed, as
    /// nearly every node has none.
    pub(super) drain: Option<Box<NodeDrain>>,
}

/// A node's drain intents (from its remediation pass) and the acknowledgements its
/// agent carries (pod UID, the intent's `requested`); and its quarantine marks.
#[derive(Default)]
pub(super) struct NodeDrain {
    pub(super) notices: Vec<faultline_common::fault::DrainNotice>,
    pub(super) acks: Vec<(String, String)>,
    /// How each quarantined device is kept from new work, by device id, as
    /// the node's last remediation pass found its record.
    pub(super) marks: Marks,
}

/// Quarantine marks by device id.
pub type Marks = Vec<(String, faultline_common::fault::QuarantineMark)>;

/// Most devices kept for one node, remembered ones included (an agent that
/// named 512 new device ids in every document grew a replica by 150 MB a minute and
/// its shard's ConfigMap past the API's limit, so no node of the shard was published).
/// A real node has at most 16 GPUs or 32 NPU chips.
pub const MAX_DEVICES_PER_NODE: usize = 64;
/// New device ids a node may name per [`NEW_ID_WINDOW_MS`] after its first document.
pub const NEW_IDS_PER_WINDOW: u32 = 16;
/// The window of [`NEW_IDS_PER_WINDOW`].
pub const NEW_ID_WINDOW_MS: u64 = 10 * 60 * 1000;

/// A device of `n` for a quarantine record, with the UUID and bus id of its last
/// reading; the verdict is the agent's (through this pipeline).
pub(super) fn record_device(n: &Node, id: &str, reason: String) -> RecordDevice {
    let last = n.last(id);
    RecordDevice {
        uuid: last.and_then(|l| l.uuid.as_deref().map(String::from)),
        pci_bus_id: last.and_then(|l| l.pci_bus_id.as_deref().map(String::from)),
        recovery_action: last.and_then(|l| l.recovery_action),
        phy_id: last.and_then(|l| l.phy_id),
        source: Some(Provenance::Agent),
        ..RecordDevice::new(id, reason)
    }
}

/// A fingerprint of a device entry's texts: its id, UUID, bus id and link status.
pub(super) fn texts(d: &faultline_common::document::DeviceView<'_>) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(0x2545f4914f6cdd1d).build_hasher();
    d.id.hash(&mut h);
    d.uuid.as_deref().hash(&mut h);
    d.pci_bus_id.as_deref().hash(&mut h);
    d.pcie_link_status.as_deref().hash(&mut h);
    h.finish()
}

/// Each device entry of a document, measured by `rules`, in the document's order.
pub(super) fn measures(rules: &Rules, doc: &DocView<'_>) -> Vec<Measure> {
    doc.npus.iter().map(|d| rules.measure(Some(d))).collect()
}

impl Node {
    /// Take the drain acknowledgements of a document: whether one is new and answers
    /// an intent published for the node and not yet acknowledged (only such a one
    /// makes the node's pass run: an agent naming ever new UIDs makes none).
    pub(super) fn take_acks(&mut self, doc: &DocView<'_>) -> bool {
        let Some(d) = self.drain.as_mut() else {
            return false;
        };
        if doc.drain_acks.is_empty() && d.acks.is_empty() {
            return false;
        }
        let new = doc.drain_acks.iter().any(|a| {
            let held = d
                .acks
                .iter()
                .any(|(u, r)| *u == *a.uid && *r == *a.requested);
            !held
                && d.notices.iter().any(|n| {
                    n.uid == *a.uid && n.requested == *a.requested && n.acknowledged.is_none()
                })
        });
        d.acks = doc
            .drain_acks
            .iter()
            .map(|a| (a.uid.to_string(), a.requested.to_string()))
            .collect();
        new
    }

    /// The last document's readings of device `id`, if it listed the device.
    pub(super) fn last(&self, id: &str) -> Option<&Last> {
        self.last.iter().find(|l| &*l.id == id)
    }

    /// Keep the readings and sources of a document. The same devices as last time (the
    /// usual case) are updated in place: no allocation unless a text changed.
    /// Whether the device ids of `doc` may be taken at `now_ms`: no more than
    /// [`MAX_DEVICES_PER_NODE`] kept in all, and after the node's first document no
    /// more than [`NEW_IDS_PER_WINDOW`] new ones per window. Why not, otherwise: the
    /// document is refused whole and the node stays as it was, so one node's agent can
    /// grow neither the replica nor its shard.
    pub(super) fn admit_ids(&mut self, doc: &DocView<'_>, now_ms: u64) -> Result<(), Churn> {
        let new = doc
            .npus
            .iter()
            .filter(|d| !self.devices.contains_key(&*d.id))
            .count();
        if new == 0 {
            return Ok(());
        }
        if self.devices.len() + new > MAX_DEVICES_PER_NODE {
            return Err(Churn::TooMany {
                new,
                kept: self.devices.len(),
            });
        }
        let first = self.devices.is_empty() && self.churn == (0, 0);
        if first {
            self.churn = (now_ms, 0);
            return Ok(());
        }
        if now_ms.saturating_sub(self.churn.0) >= NEW_ID_WINDOW_MS {
            self.churn = (now_ms, 0);
        }
        let n = u32::try_from(new).unwrap_or(u32::MAX);
        if self.churn.1.saturating_add(n) > NEW_IDS_PER_WINDOW {
            return Err(Churn::TooFast {
                new,
                in_window: self.churn.1,
            });
        }
        self.churn.1 += n;
        Ok(())
    }

    /// Whether any device's texts (id, UUID, bus id, link) changed.
    pub(super) fn remember(&mut self, doc: &DocView<'_>) -> bool {
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
        let mut changed = !same;
        if same {
            for ((l, d), fp) in self.last.iter_mut().zip(&doc.npus).zip(&fps) {
                if l.texts != *fp {
                    changed = true;
                    set(&mut l.uuid, d.uuid.as_deref());
                    set(&mut l.pci_bus_id, d.pci_bus_id.as_deref());
                    set(&mut l.pcie_link_status, d.pcie_link_status.as_deref());
                    l.texts = *fp;
                }
                l.temperature_c = d.temperature_c;
                l.power_w = d.power_w;
                l.ecc_errors = d.ecc_errors;
                l.recovery_action = d.recovery_action;
                l.phy_id = d.ascend_phy_id;
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
                    recovery_action: d.recovery_action,
                    phy_id: d.ascend_phy_id,
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
        changed
    }

    /// Judged again, every device would observe a clean sample (so a tick records that
    /// without the work, and the document need not be kept): the agent is
    /// reachable, its last document listed exactly the devices known, and every one
    /// gave a clean sample, is healthy and has quiet windows.
    pub(super) fn quiet(&self) -> bool {
        self.reach.reachable
            && self.last.len() == self.devices.len()
            && self.devices.values().all(|d| {
                // A device its agent reports unknown (a hung source) is not quiet: the
                // ticks must see it go without fresh data until it turns unknown
                // (skipped as quiet, it stayed healthy for as long as the
                // agent stayed silent, and its skipped ticks counted as clean samples).
                d.clean
                    && d.state.status == DeviceStatus::Healthy
                    && d.state.soft_since_ms.is_none()
                    && d.windows.quiet()
            })
    }

    /// Record the clean samples of the ticks it skipped while quiet: the ticks after
    /// `lazy_since_tick` up to `ticks`, the last of them at `last_tick_ms`.
    /// Whether the node was skipped (and is now looked at again).
    #[must_use]
    pub(super) fn settle(&mut self, ticks: u64, last_tick_ms: Option<u64>) -> bool {
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
    pub(super) fn state_of(
        &self,
        d: &Device,
        ticks: u64,
        last_tick_ms: Option<u64>,
    ) -> DeviceState {
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
    pub(super) fn record_quiet(&mut self, now_ms: u64) {
        self.last_eval_ms = Some(now_ms);
        for d in self.devices.values_mut() {
            d.state.last_fresh_ms = Some(now_ms);
            d.state.clean_streak = d.state.clean_streak.saturating_add(1);
        }
    }
}
