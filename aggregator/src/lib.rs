//! faultline aggregator: follows the agents, denoises their readings with windows, rules
//! and a per-device state machine, publishes a versioned fault.json, and heals around
//! failed accelerators.
//!
//! The layout follows the data:
//! - `ingest`: what comes in (agents, discovery, alerts, the kubelet);
//! - `pipeline`: windows, rules and the state machine per device;
//! - `publish`: the documents, to files or shard ConfigMaps, and pod nudges;
//! - `shard`: Leases and the fence every write asks;
//! - `remediate`: isolation, eviction, release, with their guards and announcements;
//! - `quarantine`: one device taken out through DRA's DeviceTaintRule (issue 28);
//! - `app`: the wiring, the core loop and the per-node dispatcher;
//! - `api`, `config` (and `targets`, the agents it names), `metrics`, `notify`,
//!   `rules_file`, `model` (the shared vocabulary).
#![forbid(unsafe_code)]

pub mod api;
pub mod app;
pub mod cli;
pub mod config;
pub mod ingest;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod pipeline;
pub mod publish;
pub mod quarantine;
pub mod remediate;
pub mod rules_file;
pub mod shard;
pub mod targets;

pub use app::{connect, start, start_with_clock, Aggregator};
