//! Which node reports each GPU UUID (a UUID is one physical
//! device, so two nodes reporting the same one means one of them lies or is
//! misconfigured; a quarantine or a device taint by UUID must not follow the liar).
//!
//! Kept as hashes (64-bit FNV-1a of the UUID, and the node name's hash the shard plan
//! uses), 16 bytes a device: a replica of 5,000 nodes x 8 GPUs holds ~1 MiB of claims.
//! Claims change only when a node's device texts change (a new device, a new UUID),
//! never on the hot path of a document like the last.

use std::collections::HashMap;

use faultline_common::fault::fnv1a64;

use super::node::NEW_ID_WINDOW_MS;
use super::Pipeline;

/// UUID hash -> the name hash of the node that reported it first.
#[derive(Default)]
pub(super) struct UuidClaims {
    owners: HashMap<u64, u64>,
}

impl UuidClaims {
    /// Node `node` (its name hash) now reports `uuids`: its claims on UUIDs it no longer
    /// reports are dropped, and each UUID already claimed by another node is returned
    /// (the first claimant keeps it).
    pub(super) fn claim<'a>(
        &mut self,
        node: u64,
        uuids: impl Iterator<Item = &'a str> + Clone,
    ) -> Vec<&'a str> {
        let now: Vec<u64> = uuids.clone().map(|u| fnv1a64(u.as_bytes())).collect();
        self.owners.retain(|u, o| *o != node || now.contains(u));
        let mut taken = Vec::new();
        for (uuid, h) in uuids.zip(now) {
            let owner = *self.owners.entry(h).or_insert(node);
            if owner != node {
                taken.push(uuid);
            }
        }
        taken
    }

    /// The node that claimed `uuid`, by name hash.
    pub(super) fn owner(&self, uuid: &str) -> Option<u64> {
        self.owners.get(&fnv1a64(uuid.as_bytes())).copied()
    }

    /// Node `node` is gone: its UUIDs are free.
    pub(super) fn release(&mut self, node: u64) {
        self.owners.retain(|_, o| *o != node);
    }
}

impl Pipeline {
    /// After node `name`'s devices' texts changed: a UUID another node reported first
    /// is flagged (counted, logged once per window with both nodes) and withheld from
    /// this node's entry and its quarantine records, so nothing acts on a UUID that a
    /// second node claims.
    pub(super) fn check_uuids(&mut self, name: &str, now_ms: u64) {
        let Some(node) = self.nodes.get(name) else {
            return;
        };
        let taken: Vec<String> = self
            .uuids
            .claim(
                node.name_hash,
                node.last.iter().filter_map(|l| l.uuid.as_deref()),
            )
            .into_iter()
            .map(String::from)
            .collect();
        if taken.is_empty() {
            return;
        }
        self.metrics.duplicate_uuids(taken.len());
        let owners: Vec<&str> = taken
            .iter()
            .map(|u| {
                let owner = self.uuids.owner(u);
                self.nodes
                    .iter()
                    .find(|(_, n)| Some(n.name_hash) == owner)
                    .map_or("a node no longer followed", |(k, _)| k.as_str())
            })
            .collect();
        let log = node
            .uuid_logged_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= NEW_ID_WINDOW_MS);
        if log {
            tracing::warn!(node = name, uuids = ?taken, first_reported_by = ?owners, "GPU UUIDs another node reported first: withheld from this node's entry (logged once per window)");
        }
        let node = self.nodes.get_mut(name).expect("looked up above");
        if log {
            node.uuid_logged_ms = Some(now_ms);
        }
        for l in &mut node.last {
            if l.uuid
                .as_deref()
                .is_some_and(|u| taken.iter().any(|t| t == u))
            {
                l.uuid = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_claimant_keeps_a_uuid_until_it_stops_reporting_it() {
        let mut c = UuidClaims::default();
        let (a, b) = (1, 2);
        assert!(c.claim(a, ["GPU-1", "GPU-2"].into_iter()).is_empty());
        assert_eq!(c.claim(b, ["GPU-2", "GPU-3"].into_iter()), vec!["GPU-2"]);
        assert_eq!(c.owner("GPU-2"), Some(a));
        assert_eq!(c.owner("GPU-3"), Some(b));
        // `a`'s GPU-2 moved to `b` (a swap): `a` no longer reports it.
        assert!(c.claim(a, ["GPU-1"].into_iter()).is_empty());
        assert!(c.claim(b, ["GPU-2", "GPU-3"].into_iter()).is_empty());
        assert_eq!(c.owner("GPU-2"), Some(b));
        c.release(b);
        assert_eq!(c.owner("GPU-3"), None);
        assert_eq!(c.owner("GPU-1"), Some(a));
    }
}
