//! React to your own node's accelerator health as faultline publishes it.
//!
//! Ways a pod reads its node's entry:
//! - the node's own `fault.json`, kept by its agent (the aggregator's verdict on this
//!   node, with `verdict`: whose, and whether it is still confirmed): on a read-only
//!   hostPath (`/run/faultline/node` mounted at `/config`), or in a `restricted`
//!   namespace written into an emptyDir by the Python kit's follow mode as a sidecar:
//!   [`Watch::file`]`("/config/fault.json")`;
//! - the shard ConfigMaps projected into one volume (small clusters):
//!   [`Watch::entry`]`("/config", node)` reads `/config/<node>.json`.
//!
//! No file is ever rewritten in place: kubelet swaps the volume's `..data` symlink
//! (`atomic_writer.go`) and the agent renames a new file over the old one. So a
//! [`Watch`] watches the *directory* with `notify` (inotify on Linux), re-opens the path
//! on every event and compares what it read; it never holds the file open. A slow
//! re-read every few seconds covers a missed event.
//!
//! A verdict that is no longer confirmed is reported ([`Entry::stale`]): when the agent
//! says so (`verdict.stale`), or by its age when nobody rewrites the file any more (the
//! agent stopped: `verdict.confirmed` older than `verdict.stale_after_s`, plus
//! [`STALE_GRACE`]). Then every device the verdict called healthy reads `unknown`
//! (`verdict-stale`), as the agent writes it; failed and degraded ones keep their status.
//!
//! Warn before evicting (`docs/remediation.md#warn-before-evicting`): a pod annotated
//! `faultline.io/checkpoint-grace: 300s` that uses a failed device is named in its node's
//! entry ([`Entry::drain_for`] its UID) with a deadline before it is evicted. It
//! checkpoints, then exits or calls [`acknowledge`] (its node's agent, from the pod's
//! own address, no API rights); it is then evicted at once, and at the deadline anyway.
//!
//! ```no_run
//! let mut w = faultline_consumer::Watch::file("/config/fault.json").unwrap();
//! loop {
//!     let entry = w.next(std::time::Duration::from_secs(60)).unwrap();
//!     if let Some(Some(e)) = entry {
//!         if !e.failed().is_empty() {
//!             // checkpoint and exit
//!         }
//!         if let Some(why) = e.stale {
//!             eprintln!("{}: verdict not confirmed ({})", e.node, why.as_str());
//!         }
//!     }
//! }
//! ```

mod kit;

pub use kit::*;
