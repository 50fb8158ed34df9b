//! Shard ownership: the plan (pure), the Leases that carry it out, and the fence every
//! write asks.

pub mod fence;
pub mod lease;
pub mod plan;

pub use fence::{Fence, Shards};
pub use lease::{
    lease_name, Held, LeaseConfig, SeedSource, ShardLeases, Sharing, MEMBER_LABEL, URL_ANNOTATION,
};
pub use plan::share;
