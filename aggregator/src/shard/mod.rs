//! Shard ownership: Leases and the fence every write asks.

pub mod fence;
pub mod lease;

pub use fence::{Fence, Shards};
pub use lease::{
    lease_name, share, Held, LeaseConfig, ShardLeases, Sharing, MEMBER_LABEL, URL_ANNOTATION,
};
