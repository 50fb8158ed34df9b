//! Keys with the order they were last touched in: the intake's counts and dedup, the
//! claims and Nodes found missing.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// A map of keys with the order they were last touched in (the cap's search
/// for the oldest key, and a sweep of every key per alert, were O(n) per alert on the
/// thread that renews the Leases; four senders past 10,000 keys lost the Lease three
/// times in 45 s). The order is a queue of touches, stale ones skipped when they come
/// up: the oldest key and the expired ones cost O(1) amortized.
pub struct Aged<K, V> {
    map: HashMap<K, (V, Instant)>,
    pub(crate) order: VecDeque<(Instant, K)>,
}

impl<K, V> Default for Aged<K, V> {
    fn default() -> Self {
        Aged {
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<K: Clone + Eq + Hash, V> Aged<K, V> {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains_key(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }

    pub fn remove(&mut self, k: &K) {
        self.map.remove(k);
    }

    /// `k` touched at `now` (inserted with `v` if new); the value.
    pub fn touch(&mut self, k: K, now: Instant, v: impl FnOnce() -> V) -> &mut V {
        // Touches of keys touched again since pile up: rebuilt past twice the keys.
        if self.order.len() > 2 * self.map.len() + 64 {
            let mut live: Vec<(Instant, K)> =
                self.map.iter().map(|(k, (_, t))| (*t, k.clone())).collect();
            live.sort_by_key(|(t, _)| *t);
            self.order = live.into();
        }
        self.order.push_back((now, k.clone()));
        let e = self.map.entry(k).or_insert_with(|| (v(), now));
        e.1 = now;
        &mut e.0
    }

    /// Drop the keys last touched `older` ago or more (at `now`).
    pub fn expire(&mut self, now: Instant, older: Duration) {
        while let Some((t, _)) = self.order.front() {
            if now.duration_since(*t) < older {
                break;
            }
            let (t, k) = self.order.pop_front().expect("just seen");
            if self.map.get(&k).is_some_and(|(_, last)| *last == t) {
                self.map.remove(&k);
            }
        }
    }

    /// Drop the oldest keys until there is room for one more within `max`; how many
    /// went.
    pub fn make_room(&mut self, max: usize) -> usize {
        let mut evicted = 0;
        while self.map.len() >= max {
            let Some((t, k)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|(_, last)| *last == t) {
                self.map.remove(&k);
                evicted += 1;
            }
        }
        evicted
    }
}
