//! faultline's domain: what a device reading is, how a single reading is classified,
//! the NVIDIA Xid catalog, and the node health document the agent serves.
//!
//! No Kubernetes, no NVML, no I/O: everything here is a pure function or a plain type so
//! the agent, the aggregator and the tests share one definition.
#![forbid(unsafe_code)]

pub mod classify;
pub mod document;
pub mod fault;
pub mod reading;
pub mod rules;
pub mod state;
pub mod xid;

pub use classify::{classify, Classification, Finding, Thresholds};
pub use document::{DeviceHealth, NodeHealth, SourceStatus, Summary, SCHEMA_VERSION};
pub use reading::{
    normalize_bus_id, DeviceReading, DeviceStatus, EccCounts, NvLinkState, PcieLink, RemappedRows,
    RetiredPages, Throttle, Vendor, VendorHealth, VendorHealthLevel,
};
pub use xid::{XidClass, XidEvent, XidPolicy, XidThreshold, XidVerdict};
