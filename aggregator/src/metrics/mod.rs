//! Prometheus metrics of the aggregator, on one prefixed registry.

mod labels;
mod registry;
mod remediation;
mod shards;

pub use labels::{Action, ActionResult, Delivered, DeliveryKind, IntakeResult, Nudge, Poll, Sink};
pub use registry::*;
