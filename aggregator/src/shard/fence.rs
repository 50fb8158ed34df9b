//! Fencing: the right to write for a node is the Lease of the node's shard, asked right
//! before every write. A [`Fence`] names that right for one node; [`Shards`] hands out
//! fences and says which nodes this replica acts for.

use std::time::Duration;

use faultline_common::fault::shard_of;

use super::held::Held;

/// The right to write for one node: its shard's Lease as held by this replica, asked
/// right before every write, so a pass that loses the Lease stops where it is.
#[derive(Clone)]
pub struct Fence(Kind);

#[derive(Clone)]
enum Kind {
    Shard { held: Held, shard: u32 },
    Unfenced,
}

impl Fence {
    /// Fenced by this replica's Lease of `shard`.
    pub fn shard(held: Held, shard: u32) -> Self {
        Fence(Kind::Shard { held, shard })
    }

    /// Always allowed: for one actor alone (a direct call, a test). A replica among
    /// others never acts unfenced.
    pub fn unfenced() -> Self {
        Fence(Kind::Unfenced)
    }

    /// The shard it fences (`None`: unfenced).
    pub fn shard_id(&self) -> Option<u32> {
        match &self.0 {
            Kind::Shard { shard, .. } => Some(*shard),
            Kind::Unfenced => None,
        }
    }

    /// Whether a write may go now (noted: a release of the shard waits until a write
    /// that went now has landed).
    pub fn holds(&self) -> bool {
        self.admit().is_some()
    }

    /// The fence's one decision, noted as [`Fence::holds`] says: `None` when no write
    /// may go now, else how long one that goes now may take (`Some(None)`: unbounded,
    /// unfenced).
    fn admit(&self) -> Option<Option<Duration>> {
        match &self.0 {
            Kind::Shard { held, shard } => held.admit(*shard).map(Some),
            Kind::Unfenced => Some(None),
        }
    }
}

/// Why a fenced write did not land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// The hold did not stand when the write was to go: it was not sent.
    NotHeld,
    /// The hold ended while the call was in flight (it had this long): the call was
    /// given up, so it cannot land after another replica took the shard over.
    RanOut(Duration),
}

impl Fence {
    /// `call`, sent only while the hold stands and given up when it ends: a write
    /// needs the hold for as long as it is in flight, not only when it goes. The hold
    /// ends the margin before the Lease does, so a write given up then, whose request
    /// the API server sees cancelled, cannot land after another replica took the
    /// shard; a write with a precondition (a uid, a resourceVersion) is bounded too.
    /// Unfenced: `call` as it is.
    pub async fn write<F: std::future::Future>(&self, call: F) -> Result<F::Output, Lost> {
        let left = self.admit().ok_or(Lost::NotHeld)?;
        let Some(left) = left else {
            return Ok(call.await);
        };
        let given_up = tokio::time::timeout(left, call).await;
        given_up.map_err(|_| Lost::RanOut(left))
    }
}

/// The shards of the cluster and which of them this replica holds.
#[derive(Clone)]
pub struct Shards {
    /// What this replica holds (the Lease loop updates it).
    pub held: Held,
    /// How many shards there are.
    pub count: u32,
}

impl Shards {
    /// The shard of `node`.
    pub fn of(&self, node: &str) -> u32 {
        shard_of(node, self.count)
    }

    /// Whether this replica acts for `node` now.
    pub fn holds_node(&self, node: &str) -> bool {
        self.held.holds(self.of(node))
    }

    /// The fence of `node`'s writes.
    pub fn fence(&self, node: &str) -> Fence {
        Fence::shard(self.held.clone(), self.of(node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn a_fence_follows_the_lease() {
        let shards = Shards {
            held: Held::default(),
            count: 4,
        };
        let fence = shards.fence("gpu-1");
        assert!(!fence.holds() && !shards.holds_node("gpu-1"));
        shards
            .held
            .grant(shards.of("gpu-1"), Instant::now() + Duration::from_secs(60));
        assert!(fence.holds() && shards.holds_node("gpu-1"));
        shards.held.grant(shards.of("gpu-1"), Instant::now());
        assert!(!fence.holds(), "run out on this replica's clock");
        assert!(Fence::unfenced().holds());
    }

    /// A node's fence is its shard's, the shard its document is published in: a
    /// replica holding one shard writes for that shard's nodes and no other's.
    #[test]
    fn a_fence_is_the_nodes_shards() {
        let shards = Shards {
            held: Held::default(),
            count: 4,
        };
        let nodes: Vec<String> = (0..32).map(|i| format!("gpu-{i}")).collect();
        for n in &nodes {
            let s = faultline_common::fault::shard_of(n, 4);
            assert_eq!(shards.of(n), s, "{n}");
            assert_eq!(shards.fence(n).shard_id(), Some(s), "{n}");
        }
        assert_eq!(Fence::unfenced().shard_id(), None);
        let mine = shards.of("gpu-1");
        shards
            .held
            .grant(mine, Instant::now() + Duration::from_secs(60));
        let (here, elsewhere): (Vec<&String>, Vec<&String>) =
            nodes.iter().partition(|n| shards.of(n) == mine);
        assert!(!elsewhere.is_empty() && here.len() < nodes.len());
        assert!(here
            .iter()
            .all(|n| shards.fence(n).holds() && shards.holds_node(n)));
        assert!(elsewhere
            .iter()
            .all(|n| !shards.fence(n).holds() && !shards.holds_node(n)));
        let high = nodes
            .iter()
            .find(|n| shards.of(n) >= 2)
            .expect("a node of shard 2 or 3");
        assert!(shards.fence(high).shard_id() >= Some(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_in_flight_when_the_hold_ends_is_given_up() {
        let held = Held::default();
        held.grant(3, Instant::now() + Duration::from_secs(2));
        let fence = Fence::shard(held, 3);
        assert_eq!(fence.write(async { 7 }).await, Ok(7));
        let mut landed = false;
        let slow = fence.write(async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            landed = true;
        });
        assert_eq!(slow.await, Err(Lost::RanOut(Duration::from_secs(2))));
        assert!(!landed, "the write went on past the hold");
        assert_eq!(fence.write(async { 7 }).await, Err(Lost::NotHeld));
        assert_eq!(Fence::unfenced().write(async { 7 }).await, Ok(7));
    }
}
