//! The aggregator's metrics: every family on one prefixed registry, and how each
//! is recorded.

use faultline_common::DeviceStatus;
use prometheus_client::encoding::text::encode;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::labels::{
    ActionLabel, ActionLabels, CodeLabel, Delivered, DeliveryKind, DeliveryLabels, IntakeLabel,
    KindLabel, NudgeLabel, Poll, PollLabel, Reload, ReloadLabel, ResultLabel, ShardLabel, Sink,
    SinkLabels, StateLabel, TransitionLabels, VersionLabel,
};

/// Every metric of the aggregator.
pub struct Metrics {
    registry: Registry,
    /// The HTTP server's connection counts, served with the rest.
    pub server: std::sync::Arc<faultline_common::server::Stats>,
    rules_reloads: Family<ReloadLabel, Counter>,
    agent_polls: Family<PollLabel, Counter>,
    agent_poll_errors: Family<KindLabel, Counter>,
    remediation_errors: Family<KindLabel, Counter>,
    device_taint_api: Family<VersionLabel, Gauge>,
    pub(super) devices_isolated: Family<super::labels::IsolatedLabels, Gauge>,
    agents_reachable: Gauge,
    agents_total: Gauge,
    devices: Family<StateLabel, Gauge>,
    transitions: Family<TransitionLabels, Counter>,
    write_seconds: Family<SinkLabels, Histogram>,
    write_bytes: Family<SinkLabels, Gauge>,
    write_errors: Family<SinkLabels, Counter>,
    writes_skipped: Family<SinkLabels, Counter>,
    writes_superseded: Family<ShardLabel, Counter>,
    write_conflicts: Family<SinkLabels, Counter>,
    invalid_keys: Counter,
    entries_trimmed: Counter,
    pages_unchanged: Counter,
    pub(super) lease_held: Family<ShardLabel, Gauge>,
    pub(super) lease_errors: Counter,
    pub(super) shards_held: Gauge,
    pub(super) live_replicas: Gauge,
    pub(super) nodes_followed: Gauge,
    pub(super) rebalances: Counter,
    pub(super) takeovers: Counter,
    pub(super) hold_lapses: Counter,
    pub(super) seeded_devices: Counter,
    /// `agent_polls{result="ok"}`, resolved once: it is counted for every document.
    agent_polls_ok: Counter,
    agent_watch_fallbacks: Counter,
    deliveries: Family<DeliveryLabels, Counter>,
    pub(super) discovery_errors: Counter,
    pub(super) devices_forgotten: Counter,
    pub(super) duplicate_uuids: Counter,
    pub(super) nodes_refused: Counter,
    pub(super) reconciles: Counter,
    pub(super) passes: Counter,
    pub(super) lease_passes: Counter,
    pub(super) unknown_standing_down: Gauge,
    pub(super) nudges: Family<NudgeLabel, Counter>,
    pub(super) actions: Family<ActionLabels, Counter>,
    pub(super) action_seconds: Family<ActionLabel, Histogram>,
    pub(super) quarantined_nodes: Gauge,
    pub(super) quarantined_devices: Gauge,
    pub(super) held_back: Gauge,
    pub(super) breaker_open: Gauge,
    pub(super) intake_responses: Family<CodeLabel, Counter>,
    pub(super) intake_alerts: Family<IntakeLabel, Counter>,
    pub(super) notifications: Family<ResultLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Register the plain counters.
fn register_counters(registry: &mut Registry, m: &Metrics) {
    // The plain counters.
    for (name, help, counter) in [
        (
            "lease_errors",
            "Lease requests that failed",
            &m.lease_errors,
        ),
        (
            "invalid_keys",
            "Node entries left out of a shard ConfigMap: their name is not a valid key",
            &m.invalid_keys,
        ),
        (
            "entries_trimmed",
            "Node entries trimmed (healthy devices, then all, left out) so their ConfigMap page fits the API's limit",
            &m.entries_trimmed,
        ),
        (
            "configmap_pages_unchanged",
            "Shard ConfigMap pages not written: their content is what this replica last wrote",
            &m.pages_unchanged,
        ),
        (
            "discovery_errors",
            "Node list requests that failed",
            &m.discovery_errors,
        ),
        (
            "devices_forgotten",
            "Devices dropped after their reachable agent stopped reporting them for --device-forget",
            &m.devices_forgotten,
        ),
        (
            "duplicate_uuids",
            "GPU UUIDs a node reported that another node reported first: withheld from its entry and records",
            &m.duplicate_uuids,
        ),
        (
            "nodes_refused",
            "New nodes not followed: the pipeline follows its maximum (50,000)",
            &m.nodes_refused,
        ),
        (
            "reconciles",
            "Reconciles started: every known, pending and quarantined node looked at again",
            &m.reconciles,
        ),
        (
            "remediation_passes",
            "Remediation and unknown-guard passes over one node completed, whatever their outcome",
            &m.passes,
        ),
        (
            "lease_passes",
            "Lease passes completed (renew what is held, take what has run out), one per --lease-retry",
            &m.lease_passes,
        ),
    ] {
        registry.register(name, help, counter.clone());
    }
}

impl Metrics {
    /// A registry with every metric under `faultline_aggregator_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("faultline_aggregator");
        let server = std::sync::Arc::new(faultline_common::server::Stats::default());
        registry.register_collector(Box::new(server.clone()));
        let m = Metrics {
            server,
            registry: Registry::default(),
            rules_reloads: Family::default(),
            agent_polls: Family::default(),
            agent_poll_errors: Family::default(),
            remediation_errors: Family::default(),
            device_taint_api: Family::default(),
            devices_isolated: Family::default(),
            agents_reachable: Gauge::default(),
            agents_total: Gauge::default(),
            devices: Family::default(),
            transitions: Family::default(),
            write_seconds: Family::new_with_constructor(|| {
                Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5])
            }),
            write_bytes: Family::default(),
            write_errors: Family::default(),
            writes_skipped: Family::default(),
            writes_superseded: Family::default(),
            write_conflicts: Family::default(),
            invalid_keys: Counter::default(),
            entries_trimmed: Counter::default(),
            pages_unchanged: Counter::default(),
            lease_held: Family::default(),
            lease_errors: Counter::default(),
            shards_held: Gauge::default(),
            live_replicas: Gauge::default(),
            nodes_followed: Gauge::default(),
            rebalances: Counter::default(),
            takeovers: Counter::default(),
            hold_lapses: Counter::default(),
            seeded_devices: Counter::default(),
            agent_polls_ok: Counter::default(),
            agent_watch_fallbacks: Counter::default(),
            deliveries: Family::default(),
            discovery_errors: Counter::default(),
            devices_forgotten: Counter::default(),
            duplicate_uuids: Counter::default(),
            nodes_refused: Counter::default(),
            reconciles: Counter::default(),
            passes: Counter::default(),
            lease_passes: Counter::default(),
            unknown_standing_down: Gauge::default(),
            nudges: Family::default(),
            actions: Family::default(),
            action_seconds: Family::new_with_constructor(|| {
                Histogram::new([0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
            }),
            quarantined_nodes: Gauge::default(),
            quarantined_devices: Gauge::default(),
            held_back: Gauge::default(),
            breaker_open: Gauge::default(),
            intake_responses: Family::default(),
            intake_alerts: Family::default(),
            notifications: Family::default(),
        };
        let mut m = m;
        m.agent_polls_ok = m
            .agent_polls
            .get_or_create(&PollLabel { result: Poll::Ok })
            .clone();
        registry.register(
            "remediation_actions",
            "Remediation actions (quarantine, evict, taint-unknown, release, canary) by result",
            m.actions.clone(),
        );
        registry.register(
            "remediation_action_duration_seconds",
            "Time one remediation pass of a node took, by action",
            m.action_seconds.clone(),
        );
        registry.register(
            "quarantined_nodes",
            "Nodes with a quarantine record, as last listed by this replica",
            m.quarantined_nodes.clone(),
        );
        registry.register(
            "quarantined_devices",
            "Devices in quarantine records, as last listed by this replica",
            m.quarantined_devices.clone(),
        );
        registry.register(
            "held_back_nodes",
            "Failed nodes not quarantined because a budget is spent",
            m.held_back.clone(),
        );
        registry.register(
            "breaker_open",
            "1 while the remediation circuit breaker is open",
            m.breaker_open.clone(),
        );
        registry.register(
            "intake_responses",
            "Answers of POST /v1/alerts by HTTP status",
            m.intake_responses.clone(),
        );
        registry.register(
            "intake_alerts",
            "Alerts received by outcome (counted, acted, duplicate, resolved, unattributed)",
            m.intake_alerts.clone(),
        );
        registry.register(
            "notifications",
            "Webhook notifications by result (sent, retried, failed, dropped)",
            m.notifications.clone(),
        );
        registry.register(
            "rules_reloads",
            "Rules file reloads by result",
            m.rules_reloads.clone(),
        );
        registry.register(
            "agent_polls",
            "Agents' documents received (ok) and failed requests or streams (error)",
            m.agent_polls.clone(),
        );
        registry.register(
            "agent_poll_errors",
            "Failed requests to agents by kind (timeout, connect, status, body, parse, url)",
            m.agent_poll_errors.clone(),
        );
        registry.register(
            "remediation_errors",
            "Remediation passes that failed, by kind (conflict, api, not-holder, record, budget, device)",
            m.remediation_errors.clone(),
        );
        registry.register(
            "device_taint_api",
            "1 for the resource.k8s.io version serving DeviceTaintRule (or none)",
            m.device_taint_api.clone(),
        );
        registry.register(
            "devices_isolated",
            "Failed devices faultline keeps from new work, by node, driver (or resource) and how",
            m.devices_isolated.clone(),
        );
        registry.register(
            "agents_reachable",
            "Agents whose last request succeeded",
            m.agents_reachable.clone(),
        );
        registry.register("agents", "Agents known", m.agents_total.clone());
        registry.register("devices", "Devices by smoothed state", m.devices.clone());
        registry.register(
            "transitions",
            "State transitions by target state and reason",
            m.transitions.clone(),
        );
        Self::register_writes(&mut registry, &m);
        Self::register_ownership(&mut registry, &m);
        registry.register(
            "lease_held",
            "1 while this replica holds the shard's Lease",
            m.lease_held.clone(),
        );
        registry.register(
            "pod_nudges",
            "Pod annotation nudges by result (ok, error, rate-limited, busy)",
            m.nudges.clone(),
        );
        registry.register(
            "write_conflicts",
            "Shard ConfigMap writes answered 409 (retried from the live object)",
            m.write_conflicts.clone(),
        );
        registry.register(
            "unknown_guard_standing_down",
            "1 while the unknown guard stands down: more than --unknown-standdown-share of the agents are unreachable",
            m.unknown_standing_down.clone(),
        );
        register_counters(&mut registry, &m);
        Metrics { registry, ..m }
    }

    /// A rules reload happened.
    pub fn rules_reload(&self, ok: bool) {
        let result = if ok { Reload::Ok } else { Reload::Invalid };
        self.rules_reloads
            .get_or_create(&ReloadLabel { result })
            .inc();
    }

    /// A request to an agent finished.
    pub fn agent_poll(&self, result: Poll) {
        if result == Poll::Ok {
            self.agent_polls_ok.inc();
            return;
        }
        self.agent_polls.get_or_create(&PollLabel { result }).inc();
    }

    /// A request to an agent failed, by kind.
    pub fn agent_poll_error(&self, kind: &'static str) {
        self.agent_poll_errors
            .get_or_create(&KindLabel { kind })
            .inc();
    }

    /// Where DeviceTaintRule is served: `Some("v1")`, or `None` (`version="none"`).
    pub fn device_taint_api(&self, version: Option<&str>) {
        self.device_taint_api.clear();
        let version = version.unwrap_or("none").to_string();
        self.device_taint_api
            .get_or_create(&VersionLabel { version })
            .set(1);
    }

    /// A remediation pass failed, by kind.
    pub fn remediation_error(&self, kind: &'static str) {
        self.remediation_errors
            .get_or_create(&KindLabel { kind })
            .inc();
    }

    /// Agent reachability.
    pub fn set_agents(&self, reachable: usize, total: usize) {
        self.agents_reachable.set(reachable as i64);
        self.agents_total.set(total as i64);
    }

    /// Devices by state.
    pub fn set_devices(&self, counts: &faultline_common::fault::FaultSummary) {
        for (s, n) in [
            (DeviceStatus::Healthy, counts.healthy),
            (DeviceStatus::Degraded, counts.degraded),
            (DeviceStatus::Failed, counts.failed),
            (DeviceStatus::Unknown, counts.unknown),
        ] {
            self.devices
                .get_or_create(&StateLabel { state: s })
                .set(n as i64);
        }
    }

    /// A device changed state.
    pub fn transition(&self, to: DeviceStatus, reason: &str) {
        // The reason label is the code before any detail, to bound cardinality.
        let code = reason.split_whitespace().next().unwrap_or("");
        self.transitions
            .get_or_create(&TransitionLabels {
                to,
                reason: code.into(),
            })
            .inc();
    }

    /// A write finished.
    pub fn write(&self, sink: Sink, shard: u32, secs: f64, bytes: usize, ok: bool) {
        let l = SinkLabels { sink, shard };
        if ok {
            self.write_seconds.get_or_create(&l).observe(secs);
            self.write_bytes.get_or_create(&l).set(bytes as i64);
        } else {
            self.write_errors.get_or_create(&l).inc();
        }
    }

    /// A write was not made: the shard is not ours.
    pub fn write_skipped(&self, sink: Sink, shard: u32) {
        self.writes_skipped
            .get_or_create(&SinkLabels { sink, shard })
            .inc();
    }

    /// A shard's write not made: a newer document of it was out first.
    pub fn write_superseded(&self, shard: u32) {
        self.writes_superseded
            .get_or_create(&ShardLabel { shard })
            .inc();
    }

    /// A delivery to an agent and how it went.
    pub fn delivery(&self, kind: DeliveryKind, result: Delivered) {
        self.deliveries
            .get_or_create(&DeliveryLabels { kind, result })
            .inc();
    }

    /// A shard ConfigMap page not written: unchanged since this replica wrote it.
    pub fn page_unchanged(&self, _shard: u32) {
        self.pages_unchanged.inc();
    }

    /// Node entries left out of a shard: their key is not valid.
    pub fn invalid_keys(&self, n: usize) {
        self.invalid_keys.inc_by(n as u64);
    }

    /// Node entries trimmed so that their page fits.
    pub fn entries_trimmed(&self, n: usize) {
        self.entries_trimmed.inc_by(n as u64);
    }

    /// A write met a 409.
    pub fn write_conflict(&self, shard: u32) {
        self.write_conflicts
            .get_or_create(&SinkLabels {
                sink: Sink::ConfigMap,
                shard,
            })
            .inc();
    }

    /// Shard writes.
    fn register_writes(registry: &mut Registry, m: &Metrics) {
        registry.register(
            "write_duration_seconds",
            "Time to write one shard document",
            m.write_seconds.clone(),
        );
        registry.register(
            "write_bytes",
            "Size of the last document written",
            m.write_bytes.clone(),
        );
        registry.register("write_errors", "Failed writes", m.write_errors.clone());
        registry.register(
            "writes_skipped",
            "Writes not made because this replica does not hold the shard",
            m.writes_skipped.clone(),
        );
        registry.register(
            "writes_superseded",
            "Shard writes not made because a newer document of the shard was written first (an urgent write beside one in flight)",
            m.writes_superseded.clone(),
        );
    }

    /// Shard ownership.
    fn register_ownership(registry: &mut Registry, m: &Metrics) {
        registry.register(
            "shards_held",
            "Shards this replica holds (it follows only their nodes)",
            m.shards_held.clone(),
        );
        registry.register(
            "live_replicas",
            "Replicas counted from their member Leases, this one included",
            m.live_replicas.clone(),
        );
        registry.register(
            "nodes_followed",
            "Agents this replica follows: the nodes of the shards it holds",
            m.nodes_followed.clone(),
        );
        registry.register(
            "shard_rebalances",
            "Shards handed back to even out the replicas' shares",
            m.rebalances.clone(),
        );
        registry.register(
            "shard_takeovers",
            "Shards taken from another holder (its Lease ran out or was handed back)",
            m.takeovers.clone(),
        );
        registry.register(
            "shard_hold_lapses",
            "Lease renewals that came back after the shard's hold had run out on this replica's clock (held again; no writes meanwhile)",
            m.hold_lapses.clone(),
        );
        registry.register(
            "seeded_devices",
            "Devices seeded from a taken shard's last published document",
            m.seeded_devices.clone(),
        );
        registry.register(
            "deliveries",
            "Node-local deliveries to agents (kind: entry or confirm; result: ok, conflict, refused, unreachable, error)",
            m.deliveries.clone(),
        );
        registry.register(
            "agent_watch_fallbacks",
            "Watch requests an agent answered without a stream (it is long-polled instead)",
            m.agent_watch_fallbacks.clone(),
        );
    }

    /// An agent answered a watch request without a stream.
    pub fn agent_watch_fallback(&self) {
        self.agent_watch_fallbacks.inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
