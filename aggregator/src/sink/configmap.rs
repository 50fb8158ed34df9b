//! `--sink configmap`: each shard's document in its own ConfigMap
//! (`<name>-shard-<i>`), written only while this replica holds the shard's Lease
//! (checked right before every write), with optimistic concurrency on the
//! resourceVersion and a bounded retry on 409. Keys: `fault.json` (the shard) and
//! `<node>.json` (one node each), so a pod that mounts every shard in one projected
//! volume reads `/config/$NODE_NAME.json`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use faultline_common::fault::{FaultDocument, ShardIndex};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::lease::Held;

/// Largest ConfigMap we write; the API's limit is 1 MiB.
pub const MAX_BYTES: usize = 900 << 10;

/// Why a write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// This replica does not hold the shard (any more).
    #[error("not the holder of shard {0}")]
    NotHolder(u32),
    /// The document would not fit in a ConfigMap.
    #[error("shard {shard} is {bytes} bytes, over the {MAX_BYTES} byte limit: use more shards")]
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
    name: String,
    /// Per shard: the resourceVersion and sequence of our last write.
    last: Mutex<HashMap<u32, (String, u64)>>,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
}

/// The ConfigMap of a shard.
pub fn configmap_name(name: &str, shard: u32) -> String {
    format!("{name}-shard-{shard}")
}

/// The keys of one shard: `fault.json` (the shard's index) and `<node>.json` each.
pub fn files(doc: &FaultDocument) -> Result<BTreeMap<String, String>, serde_json::Error> {
    let mut f = BTreeMap::new();
    f.insert(
        "fault.json".to_string(),
        serde_json::to_string(&ShardIndex::of(doc))?,
    );
    for (node, n) in &doc.nodes {
        f.insert(format!("{node}.json"), serde_json::to_string(n)?);
    }
    Ok(f)
}

impl ConfigMapSink {
    /// ConfigMaps named `<name>-shard-<i>` through `api`.
    pub fn new(api: Api<ConfigMap>, name: String) -> Self {
        ConfigMapSink {
            api,
            name,
            last: Mutex::new(HashMap::new()),
            metrics: None,
        }
    }

    /// Count 409s in `metrics`.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Self {
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

    fn object(
        &self,
        cm_name: &str,
        rv: Option<String>,
        shard: u32,
        data: BTreeMap<String, String>,
    ) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(cm_name.to_string()),
                resource_version: rv,
                labels: Some(BTreeMap::from([
                    (
                        "app.kubernetes.io/name".to_string(),
                        "faultline".to_string(),
                    ),
                    ("faultline.io/shard".to_string(), shard.to_string()),
                ])),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        }
    }

    /// Write `doc` as shard `doc.shard`, fenced by `held`. Returns the bytes written.
    pub async fn write(&self, mut doc: FaultDocument, held: &Held) -> Result<usize, WriteError> {
        let shard = doc.shard;
        let cm_name = configmap_name(&self.name, shard);
        let cached = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&shard)
            .cloned();
        // First write since taking the shard: continue the sequence already published.
        let (mut rv, mut seq) = match cached {
            Some((rv, seq)) => (Some(rv), seq),
            None => match self.api.get_opt(&cm_name).await? {
                Some(cm) => (cm.metadata.resource_version.clone(), Self::sequence_in(&cm)),
                None => (None, 0),
            },
        };
        for attempt in 0..3 {
            doc.sequence = seq + 1;
            let data = files(&doc)?;
            let bytes: usize = data.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > MAX_BYTES {
                return Err(WriteError::TooLarge { shard, bytes });
            }
            let cm = self.object(&cm_name, rv.clone(), shard, data);
            // Fencing: the lease is checked right before the write leaves.
            if !held.holds(shard) {
                self.forget(shard);
                return Err(WriteError::NotHolder(shard));
            }
            let r = match &rv {
                Some(_) => {
                    self.api
                        .replace(&cm_name, &PostParams::default(), &cm)
                        .await
                }
                None => self.api.create(&PostParams::default(), &cm).await,
            };
            match r {
                Ok(written) => {
                    let new_rv = written.metadata.resource_version.unwrap_or_default();
                    self.last
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(shard, (new_rv, doc.sequence));
                    return Ok(bytes);
                }
                // Written in between (or created already): read again and retry.
                Err(kube::Error::Api(s)) if s.code == 409 && attempt < 2 => {
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
                    return Err(e.into());
                }
            }
        }
        self.forget(shard);
        Err(WriteError::Conflict(shard))
    }

    /// Forget what we know of a shard (after losing it or an error): the next write
    /// reads the ConfigMap again.
    pub fn forget(&self, shard: u32) {
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&shard);
    }
}
