//! Supervised tasks, shared by both binaries (cargo feature `runtime`): a long-lived
//! part that panics, or ends before its process was told to stop, stops the process,
//! which then exits non-zero so that Kubernetes restarts it; a piece of work (one
//! node's pass) that panics is contained, logged and counted.

use std::sync::{Arc, Mutex};

use tokio::task::JoinError;
use tokio_util::sync::CancellationToken;

/// Why a process stopped on its own.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Stopped {
    #[error("the {part} panicked: {message}")]
    Panicked { part: &'static str, message: String },
    #[error("the {part} ended before the process was told to stop")]
    Ended { part: &'static str },
}

/// What a finished task says (`Ok`: an end asked for, or an abort).
pub fn judge(part: &'static str, r: Result<(), JoinError>, asked: bool) -> Result<(), Stopped> {
    match r {
        Err(e) if e.is_panic() => {
            let p = e.into_panic();
            let message = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(not a string)".into());
            Err(Stopped::Panicked { part, message })
        }
        // Aborted (a test's crash) or ended when told to.
        Err(_) => Ok(()),
        Ok(()) if asked => Ok(()),
        Ok(()) => Err(Stopped::Ended { part }),
    }
}

/// Spawns a process's long-lived parts. Each runs until `cancel`; one that panics or
/// ends before it stops the process (it cancels `cancel`), and [`Supervisor::failure`]
/// says why.
#[derive(Clone)]
pub struct Supervisor {
    cancel: CancellationToken,
    failed: Arc<Mutex<Option<Stopped>>>,
}

impl Supervisor {
    /// A supervisor that stops the process through `cancel`.
    pub fn new(cancel: CancellationToken) -> Self {
        Supervisor {
            cancel,
            failed: Arc::default(),
        }
    }

    /// Run `part` in a task of its own, watched. The handle is the watcher's: it ends
    /// once the part's end has been judged.
    pub fn spawn(
        &self,
        name: &'static str,
        part: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let task = tokio::spawn(part);
        let s = self.clone();
        tokio::spawn(async move {
            let r = task.await;
            if let Err(e) = judge(name, r, s.cancel.is_cancelled()) {
                s.fail(e);
            }
        })
    }

    /// Stop the process for `why` (the first reason stands).
    pub fn fail(&self, why: Stopped) {
        tracing::error!(error = %why, "stopping");
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(why);
        self.cancel.cancel();
    }

    /// The first part that failed, if any.
    pub fn failure(&self) -> Result<(), Stopped> {
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Run one piece of work (a node's remediation pass) in a task of its own. Its panic
/// stays with it: logged with its message, and `then(true)`; the next pass retries.
/// `then` runs however it ends, so what it counts is never left in flight.
pub fn spawn_contained(
    what: &'static str,
    work: impl std::future::Future<Output = ()> + Send + 'static,
    then: impl FnOnce(bool) + Send + 'static,
) {
    let task = tokio::spawn(work);
    tokio::spawn(async move {
        let panicked = match judge(what, task.await, true) {
            Err(e) => {
                tracing::error!(error = %e, "contained: the next pass retries");
                true
            }
            Ok(()) => false,
        };
        then(panicked);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_part_that_panics_stops_the_process_and_is_named() {
        let cancel = CancellationToken::new();
        let s = Supervisor::new(cancel.clone());
        s.spawn("node discovery", async { panic!("a bug in discovery") });
        tokio::time::timeout(Duration::from_secs(10), cancel.cancelled())
            .await
            .expect("stopped");
        assert_eq!(
            s.failure(),
            Err(Stopped::Panicked {
                part: "node discovery",
                message: "a bug in discovery".into()
            })
        );
    }

    #[tokio::test]
    async fn a_part_that_ends_before_the_stop_fails_and_one_after_it_does_not() {
        let cancel = CancellationToken::new();
        let s = Supervisor::new(cancel.clone());
        s.spawn("rules file", async {});
        tokio::time::timeout(Duration::from_secs(10), cancel.cancelled())
            .await
            .expect("stopped");
        assert_eq!(s.failure(), Err(Stopped::Ended { part: "rules file" }));

        let cancel = CancellationToken::new();
        let s = Supervisor::new(cancel.clone());
        let c = cancel.clone();
        let judged = s.spawn("rules file", async move { c.cancelled().await });
        cancel.cancel();
        judged.await.unwrap();
        assert_eq!(s.failure(), Ok(()), "ended with the process");
    }

    #[tokio::test]
    async fn a_contained_panic_is_reported_and_stops_nothing() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn_contained("remediation pass", async { panic!("one node") }, move |p| {
            let _ = tx.send(p);
        });
        assert!(rx.await.unwrap(), "then(true)");
        let (tx, rx) = tokio::sync::oneshot::channel();
        spawn_contained("remediation pass", async {}, move |p| {
            let _ = tx.send(p);
        });
        assert!(!rx.await.unwrap());
    }
}
