//! A page over the ConfigMap limit is trimmed, never left unwritten (one
//! node's agent that named hundreds of devices grew its shard's ConfigMap past the
//! API's limit, and no node of the shard was published any more).
//!
//! The largest node entries of the page go first, each as little as needed: first its
//! healthy devices and every reading of the others (what a pod needs of a sick device
//! is its status and reason), then, where that is still too much, its devices. A
//! trimmed entry says how many devices it left out (`trimmed`); its `summary` still
//! counts them all, and the shard's index on page 0 is whole. Nodes of 8 healthy GPUs
//! are trimmed only after every larger entry, and only when the page is sized too
//! small for the fleet (`--pages`), which the warning names.

use faultline_common::fault::{page_of, FaultDocument, NodeFaults};
use faultline_common::DeviceStatus;

/// How an entry may be cut down: each step keeps less.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Healthy devices and all readings left out.
    Sick,
    /// Every device left out.
    Bare,
}

/// `entry` cut down as `cut` says.
fn cut(entry: &NodeFaults, cut: Cut) -> NodeFaults {
    let mut e = entry.clone();
    let before = e.npus.len();
    match cut {
        Cut::Sick => {
            e.npus.retain(|d| d.status != DeviceStatus::Healthy);
            for d in &mut e.npus {
                d.temperature_c = None;
                d.power_w = None;
                d.ecc_errors = None;
                d.pcie_link_status = None;
            }
        }
        Cut::Bare => e.npus.clear(),
    }
    let left_out = (before - e.npus.len()) as u32;
    e.trimmed = Some(entry.trimmed.unwrap_or(0) + left_out);
    e
}

fn size(entry: &NodeFaults) -> usize {
    serde_json::to_vec(entry).map_or(0, |v| v.len())
}

/// `doc` with the entries of `page` trimmed, largest first, until the page's `bytes`
/// come within `limit`, and the nodes trimmed; `None` when even every entry of the page
/// bare would not fit (the page is then refused as too large, as before).
pub fn trim_page(
    doc: &FaultDocument,
    page: u32,
    pages: u32,
    bytes: usize,
    limit: usize,
) -> Option<(FaultDocument, Vec<String>)> {
    let mut sizes: Vec<(usize, &String)> = doc
        .nodes
        .iter()
        .filter(|(node, _)| page_of(node, doc.shards, pages) == page)
        .map(|(node, e)| (size(e), node))
        .collect();
    // Largest first; equal sizes by name, so the same page trims the same nodes.
    sizes.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    let mut out = doc.clone();
    let mut over = bytes.saturating_sub(limit);
    let mut trimmed = Vec::new();
    for step in [Cut::Sick, Cut::Bare] {
        for (_, node) in &sizes {
            if over == 0 {
                break;
            }
            let Some(entry) = out.nodes.get(*node) else {
                continue;
            };
            let was = size(entry);
            let smaller = cut(entry, step);
            let now = size(&smaller);
            if now >= was {
                continue;
            }
            over = over.saturating_sub(was - now);
            out.nodes.insert((*node).clone(), smaller);
            if !trimmed.contains(*node) {
                trimmed.push((*node).clone());
            }
        }
    }
    (over == 0).then_some((out, trimmed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use faultline_common::fault::{AgentReach, FaultSummary, NpuFault, FAULT_VERSION};
    use std::collections::BTreeMap;

    fn device(id: &str, status: DeviceStatus) -> NpuFault {
        NpuFault {
            id: id.into(),
            status,
            reason: (status != DeviceStatus::Healthy).then(|| "xid-79".into()),
            since: "2026-12-02T10:00:00.000Z".into(),
            temperature_c: Some(40.0),
            power_w: Some(300.0),
            ecc_errors: Some(0),
            pcie_link_status: Some("up".into()),
            uuid: Some(format!("GPU-{id}")),
            pci_bus_id: None,
            recovery_action: None,
            quarantine: None,
        }
    }

    fn entry(node: &str, npus: Vec<NpuFault>) -> NodeFaults {
        NodeFaults {
            version: FAULT_VERSION.into(),
            timestamp: "2026-12-02T10:00:00.000Z".into(),
            node: node.into(),
            agent: AgentReach {
                reachable: true,
                last_seen: None,
                error: None,
                sources: Vec::new(),
            },
            summary: FaultSummary::of(npus.iter().map(|d| &d.status)),
            npus,
            readings_at: None,
            verdict: None,
            trimmed: None,
            drain: Vec::new(),
        }
    }

    /// One node of 64 devices beside nodes of 8: only the large entry is trimmed, its
    /// failed device stays with its reason, and it says how many it left out.
    #[test]
    fn the_largest_entry_is_trimmed_first_and_keeps_its_sick_devices() {
        let mut nodes = BTreeMap::new();
        for i in 0..20 {
            let n = format!("n{i}");
            let devs = (0..8)
                .map(|d| device(&format!("gpu{d}"), DeviceStatus::Healthy))
                .collect();
            nodes.insert(n.clone(), entry(&n, devs));
        }
        let mut big: Vec<NpuFault> = (0..63)
            .map(|d| device(&format!("churn{d:02}"), DeviceStatus::Healthy))
            .collect();
        big.push(device("gpu-sick", DeviceStatus::Failed));
        nodes.insert("hostile".into(), entry("hostile", big));
        let doc = FaultDocument {
            version: FAULT_VERSION.into(),
            timestamp: String::new(),
            sequence: 1,
            shard: 0,
            shards: 1,
            writer: "r1".into(),
            summary: FaultSummary::default(),
            nodes,
        };
        let total: usize = doc.nodes.values().map(size).sum();
        let hostile = size(&doc.nodes["hostile"]);
        // A limit the page misses by half the hostile entry.
        let limit = total - hostile / 2;
        let (out, trimmed) = trim_page(&doc, 0, 1, total, limit).expect("trimmed to fit");
        assert_eq!(trimmed, vec!["hostile".to_string()]);
        let h = &out.nodes["hostile"];
        assert_eq!(h.npus.len(), 1);
        assert_eq!(h.npus[0].id, "gpu-sick");
        assert_eq!(h.npus[0].reason.as_deref(), Some("xid-79"));
        assert_eq!(h.trimmed, Some(63));
        assert_eq!(h.summary.total, 64, "the summary counts every device");
        assert!(out.nodes.values().map(size).sum::<usize>() <= limit);
        for i in 0..20 {
            assert_eq!(out.nodes[&format!("n{i}")], doc.nodes[&format!("n{i}")]);
        }
        // Nothing fits a limit below the bare entries.
        assert!(trim_page(&doc, 0, 1, total, 100).is_none());
    }
}
