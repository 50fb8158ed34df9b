//! What the replicas published, read back: each shard's writer, entries and every device's status.

use super::*;

pub(crate) fn cm(base: &str, s: u32) -> String {
    page_name(base, s, 0)
}

/// ConfigMaps per shard (`--pages`, `BENCH_PAGES`): 32 shards of 625 nodes x 8
/// devices are more than a ConfigMap each holds (1 MiB), two pages each are not.
pub(crate) fn pages() -> u32 {
    env_or("BENCH_PAGES", 2).max(1) as u32
}

/// The writer of a shard's last write.
pub(crate) fn writer(server: &ApiServer, base: &str, s: u32) -> Option<String> {
    let v = server.get_at("configmaps", NS, &cm(base, s), "/data/fault.json")?;
    Some(serde_json::from_str::<ShardIndex>(v.as_str()?).ok()?.writer)
}

/// Each node entry of a shard, as written.
pub(crate) fn entries(server: &ApiServer, base: &str, s: u32) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in 0..pages() {
        if let Some(o) = server.get_at("configmaps", NS, &page_name(base, s, p), "/data") {
            if let Some(o) = o.as_object() {
                out.extend(
                    o.iter()
                        .filter(|(k, _)| *k != "fault.json")
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))),
                );
            }
        }
    }
    out
}

pub(crate) type Statuses = HashMap<(String, String), DeviceStatus>;

pub(crate) fn statuses_of(entry: &str, into: &mut Statuses) {
    if let Ok(n) = serde_json::from_str::<NodeFaults>(entry) {
        for d in n.npus {
            into.insert((n.node.clone(), d.id), d.status);
        }
    }
}

/// Every published device's status.
pub(crate) fn statuses(server: &ApiServer, base: &str, shards: u32) -> Statuses {
    let mut out = HashMap::new();
    for s in 0..shards {
        for e in entries(server, base, s).values() {
            statuses_of(e, &mut out);
        }
    }
    out
}
