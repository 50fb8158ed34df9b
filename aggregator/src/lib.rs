//! faultline aggregator: follows the agents, denoises their readings with windows, rules
//! and a per-device state machine, publishes a versioned fault.json, and heals around
//! failed accelerators.
//!
//! The layout follows the data:
//! - `aged`: a map bounded and expired by when each key was last touched;
//! - `agents`: everything that talks to the agents: following them, the one gate their
//!   documents pass, and the delivery of each node's entry;
//! - `ingest`: what else comes in (which agents to follow, alerts, the kubelet);
//! - `pipeline`: windows, rules and the state machine per device;
//! - `publish`: the documents, to files or shard ConfigMaps, and pod nudges;
//! - `shard`: Leases and the fence every write asks;
//! - `remediate`: isolation, eviction, release, with their guards and announcements;
//! - `device_taint`: one device taken out (DRA's DeviceTaintRule, or the device
//!   plugin's and Ascend's own isolation) instead of its node;
//! - `app`: the wiring, the core loop and the per-node dispatcher;
//! - `api`, `config` (and `targets`, the agents it names), `metrics`, `notify`,
//!   `rules_file`, `model` (the shared vocabulary).
#![forbid(unsafe_code)]

pub mod aged;
pub mod agents;
pub mod api;
pub mod app;
pub mod cli;
pub mod config;
pub mod device_taint;
pub mod ingest;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod pipeline;
pub mod publish;
pub mod remediate;
pub mod rules_file;
pub mod shard;
pub mod targets;

pub use app::{connect, start, start_with_clock, Aggregator};
