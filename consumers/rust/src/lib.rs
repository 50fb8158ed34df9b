//! React to your own node's accelerator health as faultline publishes it.
//!
//! Two ways a pod reads its node's entry:
//! - the shard ConfigMaps projected into one volume (Pod Security baseline):
//!   [`Watch::entry`]`("/config", node)` reads `/config/<node>.json`;
//! - the agent's node file on a hostPath (privileged namespaces, milliseconds):
//!   [`Watch::file`]`("/config/fault.json")` with `/run/faultline` mounted at `/config`.
//!
//! Neither file is ever rewritten in place: kubelet swaps the volume's `..data` symlink
//! (`atomic_writer.go`) and the agent renames a new file over the old one. So a
//! [`Watch`] watches the *directory* with `notify` (inotify on Linux), re-opens the path
//! on every event and compares what it read; it never holds the file open. A slow
//! re-read every few seconds covers a missed event.
//!
//! ```no_run
//! let mut w = faultline_consumer::Watch::entry("/config", "gpu-node-7").unwrap();
//! loop {
//!     let entry = w.next(std::time::Duration::from_secs(60)).unwrap();
//!     if let Some(Some(e)) = entry {
//!         if !e.failed().is_empty() {
//!             // checkpoint and exit
//!         }
//!     }
//! }
//! ```

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use notify::{RecursiveMode, Watcher};
use serde::Deserialize;

/// A device's status. Anything this version does not know reads as `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Every check passed.
    Healthy,
    /// Usable, needs attention.
    Degraded,
    /// Must not take work.
    Failed,
    /// No current evidence either way (never a synonym for broken).
    #[serde(other)]
    Unknown,
}

impl Status {
    /// `healthy`, `degraded`, `failed`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Healthy => "healthy",
            Status::Degraded => "degraded",
            Status::Failed => "failed",
            Status::Unknown => "unknown",
        }
    }
}

/// One device of the node.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Device {
    /// Its id on the node (`gpu3`, `npu0`).
    pub id: String,
    /// Its status.
    pub status: Status,
    /// Why it is not healthy.
    #[serde(default)]
    pub reason: Option<String>,
    /// UUID, where known.
    #[serde(default)]
    pub uuid: Option<String>,
    /// PCI bus id, where known.
    #[serde(default)]
    pub pci_bus_id: Option<String>,
}

impl Device {
    /// Whether `name` is its id, UUID or bus id.
    pub fn is(&self, name: &str) -> bool {
        self.id == name
            || self.uuid.as_deref() == Some(name)
            || self.pci_bus_id.as_deref() == Some(name)
    }
}

#[derive(Debug, Clone, Deserialize)]
struct Reach {
    #[serde(default = "yes")]
    reachable: bool,
}

fn yes() -> bool {
    true
}

/// One node's entry: the aggregator's `<node>.json` or the agent's node file (both list
/// `npus`; other fields are ignored, so newer documents still read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The node it describes.
    pub node: String,
    /// Its devices (those asked for, when the watch names some).
    pub devices: Vec<Device>,
    /// Whether the aggregator reached the agent (always true in the agent's own file).
    pub reachable: bool,
}

impl Entry {
    /// The failed devices.
    pub fn failed(&self) -> Vec<&Device> {
        self.devices
            .iter()
            .filter(|d| d.status == Status::Failed)
            .collect()
    }
}

#[derive(Debug, Deserialize)]
struct Doc {
    node: String,
    npus: Vec<Device>,
    #[serde(default)]
    agent: Option<Reach>,
}

/// What can go wrong.
#[derive(Debug)]
pub enum Error {
    /// Reading the file or watching its directory.
    Io(std::io::Error),
    /// Not a node document, or another node's.
    Invalid(String),
    /// The directory watch could not start.
    Watch(notify::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::Invalid(e) => write!(f, "not a node document: {e}"),
            Error::Watch(e) => write!(f, "cannot watch: {e}"),
        }
    }
}

impl std::error::Error for Error {}

/// Parse a node document; `node`: refuse another node's; `only`: keep these devices.
pub fn parse(text: &[u8], node: Option<&str>, only: &[String]) -> Result<Entry, Error> {
    let doc: Doc = serde_json::from_slice(text).map_err(|e| Error::Invalid(e.to_string()))?;
    if let Some(n) = node.filter(|n| *n != doc.node) {
        return Err(Error::Invalid(format!(
            "document of node {:?}, not {n:?}",
            doc.node
        )));
    }
    Ok(Entry {
        node: doc.node,
        devices: doc
            .npus
            .into_iter()
            .filter(|d| only.is_empty() || only.iter().any(|o| d.is(o)))
            .collect(),
        reachable: doc.agent.is_none_or(|a| a.reachable),
    })
}

/// The entry at `path` now; `None` when there is none (the node is not published).
pub fn read(path: &Path, node: Option<&str>, only: &[String]) -> Result<Option<Entry>, Error> {
    match std::fs::read(path) {
        Ok(text) => parse(&text, node, only).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Io(e)),
    }
}

/// A watch of one node's entry.
pub struct Watch {
    path: PathBuf,
    node: Option<String>,
    only: Vec<String>,
    events: mpsc::Receiver<()>,
    _watcher: notify::RecommendedWatcher,
    last: Option<Option<Entry>>,
    invalid: u64,
}

/// How often the path is re-read without an event (a missed event costs this much).
const RESCAN: Duration = Duration::from_secs(2);

impl Watch {
    /// `<dir>/<node>.json`: the projected shard ConfigMaps.
    pub fn entry(dir: impl AsRef<Path>, node: &str) -> Result<Self, Error> {
        Self::new(dir.as_ref().join(format!("{node}.json")), Some(node))
    }

    /// The agent's node file; `node`, when given, must be the document's.
    pub fn file(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::new(path.as_ref().to_path_buf(), None)
    }

    fn new(path: PathBuf, node: Option<&str>) -> Result<Self, Error> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let (tx, events) = mpsc::channel();
        let mut watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
            let _ = tx.send(());
        })
        .map_err(Error::Watch)?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(Error::Watch)?;
        Ok(Watch {
            path,
            node: node.map(str::to_string),
            only: Vec::new(),
            events,
            _watcher: watcher,
            last: None,
            invalid: 0,
        })
    }

    /// Only these devices (id, UUID or bus id), e.g. the ones the workload holds.
    pub fn only(mut self, devices: Vec<String>) -> Self {
        self.only = devices;
        self
    }

    /// Documents that did not parse so far (each was skipped; the last good one stands).
    pub fn invalid(&self) -> u64 {
        self.invalid
    }

    /// The entry now, the first time; afterwards the next entry that differs, waiting at
    /// most `timeout` (`Ok(None)` then). `Some(None)`: the node is not published.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Option<Entry>>, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            match read(&self.path, self.node.as_deref(), &self.only) {
                Ok(now) if self.last.as_ref() != Some(&now) => {
                    self.last = Some(now.clone());
                    return Ok(Some(now));
                }
                Ok(_) => {}
                Err(Error::Invalid(_)) => self.invalid += 1,
                Err(e) => return Err(e),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // An event (any change in the directory), or the slow re-read.
            if self.events.recv_timeout(left.min(RESCAN)).is_ok() {
                while self.events.try_recv().is_ok() {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENTRY: &str = r#"{"version":"faultline.fault/v1","node":"n1","timestamp":"t",
        "agent":{"reachable":true,"sources":[{"name":"nvml","up":true}]},
        "npus":[{"id":"gpu0","status":"healthy","reason":null,"since":"t"},
                {"id":"gpu1","status":"failed","reason":"xid-79","since":"t","uuid":"GPU-1"},
                {"id":"gpu2","status":"rebooting","reason":null,"since":"t"}],
        "summary":{"total":3,"healthy":1,"degraded":0,"failed":1,"unknown":1}}"#;

    #[test]
    fn reads_the_aggregators_entry_and_keeps_what_it_does_not_know_unknown() {
        let e = parse(ENTRY.as_bytes(), Some("n1"), &[]).unwrap();
        assert_eq!(e.failed().len(), 1);
        assert_eq!(e.failed()[0].reason.as_deref(), Some("xid-79"));
        assert_eq!(e.devices[2].status, Status::Unknown);
        assert!(e.reachable);
    }

    #[test]
    fn refuses_another_nodes_document_and_garbage() {
        assert!(parse(ENTRY.as_bytes(), Some("n2"), &[]).is_err());
        assert!(parse(b"{\"npus\":", None, &[]).is_err());
        assert!(parse(b"[]", None, &[]).is_err());
    }

    #[test]
    fn keeps_only_the_devices_asked_for_by_id_or_uuid() {
        let e = parse(ENTRY.as_bytes(), None, &["GPU-1".to_string()]).unwrap();
        assert_eq!(e.devices.len(), 1);
        assert_eq!(e.devices[0].id, "gpu1");
        let e = parse(ENTRY.as_bytes(), None, &["gpu0".to_string()]).unwrap();
        assert!(e.failed().is_empty());
    }

    #[test]
    fn a_watch_sees_a_renamed_file_and_skips_a_torn_one() {
        let d = std::env::temp_dir().join(format!("faultline-consumer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("fault.json");
        let mut w = Watch::file(&path).unwrap();
        assert_eq!(w.next(Duration::from_secs(1)).unwrap(), Some(None));
        let healthy = ENTRY.replace(
            "\"failed\",\"reason\":\"xid-79\"",
            "\"healthy\",\"reason\":null",
        );
        std::fs::write(d.join(".tmp"), &healthy).unwrap();
        std::fs::rename(d.join(".tmp"), &path).unwrap();
        let e = w.next(Duration::from_secs(5)).unwrap().unwrap().unwrap();
        assert!(e.failed().is_empty());
        std::fs::write(&path, "{\"node\":\"n1\",\"npus\":[").unwrap();
        assert_eq!(w.next(Duration::from_millis(300)).unwrap(), None);
        assert!(w.invalid() > 0, "a torn document is counted and skipped");
        std::fs::write(d.join(".tmp"), ENTRY).unwrap();
        std::fs::rename(d.join(".tmp"), &path).unwrap();
        let e = w.next(Duration::from_secs(5)).unwrap().unwrap().unwrap();
        assert_eq!(e.failed()[0].id, "gpu1");
        let _ = std::fs::remove_dir_all(&d);
    }
}
