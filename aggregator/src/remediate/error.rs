//! What a remediation pass did, and why one failed.

/// Why a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum RemediateError {
    /// The API said no (409/422 on a concurrent change: try again from the live Node).
    #[error("API: {0}")]
    Api(#[from] kube::Error),
    /// This replica no longer holds the node's shard.
    #[error("not the holder of the node's shard")]
    NotHolder,
    /// The hold ended while a write was in flight (it had this long): given up, so it
    /// cannot land after another replica took the shard over.
    #[error("the shard's hold ended {0:?} into a write: given up")]
    HoldEnded(std::time::Duration),
    /// The pass took this long from taking the node's place in the budget ledger to
    /// its write: so late the place may be dropped as stale, so the write is not sent
    /// (the next pass takes the place anew).
    #[error("{0:?} from the budget's place to the write: not sent")]
    PlaceExpired(std::time::Duration),
    /// The record on the Node does not parse.
    #[error("unreadable quarantine record on {0}: {1}")]
    Record(String, String),
    /// A device quarantine could not go on (a DeviceTaintRule of another owner, one
    /// that did not decode).
    #[error("device quarantine: {0}")]
    Device(String),
    /// The API server refused the rule proposed for `device` (422): the node path.
    #[error("DeviceTaintRule for {device} refused: {why}")]
    RuleRefused { device: String, why: String },
    /// No agreement on the prediction for `device`'s rule `rule` by its deadline
    /// (`why`): the rules proposed are deleted and the node path taken.
    #[error("no agreement on DeviceTaintRule {rule} for {device}: {why}")]
    NoAgreement {
        device: String,
        rule: String,
        why: String,
    },
}

impl RemediateError {
    /// The kind, as a metric label: `conflict` (409/422: the Node changed under the
    /// pass), `api` (any other API error), `not-holder`, `record`, `budget` (a place in
    /// the budget ledger too old to write under), `device`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            RemediateError::Api(kube::Error::Api(e)) if e.code == 409 || e.code == 422 => {
                "conflict"
            }
            RemediateError::Api(_) => "api",
            RemediateError::NotHolder | RemediateError::HoldEnded(_) => "not-holder",
            RemediateError::Record(..) => "record",
            RemediateError::PlaceExpired(_) => "budget",
            RemediateError::Device(..)
            | RemediateError::RuleRefused { .. }
            | RemediateError::NoAgreement { .. } => "device",
        }
    }
}

/// What a pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Remediation is off.
    Off,
    /// Dry run: announced, nothing changed.
    Announced,
    /// The node was already isolated for this fault: nothing to do.
    AlreadyDone,
    /// Isolated now.
    Isolated,
    /// Not isolated: a budget is spent (why).
    HeldBack(String),
    /// Not isolated: the circuit breaker is open.
    BreakerOpen,
    /// The node itself is not Ready: Kubernetes' node lifecycle handles it.
    LeftToKubernetes,
    /// A person released these devices within the dedup window: not acted on again.
    Suppressed,
    /// Released now (all devices, or the named ones).
    Released,
    /// Not released yet: why (health, cool-down, canary).
    Waiting(String),
}

impl Outcome {
    /// Whether the devices a pass was given are settled by it: on the Node now, or
    /// deliberately not acted on (a budget or the breaker holding back is not settled:
    /// a later pass tries again).
    pub fn settles(&self) -> bool {
        matches!(
            self,
            Outcome::Isolated
                | Outcome::AlreadyDone
                | Outcome::Suppressed
                | Outcome::Announced
                | Outcome::Off
        )
    }
}

impl From<crate::shard::Lost> for RemediateError {
    fn from(l: crate::shard::Lost) -> Self {
        match l {
            crate::shard::Lost::NotHeld => RemediateError::NotHolder,
            crate::shard::Lost::RanOut(d) => RemediateError::HoldEnded(d),
        }
    }
}

/// A DRA error as the pass's: API errors stay API errors.
pub(super) fn quarantine_error(e: crate::device_taint::QuarantineError) -> RemediateError {
    match e {
        crate::device_taint::QuarantineError::Api(e) => RemediateError::Api(e),
        other => RemediateError::Device(other.to_string()),
    }
}
