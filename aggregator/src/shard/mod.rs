//! Shard ownership: the plan (pure), the Leases that carry it out, and the fence every
//! write asks.

pub mod fence;
pub mod held;
pub mod lease;
mod lease_write;
pub mod plan;
pub mod sharing;
pub mod timing;

pub use fence::{Fence, Lost, Shards};
pub use held::Held;
pub use lease::{
    lease_name, LeaseConfig, SeedSource, ShardLeases, Sharing, MEMBER_LABEL, URL_ANNOTATION,
};
pub use plan::share;
