//! From agents' documents to smoothed device states: per node, per device, the sliding
//! windows and correlation rules turn each sample into an observation and the state
//! machine turns observations into a status with a reason and a since-when.
//!
//! Each device gets about one observation per second: a document arriving within a
//! second of the last evaluation is kept for the next tick, unless it carries a hard
//! fault, which is evaluated at once (the fast path to `failed`).

mod drain;
mod judge;
mod node;
mod uuids;
mod views;

pub use judge::*;
pub use node::MAX_DEVICES_PER_NODE;
