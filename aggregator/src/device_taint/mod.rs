//! Take one device out, not its node: Kubernetes' DeviceTaintRule (KEP-5055) where the
//! cluster serves it, else the device plugin's or Ascend's own isolation where it
//! already took the device out. ("Quarantine" is the node's record, in `remediate`.)
//!
//! - `api`: which version of `resource.k8s.io` serves DeviceTaintRule, if any;
//! - `index` (pure): the allowlisted drivers' devices by UUID, complete pools only, and
//!   the pods that hold a device through their claims;
//! - `rule` (pure): one DeviceTaintRule per device, its name, ownership and the
//!   controller's prediction of a `None` rule;
//! - `scope` (pure): the device or the node, by the rules file's node faults and
//!   threshold, the API, and whether a complete pool publishes the device;
//! - `plugin` (pure): on a device-plugin cluster, whether the plugin already took the
//!   failed devices out of the node's allocatable;
//! - `ascend` (pure): the chips Huawei's device plugin already separated by hand
//!   (`ManuallySeparateNPU`), never isolated a second time;
//! - `settings`: what the device path of remediation is told;
//! - `claims`: the claims of a node's pods, bounded, those found missing remembered;
//! - `apply`: the writes (propose with `None`, read the prediction, enforce, release),
//!   never to a rule without faultline's label.

pub mod api;
pub mod apply;
pub mod ascend;
pub mod claims;
pub mod index;
pub mod plugin;
pub mod rule;
pub mod scope;
pub mod settings;

pub use api::{discover, newest_with_rules, TaintApi};
pub use apply::{judge, Dra, Prediction, QuarantineError, Watched};
pub use index::{
    holders, tolerates_forever, would_be_evicted, DeviceIndex, DeviceRef, Holder, Slice,
};
pub use plugin::{plugin_scope, rejections, taken_out, PluginScope, REJECTION_WINDOW_MS};
pub use rule::{
    is_ours, rule_name, rule_object, taint_value, would_evict, Effect, Reported, TAINT_KEY,
};
pub use scope::{node_fault, rejecting, scope, Failed, NodeWhy, Scope};
pub use settings::{Backend, DeviceQuarantine};
