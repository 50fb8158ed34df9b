//! The replica's long-lived tasks, watched together: the core loop, the shard Lease
//! loop, the API, and through a [`Supervisor`] the parts that follow the cluster
//! (discovery, the rules file, the pod health watch, DeviceTaintRule discovery). A
//! panic or an unexpected end of any of them stops the replica,
//! releasing its Leases where the Lease loop still runs, and [`Tasks::wait`] returns
//! an error, so the process exits non-zero and Kubernetes restarts it. Before, a core
//! loop that panicked exited 0, and a replica could run half dead while its Lease loop
//! kept renewing.

use std::time::Duration;

use faultline_common::supervise::judge;
pub use faultline_common::supervise::{spawn_contained, Stopped, Supervisor};
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

/// How long a stop waits for the Lease loop to release the Leases.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// The core loop (pipeline, writes, the remediation dispatcher).
pub const CORE: &str = "core loop";
/// The shard Lease loop.
pub const LEASES: &str = "shard Lease loop";
/// The HTTP API (health, documents, the alert intake).
pub const API: &str = "API server";

/// The handles of the replica's long-lived tasks. The core task must cancel
/// `lease_cancel` when it ends, however it ends (a drop guard): the Leases outlive it,
/// so in-flight remediation finishes before they go.
pub struct Tasks {
    /// Stops the replica (the core loop and the API).
    pub cancel: CancellationToken,
    /// Stops the Lease loop: cancelled when the core task ends.
    pub lease_cancel: CancellationToken,
    pub core: JoinHandle<()>,
    /// `None`: the file sink holds no Leases.
    pub leases: Option<JoinHandle<()>>,
    pub api: JoinHandle<()>,
    /// The other long-lived parts.
    pub supervisor: Supervisor,
}

/// Spawn the core loop: the Leases go (`lease_cancel`) once it ends, however it ends,
/// a panic included.
pub fn spawn_core(
    lease_cancel: CancellationToken,
    core: impl std::future::Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let _release = lease_cancel.drop_guard();
        core.await
    })
}

/// Until `task` ends, or never.
async fn join_opt(task: &mut Option<JoinHandle<()>>) -> Result<(), JoinError> {
    match task {
        Some(t) => {
            let r = t.await;
            *task = None;
            r
        }
        None => std::future::pending().await,
    }
}

impl Tasks {
    /// Wait until the replica stops: after a cancel, the Leases are released once the
    /// core loop has finished. The first task to fail stops the others.
    pub async fn wait(self) -> Result<(), Stopped> {
        let Tasks {
            cancel,
            lease_cancel,
            mut core,
            mut leases,
            mut api,
            supervisor,
        } = self;
        let (mut part, mut r) = tokio::select! {
            r = &mut core => (CORE, r),
            r = join_opt(&mut leases) => (LEASES, r),
            r = &mut api => (API, r),
        };
        if part == LEASES && r.is_ok() && lease_cancel.is_cancelled() {
            // Released because the core task ended: how it ended is the verdict.
            (part, r) = (CORE, (&mut core).await);
        }
        let verdict = judge(part, r, cancel.is_cancelled());
        if let Err(e) = &verdict {
            tracing::error!(error = %e, "stopping the replica");
        }
        cancel.cancel();
        // The core finishes what it has in flight (within `--shutdown-timeout`), then
        // lets the Lease loop release the Leases.
        let core_end = if part == CORE {
            Ok(())
        } else {
            judge(CORE, core.await, true)
        };
        if let Some(t) = leases {
            let _ = tokio::time::timeout(RELEASE_WAIT, t).await;
        }
        if part != API {
            api.abort();
        }
        verdict.and(supervisor.failure()).and(core_end)
    }

    /// Stop at once, as a crash would: the Leases are not released.
    pub fn abort(self) {
        if let Some(t) = self.leases {
            t.abort();
        }
        self.core.abort();
        self.api.abort();
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A replica's tasks: a core that runs `body` until cancelled, spawned as `start`
    /// spawns it; a Lease loop that marks `released` once its
    /// token is cancelled; an API that ends with the replica.
    fn replica(
        core_body: impl std::future::Future<Output = ()> + Send + 'static,
        lease_body: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> (Tasks, Arc<AtomicBool>) {
        let cancel = CancellationToken::new();
        let lease_cancel = CancellationToken::new();
        let released = Arc::new(AtomicBool::new(false));
        let core = {
            let cancel = cancel.clone();
            spawn_core(lease_cancel.clone(), async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = core_body => {}
                }
            })
        };
        let leases = {
            let (released, lease_cancel) = (released.clone(), lease_cancel.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = lease_cancel.cancelled() => released.store(true, Ordering::SeqCst),
                    _ = lease_body => {}
                }
            })
        };
        let api = {
            let cancel = cancel.clone();
            tokio::spawn(async move { cancel.cancelled().await })
        };
        let tasks = Tasks {
            supervisor: Supervisor::new(cancel.clone()),
            cancel,
            lease_cancel,
            core,
            leases: Some(leases),
            api,
        };
        (tasks, released)
    }

    #[tokio::test]
    async fn a_panic_in_the_core_loop_releases_the_leases_and_fails() {
        let (tasks, released) = replica(
            async { panic!("a bug in the pipeline") },
            std::future::pending(),
        );
        let r = tokio::time::timeout(Duration::from_secs(10), tasks.wait()).await;
        assert_eq!(
            r.unwrap(),
            Err(Stopped::Panicked {
                part: CORE,
                message: "a bug in the pipeline".into()
            })
        );
        assert!(released.load(Ordering::SeqCst), "the Leases were released");
    }

    #[tokio::test]
    async fn a_lease_loop_that_dies_stops_the_core_and_fails() {
        let core_stopped = Arc::new(AtomicBool::new(false));
        let stopped = core_stopped.clone();
        let (tasks, _) = replica(
            async move {
                // Runs until the supervisor cancels it.
                struct Flag(Arc<AtomicBool>);
                impl Drop for Flag {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::SeqCst);
                    }
                }
                let _f = Flag(stopped);
                std::future::pending::<()>().await
            },
            async { panic!("lost its client") },
        );
        let r = tokio::time::timeout(Duration::from_secs(10), tasks.wait()).await;
        assert!(
            matches!(r.unwrap(), Err(Stopped::Panicked { part: LEASES, .. })),
            "a dead Lease loop fails the replica"
        );
        assert!(
            core_stopped.load(Ordering::SeqCst),
            "the core loop was stopped"
        );
    }

    #[tokio::test]
    async fn a_core_loop_that_ends_on_its_own_fails() {
        let (tasks, released) = replica(async {}, std::future::pending());
        let r = tokio::time::timeout(Duration::from_secs(10), tasks.wait()).await;
        assert_eq!(r.unwrap(), Err(Stopped::Ended { part: CORE }));
        assert!(released.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_stop_asked_for_is_clean() {
        let (tasks, released) = replica(std::future::pending(), std::future::pending());
        assert!(!tasks.lease_cancel.is_cancelled());
        tasks.cancel.cancel();
        let r = tokio::time::timeout(Duration::from_secs(10), tasks.wait()).await;
        assert_eq!(r.unwrap(), Ok(()));
        assert!(released.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_part_that_panics_stops_the_replica_and_is_named() {
        let (tasks, released) = replica(std::future::pending(), std::future::pending());
        tasks
            .supervisor
            .spawn("node discovery", async { panic!("a bug in discovery") });
        let r = tokio::time::timeout(Duration::from_secs(10), tasks.wait()).await;
        assert_eq!(
            r.unwrap(),
            Err(Stopped::Panicked {
                part: "node discovery",
                message: "a bug in discovery".into()
            })
        );
        assert!(released.load(Ordering::SeqCst), "the Leases were released");
    }
}
