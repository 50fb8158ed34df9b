//! The label sets of the aggregator's metrics, and the typed values of the remediation
//! actions (`action` and `result` of `actions_total`).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};

use faultline_common::{label_values, DeviceStatus};

label_values!(
    /// How a request to an agent ended (`result` of `agent_polls_total`).
    Poll {
        Ok => "ok",
        Error => "error",
    }
);

label_values!(
    /// How a rules reload ended (`result` of `rules_reloads_total`).
    Reload {
        Ok => "ok",
        Invalid => "invalid",
    }
);

label_values!(
    /// How a pod nudge ended (`result` of `nudges_total`).
    Nudge {
        Ok => "ok",
        Error => "error",
        /// The nudger was still busy with the last change.
        Busy => "busy",
        RateLimited => "rate-limited",
    }
);

label_values!(
    /// Where a document was written (`sink` of the write metrics).
    Sink {
        ConfigMap => "configmap",
        File => "file",
    }
);

label_values!(
    /// What became of an alert or a kubelet verdict (`result` of
    /// `intake_alerts_total`).
    IntakeResult {
        /// Counted toward its key's threshold.
        Counted => "counted",
        /// Reached the threshold: the device is judged failed.
        Acted => "acted",
        /// A copy already counted, or a key acted on within the dedup window.
        Duplicates => "duplicates",
        Resolved => "resolved",
        /// Names no device (or no node).
        Unattributed => "unattributed",
        /// Pushed out of the intake's bounded memory.
        Evicted => "evicted",
        /// A verdict for a node this replica does not follow, over the bound kept.
        UnfollowedOverflow => "unfollowed-overflow",
        /// A verdict for more devices of a node than the bound kept.
        NodeDevicesOverflow => "node-devices-overflow",
        NoSuchNode => "no-such-node",
        KubeletUnknown => "kubelet-unknown",
        KubeletUnhealthy => "kubelet-unhealthy",
    }
);

label_values!(
    /// What a delivery to an agent carried (`kind` of `deliveries_total`).
    DeliveryKind {
        /// A node's whole entry.
        Entry => "entry",
        /// A confirmation that the entry the agent holds is current.
        Confirm => "confirm",
    }
);

label_values!(
    /// How a delivery to an agent ended (`result` of `deliveries_total`).
    Delivered {
        Ok => "ok",
        /// The agent holds a newer entry.
        Conflict => "conflict",
        /// The agent refused our token.
        Refused => "refused",
        Unreachable => "unreachable",
        Error => "error",
    }
);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ResultLabel {
    pub(super) result: crate::notify::Delivery,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct PollLabel {
    pub(super) result: Poll,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReloadLabel {
    pub(super) result: Reload,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct NudgeLabel {
    pub(super) result: Nudge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct IntakeLabel {
    pub(super) result: IntakeResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StateLabel {
    pub(super) state: DeviceStatus,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TransitionLabels {
    pub(super) to: DeviceStatus,
    /// The reason's code (its first word): codes come from the catalogs and the rules.
    pub(super) reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct DeliveryLabels {
    pub(super) kind: DeliveryKind,
    pub(super) result: Delivered,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct SinkLabels {
    pub(super) sink: Sink,
    pub(super) shard: u32,
}

/// A remediation action, as the `action` label of `actions_total` and
/// `action_seconds` counts it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Action {
    /// Taint, label and condition for a failed device.
    Quarantine,
    /// A device quarantined alone: its DeviceTaintRule, or the device
    /// plugin's isolation recorded.
    QuarantineDevice,
    /// The unknown guard's taint (no eviction).
    TaintUnknown,
    /// Evicting the pods on a failed device.
    Evict,
    /// Releasing a node.
    Release,
    /// Extending a quarantine that has not expired.
    Extend,
    /// A canary Job before an automatic release.
    Canary,
    /// An Event on the Node.
    Event,
    /// An alert the intake acted on.
    Alert,
    /// The quarantine record on the Node.
    Record,
    /// A drain intent before an eviction: `ok` published, then
    /// `acknowledged`, `timed-out` (evicted at the deadline) or `left` (the pod went).
    Drain,
}

impl Action {
    /// The label value (the names dashboards and alerts use).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Quarantine => "quarantine",
            Action::QuarantineDevice => "quarantine-device",
            Action::TaintUnknown => "taint-unknown",
            Action::Evict => "evict",
            Action::Release => "release",
            Action::Extend => "extend",
            Action::Canary => "canary",
            Action::Event => "event",
            Action::Alert => "alert",
            Action::Record => "record",
            Action::Drain => "drain",
        }
    }
}

/// What an [`Action`] came to, as the `result` label of `actions_total`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ActionResult {
    /// Done.
    Ok,
    /// Dry run: announced, nothing changed.
    DryRun,
    /// Held back by the budget.
    HeldBack,
    /// Failed with an API error.
    Error,
    /// Did not do what it should (an eviction refused past its retries, a canary that
    /// failed).
    Failed,
    /// Started (a canary Job).
    Started,
    /// Waited for the eviction rate.
    Throttled,
    /// Given up after its deadline.
    GivenUp,
    /// Deleted without eviction (`--force-delete-after-deadline`).
    Deleted,
    /// Retried after a conflict.
    Retried,
    /// Named no device of the node (an alert).
    Unattributed,
    /// A drain intent its pod acknowledged: evicted at once.
    Acknowledged,
    /// A drain intent past its deadline: evicted then.
    TimedOut,
    /// A drain intent whose pod left before its eviction.
    Left,
    /// A setting that could not be read (a checkpoint grace that is no duration).
    Invalid,
    /// The device-taint controller's prediction disagreed with faultline's count:
    /// neither acted on.
    Disagreed,
}

impl ActionResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionResult::Ok => "ok",
            ActionResult::DryRun => "dry-run",
            ActionResult::HeldBack => "held-back",
            ActionResult::Error => "error",
            ActionResult::Failed => "failed",
            ActionResult::Started => "started",
            ActionResult::Throttled => "throttled",
            ActionResult::GivenUp => "given-up",
            ActionResult::Deleted => "deleted",
            ActionResult::Retried => "retried",
            ActionResult::Unattributed => "unattributed",
            ActionResult::Acknowledged => "acknowledged",
            ActionResult::TimedOut => "timed-out",
            ActionResult::Left => "left",
            ActionResult::Invalid => "invalid",
            ActionResult::Disagreed => "disagreed",
        }
    }
}

impl EncodeLabelValue for Action {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl EncodeLabelValue for ActionResult {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ActionLabels {
    pub(super) action: Action,
    pub(super) result: ActionResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ActionLabel {
    pub(super) action: Action,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct CodeLabel {
    pub(super) code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    /// An error's `metric_label()`, or a name the code gives: never input.
    pub(super) kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ShardLabel {
    pub(super) shard: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct IsolatedLabels {
    pub(super) node: String,
    pub(super) driver: String,
    pub(super) by: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct VersionLabel {
    pub(super) version: String,
}
