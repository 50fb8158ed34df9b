//! Remediation: isolate a node whose accelerator failed (taint, label, condition,
//! record, Event), evict the pods on the failed device, and release the node once a
//! person or the proof of health says so; within budgets, the breaker and the eviction
//! rate; never twice, never on a guess.
//!
//! - `record.rs`: the quarantine record on the Node, release requests, labels;
//! - `patch.rs`: the resourceVersion-guarded Node patch;
//! - `policy.rs`: the decisions, as pure functions with table tests;
//! - `guards.rs`: budget, breaker, eviction rate and held-back nodes, each its own lock;
//! - `ledger.rs`: the budget's places, a ConfigMap written by compare-and-swap;
//! - `announce.rs`: Events, audit lines, notifications;
//! - `remediator.rs`: what every pass needs; `isolate.rs`, `evict.rs`, `release.rs`,
//!   `canary.rs`: the passes;
//! - `drain.rs`: warning a pod before its eviction; `grace.rs`: the grace a
//!   pod or its namespace asks for.
//! - `device.rs`: one device quarantined alone, `prediction.rs` the controller's
//!   prediction and its deadline, `device_canary.rs` its canary's claim,
//!   `device_release.rs` its rules deleted;
//!   `ascend.rs`: chips Huawei's device plugin separated already.

pub mod announce;
mod ascend;
pub mod canary;
pub mod describe;
pub mod device;
mod device_canary;
mod device_release;
pub mod drain;
pub mod error;
pub mod evict;
pub mod grace;
pub mod guards;
mod holders;
pub mod isolate;
mod kubelet_dra;
pub mod ledger;
pub mod node_cache;
pub mod patch;
pub mod policy;
mod prediction;
pub mod record;
pub mod release;
pub mod remediator;
pub mod view;

pub use crate::device_taint::DeviceQuarantine;
pub use error::{Outcome, RemediateError};
pub use evict::Evictions;
pub use guards::Breaker;
pub use ledger::Ledger;
pub use policy::{Budget, CanarySpec, Mode, ReleasePolicy};
pub use record::{
    history_of, label_value, record_of, CanaryState, DeviceIsolation, DeviceRule, LiveNode,
    QuarantineRecord, ReleaseRequest, CANARY_LABEL, CONDITION, DEVICES_LABEL, HISTORY_ANNOTATION,
    RECORD_ANNOTATION, RELEASE_ANNOTATION, RELEASE_BY_ANNOTATION, RELEASE_REASON_ANNOTATION,
};
pub use remediator::Remediator;
