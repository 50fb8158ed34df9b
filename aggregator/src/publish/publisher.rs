//! Where documents go, and one write of them: the file sink (a directory laid out like
//! a ConfigMap volume) or the shard ConfigMaps (written by each shard's Lease holder,
//! into every publish namespace, then the pods of alarming nodes nudged). Publishing
//! only: remediation is the dispatcher's.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use faultline_common::fault::{shard_of, FaultDocument};
use faultline_common::sync::Locked;
use faultline_common::time::now_ms;

use super::configmap::{ConfigMapSink, WriteError};
use super::document::{document, files};
use super::file;
use super::nudge::Nudger;
use crate::metrics::{Metrics, Sink};
use crate::pipeline::Pipeline;
use crate::shard::Shards;

/// What one write is: its sequence, its writer, and (with fair sharing) the shards
/// seeded since they were taken, the only ones it may write.
#[derive(Clone, Copy)]
pub struct Stamp<'a> {
    /// The write's sequence.
    pub sequence: u64,
    /// This replica.
    pub writer: &'a str,
    /// With fair sharing: the shards seeded since taken.
    pub seeded: Option<&'a BTreeSet<u32>>,
    /// The shards where a device turned failed: written before any other.
    pub urgent: &'a BTreeSet<u32>,
    /// The shards whose nodes changed (or that were just taken): written next.
    pub changed: &'a BTreeSet<u32>,
    /// The shards to write when not `whole`: the changed ones and those due their
    /// heartbeat.
    pub include: &'a BTreeSet<u32>,
    /// The shards due their refresh (`--refresh`, judged by the write schedule alone):
    /// their pages whose readings moved are rewritten too; the other shards' pages only
    /// when what they say changed.
    pub refresh: &'a BTreeSet<u32>,
    /// Write every shard held; else only those of `include`. A replica holding 16
    /// shards of 300 nodes rewrote all 16 for one device's fault, one after the other:
    /// the fault's shard waited for up to 15 others (measured at 20,000
    /// nodes).
    pub whole: bool,
}

/// Urgent ConfigMap writes in flight at once.
pub const URGENT_IN_FLIGHT: usize = 4;

/// Where documents go.
pub enum Publisher {
    /// A directory laid out like a ConfigMap volume.
    File {
        /// The directory.
        out: PathBuf,
        /// The last whole document (it is built for the files anyway), for the API.
        latest: Arc<Mutex<Option<Arc<FaultDocument>>>>,
    },
    /// One ConfigMap per shard.
    ConfigMap {
        /// One per namespace written, the aggregator's own first.
        sinks: Vec<Arc<ConfigMapSink>>,
        /// The shards and which this replica holds.
        shards: Shards,
        /// Nudges pods after a write, when on.
        nudger: Option<Arc<Nudger>>,
        /// The order of the writes of each shard.
        order: Arc<WriteOrder>,
    },
}

/// Writes of one shard in the order their documents were built. An urgent write (a
/// device turned failed) may run beside a write of other shards already in flight
/// (a fault waited behind a heartbeat of another shard); a shard's writes
/// take turns, and a document older than the one a shard last had out is not written
/// at all (else the heartbeat built before a fault would overwrite it).
#[derive(Default)]
pub struct WriteOrder(Mutex<std::collections::HashMap<u32, Arc<tokio::sync::Mutex<u64>>>>);

impl WriteOrder {
    /// The turn of `shard`: the sequence of the newest document it had out.
    fn of(&self, shard: u32) -> Arc<tokio::sync::Mutex<u64>> {
        self.0.locked().entry(shard).or_default().clone()
    }
}

impl Publisher {
    /// The shard of `node` (`None`: the file sink, one document for every node).
    pub fn shard_of(&self, node: &str) -> Option<u32> {
        match self {
            Publisher::File { .. } => None,
            Publisher::ConfigMap { shards, .. } => Some(shard_of(node, shards.count)),
        }
    }

    /// With shards: those granted to this replica and not released, whether or not their
    /// hold has run out (`None`: the file sink, which owns every node).
    pub fn granted(&self) -> Option<BTreeSet<u32>> {
        match self {
            Publisher::File { .. } => None,
            Publisher::ConfigMap { shards, .. } => Some(shards.held.keys()),
        }
    }

    /// The shards whose hold ran out and was renewed since the last call (the file
    /// sink: none).
    pub fn take_lapsed(&self) -> BTreeSet<u32> {
        match self {
            Publisher::File { .. } => BTreeSet::new(),
            Publisher::ConfigMap { shards, .. } => shards.held.take_lapsed(),
        }
    }

    /// The shards this replica writes now (the file sink writes its one).
    pub fn held(&self) -> Vec<u32> {
        match self {
            Publisher::File { .. } => vec![0],
            Publisher::ConfigMap { shards, .. } => shards.held.shards(),
        }
    }

    /// How many urgent writes may be in flight at once: ConfigMap shards take turns per
    /// shard ([`WriteOrder`]), so faults of different shards are written side by side;
    /// the file sink writes its one document, one write after the other.
    pub fn urgent_in_flight(&self) -> usize {
        match self {
            Publisher::File { .. } => 1,
            Publisher::ConfigMap { .. } => URGENT_IN_FLIGHT,
        }
    }

    /// Start one write of the pipeline's state as `sequence` by `writer`; `alarming`
    /// nodes get their pods nudged after their shard is written (and are taken: nodes of
    /// shards this replica does not hold are their holder's to nudge). The task says
    /// whether every write of it was done ([`Written`]), so the caller's next round
    /// writes again after a failure.
    pub fn write(
        &self,
        pipeline: &Pipeline,
        stamp: Stamp<'_>,
        alarming: &mut BTreeSet<String>,
        metrics: &Arc<Metrics>,
    ) -> tokio::task::JoinHandle<Written> {
        let Stamp {
            sequence,
            writer,
            seeded,
            urgent,
            changed,
            include,
            refresh,
            whole,
        } = stamp;
        let only = (!whole).then_some(include);
        match self {
            Publisher::File { out, latest } => {
                alarming.clear();
                let whole = Arc::new(document(pipeline, sequence, writer, 0, 1));
                *latest.locked() = Some(whole.clone());
                let (out, metrics) = (out.clone(), metrics.clone());
                tokio::task::spawn_blocking(move || write_files(&out, &whole, &metrics))
            }
            Publisher::ConfigMap {
                sinks,
                shards,
                nudger,
                order,
            } => {
                // A shard just taken is written once seeded from its last document.
                let mine: Vec<u32> = shards
                    .held
                    .shards()
                    .into_iter()
                    .filter(|s| seeded.is_none_or(|r| r.contains(s)))
                    .collect();
                for s in (0..shards.count).filter(|s| !mine.contains(s)) {
                    metrics.write_skipped(Sink::ConfigMap, s);
                }
                let mut mine: Vec<u32> = mine
                    .into_iter()
                    .filter(|s| only.is_none_or(|o| o.contains(s)))
                    .collect();
                // A fault's shard first, then the changed ones: neither waits behind the
                // heartbeat of the others.
                mine.sort_by_key(|s| (!urgent.contains(s), !changed.contains(s)));
                let jobs: Vec<(FaultDocument, Vec<String>, bool)> = mine
                    .iter()
                    .map(|s| {
                        let doc = document(pipeline, 0, writer, *s, shards.count);
                        let nudge: Vec<String> = alarming
                            .iter()
                            .filter(|n| doc.nodes.contains_key(*n))
                            .cloned()
                            .collect();
                        (doc, nudge, refresh.contains(s))
                    })
                    .collect();
                // Nudged with their shard's write; the nodes of shards held and not
                // written now wait for theirs (those of shards not held are their
                // holder's to nudge).
                let held = shards.held.keys();
                alarming.retain(|n| {
                    let s = shard_of(n, shards.count);
                    held.contains(&s) && !mine.contains(&s)
                });
                let (sinks, shards, metrics, nudger, order) = (
                    sinks.clone(),
                    shards.clone(),
                    metrics.clone(),
                    nudger.clone(),
                    order.clone(),
                );
                tokio::spawn(async move {
                    let mut written = Written::Done;
                    for (doc, nudge, refresh) in jobs {
                        // Its turn; skipped when a newer document of the shard is out.
                        let turn = order.of(doc.shard);
                        let mut newest = turn.lock().await;
                        if *newest > sequence {
                            metrics.write_superseded(doc.shard);
                            // What is out is newer: its pods are nudged all the same.
                            if let Some(n) = &nudger {
                                n.detach(nudge, now_ms().to_string());
                            }
                            continue;
                        }
                        *newest = sequence;
                        let target = Target {
                            sinks: &sinks,
                            shards: &shards,
                            metrics: &metrics,
                            nudger: nudger.as_ref(),
                        };
                        let shard = write_shard(doc, nudge, refresh, target).await;
                        written = written.and(shard);
                    }
                    written
                })
            }
        }
    }
}

/// Whether a write task did every write it set out to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Written {
    /// Every write done (or skipped: a shard no longer held, a newer document out).
    Done,
    /// At least one write failed: the next round writes every shard again.
    Failed,
}

impl Written {
    /// Both done, or failed.
    pub fn and(self, other: Written) -> Written {
        if self == Written::Done {
            other
        } else {
            Written::Failed
        }
    }
}

fn write_files(out: &std::path::Path, whole: &FaultDocument, metrics: &Metrics) -> Written {
    let t = Instant::now();
    let r = files(whole).map_err(std::io::Error::other).and_then(|f| {
        let bytes = f.values().map(Vec::len).sum::<usize>();
        file::write(out, &f)?;
        Ok(bytes)
    });
    match r {
        Ok(bytes) => {
            metrics.write(Sink::File, 0, t.elapsed().as_secs_f64(), bytes, true);
            Written::Done
        }
        Err(e) => {
            metrics.write(Sink::File, 0, 0.0, 0, false);
            tracing::error!(error = %e, out = %out.display(), "cannot write fault documents");
            Written::Failed
        }
    }
}

/// Where a shard's document goes.
struct Target<'a> {
    sinks: &'a [Arc<ConfigMapSink>],
    shards: &'a Shards,
    metrics: &'a Metrics,
    nudger: Option<&'a Arc<Nudger>>,
}

/// Write one shard's document into every publish namespace (with `refresh`, its pages
/// whose readings moved too), then nudge the pods of `nudge` (after the write, so the
/// sync the nudge causes finds the new content).
async fn write_shard(
    doc: FaultDocument,
    nudge: Vec<String>,
    refresh: bool,
    Target {
        sinks,
        shards,
        metrics,
        nudger,
    }: Target<'_>,
) -> Written {
    let shard = doc.shard;
    let mut written = false;
    let mut outcome = Written::Done;
    for sink in sinks {
        let t = Instant::now();
        match sink.write(&doc, &shards.held, refresh).await {
            Ok(bytes) => {
                written = true;
                metrics.write(
                    Sink::ConfigMap,
                    shard,
                    t.elapsed().as_secs_f64(),
                    bytes,
                    true,
                );
            }
            Err(WriteError::NotHolder(_)) => {
                metrics.write_skipped(Sink::ConfigMap, shard);
                break;
            }
            Err(e) => {
                outcome = Written::Failed;
                metrics.write(Sink::ConfigMap, shard, 0.0, 0, false);
                tracing::error!(shard, error = %e, "cannot write the shard ConfigMap");
            }
        }
    }
    if let (true, Some(n)) = (written, nudger) {
        n.detach(nudge, now_ms().to_string());
    }
    outcome
}
