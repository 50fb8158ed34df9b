//! Publishing: the fault documents, written to a directory or to shard ConfigMaps, and
//! pods nudged so the kubelet refreshes their mounted copy at once.

pub mod configmap;
pub mod document;
pub mod file;
pub mod nudge;
pub mod page;
pub mod publisher;
pub mod seed;
pub mod trim;

pub use configmap::{ConfigMapSink, WriteError, MAX_BYTES};
pub use document::document;
pub use nudge::Nudger;
pub use publisher::{Publisher, Stamp, Written};
