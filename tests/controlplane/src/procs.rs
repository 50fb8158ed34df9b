//! The control plane's processes: each in a process group of its own, killed with its
//! group when dropped, and by the kernel when the test process dies
//! (`PR_SET_PDEATHSIG`). The kernel sends that signal when the *thread* that forked the
//! child exits, so every child is forked by one thread that lives as long as the
//! process ([`spawner`]), never by a test's thread, which ends with its test.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

use anyhow::Context;

type Request = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The thread that forks every child.
fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static TX: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("controlplane-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("the spawner thread");
        Mutex::new(tx)
    })
}

/// A running component.
pub struct Proc {
    pub name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Start `bin` with `args` as component `name`, its output in `logs/<name>.log`.
    pub fn spawn(
        name: &'static str,
        bin: &Path,
        args: &[String],
        logs: &Path,
    ) -> anyhow::Result<Proc> {
        let log = logs.join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // SAFETY: setpgid and prctl are async-signal-safe and touch no memory of ours.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        spawner()
            .lock()
            .unwrap()
            .send((cmd, tx))
            .expect("the spawner thread lives as long as the process");
        let child = rx
            .recv()
            .expect("the spawner answers")
            .with_context(|| format!("start {}", bin.display()))?;
        Ok(Proc { name, child, log })
    }

    /// Its exit status, if it has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its resident memory (KiB), 0 once it has ended.
    pub fn rss_kib(&self) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: a signal to the group this child leads (setpgid(0, 0) above).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
