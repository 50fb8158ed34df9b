//! The quarantined Nodes as one watch keeps them. A quarantined node's pass read its
//! Node from the API two to four times (the release check, the breaker's count,
//! isolation, evictions): a full object each, 15-40 KB for a real GPU Node, every
//! reconcile (10 s), for as long as the quarantine lasts; and the reconcile listed every
//! quarantined Node in full besides. The cluster benchmark measured 10.5 Node GETs a
//! second, 280 KB/s, with 108 nodes failed. The watch selects the Nodes with the devices
//! label, which every quarantine and every release request carries (so its list is the
//! reconcile's list), and costs one event per change after its first list.
//!
//! A Node read from here may be stale by the watch's latency. Every write to a Node
//! tests its resourceVersion (`NodePatch::on`), so a write from a stale read is refused
//! and the next pass reads again: the cache never makes a write land on a state it did
//! not see. After this replica writes a Node, its passes read that Node from the API
//! until the watch brings a version other than the one the cache held when the write
//! went (or [`WRITE_SETTLE`] has passed: a write that changed nothing, or failed).
//! Nodes without the label (failed, not quarantined yet; every failed node in a dry
//! run) are read from the API, once a pass: a read is kept for [`PASS_READ`], so the
//! steps of one pass (the breaker's count, isolation) share it, and a write of this
//! replica drops it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use faultline_common::sync::Locked;
use k8s_openapi::api::core::v1::Node;
use tokio_util::sync::CancellationToken;

use crate::ingest::watched::{Seen, Watched};

/// How long after its own write a replica reads the Node from the API while the watch
/// has not shown a new version (a watch event takes milliseconds).
pub const WRITE_SETTLE: Duration = Duration::from_secs(30);

/// How long a Node read from the API serves the reads after it (a pass's steps read
/// within milliseconds; the next pass, a reconcile later, reads again).
pub const PASS_READ: Duration = Duration::from_secs(1);

/// Entries kept at most in each map before the old ones are dropped.
const KEPT: usize = 4096;

/// The quarantined Nodes, by name, as the watch last showed them. Clones share it.
#[derive(Clone, Default)]
pub struct NodeCache {
    inner: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// `None` until the watch's first list is whole.
    nodes: Option<BTreeMap<String, Node>>,
    /// Nodes this replica wrote: the resourceVersion the cache held when the write
    /// went, and when.
    written: BTreeMap<String, (Option<String>, Instant)>,
    /// Nodes read from the API, and when.
    recent: BTreeMap<String, (Instant, Node)>,
}

fn version(node: &Node) -> Option<String> {
    node.metadata.resource_version.clone()
}

impl NodeCache {
    /// Node `name` as the watch shows it, if it is quarantined (labelled), the watch
    /// has listed once, and no write of this replica is still to show; else as read
    /// from the API within [`PASS_READ`], if it was.
    pub fn get(&self, name: &str) -> Option<Node> {
        let mut s = self.inner.locked();
        if let Some(node) = s.nodes.as_ref().and_then(|n| n.get(name)).cloned() {
            let unseen = s.written.get(name).is_some_and(|(before, at)| {
                *before == version(&node) && at.elapsed() < WRITE_SETTLE
            });
            if !unseen {
                s.written.remove(name);
                return Some(node);
            }
        }
        s.recent
            .get(name)
            .filter(|(at, _)| at.elapsed() < PASS_READ)
            .map(|(_, n)| n.clone())
    }

    /// Node `name` was just read from the API: the rest of the pass reads this.
    pub fn read(&self, name: &str, node: &Node) {
        let mut s = self.inner.locked();
        if s.recent.len() >= KEPT {
            s.recent.retain(|_, (at, _)| at.elapsed() < PASS_READ);
        }
        s.recent
            .insert(name.to_string(), (Instant::now(), node.clone()));
    }

    /// This replica is about to write Node `name`: read it from the API until the watch
    /// shows the write (or another).
    pub fn writing(&self, name: &str) {
        let mut s = self.inner.locked();
        let before = s.nodes.as_ref().and_then(|n| n.get(name)).and_then(version);
        s.recent.remove(name);
        // Bounded: entries a watch event has not cleared go after the settle time.
        if s.written.len() >= KEPT {
            s.written.retain(|_, (_, at)| at.elapsed() < WRITE_SETTLE);
        }
        s.written.insert(name.to_string(), (before, Instant::now()));
    }

    /// Every quarantined Node, once the watch has listed them.
    pub fn all(&self) -> Option<Vec<Node>> {
        self.inner
            .locked()
            .nodes
            .as_ref()
            .map(|n| n.values().cloned().collect())
    }

    fn seen(&self, seen: Seen<Node>) {
        let mut s = self.inner.locked();
        let name = |n: &Node| n.metadata.name.clone().unwrap_or_default();
        match seen {
            Seen::Applied(n) | Seen::Listing(n) => {
                let key = name(&n);
                s.nodes.get_or_insert_with(BTreeMap::new).insert(key, n);
            }
            Seen::Deleted(n) => {
                if let Some(nodes) = s.nodes.as_mut() {
                    nodes.remove(&name(&n));
                }
            }
            Seen::Listed(names) => {
                let nodes = s.nodes.get_or_insert_with(BTreeMap::new);
                nodes.retain(|k, _| names.contains(k));
            }
        }
    }

    /// Keep the cache from `watch` until cancelled.
    pub async fn follow(self, mut watch: Watched<Node>, cancel: CancellationToken) {
        loop {
            let seen = tokio::select! {
                _ = cancel.cancelled() => return,
                seen = watch.next() => seen,
            };
            match seen {
                Some(seen) => self.seen(seen),
                None => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn node(name: &str, rv: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.metadata.resource_version = Some(rv.into());
        n
    }

    /// Nothing is served before the first list is whole; a list drops the Nodes it no
    /// longer holds; a delete (the label removed) drops one.
    #[test]
    fn served_after_the_first_list_and_kept_as_the_watch_shows() {
        let c = NodeCache::default();
        assert!(c.get("n1").is_none() && c.all().is_none());
        c.seen(Seen::Listing(node("n1", "1")));
        c.seen(Seen::Listing(node("n2", "1")));
        c.seen(Seen::Listed(["n1", "n2"].map(String::from).into()));
        assert_eq!(c.all().unwrap().len(), 2);
        assert_eq!(version(&c.get("n1").unwrap()).as_deref(), Some("1"));
        c.seen(Seen::Applied(node("n1", "5")));
        assert_eq!(version(&c.get("n1").unwrap()).as_deref(), Some("5"));
        c.seen(Seen::Deleted(node("n2", "6")));
        assert!(c.get("n2").is_none());
        c.seen(Seen::Listed(BTreeSet::new()));
        assert!(c.all().unwrap().is_empty());
    }

    /// After this replica's write, the Node is read from the API until the watch shows
    /// a version other than the one held when the write went.
    #[test]
    fn a_node_written_is_read_from_the_api_until_the_watch_shows_it() {
        let c = NodeCache::default();
        c.seen(Seen::Listed(BTreeSet::new()));
        c.writing("n1");
        c.seen(Seen::Applied(node("n1", "7")));
        assert!(
            c.get("n1").is_some(),
            "not in the cache when written: any version is newer"
        );
        c.writing("n1");
        assert!(c.get("n1").is_none(), "the write not shown yet");
        c.seen(Seen::Applied(node("n1", "8")));
        assert_eq!(version(&c.get("n1").unwrap()).as_deref(), Some("8"));
        assert!(c.get("n1").is_some(), "cleared");
    }

    /// A Node read from the API serves the rest of its pass, not the next, and not after
    /// this replica writes it; the watch's copy of a quarantined one comes first.
    #[test]
    fn a_read_serves_its_pass_until_a_write() {
        let c = NodeCache::default();
        assert!(c.get("n2").is_none());
        c.read("n2", &node("n2", "3"));
        assert_eq!(version(&c.get("n2").unwrap()).as_deref(), Some("3"));
        c.writing("n2");
        assert!(c.get("n2").is_none(), "written: read again");
        c.read("n2", &node("n2", "4"));
        c.inner.locked().recent.get_mut("n2").unwrap().0 -= PASS_READ;
        assert!(c.get("n2").is_none(), "the next pass reads again");
        c.seen(Seen::Listed(BTreeSet::new()));
        c.seen(Seen::Applied(node("n2", "9")));
        c.read("n2", &node("n2", "4"));
        assert_eq!(version(&c.get("n2").unwrap()).as_deref(), Some("9"));
    }
}
