//! faultline node agent: reads accelerator health from vendor libraries, tools and the
//! kernel log, and serves it at `/v1/health` without ever waiting on a source.
//!
//! [`start`] wires it up (`wiring`): polled sources run under the sampler, streaming
//! sources (NVML's event thread, kmsg) report through the store's
//! [`EventSink`](sources::EventSink), an upkeep tick ages devices and events, and the API
//! and the health file render the store.
#![deny(unsafe_code)]

pub mod api;
pub mod config;
pub mod deadband;
pub mod fault_api;
pub mod health_file;
pub mod metrics;
mod reading_checks;
pub mod reaper;
pub mod sampler;
pub mod sources;
pub mod store;
pub mod verdict;
mod wiring;

pub use wiring::{start, Agent, AGGREGATOR_CONNECTIONS};
