//! Fair sharing between replicas: where a taken shard is seeded from, and the one
//! ordered stream of shard events the Lease loop sends the core loop (a shard's seed
//! before it counts as held, the shards granted as they change, a final write before a
//! shard is handed back).

use faultline_common::fault::NodeFaults;
use futures_util::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::model::ShardEvent;

/// Where a taken shard's last published document is read from (publishing owns the
/// pages, so it implements this; `publish::seed::ShardPages`).
pub trait SeedSource: Send + Sync {
    /// The node entries of `shard`'s last published document (none: nothing to seed).
    fn read(&self, shard: u32) -> BoxFuture<'_, Vec<NodeFaults>>;
}

/// What fair sharing needs: where to seed from, and the core loop to tell what happened
/// to the shards; and the plan's state between passes.
pub struct Sharing {
    /// The shard's last published document, read to seed a shard taken.
    pub seeds: Box<dyn SeedSource>,
    /// To the core loop, in order: takeovers (before the shard counts as held), the
    /// shards granted as they change, final writes (before a shard is handed back).
    pub events: mpsc::Sender<ShardEvent>,
    /// After handing a shard back (or joining), take none until then.
    pub hold_off: Option<Instant>,
    /// The live replicas of the last pass that could count them.
    pub last_live: Option<Vec<String>>,
    /// The members were counted once: this replica has announced itself.
    pub joined: bool,
}

impl Sharing {
    /// Fair sharing, seeded from `seeds`, its events to the core loop on `events`.
    pub fn new(seeds: Box<dyn SeedSource>, events: mpsc::Sender<ShardEvent>) -> Self {
        Sharing {
            seeds,
            events,
            hold_off: None,
            last_live: None,
            joined: false,
        }
    }
}
