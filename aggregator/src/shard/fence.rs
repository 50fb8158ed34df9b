//! Fencing: the right to write for a node is the Lease of the node's shard, asked right
//! before every write. A [`Fence`] names that right for one node; [`Shards`] hands out
//! fences and says which nodes this replica acts for.

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
        match &self.0 {
            Kind::Shard { held, shard } => held.admit(*shard),
            Kind::Unfenced => true,
        }
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
    use std::time::Duration;
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
}
