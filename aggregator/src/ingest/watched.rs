//! The one watch loop of discovery: `kube::runtime::watcher` (a list from the API
//! server's watch cache, `resourceVersion=0`, unpaginated; a watch with bookmarks; a
//! relist after a 410 Gone; backoff after errors), its events folded into what a
//! follower acts on. A failed watch is counted and logged, and the objects already seen
//! are kept: the next list says which are gone.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Resource;
use serde::de::DeserializeOwned;

use crate::metrics::Metrics;

/// What a watch saw, in order.
#[derive(Debug)]
pub enum Seen<K> {
    /// An object added or changed.
    Applied(K),
    /// An object deleted.
    Deleted(K),
    /// An object of a (re)list in progress: the list is not whole yet.
    Listing(K),
    /// A (re)list is whole: these are the names it held; any other is gone.
    Listed(BTreeSet<String>),
}

/// A watch of `K` by label `selector` (empty: all), its failures counted on `metrics`
/// and logged as `what`.
pub struct Watched<K: Resource + Clone + DeserializeOwned + Debug + Send + 'static> {
    stream: std::pin::Pin<Box<dyn Stream<Item = Result<Event<K>, watcher::Error>> + Send>>,
    listing: Option<BTreeSet<String>>,
    metrics: Arc<Metrics>,
    what: &'static str,
}

impl<K> Watched<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    /// Start watching. `api` must come from a client without a read timeout: a quiet
    /// watch is silent for minutes, and a read timeout would cut it and relist each time.
    pub fn new(api: Api<K>, selector: &str, metrics: Arc<Metrics>, what: &'static str) -> Self {
        let mut cfg = watcher::Config::default().any_semantic();
        // Unpaginated: kube sends `resourceVersion=0` (the watch cache) only without a
        // limit, and these objects are few enough for one answer.
        cfg.page_size = None;
        if !selector.is_empty() {
            cfg = cfg.labels(selector);
        }
        Watched {
            stream: watcher(api, cfg).default_backoff().boxed(),
            listing: None,
            metrics,
            what,
        }
    }

    /// The next thing seen; `None` when the watch ended for good.
    pub async fn next(&mut self) -> Option<Seen<K>> {
        loop {
            match self.stream.next().await? {
                Ok(Event::Apply(k)) => return Some(Seen::Applied(k)),
                Ok(Event::Delete(k)) => return Some(Seen::Deleted(k)),
                Ok(Event::Init) => self.listing = Some(BTreeSet::new()),
                Ok(Event::InitApply(k)) => {
                    if let (Some(seen), Some(name)) = (self.listing.as_mut(), k.meta().name.clone())
                    {
                        seen.insert(name);
                    }
                    return Some(Seen::Listing(k));
                }
                Ok(Event::InitDone) => {
                    return Some(Seen::Listed(self.listing.take().unwrap_or_default()));
                }
                Err(e) => {
                    self.metrics.discovery_error();
                    tracing::warn!(error = %e, watch = self.what, "watch failed; retrying with backoff, keeping the agents we follow");
                }
            }
        }
    }
}
