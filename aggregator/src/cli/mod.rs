//! `faultline`, also `kubectl faultline` (the same binary, installed as `kubectl-faultline`): what an
//! SRE runs against the cluster.
//!
//! - `status`: the quarantined nodes, their devices and why, the breaker.
//! - `describe NODE`: each device's status, since, reason and last readings as
//!   published, faultline's taints, the quarantine record and its history.
//! - `agents`: every agent the aggregator follows, reachable or not, and its sources.
//! - `release NODE [--device D]...`: ask for a release. It writes the request on the
//!   Node (`faultline.io/release`, `-by`, `-reason`); the replica that holds the node's
//!   shard carries it out (one actor, the Lease checked, the record kept as history)
//!   and the command waits until it is done.
//! - `breaker close|open`: close the circuit breaker after a look at the cause.
//!
//! kubectl hands a plugin none of its own flags (`kubectl --context x faultline` is an
//! error in `pkg/cmd/plugin`), so the plugin takes `--kubeconfig`, `--context` and
//! `-n` itself, after `faultline`, as `kubectl faultline --context x status` reads.

mod commands;
pub mod render;
pub mod view;

pub use commands::*;
