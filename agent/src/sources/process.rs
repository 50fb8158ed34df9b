//! Running a vendor tool as a child process, bounded: the whole process group is killed
//! when the timeout passes, and output is capped so a runaway tool cannot eat memory.
#![allow(unsafe_code)]

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::ProbeError;

/// Largest stdout we keep; anything past it is a parse error.
pub const MAX_STDOUT: usize = 4 << 20;
const MAX_STDERR: usize = 16 << 10;

/// Children killed because they ran past their timeout, since start.
pub static KILLED_CHILDREN: AtomicU64 = AtomicU64::new(0);

/// Run `argv` and return its stdout when it exits 0 within `timeout`.
pub fn run(argv: &[String], timeout: Duration) -> Result<String, ProbeError> {
    let (prog, args) = argv
        .split_first()
        .ok_or_else(|| ProbeError::Init("empty command".into()))?;
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
    let out = reader(child.stdout.take(), MAX_STDOUT + 1);
    let err = reader(child.stderr.take(), MAX_STDERR);
    let kill_group = || {
        // SAFETY: killpg only sends a signal to the process group we created above
        // (pgid = the child's pid); no memory is touched.
        unsafe {
            libc::killpg(pid, libc::SIGKILL);
        }
    };

    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
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
            KILLED_CHILDREN.fetch_add(1, Ordering::Relaxed);
            return Err(ProbeError::Timeout(timeout));
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    };
    // Whatever the tool left running in the background would hold our pipes open (and
    // leak on every sample): the group goes with the tool.
    kill_group();
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let stdout = out
        .recv_timeout(left)
        .map_err(|_| ProbeError::Timeout(timeout))?;
    let stderr = err
        .recv_timeout(Duration::from_millis(100))
        .unwrap_or_default();
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

/// Read a pipe to its end on a thread, keeping the first `cap` bytes and discarding the
/// rest (closing early would kill a chatty tool with SIGPIPE).
fn reader<R: Read + Send + 'static>(pipe: Option<R>, cap: usize) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let mut chunk = [0u8; 8192];
            loop {
                match p.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => {
                        let room = cap.saturating_sub(buf.len());
                        buf.extend_from_slice(&chunk[..n.min(room)]);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        let _ = tx.send(buf);
    });
    rx
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
        let before = KILLED_CHILDREN.load(Ordering::Relaxed);
        let e = run(&sh(&script), Duration::from_millis(300)).unwrap_err();
        assert_eq!(e, ProbeError::Timeout(Duration::from_millis(300)));
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(KILLED_CHILDREN.load(Ordering::Relaxed) > before);
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
