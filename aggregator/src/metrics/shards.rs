//! The shard side of [`Metrics`]: Leases, ownership, discovery, nudges, and the
//! pipeline's upkeep.

use super::labels::{Nudge, NudgeLabel, ShardLabel};
use super::Metrics;

impl Metrics {
    /// Shards held and replicas counted, after a Lease pass.
    pub fn set_ownership(&self, shards: usize, live: usize) {
        self.shards_held.set(shards as i64);
        self.live_replicas.set(live as i64);
    }

    /// Agents followed now.
    pub fn set_nodes_followed(&self, n: usize) {
        self.nodes_followed.set(n as i64);
    }

    /// A shard handed back for balance.
    pub fn rebalance(&self) {
        self.rebalances.inc();
    }

    /// A shard taken from another holder.
    pub fn takeover(&self) {
        self.takeovers.inc();
    }

    /// A renewal came back after the hold had run out on this replica's clock.
    pub fn hold_lapse(&self) {
        self.hold_lapses.inc();
    }

    /// Devices seeded from a published document.
    pub fn seeded(&self, n: usize) {
        self.seeded_devices.inc_by(n as u64);
    }

    /// Lease ownership of a shard.
    pub fn set_lease(&self, shard: u32, held: bool) {
        self.lease_held
            .get_or_create(&ShardLabel { shard })
            .set(held as i64);
    }

    /// A lease request failed.
    pub fn lease_error(&self) {
        self.lease_errors.inc();
    }

    /// A pod nudge: `ok`, `error`, `rate-limited`, `busy` (a node's batch past the
    /// nudges in flight).
    pub fn nudge(&self, result: Nudge) {
        self.nudges.get_or_create(&NudgeLabel { result }).inc();
    }

    /// Devices forgotten: their agent stopped reporting them (`--device-forget`).
    pub fn devices_forgotten(&self, n: usize) {
        self.devices_forgotten.inc_by(n as u64);
    }

    /// UUIDs a node reported that another node reported first.
    pub fn duplicate_uuids(&self, n: usize) {
        self.duplicate_uuids.inc_by(n as u64);
    }

    /// A new node refused: the pipeline follows its maximum.
    pub fn reconciled(&self) {
        self.reconciles.inc();
    }

    pub fn lease_pass(&self) {
        self.lease_passes.inc();
    }

    pub fn pass_done(&self) {
        self.passes.inc();
    }

    pub fn node_refused(&self) {
        self.nodes_refused.inc();
    }

    /// Whether the unknown guard stands down (too many agents unreachable).
    pub fn set_unknown_standing_down(&self, on: bool) {
        self.unknown_standing_down.set(i64::from(on));
    }

    /// A node list failed.
    pub fn discovery_error(&self) {
        self.discovery_errors.inc();
    }
}
