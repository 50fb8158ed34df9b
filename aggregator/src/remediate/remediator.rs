//! The [`Remediator`]: what every remediation pass needs (the API, the mode and taint,
//! the guards, the announcer), handed to each pass as `&self`, like controller-rs's
//! `Context`. The passes themselves live in `isolate.rs`, `evict.rs`, `release.rs` and
//! `canary.rs`; the decisions they take in `policy.rs`.
//!
//! Shared state and who owns it: each guard owns its lock (`guards.rs`), the announcer
//! owns the set of Events known to be recorded, and the list of quarantined nodes below
//! is replaced whole by [`Remediator::list_quarantined`] (the reconcile tick) and read
//! by the dispatcher. Nothing else in a `Remediator` changes after it is built.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use faultline_common::sync::Locked;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, ListParams, Patch, PatchParams};

use super::announce::Announcer;
use super::error::RemediateError;
use super::guards::{Breaker, BudgetGuard, EvictionRate, HeldBack};
use super::ledger::Ledger;
use super::node_cache::NodeCache;
use super::patch::NodePatch;
use super::policy::{Budget, Mode, ReleasePolicy};
use super::record::{
    record_of, LiveNode, QuarantineRecord, ReleaseRequest, CONDITION, DEVICES_LABEL, TAINT_EFFECT,
    TAINT_FAILED,
};
use crate::metrics::Metrics;
use crate::model::RecordDevice;
use crate::notify::Notifier;
use crate::shard::Fence;

/// The accelerator resources looked for in pods by default.
pub const DEFAULT_RESOURCES: [&str; 5] = [
    "nvidia.com/gpu",
    "huawei.com/Ascend910",
    "huawei.com/Ascend910B",
    "huawei.com/Ascend310P",
    // Ascend 950 (the device plugin's ascend910.go).
    "huawei.com/npu",
];

/// Isolates nodes, evicts the pods on failed devices and releases nodes.
pub struct Remediator {
    pub(super) client: kube::Client,
    pub(super) nodes: Api<Node>,
    pub(super) mode: Mode,
    pub(super) taint: Taint,
    pub(super) actor: String,
    /// Extended resources that are accelerators (`nvidia.com/gpu`, `huawei.com/Ascend910`).
    pub(super) resources: Vec<String>,
    /// How long a PodDisruptionBudget may hold an eviction back before an alert.
    pub(super) eviction_deadline: Duration,
    /// Delete a pod whose budget refused eviction past the deadline (off by default).
    pub(super) force_delete: bool,
    /// The longest a pod may ask to checkpoint before its eviction (0: none may).
    pub(super) max_grace: Duration,
    pub(super) budget: BudgetGuard,
    pub(super) breaker: Option<Breaker>,
    pub(super) rate: EvictionRate,
    pub(super) held_back: HeldBack,
    pub(super) release: ReleasePolicy,
    pub(super) announce: Announcer,
    /// Nodes with a record, as last listed (the release pass's work list).
    quarantined: Mutex<BTreeSet<String>>,
    /// The clock decisions are judged by (deadlines, expiry, cool-downs, canaries);
    /// tests move it instead of sleeping.
    pub(super) clock: faultline_common::time::Clock,
    /// The device path; `None`: every fault takes the node path.
    pub(super) devices: Option<crate::device_taint::DeviceQuarantine>,
    /// The last `fault.json` sequence this replica wrote (a DeviceTaintRule is
    /// annotated with the one current when it was decided).
    sequence: Arc<std::sync::atomic::AtomicU64>,
    /// Nodes found missing, and the allowance of existence checks.
    ghosts: Mutex<Ghosts>,
    /// The quarantined Nodes as a watch keeps them (passes read them there); `None`:
    /// every read goes to the API.
    cache: Option<NodeCache>,
}

/// How long a node found missing is taken for missing without asking again.
const GHOST_TTL: Duration = Duration::from_secs(300);
/// Existence checks of nodes this replica does not follow, per second, and at once.
const CHECKS_PER_S: f64 = 5.0;
const CHECK_BURST: f64 = 20.0;
/// Nodes found missing remembered at most (the oldest forgotten first).
const GHOSTS_KEPT: usize = 4096;

/// Nodes found missing, and the token bucket of existence checks: alerts naming a new
/// node each cost one Node GET each, 4,561 a second, sustained, on the aggregator's
/// own identity.
#[derive(Default)]
struct Ghosts {
    missing: crate::aged::Aged<String, ()>,
    /// Checks left, and when the bucket was last filled.
    allowance: Option<(f64, std::time::Instant)>,
}

impl Ghosts {
    /// Take one check from the bucket at `now`, if one is left.
    fn take(&mut self, now: std::time::Instant) -> bool {
        let (tokens, at) = self.allowance.unwrap_or((CHECK_BURST, now));
        let refilled =
            (tokens + now.duration_since(at).as_secs_f64() * CHECKS_PER_S).min(CHECK_BURST);
        let ok = refilled >= 1.0;
        self.allowance = Some((if ok { refilled - 1.0 } else { refilled }, now));
        ok
    }
}

impl Remediator {
    /// `taint_key` e.g. `nvidia.com/gpu-fault` (value `true`, effect NoSchedule); Events
    /// go to `event_namespace`; `actor` names this replica in records and Events.
    pub fn new(
        client: kube::Client,
        mode: Mode,
        taint_key: &str,
        event_namespace: &str,
        actor: &str,
    ) -> Self {
        Remediator {
            nodes: Api::all(client.clone()),
            announce: Announcer::new(client.clone(), event_namespace, actor),
            client,
            resources: DEFAULT_RESOURCES.map(String::from).to_vec(),
            eviction_deadline: Duration::from_secs(600),
            budget: BudgetGuard::new(Budget::default()),
            breaker: None,
            rate: EvictionRate::new(0.0),
            held_back: HeldBack::default(),
            release: ReleasePolicy::default(),
            quarantined: Default::default(),
            force_delete: false,
            max_grace: Duration::ZERO,
            mode,
            taint: Taint {
                key: taint_key.to_string(),
                value: Some(TAINT_FAILED.into()),
                effect: TAINT_EFFECT.into(),
                time_added: None,
            },
            actor: actor.to_string(),
            clock: Default::default(),
            devices: None,
            sequence: Arc::default(),
            ghosts: Mutex::default(),
            cache: None,
        }
    }

    /// The clock its decisions are judged by.
    pub fn clock(&self) -> &faultline_common::time::Clock {
        &self.clock
    }

    /// Judge time by `clock` (tests: a clock they move forward).
    pub fn with_clock(mut self, clock: faultline_common::time::Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Accelerator resource names to look for in pods (default: NVIDIA and Ascend).
    pub fn with_resources(mut self, resources: Vec<String>, eviction_deadline: Duration) -> Self {
        if !resources.is_empty() {
            self.resources = resources;
        }
        self.eviction_deadline = eviction_deadline;
        self
    }

    /// Past the eviction deadline, delete a pod its disruption budget still protects
    /// (off by default: then it is announced and left).
    pub fn with_force_delete(mut self, force: bool) -> Self {
        self.force_delete = force;
        self
    }

    /// Warn before evicting: a pod may ask for up to `max` to checkpoint.
    pub fn with_checkpoint_grace(mut self, max: Duration) -> Self {
        self.max_grace = max;
        self
    }

    /// The quarantine budget.
    pub fn with_budget(mut self, budget: Budget) -> Self {
        self.budget.budget = budget;
        self
    }

    /// The budget's ledger: places taken by compare-and-swap before each quarantine, so
    /// the budget holds across replicas (none: the Nodes' count alone).
    pub fn with_budget_ledger(mut self, ledger: Option<Ledger>) -> Self {
        self.budget.set_ledger(ledger);
        self
    }

    /// The circuit breaker and the eviction rate (per minute; 0: no limit).
    pub fn with_breaker(mut self, breaker: Option<Breaker>, evictions_per_minute: f64) -> Self {
        self.breaker = breaker;
        self.rate = EvictionRate::new(evictions_per_minute);
        self
    }

    /// How quarantines end.
    pub fn with_release(mut self, release: ReleasePolicy) -> Self {
        self.release = release;
        self
    }

    /// Where announcements go besides Events, and where actions are counted.
    pub fn with_reporting(
        mut self,
        notifier: Option<Arc<Notifier>>,
        metrics: Option<Arc<Metrics>>,
    ) -> Self {
        self.announce = self.announce.with_reporting(notifier, metrics);
        self
    }

    /// Quarantine a failed device alone where the cluster can.
    pub fn with_devices(mut self, devices: Option<crate::device_taint::DeviceQuarantine>) -> Self {
        self.devices = devices;
        self
    }

    /// Read quarantined Nodes from `cache` (a watch of the labelled Nodes).
    pub fn with_node_cache(mut self, cache: Option<NodeCache>) -> Self {
        self.cache = cache;
        self
    }

    /// Where the core loop notes each `fault.json` sequence it writes.
    pub fn sequence_handle(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.sequence.clone()
    }

    /// The `fault.json` sequence current now.
    pub(super) fn sequence_hint(&self) -> u64 {
        self.sequence.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The accelerator resource names looked for in pods.
    pub fn resources(&self) -> &[String] {
        &self.resources
    }

    /// The dedup window (a person's release holds this long; the intake's dedup).
    pub fn dedup_window(&self) -> Duration {
        self.release.dedup_window
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Nodes with a record as last listed by [`Remediator::list_quarantined`].
    pub fn known_quarantined(&self) -> Vec<String> {
        self.quarantined.locked().iter().cloned().collect()
    }

    /// Whether Node `node` exists (its metadata only: a real GPU Node is 15-40 KB).
    /// `None`: not asked now; the checks of nodes not followed are over their rate
    /// ([`CHECKS_PER_S`]). A node found missing is taken for missing for
    /// [`GHOST_TTL`] without asking.
    pub async fn node_exists(&self, node: &str) -> Result<Option<bool>, RemediateError> {
        let now = self.clock.instant();
        {
            let mut g = self.ghosts.locked();
            g.missing.expire(now, GHOST_TTL);
            if g.missing.contains_key(&node.to_string()) {
                return Ok(Some(false));
            }
            if !g.take(now) {
                return Ok(None);
            }
        }
        let exists = self.nodes.get_metadata_opt(node).await?.is_some();
        if !exists {
            let mut g = self.ghosts.locked();
            g.missing.make_room(GHOSTS_KEPT);
            g.missing.touch(node.to_string(), now, || ());
        }
        Ok(Some(exists))
    }

    /// Nodes held back by the budget now.
    pub fn held_back(&self) -> Vec<String> {
        self.held_back.list()
    }

    /// Read a Node and parse its record: a quarantined one from the watch's cache
    /// (its writes test the resourceVersion read), any other from the API once a pass
    /// ([`NodeCache`]).
    pub(super) async fn read(&self, node: &str) -> Result<LiveNode, RemediateError> {
        let Some(cache) = &self.cache else {
            return LiveNode::of(self.nodes.get(node).await?);
        };
        if let Some(cached) = cache.get(node) {
            return LiveNode::of(cached);
        }
        let read = self.nodes.get(node).await?;
        cache.read(node, &read);
        LiveNode::of(read)
    }

    /// This replica is about to write Node `node`: its next reads go to the API until
    /// the watch shows the write.
    fn writing(&self, node: &str) {
        if let Some(c) = &self.cache {
            c.writing(node);
        }
    }

    /// Send a node patch while the shard's hold stands (`Fence::write`: asked right
    /// before, given up when the hold ends).
    pub(super) async fn apply(
        &self,
        node: &str,
        patch: NodePatch,
        fence: &Fence,
    ) -> Result<(), RemediateError> {
        let p = patch
            .into_patch()
            .map_err(|e| RemediateError::Record(node.to_string(), e.to_string()))?;
        self.writing(node);
        fence
            .write(
                self.nodes
                    .patch(node, &PatchParams::default(), &Patch::Json::<()>(p)),
            )
            .await??;
        Ok(())
    }

    /// Set the `AcceleratorHealthy` condition (it lives in status; conditions merge by
    /// type), while the shard's hold stands.
    pub(super) async fn condition(
        &self,
        node: &str,
        (healthy, reason): (bool, &str),
        message: String,
        at: &str,
        fence: &Fence,
    ) -> Result<(), RemediateError> {
        let condition = serde_json::json!({"status": {"conditions": [{
            "type": CONDITION, "status": if healthy { "True" } else { "False" }, "reason": reason,
            "message": message, "lastTransitionTime": at, "lastHeartbeatTime": at,
        }]}});
        self.writing(node);
        fence
            .write(self.nodes.patch_status(
                node,
                &PatchParams::default(),
                &Patch::Strategic(condition),
            ))
            .await??;
        Ok(())
    }

    /// A new record of `devices` on `node`, first seen `now`, by this replica.
    pub(super) fn new_record(
        &self,
        node: &str,
        devices: Vec<RecordDevice>,
        now: &str,
    ) -> QuarantineRecord {
        QuarantineRecord::new(node, devices, now, &self.actor, self.expiry_from_now())
    }

    /// When a record made now is due for review.
    pub(super) fn expiry_from_now(&self) -> String {
        self.clock.rfc3339_after(self.release.expiry)
    }

    /// List the nodes with a record (they carry the devices label), remember them and
    /// update the quarantine gauges.
    pub async fn list_quarantined(&self) -> Result<Vec<Node>, RemediateError> {
        // The reconcile's work list and the gauges: the watch's, or from the API
        // server's watch cache (resourceVersion=0) until it has listed once.
        let nodes = match self.cache.as_ref().and_then(NodeCache::all) {
            Some(nodes) => nodes,
            None => {
                self.nodes
                    .list(&ListParams::default().match_any().labels(DEVICES_LABEL))
                    .await?
                    .items
            }
        };
        let mut devices = 0;
        let mut with_record = Vec::new();
        let mut isolated = Vec::new();
        for n in nodes {
            let record = record_of(&n).ok().flatten();
            if record.is_some() || ReleaseRequest::of(&n).is_some() {
                if let Some(r) = &record {
                    devices += r.devices.len();
                    isolated.extend(r.isolated_counts());
                }
                with_record.push(n);
            }
        }
        *self.quarantined.locked() = with_record
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        if let Some(m) = self.announce.metrics() {
            m.set_quarantined(with_record.len(), devices);
            m.set_devices_isolated(&isolated);
            m.set_breaker(self.breaker_open().await.unwrap_or(false));
            m.set_held_back(self.held_back.list().len());
        }
        Ok(with_record)
    }

    /// Note a node whose device just turned failed, if it is not quarantined for a
    /// failure already (an unknown-only guard does not count): a repeated verdict or a
    /// second device of a quarantined node is not a new failed node for the breaker.
    pub async fn note_new_failure(&self, node: &str) -> Result<(), RemediateError> {
        if self.breaker.is_none() {
            return Ok(());
        }
        let live = self.read(node).await?;
        if live.record.is_some_and(|r| !r.unknown_only) {
            return Ok(());
        }
        self.note_failure(node).await
    }

    /// Note a node that just failed (feeds the breaker).
    pub async fn note_failure(&self, node: &str) -> Result<(), RemediateError> {
        if let Some(b) = &self.breaker {
            b.note_failure(node).await?;
        }
        Ok(())
    }

    /// Whether the breaker is open (never, without one).
    pub(super) async fn breaker_open(&self) -> Result<bool, RemediateError> {
        match &self.breaker {
            Some(b) => b.is_open().await,
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::remediate::record::RELEASE_ANNOTATION;

    /// The existence checks of nodes not followed: 20 at once, then 5 a second, never
    /// more however long the bucket stood full.
    #[test]
    fn existence_checks_burst_then_refill_at_their_rate() {
        let mut g = Ghosts::default();
        let t0 = Instant::now();
        assert_eq!((0..25).filter(|_| g.take(t0)).count(), 20);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(!g.take(at(100)), "half a check");
        assert!(g.take(at(200)), "one check a fifth of a second");
        assert!(!g.take(at(200)));
        assert_eq!((0..10).filter(|_| g.take(at(1_200))).count(), 5);
        assert_eq!((0..30).filter(|_| g.take(at(60_000))).count(), 20);
    }

    fn client(url: &str) -> kube::Client {
        let mut kc = kube::Config::new(url.parse().unwrap());
        kc.default_retry = false;
        kube::Client::try_from(kc).unwrap()
    }

    /// A node found missing is taken for missing without asking again; one found is
    /// asked about each time; past the allowance nothing is asked (`None`).
    #[tokio::test]
    async fn a_missing_node_is_remembered_and_checks_keep_to_their_allowance() {
        let (server, url) = faultline_test_apiserver::Bootstrap::new().spawn().await;
        server
            .create("nodes", "", serde_json::json!({"metadata": {"name": "n1"}}))
            .unwrap();
        let r = Remediator::new(client(&url), Mode::DryRun, "t", "ns", "me");
        let asked = |name: &str| {
            let path = format!("/api/v1/nodes/{name}");
            let calls = server.calls();
            calls.iter().filter(|c| c.uri.starts_with(&path)).count()
        };
        assert_eq!(r.node_exists("n1").await.unwrap(), Some(true));
        assert_eq!(r.node_exists("n1").await.unwrap(), Some(true));
        assert_eq!(asked("n1"), 2);
        assert_eq!(r.node_exists("ghost").await.unwrap(), Some(false));
        assert_eq!(r.node_exists("ghost").await.unwrap(), Some(false));
        assert_eq!(asked("ghost"), 1, "remembered");
        // 3 of the 20 checks at once were taken (some refilled meanwhile, 5 a second).
        let started = std::time::Instant::now();
        let mut checks = Vec::new();
        for i in 0..25 {
            checks.push(r.node_exists(&format!("g{i}")).await.unwrap());
        }
        let refilled = (started.elapsed().as_secs_f64() * 5.0).ceil() as usize;
        let missing = checks.iter().filter(|c| **c == Some(false)).count();
        assert!(missing >= 17 && missing <= 17 + refilled, "{checks:?}");
        assert!(checks.iter().any(Option::is_none), "{checks:?}");
    }

    /// The nodes with a record or a release request among those labelled are the ones
    /// the reconcile looks at again.
    #[tokio::test]
    async fn the_quarantined_are_the_labelled_nodes_with_a_record_or_a_request() {
        let (server, url) = faultline_test_apiserver::Bootstrap::new().spawn().await;
        let node = |name: &str, labelled: bool, request: bool| {
            let mut v =
                serde_json::json!({"metadata": {"name": name, "labels": {}, "annotations": {}}});
            if labelled {
                v["metadata"]["labels"][DEVICES_LABEL] = "gpu0".into();
            }
            if request {
                v["metadata"]["annotations"][RELEASE_ANNOTATION] = "all".into();
            }
            server.create("nodes", "", v).unwrap();
        };
        node("a", true, true);
        node("b", true, false);
        node("c", false, true);
        quarantined(&server, "d");
        let metrics = Arc::new(Metrics::new());
        let r = Remediator::new(client(&url), Mode::DryRun, "t", "ns", "me")
            .with_reporting(None, Some(metrics.clone()));
        assert!(r.known_quarantined().is_empty());
        let listed = r.list_quarantined().await.unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(r.known_quarantined(), ["a", "d"]);
        let text = metrics.encode();
        assert!(
            text.contains("faultline_aggregator_quarantined_nodes 2\n"),
            "{text}"
        );
        assert!(
            text.contains("faultline_aggregator_quarantined_devices 2\n"),
            "{text}"
        );
    }

    /// Node `name`, labelled, with a record of two failed devices.
    fn quarantined(server: &faultline_test_apiserver::ApiServer, name: &str) {
        let devices = ["gpu0", "gpu1"]
            .map(|d| RecordDevice::new(d, "xid-79"))
            .to_vec();
        let now = faultline_common::time::now_rfc3339();
        let record = QuarantineRecord::new(name, devices, &now, "me", now.clone());
        server
            .create(
                "nodes",
                "",
                serde_json::json!({"metadata": {"name": name,
                    "labels": {DEVICES_LABEL: "gpu0.gpu1"},
                    "annotations": {crate::remediate::record::RECORD_ANNOTATION: record.to_annotation()}}}),
            )
            .unwrap();
    }

    /// A node already quarantined for a failure is no new failure for the breaker; one
    /// without a record is.
    #[tokio::test]
    async fn only_a_node_not_yet_quarantined_counts_for_the_breaker() {
        let (server, url) = faultline_test_apiserver::Bootstrap::new()
            .namespace("ns")
            .spawn()
            .await;
        quarantined(&server, "d");
        server
            .create("nodes", "", serde_json::json!({"metadata": {"name": "n1"}}))
            .unwrap();
        let kube = client(&url);
        let breaker = Breaker::new(
            Api::namespaced(kube.clone(), "ns"),
            "b".into(),
            3,
            Duration::from_secs(600),
        );
        let r =
            Remediator::new(kube, Mode::Enforce, "t", "ns", "me").with_breaker(Some(breaker), 0.0);
        r.note_new_failure("d").await.unwrap();
        assert!(server.get("configmaps", "ns", "b").is_none(), "not counted");
        r.note_new_failure("n1").await.unwrap();
        let cm = server.get("configmaps", "ns", "b").expect("counted");
        assert!(cm.to_string().contains("n1"), "{cm}");
    }

    /// The resources and the windows given are the ones read; none given: the defaults.
    #[tokio::test]
    async fn resources_and_windows_given_are_the_ones_read() {
        let r = Remediator::new(client("http://127.0.0.1:9"), Mode::DryRun, "t", "ns", "me");
        assert_eq!(r.resources(), DEFAULT_RESOURCES);
        let r = r.with_resources(Vec::new(), Duration::from_secs(1));
        assert_eq!(r.resources(), DEFAULT_RESOURCES);
        let r = r
            .with_resources(vec!["example.com/npu".into()], Duration::from_secs(1))
            .with_release(ReleasePolicy {
                dedup_window: Duration::from_secs(77),
                ..Default::default()
            });
        assert_eq!(r.resources(), ["example.com/npu"]);
        assert_eq!(r.dedup_window(), Duration::from_secs(77));
    }

    /// The clock a remediator is given is the one it judges by, and the sequence the
    /// core loop notes through the handle is the one its rules are annotated with.
    #[tokio::test]
    async fn the_clock_and_sequence_given_are_the_ones_read() {
        let clock = faultline_common::time::Clock::manual(1_000_000);
        let r = Remediator::new(client("http://127.0.0.1:9"), Mode::DryRun, "t", "ns", "me")
            .with_clock(clock.clone());
        clock.advance(Duration::from_secs(3));
        assert_eq!(r.clock().now_ms(), 1_003_000);
        assert_eq!(r.sequence_hint(), 0);
        r.sequence_handle()
            .store(42, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(r.sequence_hint(), 42);
    }
}
