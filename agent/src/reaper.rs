//! Reaping orphans when the agent is PID 1 (a container without an init): a vendor
//! tool's descendant that outlives it is re-parented to PID 1, and its exit leaves a
//! zombie that only PID 1 can clear. Without this, a DaemonSet pod running a
//! misbehaving tool every second fills the PID space.
//!
//! The reaper never takes the exit status of a child the agent waits for itself:
//! [`process::run`](crate::sources::process) spawns under [`CHILDREN`]'s lock and
//! registers the pid before releasing it, and the reaper reaps only zombies it does not
//! find there, under the same lock.
#![allow(unsafe_code)]

use faultline_common::sync::Locked;
use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

/// Pids of the children `process::run` waits for itself.
pub static CHILDREN: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Children `process::run` killed because they ran past their timeout, since start (kept
/// here, with the children's registry, so the metrics read it without importing the
/// sources).
pub static KILLED_CHILDREN: AtomicU64 = AtomicU64::new(0);

/// How often the reaper looks.
const EVERY: Duration = Duration::from_millis(500);

/// Our zombie children that nobody waits for.
fn orphan_zombies(me: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // After the command name (in parentheses, may hold spaces): state, ppid.
            let mut rest = stat
                .rsplit_once(')')
                .map(|(_, r)| r.split_whitespace())
                .into_iter()
                .flatten();
            let state = rest.next();
            let ppid = rest.next().and_then(|p| p.parse::<i32>().ok());
            state == Some("Z") && ppid == Some(me)
        })
        .collect()
}

/// Reap the zombie children nobody waits for, once; how many.
pub fn reap_once() -> usize {
    let me = std::process::id() as i32;
    let waited = CHILDREN.locked();
    let mut n = 0;
    for pid in orphan_zombies(me) {
        if waited.contains(&pid) {
            continue;
        }
        let mut status = 0;
        // SAFETY: waitpid on one pid that is our zombie child and not waited for by
        // anyone else (checked under the lock); it writes only `status`.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            n += 1;
        }
    }
    n
}

/// Start reaping on a thread when this process is PID 1, or when `force` (a child
/// subreaper, or a test). Whether it started.
pub fn start(force: bool) -> bool {
    if std::process::id() != 1 && !force {
        return false;
    }
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(|| loop {
            let n = reap_once();
            if n > 0 {
                tracing::debug!(reaped = n, "reaped orphaned children");
            }
            std::thread::sleep(EVERY);
        })
        .is_ok()
}
