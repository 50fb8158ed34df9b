//! The running aggregator: [`start`] builds every part from the
//! [`Config`](crate::config::Config) (`wiring.rs`: the collectors, the publisher, the
//! shard Leases, remediation and its dispatcher, the intake, the API) and spawns them;
//! the core loop (`core.rs`) runs the pipeline, the dispatcher (`dispatch.rs`) the
//! per-node remediation passes.

pub mod core;
pub mod dispatch;
mod follow;
mod in_flight;
pub mod ratelimit;
pub mod schedule;
pub mod supervise;
mod wiring;

pub use supervise::Stopped;
pub use wiring::{connect, connect_with, start, start_with_clock, Aggregator};
