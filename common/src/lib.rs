//! faultline's domain: what a device reading is, how a single reading is classified,
//! the NVIDIA Xid catalog, the node health document the agent serves, the JSON body of
//! every HTTP error answer ([`api`]) and the wall-clock helpers ([`time`]).
//!
//! No Kubernetes, no NVML, no I/O: everything here is a pure function or a plain type so
//! the agent, the aggregator and the tests share one definition ([`seal`]'s
//! `Reloaded` reads a key or token file, and nothing else). The one exception is
//! `runtime` (cargo feature `runtime`, off by default): the logging and signal wiring
//! both binaries share, which pulls in tokio and tracing-subscriber. `testing` (cargo
//! feature `test-util`, off by default) is for tests and benchmarks only.
#![forbid(unsafe_code)]

pub mod api;
pub mod ascend;
pub mod ascend_escalation;
pub mod classify;
mod doc_view;
pub mod document;
pub mod fault;
pub mod flags;
#[cfg(feature = "server")]
mod label_values;
pub mod names;
pub mod reading;
pub mod rules;
#[cfg(feature = "runtime")]
pub mod runtime;
pub mod seal;
#[cfg(feature = "server")]
pub mod server;
pub mod state;
pub mod status;
#[cfg(feature = "runtime")]
pub mod supervise;
pub mod sync;
#[cfg(any(test, feature = "test-util"))]
pub mod testing;
pub mod time;
pub mod xid;

pub use classify::{classify, Classification, Finding, Thresholds};
pub use document::{DeviceHealth, NodeHealth, SourceStatus, Summary, SCHEMA_VERSION};
pub use reading::{
    normalize_bus_id, AscendIds, DeviceReading, DeviceStatus, EccCounts, NvLinkState, PcieLink,
    RecoveryAction, RemappedRows, RetiredPages, RoceLink, Throttle, Vendor, VendorHealth,
    VendorHealthLevel,
};
pub use xid::{XidClass, XidEvent, XidPolicy, XidThreshold, XidVerdict};
