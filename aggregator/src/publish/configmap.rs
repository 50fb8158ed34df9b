//! `--sink configmap`: each shard's document in its own ConfigMap
//! (`<name>-shard-<i>`), written only while this replica holds the shard's Lease
//! (checked right before every write), with optimistic concurrency on the
//! resourceVersion and a bounded retry on 409. Keys: `fault.json` (the shard) and
//! `<node>.json` (one node each), so a pod that mounts every shard in one projected
//! volume reads `/config/$NODE_NAME.json`.
//!
//! Pages (`--pages`): a ConfigMap holds at most 1 MiB (the API's limit,
//! `validation.go` `ValidateConfigMap`), about 450 nodes of 8 devices; a shard larger
//! than that spreads its node entries over `pages` ConfigMaps: page 0 is
//! `<name>-shard-<i>` with `fault.json` (the index of the whole shard) and the nodes of
//! page 0, page `p` is `<name>-shard-<i>-page-<p>` with its nodes only (so no two
//! ConfigMaps of one projected volume both carry `fault.json` of one shard). A node's
//! page is [`page_of`]. Pages other than 0 are written first, so that the index never
//! announces a sequence its entries do not have yet.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

pub use faultline_common::fault::{page_name, parse_page_name};
use faultline_common::fault::{FaultDocument, NodeFaults};
use faultline_common::sync::Locked;
use k8s_openapi::api::core::v1::ConfigMap;
pub use kube::api::ObjectMeta;
use kube::api::{Api, PostParams};

pub use super::page::{page_body, PageBody};
use crate::metrics::Metrics;
use crate::shard::Held;

/// Largest ConfigMap we write; the API's limit is 1 MiB.
pub const MAX_BYTES: usize = 900 << 10;

/// Why a write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// This replica does not hold the shard (any more).
    #[error("not the holder of shard {0}")]
    NotHolder(u32),
    /// The document would not fit in a ConfigMap.
    #[error("shard {shard} is {bytes} bytes, over the {MAX_BYTES} byte limit: use more shards or --pages")]
    TooLarge { shard: u32, bytes: usize },
    /// The API said no.
    #[error("API: {0}")]
    Api(#[from] kube::Error),
    /// Conflicts on every attempt.
    #[error("shard {0}: conflicting writes on every attempt")]
    Conflict(u32),
    /// Encoding failed.
    #[error("encode: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Writes shard ConfigMaps.
pub struct ConfigMapSink {
    api: Api<ConfigMap>,
    /// The client and the ConfigMaps' URL, for writes whose answer is read only for
    /// its metadata.
    client: kube::Client,
    url: String,
    name: String,
    /// ConfigMaps per shard (`--pages`).
    pages: u32,
    /// Per shard and page: our last write.
    last: Mutex<HashMap<(u32, u32), Known>>,
    metrics: Option<std::sync::Arc<Metrics>>,
    /// A copy in a publish namespace: its drain intents only for pods of this one.
    drains_of: Option<String>,
}

/// A page as this replica last wrote it.
#[derive(Debug, Clone)]
struct Known {
    /// Its resourceVersion.
    rv: String,
    /// The shard's sequence it carried (page 0) or continued.
    sequence: u64,
    /// Its content fingerprint ([`PageBody::content`]).
    content: u64,
    /// Its whole fingerprint, readings included ([`PageBody::full`]).
    full: u64,
}

/// The ConfigMap of a shard (its page 0).
pub fn configmap_name(name: &str, shard: u32) -> String {
    page_name(name, shard, 0)
}

/// `doc` with only `namespace`'s pods in each node's `drain[]`; `None` when it has no
/// other (the common case: nothing is copied).
pub fn scope_drains(doc: &FaultDocument, namespace: &str) -> Option<FaultDocument> {
    let foreign = |n: &NodeFaults| n.drain.iter().any(|d| d.namespace != namespace);
    if !doc.nodes.values().any(foreign) {
        return None;
    }
    let mut scoped = doc.clone();
    for n in scoped.nodes.values_mut() {
        n.drain.retain(|d| d.namespace == namespace);
    }
    Some(scoped)
}

impl ConfigMapSink {
    /// ConfigMaps named `<name>-shard-<i>` through `api`.
    pub fn new(api: Api<ConfigMap>, name: String) -> Self {
        ConfigMapSink {
            client: api.clone().into_client(),
            url: api.resource_url().to_string(),
            api,
            name,
            pages: 1,
            last: Mutex::new(HashMap::new()),
            metrics: None,
            drains_of: None,
        }
    }

    /// A copy for the pods of `namespace`: each node's `drain[]` keeps only the intents
    /// of that namespace's pods (another tenant's pod names, UIDs and addresses are not
    /// theirs to read). The aggregator's own namespace keeps the whole view: a takeover
    /// seeds from it.
    pub fn with_drains_of(mut self, namespace: &str) -> Self {
        self.drains_of = Some(namespace.to_string());
        self
    }

    /// Spread each shard over `pages` ConfigMaps (`--pages`, at least 1).
    pub fn with_pages(mut self, pages: u32) -> Self {
        self.pages = pages.max(1);
        self
    }

    /// Count 409s in `metrics`.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn sequence_in(cm: &ConfigMap) -> u64 {
        cm.data
            .as_ref()
            .and_then(|d| d.get("fault.json"))
            .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
            .and_then(|v| v["sequence"].as_u64())
            .unwrap_or(0)
    }

    /// The metadata of page `page` of shard `shard`.
    fn meta(cm_name: &str, rv: Option<String>, shard: u32, page: u32) -> ObjectMeta {
        ObjectMeta {
            name: Some(cm_name.to_string()),
            resource_version: rv,
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/name".to_string(),
                    "faultline".to_string(),
                ),
                ("faultline.io/shard".to_string(), shard.to_string()),
                ("faultline.io/page".to_string(), page.to_string()),
            ])),
            ..Default::default()
        }
    }

    /// Write `doc` as shard `doc.shard`, fenced by `held`: its pages other than 0, then
    /// page 0 with the index and the new sequence; a page whose content did not change
    /// is left, and one whose readings alone moved is rewritten only with `refresh` (the
    /// shard's `--refresh` came due: the write schedule judges it). Returns the bytes
    /// written.
    /// The document is borrowed (a clone for each sink was a tenth of a
    /// write); its sequence is the one this write continues, not `doc.sequence`.
    pub async fn write(
        &self,
        doc: &FaultDocument,
        held: &Held,
        refresh: bool,
    ) -> Result<usize, WriteError> {
        let scoped = self
            .drains_of
            .as_deref()
            .and_then(|ns| scope_drains(doc, ns));
        let doc = scoped.as_ref().unwrap_or(doc);
        let mut total = 0;
        for page in (1..self.pages).chain([0]) {
            total += self.write_page(doc, page, held, refresh).await?;
        }
        Ok(total)
    }

    /// One page of a shard, with optimistic concurrency: the first write since taking
    /// the shard continues the sequence already published (page 0 carries it; the
    /// others have none, and their sequence is never read). A page whose content is what
    /// this replica last wrote is not written again (every write of a page
    /// reaches every watcher of it; a rewrite that says nothing new is pure cost).
    async fn write_page(
        &self,
        doc: &FaultDocument,
        page: u32,
        held: &Held,
        refresh: bool,
    ) -> Result<usize, WriteError> {
        let shard = doc.shard;
        let cm_name = page_name(&self.name, shard, page);
        let (mut rv, mut seq, last) = self.known(shard, page).await?;
        for attempt in 0..3 {
            let sequence = seq + 1;
            let meta = Self::meta(&cm_name, rv.clone(), shard, page);
            let page_body = self.page_body(&meta, doc, page, attempt, sequence)?;
            let unchanged = last.as_ref().is_some_and(|k| {
                k.content == page_body.content && (k.full == page_body.full || !refresh)
            });
            if attempt == 0 && unchanged {
                if let Some(m) = &self.metrics {
                    m.page_unchanged(shard);
                }
                if page == 0 {
                    held.note_published(shard, seq);
                }
                return Ok(0);
            }
            match self
                .put_fenced(&cm_name, shard, rv.is_some(), page_body.body, held)
                .await
            {
                Ok(new_rv) => {
                    if page == 0 {
                        held.note_published(shard, sequence);
                    }
                    self.remember(
                        shard,
                        page,
                        Known {
                            rv: new_rv,
                            sequence,
                            content: page_body.content,
                            full: page_body.full,
                        },
                    );
                    return Ok(page_body.bytes);
                }
                // Written in between (or created already): read again and retry.
                Err(WriteError::Api(kube::Error::Api(s))) if s.code == 409 && attempt < 2 => {
                    if let Some(m) = &self.metrics {
                        m.write_conflict(shard);
                    }
                    let cur = self.api.get_opt(&cm_name).await?;
                    rv = cur
                        .as_ref()
                        .and_then(|c| c.metadata.resource_version.clone());
                    seq = seq.max(cur.as_ref().map(Self::sequence_in).unwrap_or(0));
                }
                Err(e) => {
                    self.forget(shard);
                    return Err(e);
                }
            }
        }
        self.forget(shard);
        Err(WriteError::Conflict(shard))
    }

    /// The resourceVersion and sequence of a page, with what this replica last wrote
    /// there: ours from the last write, else read (what it says then unknown: the first
    /// write after reading writes).
    async fn known(
        &self,
        shard: u32,
        page: u32,
    ) -> Result<(Option<String>, u64, Option<Known>), WriteError> {
        let cached = self.last.locked().get(&(shard, page)).cloned();
        Ok(match cached {
            Some(k) => (Some(k.rv.clone()), k.sequence, Some(k)),
            None => match self
                .api
                .get_opt(&page_name(&self.name, shard, page))
                .await?
            {
                Some(cm) => (
                    cm.metadata.resource_version.clone(),
                    Self::sequence_in(&cm),
                    None,
                ),
                None => (None, 0, None),
            },
        })
    }

    /// The sequence of shard `shard` as this replica last wrote it (page 0), if it did.
    pub fn sequence(&self, shard: u32) -> Option<u64> {
        self.last.locked().get(&(shard, 0)).map(|k| k.sequence)
    }

    fn remember(&self, shard: u32, page: u32, known: Known) {
        self.last.locked().insert((shard, page), known);
    }

    /// The body of a page's ConfigMap, within the limit (skipped keys counted and logged
    /// on the first attempt).
    fn page_body(
        &self,
        meta: &ObjectMeta,
        doc: &FaultDocument,
        page: u32,
        attempt: u32,
        sequence: u64,
    ) -> Result<PageBody, WriteError> {
        let shard = doc.shard;
        let mut body = page_body(meta, doc, page, self.pages, sequence)?;
        if body.bytes > MAX_BYTES {
            // Trim the page's largest entries rather than leave every node of it
            // unpublished.
            if let Some((trimmed, nodes)) =
                super::trim::trim_page(doc, page, self.pages, body.bytes, MAX_BYTES)
            {
                if attempt == 0 {
                    if let Some(m) = &self.metrics {
                        m.entries_trimmed(nodes.len());
                    }
                    tracing::warn!(shard, page, bytes = body.bytes, nodes = ?nodes, "page over the ConfigMap limit: the largest node entries trimmed to fit (their healthy devices first); if these are ordinary nodes, raise --pages");
                }
                body = page_body(meta, &trimmed, page, self.pages, sequence)?;
            }
        }
        if !body.skipped.is_empty() && attempt == 0 {
            if let Some(m) = &self.metrics {
                m.invalid_keys(body.skipped.len());
            }
            tracing::warn!(shard, nodes = ?body.skipped, "node names that are not valid ConfigMap keys: left out of the shard");
        }
        if body.bytes > MAX_BYTES {
            return Err(WriteError::TooLarge {
                shard,
                bytes: body.bytes,
            });
        }
        Ok(body)
    }

    /// Write one ConfigMap if this replica still holds the shard (checked right before
    /// the write leaves). The new resourceVersion.
    async fn put_fenced(
        &self,
        name: &str,
        shard: u32,
        replace: bool,
        body: Vec<u8>,
        held: &Held,
    ) -> Result<String, WriteError> {
        if !held.holds(shard) {
            self.forget(shard);
            return Err(WriteError::NotHolder(shard));
        }
        let written = self.put(name, replace, body).await?;
        Ok(written.resource_version.unwrap_or_default())
    }

    /// Create (`replace` false) or replace a ConfigMap, `body` its JSON
    /// ([`page_body`]); the answer is read only for its metadata. The API answers with
    /// the whole object, up to a MiB of node entries a replica has just encoded:
    /// reading it back into a `ConfigMap` was as costly as the write
    /// (profiled).
    async fn put(
        &self,
        name: &str,
        replace: bool,
        body: Vec<u8>,
    ) -> Result<ObjectMeta, kube::Error> {
        #[derive(serde::Deserialize)]
        struct Written {
            metadata: ObjectMeta,
        }
        let req = kube::core::Request::new(self.url.as_str());
        let pp = PostParams::default();
        let req = if replace {
            req.replace(name, &pp, body)
        } else {
            req.create(&pp, body)
        }
        .map_err(kube::Error::BuildRequest)?;
        let written: Written = self.client.request(req).await?;
        Ok(written.metadata)
    }

    /// Forget what we know of a shard (after losing it or an error): the next write
    /// reads the ConfigMap again.
    pub fn forget(&self, shard: u32) {
        self.last.locked().retain(|(s, _), _| *s != shard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::pipeline::Pipeline;
    use crate::publish::document;
    use crate::publish::page::page_entries;
    use faultline_common::fault::shard_of;
    use faultline_common::fault::{page_of, ShardIndex};
    use faultline_common::rules::Rules;
    use faultline_common::testing::{self, Device};
    use faultline_common::NodeHealth;
    use std::sync::Arc;
    use std::time::Duration;

    /// Node `node`'s document: `devices` GPUs as NVML reads them, gpu3 failed (Xid 79).
    fn node_doc(node: &str, devices: u32) -> NodeHealth {
        testing::node(node)
            .npus((0..devices).map(|i| {
                let d = Device::nvml(i)
                    .temperature(61.5)
                    .power(312.25)
                    .ecc_errors(12)
                    .sample_age_ms(100);
                if i == 3 { d.failed("xid-79") } else { d }.build()
            }))
            .build()
    }

    /// A pipeline with `nodes` nodes of 8 devices (one failed each), their names, and
    /// the test API server with the `faultline` namespace, through the kube client.
    async fn fleet_and_server(
        nodes: usize,
    ) -> (
        Pipeline,
        Vec<String>,
        faultline_test_apiserver::ApiServer,
        Api<ConfigMap>,
    ) {
        let mut p = Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()));
        let names: Vec<String> = (0..nodes)
            .map(|i| format!("gpu-node-{i:05}.rack-{:03}.example.internal", i / 40))
            .collect();
        for n in &names {
            p.on_document(node_doc(n, 8), 1_000);
        }
        let (server, url) = faultline_test_apiserver::Bootstrap::new()
            .namespace("faultline")
            .spawn()
            .await;
        let mut kc = kube::Config::new(url.parse().unwrap());
        kc.default_retry = false;
        let client = kube::Client::try_from(kc).unwrap();
        (p, names, server, Api::namespaced(client, "faultline"))
    }

    /// 5,000 nodes x 8 devices in 16 shards: every shard ConfigMap under the limit
    /// (written to the test API server, which refuses anything over 1 MiB), and every
    /// node found in the shard its name hashes to.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_thousand_nodes_fit_and_every_node_is_findable() {
        const NODES: usize = 5_000;
        const SHARDS: u32 = 16;
        let (p, names, server, api) = fleet_and_server(NODES).await;
        let sink = ConfigMapSink::new(api, "faultline".into());
        let held = Held::default();
        let mut largest = 0;
        for s in 0..SHARDS {
            held.grant(s, tokio::time::Instant::now() + Duration::from_secs(60));
            let doc = document(&p, 0, "r1", s, SHARDS);
            let bytes = sink
                .write(&doc, &held, true)
                .await
                .unwrap_or_else(|e| panic!("shard {s}: {e}"));
            largest = largest.max(bytes);
        }
        assert!(largest < MAX_BYTES, "largest shard {largest} bytes");
        for n in names.iter().step_by(97).chain(names.last()) {
            let cm = server
                .get(
                    "configmaps",
                    "faultline",
                    &format!("faultline-shard-{}", shard_of(n, SHARDS)),
                )
                .unwrap();
            let entry: faultline_common::fault::NodeFaults =
                serde_json::from_str(cm["data"][format!("{n}.json")].as_str().unwrap()).unwrap();
            assert_eq!(entry.summary.total, 8);
            assert_eq!(entry.summary.failed, 1);
        }
        let total: usize = (0..SHARDS)
            .map(|s| {
                server
                    .get("configmaps", "faultline", &format!("faultline-shard-{s}"))
                    .unwrap()["data"]
                    .as_object()
                    .unwrap()
                    .len()
                    - 1
            })
            .sum();
        assert_eq!(total, NODES, "every node in exactly one shard");
        eprintln!("5000 nodes x 8 devices in {SHARDS} shards: largest ConfigMap {largest} bytes");
    }

    /// A page's body, encoded in one pass, is the ConfigMap of its keys with each value
    /// exactly as serialized alone: escaped once, quotes, backslashes, control and
    /// non-ASCII characters included; the pages of a shard hold each node once.
    #[test]
    fn a_page_body_is_its_keys_escaped_once() {
        let mut p = Pipeline::new(Arc::new(Rules::default()), Arc::new(Metrics::new()));
        let names: Vec<String> = (0..40).map(|i| format!("gpu-node-{i:05}")).collect();
        for n in &names {
            p.on_document(node_doc(n, 8), 1_000);
        }
        let mut doc = document(&p, 7, "r", 0, 1);
        let tricky = "q\"uote \\ back\\\"slash\n\t\u{1}\u{1f}\u{7f} é 🚀 </script>";
        doc.nodes.get_mut(&names[3]).unwrap().npus[0].reason = Some(tricky.into());
        for pages in [1, 3] {
            let mut seen = Vec::new();
            for page in 0..pages {
                let meta = ConfigMapSink::meta("fl-shard-0", Some("42".into()), 0, page);
                let PageBody {
                    body,
                    bytes,
                    skipped,
                    content,
                    full,
                } = page_body(&meta, &doc, page, pages, 9).unwrap();
                assert!(skipped.is_empty());
                // The content is what the page says, not when or as which sequence.
                let mut later = doc.clone();
                later.timestamp = "2030-01-01T00:00:00.000Z".into();
                let again = page_body(&meta, &later, page, pages, 10).unwrap();
                assert_eq!((again.content, again.full), (content, full));
                // Readings and the agent's last contact move `full`, not `content`.
                let mut warmer = doc.clone();
                for n in warmer.nodes.values_mut() {
                    n.agent.last_seen = Some("2030-01-01T00:00:00.000Z".into());
                    for d in &mut n.npus {
                        d.temperature_c = d.temperature_c.map(|t| t + 3.0);
                        d.power_w = d.power_w.map(|w| w * 1.5);
                    }
                }
                let warm = page_body(&meta, &warmer, page, pages, 9).unwrap();
                assert_eq!(
                    warm.content, content,
                    "page {page}: readings are not content"
                );
                assert_ne!(warm.full, full, "page {page}: readings are in the page");
                assert_eq!(page == 0, again.body != body, "only the index says when");
                let cm: ConfigMap = serde_json::from_slice(&body).unwrap();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(
                    (v["apiVersion"].as_str(), v["kind"].as_str()),
                    (Some("v1"), Some("ConfigMap"))
                );
                assert_eq!(cm.metadata, meta);
                let mut want = BTreeMap::new();
                page_entries(&doc, page, pages, 9, |k, v| {
                    want.insert(k.to_string(), serde_json::to_string(&v)?);
                    Ok(())
                })
                .unwrap();
                let data = cm.data.unwrap();
                assert_eq!(data, want, "page {page} of {pages}");
                assert_eq!(
                    bytes,
                    want.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
                );
                assert_eq!(page == 0, data.contains_key("fault.json"));
                seen.extend(data.keys().filter(|k| *k != "fault.json").cloned());
            }
            // A node's entry that changes changes the content of its page.
            let mut moved = doc.clone();
            moved.nodes.get_mut(&names[5]).unwrap().npus[1].reason = Some("xid-48".into());
            let page = page_of(&names[5], doc.shards, pages);
            let meta = ConfigMapSink::meta("fl-shard-0", None, 0, page);
            assert_ne!(
                page_body(&meta, &moved, page, pages, 9).unwrap().content,
                page_body(&meta, &doc, page, pages, 9).unwrap().content
            );
            seen.sort();
            let all: Vec<String> = names.iter().map(|n| format!("{n}.json")).collect();
            assert_eq!(seen, all, "each node on one page of {pages}");
        }
        let body = page_body(&ObjectMeta::default(), &doc, 0, 1, 9)
            .unwrap()
            .body;
        let cm: ConfigMap = serde_json::from_slice(&body).unwrap();
        let entry: NodeFaults =
            serde_json::from_str(&cm.data.unwrap()[&format!("{}.json", names[3])]).unwrap();
        assert_eq!(entry.npus[0].reason.as_deref(), Some(tricky));
    }

    /// Page names round-trip; nothing else of the name's shape is taken for a page.
    #[test]
    fn page_names_round_trip() {
        for (s, p) in [(0, 0), (7, 0), (31, 1), (3, 15)] {
            assert_eq!(parse_page_name("fl", &page_name("fl", s, p)), Some((s, p)));
        }
        for bad in [
            "fl-breaker",
            "fl-shard-x",
            "fl-shard-1-page-0",
            "other-shard-1",
            "fl-shard-1-page-",
        ] {
            assert_eq!(parse_page_name("fl", bad), None, "{bad}");
        }
    }

    /// A shard of 625 nodes x 8 devices (20,000 nodes in 32 shards) is more
    /// than one ConfigMap holds (the test API server refuses over 1 MiB, as
    /// kube-apiserver does: `ValidateConfigMap`, pkg/apis/core/validation/validation.go);
    /// spread over two pages it is written whole: page 0 with the index of every node
    /// of the shard, each node's entry on the page [`page_of`] names, exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shard_too_large_for_one_configmap_is_written_over_pages() {
        const NODES: usize = 5_000;
        const SHARDS: u32 = 8;
        const PAGES: u32 = 2;
        let (p, names, server, api) = fleet_and_server(NODES).await;
        let held = Held::default();
        held.grant(0, tokio::time::Instant::now() + Duration::from_secs(60));
        // One page: over the limit, so its largest entries are trimmed (every device
        // healthy: left out) until it fits, and it is written, each trimmed
        // entry saying how many devices it left out and counting them all.
        let one = ConfigMapSink::new(api.clone(), "single".into());
        one.write(&document(&p, 0, "r1", 0, SHARDS), &held, true)
            .await
            .expect("written, trimmed");
        let cm = server
            .get("configmaps", "faultline", "single-shard-0")
            .unwrap();
        let trimmed: Vec<NodeFaults> = cm["data"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "fault.json")
            .map(|(_, v)| serde_json::from_str(v.as_str().unwrap()).unwrap())
            .filter(|e: &NodeFaults| e.trimmed.is_some())
            .collect();
        assert!(!trimmed.is_empty(), "entries trimmed");
        for e in &trimmed {
            assert_eq!(e.trimmed, Some(8 - e.npus.len() as u32), "{}", e.node);
            assert_eq!(e.summary.total, 8, "{}", e.node);
        }
        let sink = ConfigMapSink::new(api, "faultline".into()).with_pages(PAGES);
        for s in 0..SHARDS {
            held.grant(s, tokio::time::Instant::now() + Duration::from_secs(60));
            sink.write(&document(&p, 0, "r1", s, SHARDS), &held, true)
                .await
                .unwrap_or_else(|e| panic!("shard {s}: {e}"));
        }
        let mut seen = 0;
        for s in 0..SHARDS {
            let index: ShardIndex = serde_json::from_str(
                server
                    .get("configmaps", "faultline", &page_name("faultline", s, 0))
                    .unwrap()["data"]["fault.json"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
            assert_eq!(index.sequence, 1);
            let mine: Vec<&String> = names.iter().filter(|n| shard_of(n, SHARDS) == s).collect();
            assert_eq!(
                index.nodes.len(),
                mine.len(),
                "the index is the whole shard's"
            );
            for page in 0..PAGES {
                let cm = server
                    .get("configmaps", "faultline", &page_name("faultline", s, page))
                    .unwrap();
                let data = cm["data"].as_object().unwrap();
                assert_eq!(
                    cm["metadata"]["labels"]["faultline.io/shard"],
                    s.to_string()
                );
                assert_eq!(data.contains_key("fault.json"), page == 0);
                for n in &mine {
                    let here = data.contains_key(&format!("{n}.json"));
                    assert_eq!(
                        here,
                        page_of(n, SHARDS, PAGES) == page,
                        "{n} on page {page}"
                    );
                    seen += usize::from(here);
                }
            }
        }
        assert_eq!(seen, NODES, "every node on exactly one page");
    }

    /// A status change rewrites its node's page and page 0 (the index), not
    /// the other pages of the shard, whose nodes' readings and last contact moved
    /// meanwhile (at 20,000 nodes that was 1.6 MB of responses for one change); those
    /// are rewritten at the shard's refresh (the write schedule says when).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_status_change_rewrites_its_page_and_the_index_only() {
        const PAGES: u32 = 4;
        let (mut p, names, server, api) = fleet_and_server(200).await;
        let held = Held::default();
        held.grant(0, tokio::time::Instant::now() + Duration::from_secs(60));
        let puts = || {
            server
                .calls()
                .iter()
                .filter(|c| c.method == "PUT" && c.uri.contains("/configmaps/"))
                .count()
        };
        // Every node's readings move (and it is heard from again); `failing`'s gpu5 fails.
        let moved = |p: &mut Pipeline, failing: Option<&str>, temperature: f64, now: u64| {
            for n in &names {
                let doc = testing::node(n)
                    .npus((0..8).map(|i| {
                        let d = Device::nvml(i)
                            .temperature(temperature)
                            .power(280.0 + temperature)
                            .ecc_errors(12)
                            .sample_age_ms(100);
                        if i == 3 || (i == 5 && failing == Some(n.as_str())) {
                            d.failed("xid-79")
                        } else {
                            d
                        }
                        .build()
                    }))
                    .build();
                p.on_document(doc, now);
            }
        };
        let failing = names
            .iter()
            .find(|n| page_of(n, 1, PAGES) != 0)
            .unwrap()
            .clone();
        let sink = ConfigMapSink::new(api.clone(), "faultline".into()).with_pages(PAGES);
        sink.write(&document(&p, 0, "r1", 0, 1), &held, true)
            .await
            .unwrap();
        let before = puts();
        moved(&mut p, Some(&failing), 70.0, 2_000);
        sink.write(&document(&p, 1, "r1", 0, 1), &held, false)
            .await
            .unwrap();
        assert_eq!(puts() - before, 2, "the failed device's page and the index");
        let page = page_name("faultline", 0, page_of(&failing, 1, PAGES));
        let entry: NodeFaults = serde_json::from_str(
            server.get("configmaps", "faultline", &page).unwrap()["data"]
                [format!("{failing}.json")]
            .as_str()
            .unwrap(),
        )
        .unwrap();
        assert_eq!(entry.summary.failed, 2);
        assert_eq!(entry.npus[0].temperature_c, Some(70.0), "its page is fresh");
        // Readings alone: nothing, before the refresh.
        let before = puts();
        moved(&mut p, Some(&failing), 75.0, 3_000);
        sink.write(&document(&p, 2, "r1", 0, 1), &held, false)
            .await
            .unwrap();
        assert_eq!(puts(), before, "readings wait for the refresh");
        // At the shard's refresh, the pages whose readings moved are rewritten.
        sink.write(&document(&p, 3, "r1", 0, 1), &held, true)
            .await
            .unwrap();
        assert_eq!(puts() - before, PAGES as usize, "every page at its refresh");
    }

    /// A shard's writes take turns in the order their documents were built,
    /// and a document older than the one the shard last had out is not written (the
    /// heartbeat built before a fault, done after the fault's urgent write, would undo
    /// it); it is counted. A newer one is written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_older_document_of_a_shard_is_not_written_after_a_newer_one() {
        use crate::publish::{Publisher, Stamp, Written};
        use crate::shard::Shards;
        use std::collections::BTreeSet;
        let (mut p, names, server, api) = fleet_and_server(3).await;
        let held = Held::default();
        held.grant(0, tokio::time::Instant::now() + Duration::from_secs(600));
        let metrics = Arc::new(Metrics::new());
        let publisher = Publisher::ConfigMap {
            sinks: vec![Arc::new(ConfigMapSink::new(api, "faultline".into()))],
            shards: Shards { held, count: 1 },
            nudger: None,
            order: Default::default(),
        };
        let none = BTreeSet::new();
        let write = |p: &Pipeline, sequence: u64| {
            publisher.write(
                p,
                Stamp {
                    sequence,
                    writer: "r1",
                    seeded: None,
                    urgent: &none,
                    changed: &none,
                    include: &none,
                    refresh: &none,
                    whole: true,
                },
                &mut BTreeSet::new(),
                &metrics,
            )
        };
        let key = format!("{}.json", names[0]);
        let has = |k: &str| {
            server
                .get("configmaps", "faultline", "faultline-shard-0")
                .is_some_and(|cm| cm["data"].get(k).is_some())
        };
        assert_eq!(write(&p, 5).await.unwrap(), Written::Done);
        assert!(has(&key));
        // Built earlier (sequence 4), done later: not written.
        p.remove_node(&names[0]);
        assert_eq!(
            write(&p, 4).await.unwrap(),
            Written::Done,
            "skipped, not failed"
        );
        assert!(has(&key), "an older document overwrote a newer one");
        assert!(
            metrics
                .encode()
                .contains("faultline_aggregator_writes_superseded_total{shard=\"0\"} 1"),
            "{}",
            metrics.encode()
        );
        assert_eq!(write(&p, 6).await.unwrap(), Written::Done);
        assert!(!has(&key), "a newer document is written");
    }
}
