//! The store's change log: each change recorded as a watch event, in the history that
//! watches resume from, seen by the simulated kubelets, its bytes charged.

use serde_json::Value;
use tokio::sync::broadcast;

use crate::{costs, ApiServer, Inner, Key, WatchEvent, HISTORY};

/// One change of the store, as it is recorded for watches.
pub(crate) struct Change {
    pub(crate) key: Key,
    pub(crate) kind: &'static str,
    pub(crate) event: &'static str,
    pub(crate) object: Value,
    /// The object before (MODIFIED and DELETED).
    pub(crate) prev: Option<Value>,
    /// The verb and resource a stored object is charged to as written bytes; `None`
    /// for a removal (etcd keeps nothing).
    pub(crate) charge: Option<(&'static str, String)>,
}

impl ApiServer {
    /// Record a change: the watch event, the kubelets' view of it, the bytes written.
    pub(crate) fn record(g: &mut Inner, tx: &broadcast::Sender<WatchEvent>, c: Change) {
        let watched = matches!(c.key.0.as_str(), "configmaps" | "secrets" | "pods");
        let size = if c.charge.is_some() || watched {
            costs::json_len(&c.object)
        } else {
            0
        };
        if let Some((verb, resource)) = &c.charge {
            g.meter.written(verb, resource, size);
        }
        if watched {
            let Inner {
                kubelets,
                objects,
                meter,
                rv,
                ..
            } = g;
            kubelets.observe(objects, meter, &c.key, c.event, &c.object, size, *rv);
        }
        let e = WatchEvent {
            rv: g.rv,
            key: c.key,
            kind: c.kind,
            event: c.event,
            object: c.object,
            prev: c.prev,
            at_ms: crate::clock::now_ms(),
        };
        g.history.push_back(e.clone());
        while g.history.len() > HISTORY {
            g.history.pop_front();
        }
        let _ = tx.send(e);
    }
}
