//! Running a vendor tool as a child process, bounded: the whole process group is killed
//! when the timeout passes, and output is capped so a runaway tool cannot eat memory.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ProbeError;
use faultline_common::sync::Locked;

/// Largest stdout we keep; anything past it is a parse error.
pub const MAX_STDOUT: usize = 4 << 20;
const MAX_STDERR: usize = 16 << 10;

/// Run `argv` and return its stdout when it exits 0 within `timeout`.
pub fn run(argv: &[String], timeout: Duration) -> Result<String, ProbeError> {
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| ProbeError::Init("empty command".into()))?;
    // Spawned and registered under the reaper's lock: the reaper never takes the exit
    // status of a child waited for here.
    let mut registry = crate::reaper::CHILDREN.locked();
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout kills whatever it forked too.
        .process_group(0)
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                ProbeError::Init(format!("{prog}: {e}"))
            }
            _ => ProbeError::Call(format!("{prog}: spawn: {e}")),
        })?;
    let pid = child.id() as i32;
    registry.insert(pid);
    drop(registry);
    let _registered = Registered(pid);
    let kill_group = || {
        // SAFETY: killpg only sends a signal to the process group we created above
        // (pgid = the child's pid); no memory is touched.
        unsafe {
            libc::killpg(pid, libc::SIGKILL);
        }
    };
    let mut out = Pipe::new(child.stdout.take(), MAX_STDOUT + 1);
    let mut err = Pipe::new(child.stderr.take(), MAX_STDERR);
    let deadline = Instant::now() + timeout;
    // Both pipes are read here, on this thread, with poll(2): no reader thread can be
    // left blocked on a pipe that a descendant escaped with (setsid) keeps open.
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                kill_group();
                return Err(ProbeError::Call(format!("{prog}: wait: {e}")));
            }
        }
        let now = Instant::now();
        if now >= deadline {
            kill_group();
            let _ = child.kill();
            let _ = child.wait();
            crate::reaper::KILLED_CHILDREN.fetch_add(1, Ordering::Relaxed);
            return Err(ProbeError::Timeout(timeout));
        }
        pump(&mut [&mut out, &mut err], (deadline - now).min(POLL_SLICE));
    };
    // Whatever the tool left running in its group would hold our pipes open (and leak
    // on every sample): the group goes with the tool.
    kill_group();
    // What the tool wrote before it exited is in the pipes: read to their end, for a
    // short while at most (a descendant in another session may hold them open). Then
    // the pipes are closed here, whatever holds their other end.
    let drain_until = Instant::now() + DRAIN;
    while !(out.done && err.done) {
        let now = Instant::now();
        if now >= drain_until {
            break;
        }
        pump(
            &mut [&mut out, &mut err],
            (drain_until - now).min(POLL_SLICE),
        );
    }
    let (stdout, stderr) = (out.buf, err.buf);
    if !status.success() {
        let msg = String::from_utf8_lossy(&stderr);
        let msg = msg.trim();
        let first = msg.lines().next().unwrap_or("");
        return Err(ProbeError::Call(format!(
            "{prog} exited with {status}: {first}"
        )));
    }
    if stdout.len() > MAX_STDOUT {
        return Err(ProbeError::Parse(format!(
            "{prog} printed more than {MAX_STDOUT} bytes"
        )));
    }
    String::from_utf8(stdout)
        .map_err(|_| ProbeError::Parse(format!("{prog} printed invalid UTF-8")))
}

/// Takes a child's pid off the reaper's list once it has been waited for (every way out
/// of `run` waits for it first).
struct Registered(i32);

impl Drop for Registered {
    fn drop(&mut self) {
        crate::reaper::CHILDREN.locked().remove(&self.0);
    }
}

/// The longest single wait in poll(2).
const POLL_SLICE: Duration = Duration::from_millis(20);
/// After the tool exits, how long its pipes are read to their end at most.
const DRAIN: Duration = Duration::from_millis(200);

/// One of the child's pipes, read without blocking, keeping the first `cap` bytes and
/// discarding the rest (closing early would kill a chatty tool with SIGPIPE).
struct Pipe {
    fd: Option<std::os::fd::OwnedFd>,
    buf: Vec<u8>,
    cap: usize,
    done: bool,
}

impl Pipe {
    fn new(p: Option<impl Into<std::os::fd::OwnedFd>>, cap: usize) -> Self {
        let fd = p.map(Into::into);
        if let Some(fd) = &fd {
            use std::os::fd::AsRawFd;
            // SAFETY: fcntl on a descriptor we own; only its flags change.
            unsafe {
                let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Pipe {
            done: fd.is_none(),
            fd,
            buf: Vec::new(),
            cap,
        }
    }

    /// Read what is there now.
    fn read_available(&mut self) {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.fd else { return };
        let raw = fd.as_raw_fd();
        let mut chunk = [0u8; 8192];
        loop {
            // SAFETY: read into our own buffer, at most its length, from our own fd.
            let n = unsafe { libc::read(raw, chunk.as_mut_ptr().cast(), chunk.len()) };
            match n {
                0 => break self.close(),
                n if n > 0 => {
                    let n = n as usize;
                    let room = self.cap.saturating_sub(self.buf.len());
                    self.buf.extend_from_slice(&chunk[..n.min(room)]);
                }
                _ => match std::io::Error::last_os_error().kind() {
                    std::io::ErrorKind::Interrupted => {}
                    std::io::ErrorKind::WouldBlock => return,
                    _ => break self.close(),
                },
            }
        }
    }

    fn close(&mut self) {
        self.done = true;
        self.fd = None;
    }
}

/// Wait up to `wait` for any of `pipes` to be readable, then read what is there.
fn pump(pipes: &mut [&mut Pipe], wait: Duration) {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> = pipes
        .iter()
        .filter_map(|p| p.fd.as_ref())
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    if fds.is_empty() {
        std::thread::sleep(wait);
        return;
    }
    // SAFETY: poll reads and writes only the array we pass, of the length we pass.
    unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            wait.as_millis().min(i32::MAX as u128) as i32,
        );
    }
    for p in pipes.iter_mut() {
        p.read_available();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn returns_stdout_of_a_good_command() {
        assert_eq!(
            run(&sh("echo hello"), Duration::from_secs(5)).unwrap(),
            "hello\n"
        );
    }

    fn alive(pid_file: &std::path::Path) -> bool {
        let pid = std::fs::read_to_string(pid_file).unwrap();
        // A killed child of ours may linger as a zombie until init reaps it.
        match std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())) {
            Ok(stat) => !stat
                .rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z')),
            Err(_) => false,
        }
    }

    fn wait_dead(pid_file: &std::path::Path) -> bool {
        (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(20));
            !alive(pid_file)
        })
    }

    #[test]
    fn a_hung_child_and_its_children_are_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("bg.pid");
        let script = format!("sleep 30 & echo $! > {}; sleep 30", pid_file.display());
        let start = Instant::now();
        let before = crate::reaper::KILLED_CHILDREN.load(Ordering::Relaxed);
        let e = run(&sh(&script), Duration::from_millis(300)).unwrap_err();
        assert_eq!(e, ProbeError::Timeout(Duration::from_millis(300)));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(crate::reaper::KILLED_CHILDREN.load(Ordering::Relaxed) > before);
        assert!(wait_dead(&pid_file), "the background child survived");
    }

    #[test]
    fn a_tool_that_leaves_a_child_behind_neither_hangs_us_nor_leaks_it() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("bg.pid");
        let script = format!("sleep 30 & echo $! > {}; echo done", pid_file.display());
        let start = Instant::now();
        assert_eq!(run(&sh(&script), Duration::from_secs(5)).unwrap(), "done\n");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "held by the child's open pipe"
        );
        assert!(wait_dead(&pid_file), "the background child leaked");
    }

    fn count(dir: &str) -> usize {
        std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
    }

    /// A tool whose descendant escapes the process group
    /// (`setsid`) and keeps stdout open: 100 samples neither hang nor leave threads or
    /// descriptors behind (the pipes are read on the caller's thread, then closed).
    #[test]
    fn an_escaped_descendant_leaks_no_thread_and_no_descriptor() {
        if !faultline_common::testing::have_tool(
            "an_escaped_descendant_leaks_no_thread_and_no_descriptor",
            "setsid",
            &["true"],
            "util-linux",
        ) {
            return;
        }
        // The escaped child outlives the 5 s timeout: waiting for its end fails the run.
        let script = "setsid sh -c 'sleep 30' & echo done";
        // Warm up whatever the first run allocates.
        run(&sh(script), Duration::from_secs(5)).unwrap();
        let (threads, fds) = (count("/proc/self/task"), count("/proc/self/fd"));
        for _ in 0..100 {
            assert_eq!(run(&sh(script), Duration::from_secs(5)).unwrap(), "done\n");
        }
        // Other tests run in parallel threads of this process: allow a little noise,
        // far below the hundred a leak per sample would add.
        assert!(count("/proc/self/task") <= threads + 8, "threads grew");
        assert!(count("/proc/self/fd") <= fds + 16, "descriptors grew");
    }

    #[test]
    fn a_chatty_tool_is_not_killed_by_a_closed_pipe() {
        let out = run(
            &sh("head -c 100000 /dev/zero >&2; echo ok"),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(out, "ok\n");
    }

    #[test]
    fn non_zero_exit_is_a_call_error_with_stderr() {
        let e = run(&sh("echo boom >&2; exit 3"), Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(&e, ProbeError::Call(m) if m.contains("boom")),
            "{e}"
        );
    }

    #[test]
    fn a_missing_tool_is_an_init_error() {
        let e = run(&["/nonexistent/npu-smi".into()], Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.kind(), "init");
    }
}
