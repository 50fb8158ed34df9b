//! faultline on a real Kubernetes control plane: kube-apiserver, etcd,
//! kube-controller-manager and kube-scheduler built from their Go modules
//! (`tests/controlplane`), deploy/ applied as a user applies it, the aggregator under its
//! ServiceAccount's token with exactly deploy/'s RBAC. Each scenario runs on the newest
//! pinned release and an older one, each in a process and network namespace of its own
//! (`faultline_controlplane::network_namespace`: the pods' addresses are local there,
//! nothing outside is reachable), one after the other: a control plane takes ~0.5 GiB
//! and most of the 2 cores while it starts.
//!
//! - `rollout`: discovery from real EndpointSlices through an agent DaemonSet rollout;
//! - `device`: DRA per-device quarantine, answered by the real device-taint eviction
//!   controller;
//! - `healing`: the node path under a real PodDisruptionBudget, released after a canary
//!   run by the real Job controller;
//! - `delivery`: node-local delivery and the drain handshake, from the pods' own
//!   addresses;
//! - `replicas`: two replicas, one killed, the other taking its Leases over;
//! - `churn`: fifty GPU faults at once amid pod churn, both paths, on 1.37;
//! - `helm`: the Helm chart installed, upgraded and removed with the pinned helm on a
//!   cluster that limits the system priority classes as GKE does, healing under the
//!   chart's RBAC, on 1.37.

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

/// The Deployment's `--shards`.
const SHARDS: u32 = 4;

/// The aggregator's extra flags in the healing tests: a reconcile every 500 ms, no node
/// share budget (one or two nodes).
const HEALING: [&str; 2] = [
    "--reconcile-interval=500ms",
    "--max-quarantined-percent=100",
];

/// Whether to run test `test` here: in the network namespace of its own that its
/// process runs in (`true`), or not at all, having run it in a child process there or
/// skipped it (`false`). One at a time: each starts a control plane of its own.
fn isolated(test: &str) -> bool {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    faultline_controlplane::network_namespace(test)
}

/// The test harness's name of test `name` in module `module` (`module_path!()`, which
/// starts with this crate's name).
fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}

/// Run a test's body on a runtime of its own.
fn run(body: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(body);
}

/// One `#[test]` per release of `scenario` (an `async fn(Release)`), each isolated in a
/// network namespace of its own.
macro_rules! on_releases {
    ($scenario:ident: $($test:ident = $release:ident),+ $(,)?) => {
        $(
            #[test]
            fn $test() {
                if crate::isolated(&crate::test_name(module_path!(), stringify!($test))) {
                    crate::run($scenario(faultline_controlplane::Release::$release));
                }
            }
        )+
    };
}

/// Wait up to `within` for `check` (a synchronous look at the cluster) to give a value;
/// the value. Fails naming `what`, with the last look's `Err`.
async fn until<T>(within: Duration, what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let start = std::time::Instant::now();
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) => assert!(
                start.elapsed() < within,
                "{what}: not within {within:?}; last seen: {last}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

mod churn;
mod delivery;
mod device;
mod healing;
mod helm;
mod replicas;
mod rollout;
