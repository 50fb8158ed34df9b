//! The server's wall clock: the system's, or, for a server made with
//! [`crate::ApiServer::new_virtual`], a virtual one that starts at a fixed epoch and
//! moves with tokio's clock (paused in a test, it moves only when every task waits).
//! The randomized schedules run each seed on a current-thread runtime with a
//! paused clock, so the same seed replays the same timestamps, `creationTimestamp`,
//! `deletionTimestamp`, and the calls' `at_ms`, and its controllers (the simulated
//! kubelet, the disruption and device-taint eviction controllers) tick on that clock,
//! as tasks of that runtime instead of threads of their own.
//!
//! A virtual server lives on the thread that made it (a current-thread runtime runs
//! every task there), so the clock is kept per thread.

use std::cell::Cell;
use std::time::{Duration, SystemTime};

thread_local! {
    /// This thread's virtual clock: its epoch and tokio's instant at that epoch.
    static VIRTUAL: Cell<Option<(SystemTime, tokio::time::Instant)>> = const { Cell::new(None) };
}

/// Now, on this thread's server clock.
pub(crate) fn now() -> SystemTime {
    match VIRTUAL.get() {
        Some((epoch, start)) => epoch + (tokio::time::Instant::now() - start),
        None => SystemTime::now(),
    }
}

/// Milliseconds since the Unix epoch, on this thread's server clock.
pub(crate) fn now_ms() -> u64 {
    now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Run this thread's server clock virtually from `epoch_ms` on.
pub(crate) fn set_virtual(epoch_ms: u64) {
    let epoch = SystemTime::UNIX_EPOCH + Duration::from_millis(epoch_ms);
    VIRTUAL.set(Some((epoch, tokio::time::Instant::now())));
}

/// Call `f` every `tick` until it returns false (the server is gone): on a thread of
/// its own on the system's clock, or, on a virtual clock, as a task of this runtime.
pub(crate) fn every(name: &str, tick: Duration, mut f: impl FnMut() -> bool + Send + 'static) {
    if VIRTUAL.get().is_some() {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                if !f() {
                    return;
                }
            }
        });
    } else {
        let _ = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || loop {
                std::thread::sleep(tick);
                if !f() {
                    return;
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_virtual_clock_moves_with_tokio_time_only() {
        set_virtual(1_700_000_000_000);
        assert_eq!(now_ms(), 1_700_000_000_000);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(now_ms(), 1_700_000_000_000);
        tokio::time::sleep(Duration::from_millis(1_250)).await;
        assert_eq!(now_ms(), 1_700_000_001_250);
        // Another thread keeps the system's clock.
        let other = std::thread::spawn(now_ms).join().unwrap();
        assert!(other > 1_700_000_002_000);
    }
}
